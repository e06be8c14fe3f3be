"""The MPI engine: layout, transport, dispatch, the worker host, heartbeat, ULFM, stop signals
and ``mpirl doctor``. It imports nothing from RL, torch or gymnasium (tests/test_import_graph.py).
"""
