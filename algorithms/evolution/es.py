"""ES: OpenAI's evolution strategies (Salimans et al. 2017), as RLlib's former ``ESConfig``.

Every rollout rank keeps the weights and evaluates antithetic pairs ``theta +- sigma * eps`` on
whole episodes, with ``eps`` read from a noise table that exists once per node in MPI shared
memory. The ranks exchange only (noise index, return+, return-, lengths) per pair; every rank
ranks all returns (centered ranks), forms the same gradient estimate and takes the same Adam step
with L2 weight decay, so no weight vector crosses the network while training. Observation
statistics are summed over all ranks. ``episode_return_mean`` is the unperturbed policy's, from
the evaluation episodes (``eval_prob``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mpirl.algorithms.evolution.config import EvolutionConfig
from mpirl.algorithms.evolution.driver_weights import DriverWeights
from mpirl.algorithms.evolution.operators import (
    EvolutionState,
    check_same_weights,
    count_generation,
    direct_policy_spec,
    evaluate_generation,
    generation_stats,
    setup_perturbations,
)
from mpirl.algorithms.evolution.operators import check_evolution_config as check_config
from mpirl.algorithms.evolution.perturbation_worker import PerturbationWorker

from mpirl.config.fields import Range, above, at_least
from mpirl.execution.trainer import Trainer

__all__ = ["LEARNER", "RECURRENT", "ROLLOUT_WORKER", "Config", "check_config", "loss",
           "model_spec", "setup", "training_step"]

ROLLOUT_WORKER = PerturbationWorker
LEARNER = DriverWeights  # the driver's copy of the weights
model_spec = direct_policy_spec
loss = None  # derivative-free: no loss to differentiate
RECURRENT = False  # whole episodes of perturbed policies, no recurrent state


@dataclass
class Config(EvolutionConfig):
    """ES's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    hidden_sizes: tuple[int, ...] = (32,)
    """Hidden layer widths of the deterministic policy (() is linear)."""
    episodes_per_batch: int = 50
    """Episodes per generation over all ranks (antithetic: half as many noise vectors)."""
    train_batch_size: int = 2_000
    noise_stdev: float = 0.02
    """sigma: the standard deviation of the parameter perturbations."""
    stepsize: float = 0.01
    """Adam's step size."""
    l2_coeff: float = 0.005
    """L2 weight decay added to the gradient estimate."""

    ranges: ClassVar[dict[str, Range]] = {
        **EvolutionConfig.ranges, "episodes_per_batch": at_least(2), "noise_stdev": above(0),
        "stepsize": above(0), "l2_coeff": at_least(0)}


def setup(trainer: Trainer) -> EvolutionState:
    """Every rollout rank's noise table and update rule (ES's: Adam on centered ranks)."""
    c = trainer.config
    return setup_perturbations(trainer, "es", noise_stdev=c.noise_stdev, stepsize=c.stepsize,
                        l2_coeff=c.l2_coeff)


def training_step(trainer: Trainer, evolution: EvolutionState) -> dict[str, float]:
    """One generation: evaluate pairs on every rollout rank, apply the same update on each."""
    c = trainer.config
    evolution.sync_workers()
    generation = evaluate_generation(trainer, c.episodes_per_batch // 2, c.train_batch_size)
    check_same_weights(generation, trainer.iteration + 1)
    count_generation(trainer, generation)
    return generation_stats(generation, evolution)
