"""BC: behaviour cloning from a trajectory dump, data-parallel over the learner ranks.

Learner i of n reads shard (i, n) of the dump's episodes itself (only the path crosses ranks) and
each iteration runs ``num_sgd_steps_per_iteration`` steps of -log pi(a|s) with averaged
gradients; learner 0 broadcasts the weights; the rollout workers play evaluation episodes, which
are never trained on. ``timesteps_total`` counts dataset rows trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpirl.env_guard import check_max_failures
from mpirl.offline import check_config, count_and_evaluate, offline_input
from mpirl.operators import broadcast_weights, train_on_dataset

__all__ = ["Config", "check_config", "loss", "training_step"]


@dataclass
class Config:
    """BC's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

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

    # Optimization
    lr: float = 1e-3
    """Adam learning rate."""
    train_batch_size: int = 512
    """Dataset rows per SGD step, summed over all learners (each draws its share)."""
    num_sgd_steps_per_iteration: int = 100
    """SGD steps per iteration."""
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
    """Hidden layer widths of the actor (and of the critic, which BC does not train)."""
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
