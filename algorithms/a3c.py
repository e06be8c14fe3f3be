"""A3C: asynchronous advantage actor-critic, with gradients computed on the rollout workers.

Every rollout worker samples a short fragment, computes GAE advantages and the gradient of A2C's
loss on its own policy copy, and sends the gradient (one flat float32 vector) to the driver. The
driver has learner 0 apply each gradient as it comes, first come first applied, and sends the new
weights back to that worker alone; the others keep working. ``policy_lag_mean`` counts the
updates other workers made between a gradient's weights and its application.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpirl.algorithms.a2c import loss  # A3C's update is A2C's, applied asynchronously

from mpirl.config.fields import OnPolicyConfig
from mpirl.errors import ConfigError
from mpirl.execution.async_ops import GradientRequests, async_apply_gradients
from mpirl.execution.contract import no_config_checks
from mpirl.execution.operators import mean_stats
from mpirl.execution.trainer import Trainer
from mpirl.models.policy import actor_critic_model
from mpirl.workers.learner import Learner
from mpirl.workers.rollout import RolloutWorker

#: Its rollout workers compute the gradients (of A2C's loss); learner 0 applies them.
ROLLOUT_WORKER = RolloutWorker
LEARNER = Learner
model_spec = actor_critic_model
check_config = no_config_checks
#: use_lstm works: the rollout ranks carry each env's state and the loss takes sequences.
RECURRENT = True


@dataclass
class Config(OnPolicyConfig):
    """A3C's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the learner leaves. 0 samples in the driver."""
    num_learners: int = 0
    """0 applies the gradients in the driver's process, 1 on a learner rank (no more: each
    gradient is one update of one optimizer)."""

    # Sampling
    rollout_fragment_length: int = 8
    """Steps per environment behind each gradient."""
    max_requests_in_flight_per_worker: int = 1
    """Gradient calls kept running on each rollout worker. 1 is classic A3C: a worker computes
    its next gradient with the weights its last one produced."""
    min_steps_per_iteration: int = 2000
    """Environment steps behind the gradients applied per iteration (one row of metrics)."""

    # Returns, advantages and optimization
    gae_lambda: float = 1.0
    """GAE lambda; 1 gives plain n-step advantages."""
    grad_clip: float = 0.5
    """Global gradient-norm clip, applied by the learner to each gradient; 0 turns it off."""

    def advantage_lambda(self) -> float:
        return self.gae_lambda

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_learners > 1:
            raise ConfigError(f"A3C applies each gradient on one learner: num_learners must be "
                              f"0 or 1, got {self.num_learners}")


def setup(trainer: Trainer) -> GradientRequests:
    """The gradient calls kept running on every rollout worker, from one iteration to the next
    (settled before each checkpoint)."""
    config = trainer.config
    return GradientRequests(trainer, config.rollout_fragment_length, loss,
                            config.max_requests_in_flight_per_worker)


def training_step(trainer: Trainer, requests: GradientRequests) -> dict[str, float]:
    """Apply gradients as they come until ``min_steps_per_iteration`` steps are behind them."""
    config = trainer.config
    stats, start = [], trainer.timesteps_total
    while trainer.timesteps_total - start < config.min_steps_per_iteration:
        stats += async_apply_gradients(trainer, requests)
    return mean_stats(stats) | requests.metrics()
