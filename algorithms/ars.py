"""ARS: augmented random search (Mania et al. 2018), as RLlib's former ``ARSConfig``.

Linear policies by default. Each generation evaluates ``num_rollouts`` antithetic directions,
keeps the ``rollouts_used`` with the best max(r+, r-), and steps along their return-weighted sum
scaled by the standard deviation of the returns used. ``normalize_observations`` true is ARS V2
(observations normalized by statistics summed over all ranks), false V1. It runs on ES's workers
and noise table: only (noise index, returns) cross ranks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from mpirl.config.fields import CommonConfig, Range, above, at_least
from mpirl.errors import ConfigError
from mpirl.execution.evolution import check_search_config, run_generation, setup_search
from mpirl.models.evolution import DirectPolicySpec
from mpirl.workers.es_worker import PerturbationWorker, SearchWeights

__all__ = ["Config", "loss", "training_step", "setup", "model_spec"]

ROLLOUT_WORKER = PerturbationWorker
LEARNER = SearchWeights
loss = None  # derivative-free: no loss to differentiate


@dataclass
class Config(CommonConfig):
    """ARS's settings. Defaults suit CartPole-v1; every field is a ``--config`` key. ``lr`` and
    ``grad_clip`` are not used (the step size is ``sgd_stepsize``)."""

    num_learners: int = 0
    """Must be 0: the driver keeps a copy of the weights for checkpoints, no learner ranks."""
    num_envs_per_worker: int = 8
    """Episodes each rollout rank plays at once, each with its own perturbation."""
    hidden_sizes: tuple[int, ...] = ()
    """Hidden layer widths of the policy; () is ARS's linear policy."""
    zero_init: bool = True
    """Start from all-zero weights, as the paper does."""

    num_rollouts: int = 16
    """Directions (antithetic pairs) evaluated per generation, over all ranks."""
    rollouts_used: int = 8
    """b: the best directions kept for the update (at most num_rollouts)."""
    train_batch_size: int = 0
    """At least this many env steps per generation (more directions are drawn until they are
    played); 0: exactly num_rollouts."""
    noise_stdev: float = 0.03
    """nu: the standard deviation of the parameter perturbations."""
    sgd_stepsize: float = 0.02
    """alpha: the step size."""
    offset: float = 0.0
    """Subtracted from every reward of a training episode (the paper's alive-bonus shift for
    Humanoid); evaluation episodes report the env's own rewards."""
    action_noise_std: float = 0.0
    """Gaussian noise on Box actions of training episodes (0: none)."""
    eval_prob: float = 0.1
    """Probability that an episode is played by the unperturbed policy; those give
    episode_return_mean."""
    noise_size: int = 25_000_000
    """float32 values in the noise table (one copy per node)."""
    noise_seed: int = 123
    """Seed of the noise table (every node builds the same one)."""
    normalize_observations: bool = True
    """ARS V2 (true): observations normalized by statistics summed over all ranks; V1 (false)."""
    metrics_window: int = 20
    """Evaluation episodes averaged into episode_return_mean."""

    ranges: ClassVar[dict[str, Range]] = {
        "num_rollouts": at_least(1), "rollouts_used": at_least(1),
        "train_batch_size": at_least(0), "noise_stdev": above(0), "sgd_stepsize": above(0),
        "action_noise_std": at_least(0), "eval_prob": Range(0, 1, high_open=True),
        "noise_size": above(0), "noise_seed": at_least(0)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_learners != 0:
            raise ConfigError(f"ARS keeps its weights on the rollout ranks: num_learners must "
                              f"be 0, got {self.num_learners}")
        if self.rollouts_used > self.num_rollouts:
            raise ConfigError(f"rollouts_used ({self.rollouts_used}) must be at most "
                              f"num_rollouts ({self.num_rollouts})")


def model_spec(observation_space: Any, action_space: Any, config: Config) -> DirectPolicySpec:
    return DirectPolicySpec(observation_space, action_space, tuple(config.hidden_sizes),
                            config.activation)


def check_config(config: Config, env: Any) -> None:
    check_search_config(sys.modules[__name__], config, env)


def setup(algo) -> None:
    c = algo.config
    setup_search(algo, "ars", noise_size=c.noise_size, noise_seed=c.noise_seed,
                 noise_stdev=c.noise_stdev, stepsize=c.sgd_stepsize,
                 rollouts_used=c.rollouts_used, offset=c.offset,
                 action_noise_std=c.action_noise_std, eval_prob=c.eval_prob)


def training_step(algo) -> dict[str, float]:
    """One generation: evaluate directions on every rollout rank, apply the same step on each."""
    c = algo.config
    return run_generation(algo, c.num_rollouts, c.train_batch_size)
