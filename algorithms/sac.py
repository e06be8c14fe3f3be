"""SAC: soft actor-critic for continuous actions, with twin Q critics and a learned temperature.

Each iteration every rollout worker samples actions from the actor (uniformly random ones until
``learning_starts`` env steps are stored) and sends its steps to replay; the learners take
``sgd_steps_per_env_step`` SGD steps per new env step on minibatches from replay, soft-updating the
target critics after each; learner 0 broadcasts the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpirl.env_guard import check_max_failures
from mpirl.qlearning import (
    QLearner,
    TransitionWorker,
    check_q_config,
    sample_and_train,
    spawn_replay,
)
from mpirl.soft_q import SAC_STATS, sac_loss, sac_model_spec

ROLLOUT_WORKER = TransitionWorker
LEARNER = QLearner
model_spec = sac_model_spec
loss = sac_loss


@dataclass
class Config:
    """SAC's settings. Defaults suit Pendulum-v1; every field is a ``--config`` key."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the replay shards and learners leave."""
    num_replay_shards: int = 0
    """Replay ranks. 0 keeps the buffer in the driver's process."""
    num_learners: int = 0
    """Learner ranks (data-parallel SGD). 0 trains in the driver's process."""

    # Sampling
    num_envs_per_worker: int = 1
    """Environments each rollout worker steps together."""
    rollout_fragment_length: int = 64
    """Steps per environment per iteration."""
    max_env_failures: int = 10
    """Failures in a row of one environment that end the run; fewer are recovered."""

    # Replay
    buffer_size: int = 100_000
    """Rows of replay over all shards."""
    learning_starts: int = 128
    """Env steps of uniformly random actions stored before the first SGD step."""
    prioritized_replay: bool = False
    """Sample in proportion to |TD error of Q1|**alpha instead of uniformly."""
    prioritized_replay_alpha: float = 0.6
    """Prioritization exponent (0 is uniform)."""
    prioritized_replay_beta: float = 0.4
    """Importance-sampling exponent of the loss weights."""
    prioritized_replay_eps: float = 1e-6
    """Added to |TD error| so that no row has priority 0."""
    n_step: int = 1
    """Rewards summed before bootstrapping."""

    # Optimization
    gamma: float = 0.99
    """Discount factor."""
    lr: float = 1e-3
    """Adam learning rate of the actor, the critics and the temperature."""
    train_batch_size: int = 256
    """Rows per SGD step, summed over learners."""
    sgd_steps_per_env_step: float = 1.0
    """SGD steps per new env step."""
    tau: float = 0.005
    """Soft target update: target += tau * (online - target) after every SGD step."""
    target_network_update_freq: int = 1
    """Unused with tau < 1 (every step); kept for the shared replay checks."""
    initial_alpha: float = 1.0
    """Starting entropy temperature."""
    target_entropy: str | float = "auto"
    """Entropy the temperature aims for; auto is minus the action dimension."""
    grad_clip: float = 0.0
    """Global gradient-norm clip; 0 turns it off."""

    # Model and compute
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor and of each critic (64: 4x cheaper SGD steps than 256
    on a CPU, enough for Pendulum)."""
    activation: str = "relu"
    """tanh, relu or elu."""
    learner_backend: str = "auto"
    """Gradient allreduce: auto (NCCL on GPUs, MPI on CPUs), mpi, gloo or nccl."""
    torch_threads: int = 1
    """torch threads per rank."""

    # Bookkeeping
    metrics_window: int = 100
    """Episodes averaged into episode_return_mean."""
    seed: int = 0
    """Base seed; rank-specific seeds derive from it."""

    def __post_init__(self) -> None:
        check_max_failures(self.max_env_failures)


def check_config(config: Config, env) -> None:
    check_q_config(config, env, "SAC", continuous=True)


def setup(algo) -> None:
    algo.replay = spawn_replay(algo)


def training_step(algo) -> dict[str, float]:
    """One SAC iteration: sample into replay (random actions at first), train, broadcast."""
    random_actions = algo.timesteps_total < algo.config.learning_starts
    return sample_and_train(algo, 1.0 if random_actions else 0.0, SAC_STATS)
