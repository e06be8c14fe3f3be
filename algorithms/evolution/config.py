"""The config keys ES and ARS share: ``EvolutionConfig``, the base of their ``Config``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mpirl.config.fields import CommonConfig, Range, above, at_least
from mpirl.errors import ConfigError


@dataclass
class EvolutionConfig(CommonConfig):
    """Keys of ES and ARS (evolution strategies): perturbation workers on the rollout ranks, a
    noise table per node, the weights kept on every rollout rank. ``lr`` and ``grad_clip`` are
    not used."""

    num_learners: int = 0
    """Must be 0: the driver keeps a copy of the weights for checkpoints, no learner ranks."""
    num_envs_per_worker: int = 8
    """Episodes each rollout rank plays at once, each with its own perturbation."""
    train_batch_size: int = 0
    """At least this many env steps per generation over all ranks (more pairs are drawn until
    they are played); 0: just the pairs asked for."""
    action_noise_std: float = 0.0
    """Gaussian noise on Box actions of training episodes (0: none)."""
    eval_prob: float = 0.1
    """Share of the episodes played by the unperturbed policy (every 1/eval_prob-th episode a
    rank starts, from a random phase); those give episode_return_mean."""
    noise_size: int = 25_000_000
    """float32 values in the noise table (one copy per node: 100 MB at the default). Salimans et
    al. used 250M; make it at least 10x the number of weights."""
    noise_seed: int = 123
    """Seed of the noise table (every node builds the same one)."""
    normalize_observations: bool = True
    """Normalize observations by running statistics summed over all ranks."""
    metrics_window: int = 20
    """Evaluation episodes averaged into episode_return_mean."""

    ranges: ClassVar[dict[str, Range]] = {
        "train_batch_size": at_least(0), "action_noise_std": at_least(0),
        "eval_prob": Range(0, 1, high_open=True), "noise_size": above(0),
        "noise_seed": at_least(0)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_learners != 0:
            raise ConfigError(f"ES and ARS keep their weights on the rollout ranks: "
                              f"num_learners must be 0, got {self.num_learners}")

    def observation_normalization(self) -> bool:
        return self.normalize_observations

    def samples_per_iteration(self, rollout_slots: int) -> int:
        """A generation plays at least ``train_batch_size`` env steps, over all ranks."""
        return self.train_batch_size
