"""Offline training: learners train on their own shard of a trajectory dump.

What crosses ranks: the driver sends each learner an ``OfflineInput`` (a path and a few numbers,
never data); learner i of n opens the dump itself on its first call and keeps shard (i, n) of its
episodes in memory (``EpisodeShard``). The rollout workers only evaluate the current policy; what
they play is never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpirl.errors import ConfigError, MpirlError


@dataclass(frozen=True)
class OfflineInput:
    """Where a learner reads its shard, and how it turns episodes into rows."""

    path: str
    """A dump directory or its main_data.hdf5."""
    gamma: float
    """Discount of the returns-to-go stored with every row."""
    max_rows_in_memory: int
    """The most rows one learner holds; a larger shard is a ConfigError."""


def _open(path: str):
    # Imported here: mpirl.io is the dump reader, needed only by offline runs.
    from mpirl.io import open_dataset

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
    if dataset.env_id != env_id:
        raise ConfigError(f'config key "input": {path} holds episodes of {dataset.env_id}, but '
                          f'--env is {env_id}. Train on the environment the dump was made on.')
    if dataset.num_episodes == 0:
        raise ConfigError(f'config key "input": {path} holds no episodes')
    return dataset.num_episodes


def returns_to_go(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """Discounted sum of each step's reward and those after it, within one episode. A truncated
    episode is not bootstrapped (the dump has no value estimates)."""
    returns = np.empty(len(rewards), np.float32)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        returns[t] = running
    return returns


class EpisodeShard:
    """One learner's shard of a dump, in memory as rows ``obs``, ``actions``, ``returns``."""

    def __init__(self, source: OfflineInput, shard: tuple[int, int]) -> None:
        columns: dict[str, list[np.ndarray]] = {"obs": [], "actions": [], "returns": []}
        rows = 0
        self.num_episodes = 0
        for episode in _open(source.path).iterate_episodes(shard):
            rows += len(episode.rewards)
            if rows > source.max_rows_in_memory:
                raise ConfigError(
                    f"learner shard {shard[0]} of {shard[1]} of {source.path} holds more than "
                    f"max_rows_in_memory={source.max_rows_in_memory} rows; raise it, or use more "
                    f"learners (num_learners) so that each holds a smaller shard")
            columns["obs"].append(episode.observations[:-1])
            columns["actions"].append(episode.actions)
            columns["returns"].append(returns_to_go(episode.rewards, source.gamma))
            self.num_episodes += 1
        self.rows = {k: np.concatenate(v) if v else np.zeros(0, np.float32)
                     for k, v in columns.items()}
        self.rows["obs"] = self.rows["obs"].astype(np.float32, copy=False)

    def __len__(self) -> int:
        return len(self.rows["returns"])

    def sample(self, size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """``size`` rows drawn uniformly with replacement."""
        index = rng.integers(0, len(self), size)
        return {k: v[index] for k, v in self.rows.items()}


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


def rows_per_learner(train_batch_size: int, num_learners: int) -> int:
    """Each learner's share of a step's rows; equal shares, so the plain average of the
    learners' gradients is the gradient of the whole batch."""
    return max(1, train_batch_size // num_learners)


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


def offline_input(config) -> OfflineInput:
    return OfflineInput(str(config.input), getattr(config, "gamma", 1.0),
                        config.max_rows_in_memory)


def count_and_evaluate(algo, train_stats: dict[str, float]) -> dict[str, float]:
    """Count the dataset rows just trained on as ``timesteps_total``; every
    ``evaluation_interval`` iterations, have the rollout workers play ``evaluation_episodes``
    with the weights they hold, into the episode metrics (``episode_return_mean``). Their env
    steps are counted apart, in ``evaluation_env_steps_total``."""
    from mpirl.operators import evaluate_policy  # operators import this module

    config = algo.config
    algo.timesteps_total += int(train_stats["learner_samples"])
    if (algo.iteration + 1) % config.evaluation_interval == 0:
        played = evaluate_policy(algo.rollouts, config.evaluation_episodes,
                                 config.evaluation_deterministic)
        algo.evaluation_env_steps_total += played.env_steps
        played.env_steps = 0
        algo.count(played)
    return {"evaluation_env_steps_total": float(algo.evaluation_env_steps_total)}
