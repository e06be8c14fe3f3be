"""DQN and Ape-X, Q-learning from prioritized replay: ``dqn`` and ``apex`` are the algorithm
modules; ``network`` their Q network and loss (its spec, ``QSpec``, stays in ``mpirl.models``:
the rollout ranks' shared acting code builds its NumPy actor); ``apex_loops`` Ape-X's per-worker
epsilons and asynchronous driver loops, and ``apex_learner`` its streamed learner. The replay
group, its shards, the Q learner and the transition worker are shared with SAC and MBPO and stay
in ``mpirl``.
"""
