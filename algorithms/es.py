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
    """ES's settings. Defaults suit CartPole-v1; every field is a ``--config`` key. ``lr`` and
    ``grad_clip`` are not used (the step size is ``stepsize``)."""

    num_learners: int = 0
    """Must be 0: the driver keeps a copy of the weights for checkpoints, no learner ranks."""
    num_envs_per_worker: int = 8
    """Episodes each rollout rank plays at once, each with its own perturbation."""
    hidden_sizes: tuple[int, ...] = (32,)
    """Hidden layer widths of the deterministic policy (() is linear)."""

    episodes_per_batch: int = 50
    """Episodes per generation over all ranks (antithetic: half as many noise vectors)."""
    train_batch_size: int = 2_000
    """At least this many env steps per generation over all ranks (more pairs are drawn until
    they are played)."""
    noise_stdev: float = 0.02
    """sigma: the standard deviation of the parameter perturbations."""
    stepsize: float = 0.01
    """Adam's step size."""
    l2_coeff: float = 0.005
    """L2 weight decay added to the gradient estimate."""
    action_noise_std: float = 0.0
    """Gaussian noise on Box actions of training episodes (0: none)."""
    eval_prob: float = 0.1
    """Probability that an episode is played by the unperturbed policy; those give
    episode_return_mean."""
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
        "episodes_per_batch": at_least(2), "train_batch_size": at_least(0),
        "noise_stdev": above(0), "stepsize": above(0), "l2_coeff": at_least(0),
        "action_noise_std": at_least(0), "eval_prob": Range(0, 1, high_open=True),
        "noise_size": above(0), "noise_seed": at_least(0)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_learners != 0:
            raise ConfigError(f"ES keeps its weights on the rollout ranks: num_learners must be "
                              f"0, got {self.num_learners}")


def model_spec(observation_space: Any, action_space: Any, config: Config) -> DirectPolicySpec:
    return DirectPolicySpec(observation_space, action_space, tuple(config.hidden_sizes),
                            config.activation)


def check_config(config: Config, env: Any) -> None:
    check_search_config(sys.modules[__name__], config, env)


def setup(algo) -> None:
    c = algo.config
    setup_search(algo, "es", noise_size=c.noise_size, noise_seed=c.noise_seed,
                 noise_stdev=c.noise_stdev, stepsize=c.stepsize, l2_coeff=c.l2_coeff,
                 action_noise_std=c.action_noise_std, eval_prob=c.eval_prob)


def training_step(algo) -> dict[str, float]:
    """One generation: evaluate pairs on every rollout rank, apply the same update on each."""
    c = algo.config
    return run_generation(algo, c.episodes_per_batch // 2, c.train_batch_size)
