"""ARS: augmented random search (Mania et al. 2018), as RLlib's former ``ARSConfig``.

Linear policies by default. Each generation evaluates ``num_rollouts`` antithetic directions,
keeps the ``rollouts_used`` with the best max(r+, r-), and steps along their return-weighted sum
scaled by the standard deviation of the returns used. ``normalize_observations`` true is ARS V2
(observations normalized by statistics summed over all ranks), false V1. It runs on ES's workers
and noise table: only (noise index, returns) cross ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mpirl.algorithms.evolution.config import EvolutionConfig

# ES's workers, model and checks: only the update rule differs.
from mpirl.algorithms.evolution.es import (
    LEARNER,
    RECURRENT,
    ROLLOUT_WORKER,
    check_config,
    loss,
    model_spec,
)
from mpirl.algorithms.evolution.operators import (
    EvolutionState,
    check_same_weights,
    count_generation,
    evaluate_generation,
    generation_stats,
    setup_perturbations,
)

from mpirl.config.fields import Range, above, at_least
from mpirl.errors import ConfigError
from mpirl.execution.trainer import Trainer

__all__ = ["LEARNER", "RECURRENT", "ROLLOUT_WORKER", "Config", "check_config", "loss",
           "model_spec", "setup", "training_step"]


@dataclass
class Config(EvolutionConfig):
    """ARS's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    hidden_sizes: tuple[int, ...] = ()
    """Hidden layer widths of the policy; () is ARS's linear policy."""
    zero_init: bool = True
    """Start from all-zero weights, as the paper does."""
    num_rollouts: int = 16
    """Directions (antithetic pairs) evaluated per generation, over all ranks."""
    rollouts_used: int = 8
    """b: the best directions kept for the update (at most num_rollouts)."""
    noise_stdev: float = 0.03
    """nu: the standard deviation of the parameter perturbations."""
    sgd_stepsize: float = 0.02
    """alpha: the step size."""
    offset: float = 0.0
    """Subtracted from every reward of a training episode (the paper's alive-bonus shift for
    Humanoid); evaluation episodes report the env's own rewards."""
    normalize_observations: bool = True
    """ARS V2 (true): observations normalized by statistics summed over all ranks; V1 (false)."""

    ranges: ClassVar[dict[str, Range]] = {
        **EvolutionConfig.ranges, "num_rollouts": at_least(1), "rollouts_used": at_least(1),
        "noise_stdev": above(0), "sgd_stepsize": above(0), "offset": Range()}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollouts_used > self.num_rollouts:
            raise ConfigError(f"rollouts_used ({self.rollouts_used}) must be at most "
                              f"num_rollouts ({self.num_rollouts})")


def setup(trainer: Trainer) -> EvolutionState:
    """Every rollout rank's noise table and update rule (ARS's: the best directions' step)."""
    c = trainer.config
    return setup_perturbations(trainer, "ars", noise_stdev=c.noise_stdev, stepsize=c.sgd_stepsize,
                        rollouts_used=c.rollouts_used, offset=c.offset)


def training_step(trainer: Trainer, evolution: EvolutionState) -> dict[str, float]:
    """One generation: evaluate directions on every rollout rank, apply the same step on each."""
    c = trainer.config
    evolution.sync_workers()
    generation = evaluate_generation(trainer, c.num_rollouts, c.train_batch_size)
    check_same_weights(generation, trainer.iteration + 1)
    count_generation(trainer, generation)
    return generation_stats(generation, evolution)
