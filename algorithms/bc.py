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
from mpirl.execution.operators import broadcast_weights, count_and_evaluate, train_on_dataset

__all__ = ["Config", "check_config", "loss", "training_step"]


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


def training_step(algo) -> dict[str, float]:
    """One BC iteration: SGD on every learner's shard, broadcast the weights, evaluate."""
    config = algo.config
    stats = train_on_dataset(algo.learners, offline_input(config),
                             config.num_sgd_steps_per_iteration, config.train_batch_size)
    broadcast_weights(algo.learners, algo.rollouts)
    return stats | count_and_evaluate(algo, stats)
