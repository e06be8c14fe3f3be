"""Game-tree search for two-player board games: batched MCTS (PUCT and Gumbel) for AlphaZero,
reference players to evaluate against, and board symmetries. NumPy only: no torch, no MPI."""
