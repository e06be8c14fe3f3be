"""A2C: synchronous advantage actor-critic, data-parallel.

Each iteration every rollout worker samples a short fragment per environment; the learners take
one gradient step on the whole batch (averaged across learners); learner 0 broadcasts the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpirl.config.fields import AllreduceConfig, OnPolicyConfig
from mpirl.execution.contract import PlanState, no_config_checks, stateless
from mpirl.execution.operators import sample_with_new_weights, train_one_step
from mpirl.execution.trainer import Trainer
from mpirl.models.policy import actor_critic_model, evaluate_batch
from mpirl.workers.learner import Learner
from mpirl.workers.rollout import RolloutWorker

ROLLOUT_WORKER = RolloutWorker
LEARNER = Learner
model_spec = actor_critic_model
check_config = no_config_checks
setup = stateless
#: use_lstm works: the rollout ranks carry each env's state and the loss takes sequences.
RECURRENT = True


@dataclass
class Config(OnPolicyConfig, AllreduceConfig):
    """A2C's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    rollout_fragment_length: int = 8
    """Steps per environment per iteration (A2C updates often, on short fragments)."""
    gae_lambda: float = 1.0
    """GAE lambda; 1 gives plain n-step advantages."""
    standardize_advantages: bool = False
    """Scale advantages to mean 0, std 1 over each iteration's batch."""

    def advantage_lambda(self) -> float:
        return self.gae_lambda


def loss(policy, batch: dict[str, torch.Tensor], config: Config):
    """Policy gradient with a learned baseline, plus value loss and entropy bonus."""
    logp, entropy, values, batch = evaluate_batch(policy, batch)
    policy_loss = -(logp * batch["advantages"]).mean()
    vf_loss = 0.5 * (values - batch["value_targets"]).pow(2).mean()
    entropy_mean = entropy.mean()
    total = policy_loss + config.vf_coef * vf_loss - config.ent_coef * entropy_mean
    stats = {"policy_loss": policy_loss.item(), "vf_loss": vf_loss.item(),
             "entropy": entropy_mean.item()}
    return total, stats


def training_step(trainer: Trainer, state: PlanState) -> dict[str, float]:
    """One A2C iteration: broadcast the newest weights and sample everywhere (one call to
    each rollout rank), one gradient step."""
    config = trainer.config
    samples = sample_with_new_weights(trainer.rollouts, trainer.learners,
                                      config.rollout_fragment_length, trainer.obs_filter)
    trainer.count(samples)
    stats = train_one_step(
        trainer.learners, samples, num_epochs=1, num_minibatches=1,
        standardize=("advantages",) if config.standardize_advantages else (),
    )
    return stats
