"""Offline training: learners train on their own shard of a trajectory dump.

What crosses ranks: the driver sends each learner an ``OfflineInput`` (a path and a few numbers,
never data); learner i of n opens the dump itself on its first call and reads shard (i, n) of its
episodes (``EpisodeShard``): whole into memory, or streamed when larger than memory allows. The
rollout workers only evaluate the current policy; what they play is never trained on.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpirl.config.fields import OfflineConfig
from mpirl.errors import ConfigError, MpirlError

__all__ = ["OfflineInput", "check_config", "offline_input"]


@dataclass(frozen=True)
class OfflineInput:
    """Where a learner reads its shard, and how it turns episodes into rows."""

    path: str
    """A dump directory or its main_data.hdf5."""
    gamma: float
    """Discount of the returns-to-go stored with every row."""
    max_rows_in_memory: int
    """The most rows one learner holds in memory; a larger shard is streamed."""


def _open(path: str):
    # Imported here: mpirl.data.reader is the dump reader, needed only by offline runs.
    from mpirl.data.reader import open_dataset

    return open_dataset(path)


def check_input(path: str, env_id: str) -> int:
    """The number of episodes in the dump at ``path``; ConfigError (or the reader's own error,
    exit code 2) unless it is a dump of ``env_id``. Cheap: reads the dump's metadata only."""
    if not path:
        raise ConfigError('offline algorithms need the config key "input": a trajectory dump '
                          'directory, e.g. --config \'{"input": "runs/PPO-run/trajectories"}\'')
    if not Path(path).exists():
        raise ConfigError(f'config key "input": {path}: no such file or directory')
    dataset = _open(path)
    if dataset.damaged:
        # Every rank checks the input; rank 0 speaks. The learners' shards leave them out too.
        from mpirl.runtime.world import run_rank

        if run_rank() == 0:
            for damaged in dataset.damaged:
                print(f'mpirl: warning: config key "input": {damaged.describe()}; training on '
                      f'the rest', file=sys.stderr, flush=True)
    if dataset.env_id != env_id:
        raise ConfigError(f'config key "input": {path} holds episodes of {dataset.env_id}, but '
                          f'--env is {env_id}. Train on the environment the dump was made on.')
    if dataset.num_episodes == 0:
        raise ConfigError(f'config key "input": {path} holds no episodes')
    return dataset.num_episodes


class EpisodeShard:
    """One learner's shard of a dump as rows ``obs``, ``actions``, ``returns`` (discounted
    returns-to-go). A shard of at most ``max_rows_in_memory`` rows is read whole and sampled
    uniformly with replacement; a larger one is streamed from the files through a shuffle
    buffer of that many rows (``Dataset.sample_batches``), a pass at a time."""

    def __init__(self, source: OfflineInput, shard: tuple[int, int]) -> None:
        self.source, self.shard = source, shard
        self.dataset = _open(source.path)
        self.num_episodes = len(self.dataset.shard_ids(shard))
        self.num_rows = self.dataset.shard_steps(shard)
        self.streamed = self.num_rows > source.max_rows_in_memory
        self._stream: Iterator[dict[str, np.ndarray]] | None = None
        self._stream_batch = 0
        self.rows: dict[str, np.ndarray] = {}
        if not self.streamed:
            from mpirl.data.reader import returns_to_go

            columns: dict[str, list[np.ndarray]] = {"obs": [], "actions": [], "returns": []}
            for episode in self.dataset.iterate_episodes(shard):
                columns["obs"].append(episode.observations[:-1])
                columns["actions"].append(episode.actions)
                columns["returns"].append(returns_to_go(episode.rewards, source.gamma))
            self.rows = {k: np.concatenate(v) if v else np.zeros(0, np.float32)
                         for k, v in columns.items()}
            # uint8 images stay bytes (the model scales them); other observations are floats.
            if self.rows["obs"].dtype != np.uint8:
                self.rows["obs"] = self.rows["obs"].astype(np.float32, copy=False)
            self.dataset.close()

    def __len__(self) -> int:
        return self.num_rows

    def sample(self, size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """``size`` rows: uniformly with replacement from memory, or the stream's next batch."""
        if not self.streamed:
            index = rng.integers(0, len(self), size)
            return {k: v[index] for k, v in self.rows.items()}
        if self._stream is None or self._stream_batch != size:
            self._stream = self.dataset.sample_batches(
                size, rng, self.shard, buffer_size=self.source.max_rows_in_memory,
                gamma=self.source.gamma)
            self._stream_batch = size
        batch = next(self._stream)
        obs = batch["obs"] if batch["obs"].dtype == np.uint8 else batch["obs"].astype(np.float32,
                                                                                   copy=False)
        return {"obs": obs, "actions": batch["actions"], "returns": batch["returns_to_go"]}


def load_shard(source: OfflineInput, comm) -> EpisodeShard:
    """Every learner of ``comm`` loads its own shard; all raise the same ConfigError if any
    shard failed to load or is empty (each later SGD step is an allreduce they must all join)."""
    shard = error = None
    try:
        shard = EpisodeShard(source, (comm.Get_rank(), comm.Get_size()))
    except MpirlError as caught:
        error = str(caught)
    outcomes = comm.allgather(error or len(shard))
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, str):
            raise ConfigError(f"learner {index} could not load its shard: {outcome}")
    if min(outcomes) == 0:
        raise ConfigError(f"{source.path} has fewer episodes than the {comm.Get_size()} learners "
                          f"that each read a shard of them; use fewer learners (num_learners)")
    return shard


def rows_per_learner(train_batch_size: int, num_learners: int, index: int) -> int:
    """Learner ``index``'s share of a step's ``train_batch_size`` rows: the shares add up to it
    (the allreduce weighs each learner's gradient by its rows, so they need not be equal), and
    none is empty."""
    share, extra = divmod(train_batch_size, num_learners)
    return max(1, share + (index < extra))


# What the offline plans (BC, MARWIL) share: their config checks and their bookkeeping.


def check_config(config, env) -> None:
    """Checks of an offline config made on every rank before MPI traffic starts (by
    ``make_request``): numbers in range, and ``input`` a dump of ``env``."""
    for key in ("train_batch_size", "evaluation_episodes", "evaluation_interval",
                "max_rows_in_memory"):
        if getattr(config, key) < 1:
            raise ConfigError(f"config key {key!r} must be >= 1, got {getattr(config, key)}")
    if config.num_sgd_steps_per_iteration < 0:
        raise ConfigError(f"config key 'num_sgd_steps_per_iteration' must be >= 0, got "
                          f"{config.num_sgd_steps_per_iteration}")
    num_episodes = check_input(config.input, env.env_id)
    if num_episodes < config.num_learners:
        raise ConfigError(f'config key "input": {config.input} holds {num_episodes} episodes, '
                          f'fewer than the {config.num_learners} learners that each read a '
                          f'shard of them; use fewer learners (num_learners)')


def offline_input(config: OfflineConfig) -> OfflineInput:
    """Where the learners read ``config``'s dump, and the discount of its returns-to-go."""
    return OfflineInput(str(config.input), config.discount(), config.max_rows_in_memory)
