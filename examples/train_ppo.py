"""Train PPO on CartPole from a script: every rank runs this file.

    mpiexec -n 3 python examples/train_ppo.py      # a driver and two rollout ranks
    python examples/train_ppo.py                   # local mode: one process
"""

import sys

import mpirl

result = mpirl.train(
    "PPO", "CartPole-v1",
    config={"num_envs_per_worker": 8},
    stop={"episode_return_mean": 150, "timesteps_total": 200_000},
    run_dir=sys.argv[1] if len(sys.argv) > 1 else None,
)
if result is not None:  # rank 0; the other ranks get None
    print(f"episode_return_mean {result['episode_return_mean']:.1f} after "
          f"{result['timesteps_total']} env steps")
