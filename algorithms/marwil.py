"""MARWIL: advantage-weighted behaviour cloning from a trajectory dump (Wang et al., 2018).

The plan is BC's (each learner reads its own shard of the dump; SGD with averaged gradients;
learner 0 broadcasts the weights; the rollout workers only evaluate), with a loss that weights
each row's log-likelihood by exp(beta * A / c), where A = R - V(s) is the discounted return-to-go
minus a learned value baseline and c the square root of a moving average of A^2. beta = 0 is BC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

# The plan is BC's, and so are its workers, model and checks: only the loss differs.
from mpirl.algorithms.bc import (
    LEARNER,
    RECURRENT,
    ROLLOUT_WORKER,
    check_config,
    model_spec,
    setup,
    training_step,
)

from mpirl.config.fields import OfflineConfig
from mpirl.execution import StatefulLoss

__all__ = ["LEARNER", "RECURRENT", "ROLLOUT_WORKER", "Config", "check_config", "loss",
           "model_spec", "setup", "training_step"]


@dataclass
class Config(OfflineConfig):
    """MARWIL's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Advantage weighting
    beta: float = 1.0
    """Temperature of the advantage weights; 0 gives plain behaviour cloning."""
    gamma: float = 0.99
    """Discount of the returns-to-go (truncated episodes are not bootstrapped)."""
    advantage_norm_rate: float = 0.01
    """Update rate of the moving average of A^2 that scales the advantages."""
    max_weight: float = 20.0
    """Upper clip of each row's weight exp(beta * A / c)."""

    # Optimization
    vf_coef: float = 1.0
    """Weight of the value loss (actor and critic are separate networks)."""

    def discount(self) -> float:
        return self.gamma


class Loss(StatefulLoss):
    """MARWIL's loss. It holds the moving average of squared advantages, which it saves in the
    learner's checkpoint (``get_state``). With several learners each call is a collective: the
    mean of this step's squared advantages is taken over every learner's rows (one small
    allreduce on the learner communicator), so all learners keep the same average, that of
    one learner on all the rows. Every learner calls it once per step (``train_offline``)."""

    def __init__(self) -> None:
        self.squared_advantage_mean: float | None = None
        self.comm: MPI.Comm | None = None

    def share_statistics(self, comm: MPI.Comm) -> None:
        """Average the statistics over the ranks of ``comm`` (the learners) from now on."""
        self.comm = comm

    def _mean_square(self, advantages: torch.Tensor) -> float:
        sums = np.array([advantages.pow(2).sum().item(), advantages.numel()], np.float64)
        if self.comm is not None and self.comm.Get_size() > 1:
            self.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        return float(sums[0] / max(sums[1], 1.0))

    def __call__(self, policy, batch: dict[str, torch.Tensor], config: Config):
        logp, entropy, values = policy.evaluate(batch["obs"], batch["actions"])
        returns = batch["returns"]
        advantages = (returns - values).detach()
        squared = self._mean_square(advantages)
        if self.squared_advantage_mean is None:
            self.squared_advantage_mean = squared
        else:
            self.squared_advantage_mean += config.advantage_norm_rate * (
                squared - self.squared_advantage_mean)
        scale = math.sqrt(self.squared_advantage_mean) + 1e-8
        weights = torch.exp(config.beta * advantages / scale).clamp(max=config.max_weight)
        policy_loss = -(weights * logp).mean()
        vf_loss = 0.5 * (values - returns).pow(2).mean()
        entropy_mean = entropy.mean()
        total = policy_loss + config.vf_coef * vf_loss - config.ent_coef * entropy_mean
        stats = {"policy_loss": policy_loss.item(), "vf_loss": vf_loss.item(),
                 "entropy": entropy_mean.item(), "weight_mean": weights.mean().item(),
                 "advantage_scale": scale}
        return total, stats

    def get_state(self) -> dict[str, Any]:
        return {"squared_advantage_mean": self.squared_advantage_mean}

    def set_state(self, state: dict[str, Any]) -> None:
        self.squared_advantage_mean = state["squared_advantage_mean"]


loss = Loss()

