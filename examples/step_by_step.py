"""Drive a run one iteration at a time, as RLlib's algo.train(): save, restore, act.

    mpiexec -n 3 python examples/step_by_step.py RUN_DIR
    python examples/step_by_step.py RUN_DIR

Only rank 0 runs past ``build``: the other ranks serve their workers until ``stop()``.
"""

import sys

import gymnasium as gym

import mpirl

run_dir = sys.argv[1] if len(sys.argv) > 1 else None
algo = mpirl.Algorithm.build("PPO", "CartPole-v1", config={"num_envs_per_worker": 8},
                             run_dir=run_dir)
for _ in range(30):
    row = algo.train()
    print(f"iteration {row['iteration']}: return {row['episode_return_mean']:.1f}")
    if row["episode_return_mean"] >= 150:
        break
checkpoint = algo.save()
algo.restore(checkpoint)

env = gym.make("CartPole-v1")
obs, _ = env.reset(seed=0)
total, done = 0.0, False
while not done:
    obs, reward, terminated, truncated, _ = env.step(int(algo.compute_single_action(obs)))
    total += float(reward)
    done = terminated or truncated
print(f"greedy episode return {total:.0f}; checkpoint {checkpoint}")
algo.stop()
