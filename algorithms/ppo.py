"""PPO: clipped-surrogate policy optimization, synchronous and data-parallel.

Each iteration every rollout worker samples ``rollout_fragment_length`` steps per environment and
sends its batch to a learner; the learners run ``num_epochs`` of minibatch SGD with averaged
gradients; learner 0 broadcasts the new weights.
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
    """PPO's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    rollout_fragment_length: int = 64
    """Steps per environment per iteration."""
    gamma: float = 0.98
    gae_lambda: float = 0.8
    """GAE lambda: 1 is Monte Carlo, 0 is one-step TD."""
    num_epochs: int = 10
    """Passes over each iteration's batch."""
    minibatch_size: int = 256
    """Rows per SGD step, summed over all learners."""
    clip_param: float = 0.2
    """PPO's ratio clip."""
    centralized_critic: bool = False
    """Multi-agent runs (MAPPO-style): the value function sees the env's global state(), or
    every agent's observation concatenated when the env has no state(); the actor sees its
    agent's own observation."""

    def advantage_lambda(self) -> float:
        return self.gae_lambda

    def centralizes_critic(self) -> bool:
        return self.centralized_critic


def loss(policy, batch: dict[str, torch.Tensor], config: Config):
    """PPO's clipped surrogate, value loss and entropy bonus for one minibatch."""
    logp, entropy, values, batch = evaluate_batch(policy, batch)
    log_ratio = logp - batch["logp"]
    ratio = log_ratio.exp()
    advantages = batch["advantages"]
    clipped = ratio.clamp(1 - config.clip_param, 1 + config.clip_param)
    policy_loss = -torch.min(ratio * advantages, clipped * advantages).mean()
    vf_loss = 0.5 * (values - batch["value_targets"]).pow(2).mean()
    entropy_mean = entropy.mean()
    total = policy_loss + config.vf_coef * vf_loss - config.ent_coef * entropy_mean
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.item(), "vf_loss": vf_loss.item(),
            "entropy": entropy_mean.item(),
            "approx_kl": ((ratio - 1) - log_ratio).mean().item(),
            "clip_fraction": ((ratio - 1).abs() > config.clip_param).float().mean().item(),
        }
    return total, stats


def training_step(trainer: Trainer, state: PlanState) -> dict[str, float]:
    """One PPO iteration: broadcast the newest weights and sample everywhere (one call to
    each rollout rank), train the learners."""
    config = trainer.config
    samples = sample_with_new_weights(trainer.rollouts, trainer.learners,
                                      config.rollout_fragment_length, trainer.obs_filter)
    trainer.count(samples)
    stats = train_one_step(trainer.learners, samples, num_epochs=config.num_epochs,
                           num_minibatches=trainer.num_minibatches(config.minibatch_size))
    return stats
