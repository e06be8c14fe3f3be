"""The ``--config`` fields that several algorithms share, declared once.

Each algorithm's ``Config`` inherits one family base here and adds its own fields. The keys stay
flat: a subclass is still one dataclass whose fields are the ``--config`` keys. A subclass that
only changes a default redeclares the field without a docstring and keeps the inherited one; it
gives its own docstring where the meaning differs (a string literal right after a field;
tests/test_algorithm_configs.py checks that every key has one).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpirl.env_guard import check_max_failures


@dataclass
class CommonConfig:
    """The fields of every algorithm: layout, sampling, model and compute, bookkeeping."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the learners leave. 0 samples in the driver."""
    num_learners: int = 0
    """Learner ranks (data-parallel SGD). 0 trains in the driver's process."""

    # Sampling
    num_envs_per_worker: int = 8
    """Environments each rollout worker steps together (a gymnasium vector env)."""
    max_env_failures: int = 10
    """Failures in a row of one environment (an exception in reset or step; a successful step
    resets the count) that end the run. Fewer are recovered: the env is rebuilt and its partial
    episode dropped. 1 ends the run on the first failure."""

    # Optimization
    lr: float = 1e-3
    """Adam learning rate."""
    grad_clip: float = 0.5
    """Global gradient-norm clip (after averaging across learners); 0 turns it off."""

    # Model and compute
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor and the critic."""
    activation: str = "tanh"
    """tanh, relu or elu."""
    learner_backend: str = "auto"
    """Gradient allreduce: auto (NCCL on GPUs, MPI on CPUs), mpi, gloo or nccl."""
    learner_master_addr: str = ""
    """Address of learner 0's host that the other learners reach it on, to start gloo or NCCL;
    "" takes MASTER_ADDR, else the address on the route to the MPI launcher's host."""
    torch_threads: int = 1
    """torch threads per rank; 1 avoids oversubscribing cores shared by many ranks."""

    # Bookkeeping
    metrics_window: int = 100
    """Episodes averaged into episode_return_mean."""
    seed: int = 0
    """Base seed; rank-specific seeds derive from it."""

    def __post_init__(self) -> None:
        check_max_failures(self.max_env_failures)


@dataclass
class OnPolicyConfig(CommonConfig):
    """Actor-critic algorithms that train on fresh samples: PPO, A2C, A3C, IMPALA."""

    normalize_observations: bool = False
    """Normalize observations with running statistics merged over all rollout ranks."""
    gamma: float = 0.99
    """Discount factor."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""


@dataclass
class ReplayConfig(CommonConfig):
    """Algorithms that learn from a (possibly sharded, possibly prioritized) replay buffer."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the replay shards and learners leave."""
    num_replay_shards: int = 0
    """Replay ranks, each holding buffer_size / num_replay_shards rows. 0 keeps the buffer in
    the driver's process."""

    # Sampling
    num_envs_per_worker: int = 4
    """Environments each rollout worker steps together."""
    rollout_fragment_length: int = 64
    """Steps per environment per iteration."""
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
    """Importance-sampling exponent of the loss weights at the start."""
    prioritized_replay_beta_final: float = 1.0
    """The exponent reached after prioritized_replay_beta_anneal_steps (1 corrects fully)."""
    prioritized_replay_beta_anneal_steps: int = 100_000
    """Env steps over which the exponent rises linearly from prioritized_replay_beta to
    prioritized_replay_beta_final; 0 keeps it at prioritized_replay_beta."""
    prioritized_replay_eps: float = 1e-6
    """Added to |TD error| so that no row has priority 0."""
    n_step: int = 3
    """Rewards summed before bootstrapping."""

    # Optimization
    gamma: float = 0.99
    """Discount factor."""
    train_batch_size: int = 64
    """Rows per SGD step, summed over learners."""
    target_network_update_freq: int = 128
    """SGD steps between copies of the online network into the target network."""
    grad_clip: float = 10.0
    """Global gradient-norm clip; 0 turns it off."""

    # Model and compute
    activation: str = "relu"
    torch_threads: int = 1
    """torch threads per rank."""


@dataclass
class QLearningConfig(ReplayConfig):
    """Replay algorithms with a Q network: DQN and Ape-X."""

    double_q: bool = True
    """Choose the bootstrap action with the online network (double DQN)."""
    dueling: bool = True
    """Split Q into a state value and action advantages."""
    hidden_sizes: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the Q network."""


@dataclass
class OfflineConfig(CommonConfig):
    """Algorithms that learn from a trajectory dump and only play to evaluate: BC, MARWIL."""

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
    train_batch_size: int = 512
    """Dataset rows per SGD step, summed over all learners (each draws its share)."""
    num_sgd_steps_per_iteration: int = 100
    """SGD steps per iteration."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    grad_clip: float = 0.0

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

    # Bookkeeping
    metrics_window: int = 0
    """Episodes averaged into episode_return_mean; 0 means evaluation_episodes, so that it is
    the mean of the latest evaluation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.metrics_window = self.metrics_window or self.evaluation_episodes
