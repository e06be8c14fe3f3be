"""Running an algorithm: its worker groups, counters, metrics and stop criteria.

An algorithm module (``mpirl.algorithms.<name>``) provides ``Config`` (a flat dataclass), a loss
``(policy, batch, config) -> (loss, stats)`` and ``training_step(algo) -> stats``. ``Algorithm``
builds the rollout and learner groups that every plan uses and turns each iteration into one
metrics row.
"""

from __future__ import annotations

import importlib
import math
import time
from collections import deque
from types import ModuleType
from typing import Any

import numpy as np

from mpirl.errors import ConfigError
from mpirl.learner import Learner
from mpirl.operators import SampleResult, broadcast_weights
from mpirl.policy import PolicySpec, RunningMeanStd
from mpirl.rollout import EnvSpec, RolloutWorker
from mpirl.runtime import Driver

#: Algorithm name on the command line -> module.
ALGORITHMS = {"PPO": "mpirl.algorithms.ppo", "A2C": "mpirl.algorithms.a2c"}

#: Keys a ``--stop`` criterion may use (any one reached stops the run).
STOP_KEYS = ("episode_return_mean", "timesteps_total", "training_iteration", "time_total_s")


def load_algorithm(name: str) -> ModuleType:
    module = ALGORITHMS.get(name.upper())
    if module is None:
        raise ConfigError(f"unknown algorithm {name!r}; available: {', '.join(ALGORITHMS)}")
    return importlib.import_module(module)


class Algorithm:
    """The driver-side state of one run; ``train()`` runs one iteration and returns its row."""

    def __init__(self, driver: Driver, module: ModuleType, config: Any, env: EnvSpec) -> None:
        self.driver, self.module, self.config, self.env = driver, module, config, env
        observation_space, action_space = env.spaces()
        self.policy_spec = PolicySpec(observation_space, action_space,
                                      tuple(config.hidden_sizes), config.activation)
        self.rollouts = driver.spawn(
            "rollout", RolloutWorker, env, self.policy_spec, config.num_envs_per_worker,
            config.seed, config.gamma, config.gae_lambda, config.normalize_observations,
            config.torch_threads, local_if_empty=True,
        )
        self.learners = driver.spawn(
            "learner", Learner, self.policy_spec, module.loss, config, config.lr,
            config.grad_clip, config.seed, config.learner_backend, config.torch_threads,
            local_if_empty=True,
        )
        broadcast_weights(self.learners, self.rollouts)
        shape = observation_space.shape
        self.obs_filter = RunningMeanStd(shape) if config.normalize_observations and shape else None
        self.iteration = 0
        self.timesteps_total = 0
        self.episodes_total = 0
        self.returns: deque[float] = deque(maxlen=config.metrics_window)
        self.lengths: deque[int] = deque(maxlen=config.metrics_window)
        self.started = time.monotonic()

    @property
    def train_batch_size(self) -> int:
        """Environment steps per iteration, over all rollout workers."""
        c = self.config
        return len(self.rollouts) * c.num_envs_per_worker * c.rollout_fragment_length

    def num_minibatches(self, minibatch_size: int) -> int:
        """SGD steps per epoch such that each step sees about ``minibatch_size`` rows in total,
        whatever the number of learners (each learner's share is split this many times)."""
        return max(1, round(self.train_batch_size / minibatch_size))

    def count(self, samples: SampleResult) -> None:
        """Add one round of samples to the counters and the episode window."""
        self.timesteps_total += samples.env_steps
        self.episodes_total += len(samples.episode_returns)
        self.returns.extend(samples.episode_returns)
        self.lengths.extend(samples.episode_lengths)

    def train(self) -> dict[str, Any]:
        start, steps_before = time.monotonic(), self.timesteps_total
        stats = self.module.training_step(self)
        self.iteration += 1
        elapsed = time.monotonic() - start
        nan = math.nan
        return {
            "iteration": self.iteration,
            "timesteps_total": self.timesteps_total,
            "episodes_total": self.episodes_total,
            "episode_return_mean": float(np.mean(self.returns)) if self.returns else nan,
            "episode_return_min": float(np.min(self.returns)) if self.returns else nan,
            "episode_return_max": float(np.max(self.returns)) if self.returns else nan,
            "episode_len_mean": float(np.mean(self.lengths)) if self.lengths else nan,
            "env_steps_per_s": (self.timesteps_total - steps_before) / max(elapsed, 1e-9),
            "time_this_iter_s": elapsed,
            "time_total_s": time.monotonic() - self.started,
            # Rollout ranks can be lost and survived (survive_rollout_loss, under ULFM).
            "num_rollout_workers": len(self.rollouts),
            "rollout_ranks_lost": len(self.rollouts.lost),
            **stats,
        }


def stop_reached(row: dict[str, Any], stop: dict[str, float]) -> str | None:
    """The first criterion of ``stop`` that ``row`` meets, or None."""
    values = {**row, "training_iteration": row["iteration"]}
    for key, threshold in stop.items():
        value = values.get(key)
        if value is not None and not math.isnan(value) and value >= threshold:
            return key
    return None
