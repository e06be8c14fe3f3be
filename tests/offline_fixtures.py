"""Trajectory dumps for the offline tests, written the way mpirl's dumps are laid out (Minari's
HDF5 layout: one file per rollout rank, a main_data.hdf5 of external links, metadata.json).

A stand-in until ``mpirl train --dump-trajectories`` lands: it plays a trained checkpoint's policy
(stochastic actions, so the data has some variety) and writes its episodes itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np

from mpirl.algorithm import load_algorithm
from mpirl.checkpoint import read_state_file
from mpirl.config import build
from mpirl.evaluate import find_checkpoint
from mpirl.policy import PolicySpec


def play_episodes(policy, env_id: str, episodes: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Whole episodes of ``policy`` (sampled actions) as Minari's per-episode arrays."""
    env = gym.make(env_id)
    played = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        columns = {k: [] for k in ("actions", "rewards", "terminations", "truncations",
                                   "action_logp")}
        observations, done = [obs], False
        while not done:
            actions, logp, _ = policy.act(np.asarray(obs)[None])
            obs, reward, terminated, truncated, _ = env.step(policy.env_actions(actions)[0])
            observations.append(obs)
            for key, value in (("actions", actions[0]), ("rewards", reward),
                               ("terminations", terminated), ("truncations", truncated),
                               ("action_logp", logp[0])):
                columns[key].append(value)
            done = terminated or truncated
        played.append({"observations": np.asarray(observations, np.float32),
                       **{k: np.asarray(v) for k, v in columns.items()}})
    env.close()
    return played


def write_dump(directory: Path, env_id: str, episodes: list[dict[str, np.ndarray]],
               num_files: int = 2) -> Path:
    """Write ``episodes`` round-robin into ``num_files`` per-rank files, link them from
    main_data.hdf5 and describe them in metadata.json. Returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"rollout_{i}.hdf5" for i in range(num_files)]
    files = [h5py.File(directory / name, "w") for name in names]
    with h5py.File(directory / "main_data.hdf5", "w") as main:
        for i, episode in enumerate(episodes):
            group = files[i % num_files].create_group(f"episode_{i}")
            for key, value in episode.items():
                if key == "action_logp":
                    group.create_dataset(f"infos/{key}", data=value)
                else:
                    group.create_dataset(key, data=value)
            main[f"episode_{i}"] = h5py.ExternalLink(names[i % num_files], f"/episode_{i}")
    for f in files:
        f.close()
    metadata = {"env_id": env_id, "total_episodes": len(episodes),
                "total_steps": int(sum(len(e["rewards"]) for e in episodes))}
    (directory / "metadata.json").write_text(json.dumps(metadata))
    return directory


def checkpoint_policy(run_dir: Path):
    """The policy of a run's newest checkpoint (learner 0's weights)."""
    checkpoint, manifest = find_checkpoint(run_dir)
    config = build(load_algorithm(manifest["algo"]).Config, manifest["config"])
    env = gym.make(manifest["env"]["env_id"])
    policy = PolicySpec(env.observation_space, env.action_space, tuple(config.hidden_sizes),
                        config.activation).build("cpu")
    env.close()
    state = read_state_file(checkpoint / "learner_0.pkl", manifest["files"]["learner_0.pkl"])
    policy.set_flat_weights(state["weights"])
    return policy
