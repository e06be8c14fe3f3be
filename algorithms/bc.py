"""BC: behaviour cloning from a trajectory dump, data-parallel over the learner ranks.

Learner i of n reads shard (i, n) of the dump's episodes itself (only the path crosses ranks) and
each iteration runs ``num_sgd_steps_per_iteration`` steps of -log pi(a|s) with averaged
gradients; learner 0 broadcasts the weights; the rollout workers play evaluation episodes, which
are never trained on. ``timesteps_total`` counts dataset rows trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpirl.config.fields import OfflineConfig
from mpirl.data.offline import check_config, offline_input
from mpirl.execution.contract import PlanState, stateless
from mpirl.execution.operators import broadcast_weights, count_and_evaluate, train_on_dataset
from mpirl.execution.trainer import Trainer
from mpirl.models.policy import actor_critic_model
from mpirl.workers.learner import Learner
from mpirl.workers.rollout import RolloutWorker

__all__ = ["LEARNER", "RECURRENT", "ROLLOUT_WORKER", "Config", "check_config", "loss",
           "model_spec", "setup", "training_step"]

#: The rollout workers only play evaluation episodes.
ROLLOUT_WORKER = RolloutWorker
LEARNER = Learner
model_spec = actor_critic_model
setup = stateless
RECURRENT = False  # it learns from the dump's single steps: no state to resume from


@dataclass
class Config(OfflineConfig):
    """BC's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor (and of the critic, which BC does not train)."""


def loss(policy, batch: dict[str, torch.Tensor], config: Config):
    """Negative log-likelihood of the dataset's actions, minus an optional entropy bonus."""
    logp, entropy, _ = policy.evaluate(batch["obs"], batch["actions"])
    policy_loss = -logp.mean()
    entropy_mean = entropy.mean()
    stats = {"policy_loss": policy_loss.item(), "entropy": entropy_mean.item()}
    return policy_loss - config.ent_coef * entropy_mean, stats


def training_step(trainer: Trainer, state: PlanState) -> dict[str, float]:
    """One iteration (BC's and MARWIL's): SGD on every learner's shard, broadcast the weights,
    evaluate."""
    config = trainer.config
    stats = train_on_dataset(trainer.learners, offline_input(config),
                             config.num_sgd_steps_per_iteration, config.train_batch_size)
    broadcast_weights(trainer.learners, trainer.rollouts)
    return stats | count_and_evaluate(trainer, stats)
