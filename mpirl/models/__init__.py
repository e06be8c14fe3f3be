"""Models and losses: policies, Q networks, soft Q (SAC), V-trace, and the dynamics ensemble of
model-based RL.
"""
