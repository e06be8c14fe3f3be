"""DQN: double, dueling, n-step Q-learning from (prioritized) replay, with a target network.

Each iteration every rollout worker steps its environments epsilon-greedily and sends the steps
to its replay shard (a replay rank, or the driver's process with ``num_replay_shards`` 0); the
learners then take ``sgd_steps_per_env_step`` SGD steps per new env step on minibatches the shards
send them, return the TD errors to the shards as priorities, and learner 0 broadcasts the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpirl.env_guard import check_max_failures
from mpirl.qlearning import (
    DQN_STATS,
    QLearner,
    TransitionWorker,
    check_q_config,
    dqn_loss,
    linear_epsilon,
    q_model_spec,
    sample_and_train,
    spawn_replay,
)

ROLLOUT_WORKER = TransitionWorker
LEARNER = QLearner
model_spec = q_model_spec
loss = dqn_loss


@dataclass
class Config:
    """DQN's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the replay shards and learners leave."""
    num_replay_shards: int = 0
    """Replay ranks, each holding buffer_size / num_replay_shards rows. 0 keeps the buffer in
    the driver's process."""
    num_learners: int = 0
    """Learner ranks (data-parallel SGD). 0 trains in the driver's process."""

    # Sampling and exploration
    num_envs_per_worker: int = 4
    """Environments each rollout worker steps together."""
    rollout_fragment_length: int = 64
    """Steps per environment per iteration."""
    initial_epsilon: float = 1.0
    """Probability of a random action at the start."""
    final_epsilon: float = 0.02
    """Probability of a random action after exploration_steps."""
    exploration_steps: int = 8_000
    """Env steps over which epsilon falls linearly from initial_epsilon to final_epsilon."""
    max_env_failures: int = 10
    """Failures in a row of one environment that end the run; fewer are recovered."""

    # Replay
    buffer_size: int = 100_000
    """Rows of replay over all shards."""
    learning_starts: int = 1_000
    """Env steps sampled before the first SGD step."""
    prioritized_replay: bool = False
    """Sample in proportion to |TD error|**alpha instead of uniformly."""
    prioritized_replay_alpha: float = 0.6
    """Prioritization exponent (0 is uniform)."""
    prioritized_replay_beta: float = 0.4
    """Importance-sampling exponent of the loss weights."""
    prioritized_replay_eps: float = 1e-6
    """Added to |TD error| so that no row has priority 0."""
    n_step: int = 3
    """Rewards summed before bootstrapping."""

    # Optimization
    gamma: float = 0.99
    """Discount factor."""
    lr: float = 1e-3
    """Adam learning rate."""
    train_batch_size: int = 64
    """Rows per SGD step, summed over learners."""
    sgd_steps_per_env_step: float = 0.5
    """SGD steps per new env step (0.5: 128 steps after each 256 env steps)."""
    target_network_update_freq: int = 128
    """SGD steps between copies of the online network into the target network."""
    double_q: bool = True
    """Choose the bootstrap action with the online network (double DQN)."""
    dueling: bool = True
    """Split Q into a state value and action advantages."""
    grad_clip: float = 10.0
    """Global gradient-norm clip; 0 turns it off."""

    # Model and compute
    hidden_sizes: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the Q network."""
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
    check_q_config(config, env, "DQN")


def setup(algo) -> None:
    algo.replay = spawn_replay(algo)


def training_step(algo) -> dict[str, float]:
    """One DQN iteration: sample into replay, train from replay, broadcast the weights."""
    config = algo.config
    epsilon = linear_epsilon(algo.timesteps_total, config.initial_epsilon, config.final_epsilon,
                             config.exploration_steps)
    return {"epsilon": epsilon} | sample_and_train(algo, epsilon, DQN_STATS)
