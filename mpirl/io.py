"""Reading trajectory dumps (Minari's HDF5 layout).

TEMPORARY STAND-IN on the ``offline`` branch: the real ``mpirl.io`` comes from the ``dumps``
branch and replaces this file on merge. It implements only the agreed API (``open_dataset``,
``Dataset``, ``Episode``), minimally, so that the offline algorithms can be written and tested
against it. The environment's spaces come from ``metadata.json``'s ``env_id`` (the env is built
once to read them); the real reader may take them from the file instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py
import numpy as np

from mpirl.errors import EXIT_USAGE, MpirlError

MAIN_FILE = "main_data.hdf5"
METADATA_FILE = "metadata.json"
_STEP_KEYS = ("observations", "actions", "rewards", "terminations", "truncations")


class DatasetError(MpirlError):
    """A dump is missing, foreign or truncated."""

    exit_code = EXIT_USAGE


@dataclass
class Episode:
    id: int
    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    infos: dict[str, np.ndarray] = field(default_factory=dict)


class Dataset:
    """One dump: the episodes of every per-rank file, reachable through ``main_data.hdf5``."""

    def __init__(self, main: Path, metadata: dict[str, Any]) -> None:
        self.main = main
        self.env_id: str = metadata["env_id"]
        with h5py.File(main, "r") as f:
            self._names = sorted((n for n in f if n.startswith("episode_")),
                                 key=lambda n: int(n.split("_")[1]))
            self.files = sorted({Path(main.parent / f.get(n, getlink=True).filename)
                                 if isinstance(f.get(n, getlink=True), h5py.ExternalLink)
                                 else main for n in self._names})
            self.total_steps = int(sum(len(f[n]["rewards"]) for n in self._names))
        self.num_episodes = len(self._names)
        env = gym.make(self.env_id)
        self.observation_space, self.action_space = env.observation_space, env.action_space
        env.close()

    def iterate_episodes(self, shard: tuple[int, int] = (0, 1)) -> Iterator[Episode]:
        index, count = shard
        with h5py.File(self.main, "r") as f:
            for name in self._names[index::count]:
                group = f[name]
                data = {key: group[key][()] for key in _STEP_KEYS}
                infos = {k: v[()] for k, v in group["infos"].items()} if "infos" in group else {}
                yield Episode(int(name.split("_")[1]), infos=infos, **data)

    def sample_batches(self, batch_size: int, rng: np.random.Generator,
                       shard: tuple[int, int] = (0, 1),
                       num_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        episodes = list(self.iterate_episodes(shard))
        rows = {
            "obs": np.concatenate([e.observations[:-1] for e in episodes]),
            "next_obs": np.concatenate([e.observations[1:] for e in episodes]),
            "actions": np.concatenate([e.actions for e in episodes]),
            "rewards": np.concatenate([e.rewards for e in episodes]),
            "terminations": np.concatenate([e.terminations for e in episodes]),
            "truncations": np.concatenate([e.truncations for e in episodes]),
            "action_logp": np.concatenate([e.infos["action_logp"] for e in episodes]),
        }
        made = 0
        while num_batches is None or made < num_batches:
            index = rng.integers(0, len(rows["obs"]), batch_size)
            yield {k: v[index] for k, v in rows.items()}
            made += 1


def open_dataset(path: str | Path) -> Dataset:
    """The dump at ``path`` (a dump directory or its ``main_data.hdf5``); DatasetError if not."""
    path = Path(path)
    main = path / MAIN_FILE if path.is_dir() else path
    if not main.exists():
        raise DatasetError(f"{path}: no such dump (expected {MAIN_FILE} there)")
    metadata_path = main.parent / METADATA_FILE
    try:
        metadata = json.loads(metadata_path.read_text(encoding="utf-8"))
        metadata["env_id"]
        return Dataset(main, metadata)
    except (OSError, KeyError, ValueError) as error:
        raise DatasetError(f"{path} is not a readable mpirl dump: {error}") from None
