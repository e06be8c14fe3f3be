"""AlphaZero: self-play with batched MCTS and a policy-value network, for two-player board games.

``alphazero`` is the algorithm module (``--algo AlphaZero``): its config, plan and evaluation.
The rest is its own:

* the game (``games``: PettingZoo classic and OpenSpiel behind one interface; ``game_env``: the
  game as the run's env) and its symmetries (``symmetries``);
* search (``mcts``: batched MCTS, PUCT or Gumbel; ``players``: reference opponents and matches)
  and self-play (``self_play``), NumPy only;
* the network (``spec``, torch-free; ``network``, torch, with the loss);
* the workers (``self_play_worker`` on the rollout ranks, ``learner`` with its ``replay``
  shard) and the operator between them (``operators``);
* ``match``: ``mpirl evaluate --opponent`` and ``mpirl play`` of a checkpoint.

Nothing here is imported by mpirl itself: the package's ``__init__`` imports nothing, so a
torch-free module of it loads without torch.
"""
