"""Models and losses: policies, Q networks, soft Q (SAC), V-trace.
"""
