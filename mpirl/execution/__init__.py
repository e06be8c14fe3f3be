"""Operators and the Algorithm loop: the dataflow that algorithms' plans are written in. Runs on
the driver (rank 0) and calls workers.
"""
