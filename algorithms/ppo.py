"""PPO: clipped-surrogate policy optimization, synchronous and data-parallel.

Each iteration every rollout worker samples ``rollout_fragment_length`` steps per environment and
sends its batch to a learner; the learners run ``num_epochs`` of minibatch SGD with averaged
gradients; learner 0 broadcasts the new weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpirl.env_guard import check_max_failures
from mpirl.operators import broadcast_weights, parallel_rollouts, train_one_step


@dataclass
class Config:
    """PPO's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the learners leave. 0 samples in the driver."""
    num_learners: int = 0
    """Learner ranks (data-parallel SGD). 0 trains in the driver's process."""

    # Sampling
    num_envs_per_worker: int = 8
    """Environments each rollout worker steps together (a gymnasium vector env)."""
    rollout_fragment_length: int = 64
    """Steps per environment per iteration."""
    normalize_observations: bool = False
    """Normalize observations with running statistics merged over all rollout ranks."""
    max_env_failures: int = 10
    """Failures in a row of one environment (an exception in reset or step; a successful step
    resets the count) that end the run. Fewer are recovered: the env is rebuilt and its partial
    episode dropped. 1 ends the run on the first failure."""

    # Returns and advantages
    gamma: float = 0.98
    """Discount factor."""
    gae_lambda: float = 0.8
    """GAE lambda: 1 is Monte Carlo, 0 is one-step TD."""

    # Optimization
    lr: float = 1e-3
    """Adam learning rate."""
    num_epochs: int = 10
    """Passes over each iteration's batch."""
    minibatch_size: int = 256
    """Rows per SGD step, summed over all learners."""
    clip_param: float = 0.2
    """PPO's ratio clip."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    grad_clip: float = 0.5
    """Global gradient-norm clip (after averaging across learners); 0 turns it off."""

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
    """PPO's clipped surrogate, value loss and entropy bonus for one minibatch."""
    logp, entropy, values = policy.evaluate(batch["obs"], batch["actions"])
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


def training_step(algo) -> dict[str, float]:
    """One PPO iteration: sample everywhere, train the learners, broadcast the weights."""
    config = algo.config
    samples = parallel_rollouts(algo.rollouts, algo.learners, config.rollout_fragment_length,
                                algo.obs_filter)
    algo.count(samples)
    stats = train_one_step(algo.learners, samples, num_epochs=config.num_epochs,
                           num_minibatches=algo.num_minibatches(config.minibatch_size))
    broadcast_weights(algo.learners, algo.rollouts)
    return stats
