"""A2C: synchronous advantage actor-critic, data-parallel.

Each iteration every rollout worker samples a short fragment per environment; the learners take
one gradient step on the whole batch (averaged across learners); learner 0 broadcasts the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpirl.env_guard import check_max_failures
from mpirl.operators import broadcast_weights, parallel_rollouts, train_one_step


@dataclass
class Config:
    """A2C's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the learners leave. 0 samples in the driver."""
    num_learners: int = 0
    """Learner ranks (data-parallel SGD). 0 trains in the driver's process."""

    # Sampling
    num_envs_per_worker: int = 8
    """Environments each rollout worker steps together (a gymnasium vector env)."""
    rollout_fragment_length: int = 8
    """Steps per environment per iteration (A2C updates often, on short fragments)."""
    normalize_observations: bool = False
    """Normalize observations with running statistics merged over all rollout ranks."""
    max_env_failures: int = 10
    """Failures in a row of one environment (an exception in reset or step; a successful step
    resets the count) that end the run. Fewer are recovered: the env is rebuilt and its partial
    episode dropped. 1 ends the run on the first failure."""

    # Returns and advantages
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 1.0
    """GAE lambda; 1 gives plain n-step advantages."""

    # Optimization
    lr: float = 1e-3
    """Adam learning rate."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    grad_clip: float = 0.5
    """Global gradient-norm clip (after averaging across learners); 0 turns it off."""
    standardize_advantages: bool = False
    """Scale advantages to mean 0, std 1 over each iteration's batch."""

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
    metrics_window: int = 100
    """Episodes averaged into episode_return_mean."""
    seed: int = 0
    """Base seed; rank-specific seeds derive from it."""

    def __post_init__(self) -> None:
        check_max_failures(self.max_env_failures)


def loss(policy, batch: dict[str, torch.Tensor], config: Config):
    """Policy gradient with a learned baseline, plus value loss and entropy bonus."""
    logp, entropy, values = policy.evaluate(batch["obs"], batch["actions"])
    policy_loss = -(logp * batch["advantages"]).mean()
    vf_loss = 0.5 * (values - batch["value_targets"]).pow(2).mean()
    entropy_mean = entropy.mean()
    total = policy_loss + config.vf_coef * vf_loss - config.ent_coef * entropy_mean
    stats = {"policy_loss": policy_loss.item(), "vf_loss": vf_loss.item(),
             "entropy": entropy_mean.item()}
    return total, stats


def training_step(algo) -> dict[str, float]:
    """One A2C iteration: sample everywhere, one gradient step, broadcast the weights."""
    config = algo.config
    samples = parallel_rollouts(algo.rollouts, algo.learners, config.rollout_fragment_length,
                                algo.obs_filter)
    algo.count(samples)
    stats = train_one_step(
        algo.learners, samples, num_epochs=1, num_minibatches=1,
        standardize=("advantages",) if config.standardize_advantages else (),
    )
    broadcast_weights(algo.learners, algo.rollouts)
    return stats
