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

import torch

from mpirl.env_guard import check_max_failures
from mpirl.offline import check_config, count_and_evaluate, offline_input
from mpirl.operators import broadcast_weights, train_on_dataset

__all__ = ["Config", "check_config", "loss", "training_step"]


@dataclass
class Config:
    """MARWIL's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Data
    input: str = ""
    """The trajectory dump to learn from (a directory, or its main_data.hdf5). Required."""
    max_rows_in_memory: int = 5_000_000
    """The most dataset rows one learner holds in memory. A smaller shard is read whole and
    sampled uniformly; a larger one is streamed from the files through a shuffle buffer of this
    many rows (a resume then restarts the stream: not bit-identical)."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks, which only evaluate; -1 takes every rank the learners leave. 0 evaluates in
    the driver."""
    num_learners: int = 1
    """Learner ranks, each reading its own shard of the dump. 0 trains in the driver's process."""

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
    lr: float = 1e-3
    """Adam learning rate."""
    train_batch_size: int = 512
    """Dataset rows per SGD step, summed over all learners (each draws its share)."""
    num_sgd_steps_per_iteration: int = 100
    """SGD steps per iteration."""
    vf_coef: float = 1.0
    """Weight of the value loss (actor and critic are separate networks)."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    grad_clip: float = 0.0
    """Global gradient-norm clip (after averaging across learners); 0 turns it off."""

    # Evaluation
    evaluation_episodes: int = 10
    """Episodes played with the current policy at each evaluation, over all rollout workers."""
    evaluation_interval: int = 1
    """Evaluate every this many iterations."""
    evaluation_deterministic: bool = False
    """Play the most likely actions instead of sampling them."""
    num_envs_per_worker: int = 5
    """Environments each rollout worker plays its evaluation episodes in."""
    max_env_failures: int = 10
    """Failures in a row of one evaluation environment that end the run; fewer are recovered
    (the env is rebuilt and its episode dropped)."""

    # Model and compute
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor and the critic."""
    activation: str = "tanh"
    """tanh, relu or elu."""
    learner_backend: str = "auto"
    """Gradient allreduce: auto (NCCL on GPUs, MPI on CPUs), mpi, gloo or nccl."""
    torch_threads: int = 1
    """torch threads per rank; 1 avoids oversubscribing cores shared by many ranks."""

    # Bookkeeping
    metrics_window: int = 0
    """Episodes averaged into episode_return_mean; 0 means evaluation_episodes, so that it is
    the mean of the latest evaluation."""
    seed: int = 0
    """Base seed; rank-specific seeds derive from it."""

    def __post_init__(self) -> None:
        check_max_failures(self.max_env_failures)
        self.metrics_window = self.metrics_window or self.evaluation_episodes


class Loss:
    """MARWIL's loss. It holds the moving average of squared advantages, which each learner
    keeps from its own minibatches and saves in its checkpoint (``get_state``)."""

    def __init__(self) -> None:
        self.squared_advantage_mean: float | None = None

    def __call__(self, policy, batch: dict[str, torch.Tensor], config: Config):
        logp, entropy, values = policy.evaluate(batch["obs"], batch["actions"])
        returns = batch["returns"]
        advantages = (returns - values).detach()
        squared = advantages.pow(2).mean().item()
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


def training_step(algo) -> dict[str, float]:
    """One MARWIL iteration: SGD on every learner's shard, broadcast the weights, evaluate."""
    config = algo.config
    stats = train_on_dataset(algo.learners, offline_input(config),
                             config.num_sgd_steps_per_iteration, config.train_batch_size)
    broadcast_weights(algo.learners, algo.rollouts)
    return stats | count_and_evaluate(algo, stats)
