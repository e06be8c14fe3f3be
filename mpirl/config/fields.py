"""The ``--config`` fields that several algorithms share, declared once.

Each algorithm's ``Config`` inherits one family base here and adds its own fields. The keys stay
flat: a subclass is still one dataclass whose fields are the ``--config`` keys. A subclass that
only changes a default redeclares the field without a docstring and keeps the inherited one; it
gives its own docstring where the meaning differs (a string literal right after a field;
tests/test_algorithm_configs.py checks that every key has one).

``RANGES`` below says which values every numeric key accepts (tests/test_bad_input.py checks that
every numeric key of every config and settings class has an entry). ``check_ranges`` applies it on
every rank before any MPI traffic, so ``minibatch_size: 0`` or ``lr: NaN`` ends the job at once
with one line instead of a division by zero on some rank later.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mpirl.errors import ConfigError

__all__ = ["Range", "RANGES", "above", "at_least", "within", "ConfigHooks", "CommonConfig",
           "AllreduceConfig", "OnPolicyConfig", "ReplayConfig", "QLearningConfig", "OfflineConfig"]


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: finite numbers from ``low`` to ``high`` (bounds
    included unless ``*_open``), or one of ``words``. Whether it must be whole comes from the
    field's type."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    words: tuple[str, ...] = ()

    def admits(self, value: Any, integer: bool) -> bool:
        if isinstance(value, str):
            return value in self.words
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, integer: bool) -> str:
        """``an integer >= 1``, ``a finite number in (0, 1]``, ``a finite number or "auto"``."""
        kind = "an integer" if integer else "a finite number"
        low, high = _number(self.low), _number(self.high)
        if self.low > -math.inf and self.high < math.inf:
            text = (f"{kind} in {'(' if self.low_open else '['}{low}, {high}"
                    f"{')' if self.high_open else ']'}")
        elif self.low > -math.inf:
            text = f"{kind} {'>' if self.low_open else '>='} {low}"
        elif self.high < math.inf:
            text = f"{kind} {'<' if self.high_open else '<='} {high}"
        else:
            text = kind
        return text + "".join(f" or {json.dumps(word)}" for word in self.words)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def at_least(low: float) -> Range:
    return Range(low=low)


def above(low: float) -> Range:
    return Range(low=low, low_open=True)


def within(low: float, high: float, low_open: bool = False) -> Range:
    return Range(low=low, high=high, low_open=low_open)


#: Every numeric ``--config`` key (algorithm, runtime, checkpoint, dump and layout keys) and the
#: values it accepts. A key means the same in every algorithm; a class may narrow or widen one in
#: its own ``ranges`` (OfflineConfig's metrics_window may be 0). Floats must be finite: JSON's
#: NaN and Infinity are refused everywhere.
RANGES: dict[str, Range] = {
    # Layout
    "num_rollout_workers": at_least(-1),
    "num_learners": at_least(0),
    "num_replay_shards": at_least(0),
    "ranks_per_env": at_least(0),
    "envs_per_rollout": at_least(1),  # Layout's, filled from num_envs_per_worker
    # Sampling and exploration
    "num_envs_per_worker": at_least(1),
    "env_step_timeout_s": above(0),
    "rollout_fragment_length": at_least(1),
    "max_env_failures": at_least(1),
    "env_failure_window": at_least(1),
    "max_requests_in_flight_per_worker": at_least(1),
    "fragments_per_call": at_least(0),
    "min_steps_per_iteration": at_least(1),
    "min_env_steps_per_iteration": at_least(1),
    "initial_epsilon": within(0, 1),
    "final_epsilon": within(0, 1),
    "exploration_steps": at_least(0),
    "epsilon": within(0, 1),
    "epsilon_alpha": at_least(0),
    "metrics_max_epsilon": within(0, 1),
    # Replay
    "buffer_size": at_least(1),
    "learning_starts": at_least(0),
    "prioritized_replay_alpha": at_least(0),
    "prioritized_replay_beta": within(0, 1),
    "prioritized_replay_beta_final": within(0, 1),
    "prioritized_replay_beta_anneal_steps": at_least(0),
    "prioritized_replay_eps": above(0),
    "n_step": at_least(1),
    # Returns and losses
    "gamma": within(0, 1),
    "gae_lambda": within(0, 1),
    "vf_coef": at_least(0),
    "ent_coef": at_least(0),
    "clip_param": above(0),
    "vtrace_rho_bar": above(0),
    "vtrace_c_bar": above(0),
    "beta": at_least(0),
    "advantage_norm_rate": within(0, 1, low_open=True),
    "max_weight": above(0),
    "tau": within(0, 1, low_open=True),
    "initial_alpha": above(0),
    "target_entropy": Range(words=("auto",)),
    # Optimization
    "lr": above(0),
    "lr_decay_steps": at_least(0),
    "lr_final": at_least(0),
    "grad_clip": at_least(0),
    "num_epochs": at_least(1),
    "minibatch_size": at_least(1),
    "num_minibatches": at_least(1),
    "train_batch_size": at_least(1),
    "num_sgd_steps_per_iteration": at_least(0),
    "sgd_steps_per_env_step": above(0),
    "target_network_update_freq": at_least(1),
    "batches_per_train": at_least(1),
    "weight_sync_every": at_least(1),
    # Offline data and evaluation
    "max_rows_in_memory": at_least(1),
    "evaluation_episodes": at_least(1),
    "evaluation_interval": at_least(1),
    # Model and compute (hidden_sizes: each width)
    "hidden_sizes": at_least(1),
    "cnn_dense_size": at_least(1),
    "lstm_cell_size": at_least(1),
    "max_seq_len": at_least(1),
    "torch_threads": at_least(1),
    # Bookkeeping
    "metrics_window": at_least(1),
    "tensorboard_histograms_every": at_least(0),
    "seed": within(0, 2**32 - 1),
    # Environment (Atari preprocessing)
    "atari_noop_max": at_least(0),
    "atari_frame_skip": at_least(1),
    "atari_frame_size": at_least(0),
    "atari_frame_stack": at_least(1),
    # Runtime (mpirl.runtime.driver.RuntimeSettings)
    "max_calls_in_flight": at_least(1),
    "task_timeout_s": above(0),
    "stuck_task_timeout_s": above(0),
    "startup_timeout_s": above(0),
    "heartbeat_interval_s": above(0),
    "heartbeat_timeout_s": above(0),
    "shutdown_timeout_s": above(0),
    "poll_max_sleep_s": above(0),
    "poll_sleep_share": within(0, 1),
    # Checkpoints and dumps (mpirl.jobs.checkpoint, mpirl.data.dump_writer)
    "checkpoint_every": at_least(0),
    "keep_checkpoints": at_least(1),
    "dump_compression_level": within(0, 9),
    "dump_compression_min_bytes": at_least(0),
}


def numeric_fields(cls: type) -> dict[str, str]:
    """The numeric fields of the dataclass ``cls`` -> ``"int"``, ``"float"``, ``"ints"`` (a tuple
    of ints) or ``"words|float"`` (a number or a word such as "auto")."""
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        if hint is int:
            kinds[name] = "int"
        elif hint is float:
            kinds[name] = "float"
        elif hint == tuple[int, ...]:
            kinds[name] = "ints"
        elif float in typing.get_args(hint) or int in typing.get_args(hint):
            kinds[name] = "words|float"
    return kinds


def range_of(cls: type, key: str) -> Range | None:
    """The Range of ``key`` in ``cls``: the class's own ``ranges`` first, then ``RANGES``."""
    return getattr(cls, "ranges", {}).get(key) or RANGES.get(key)


def check_key(key: str, value: Any, kind: str = "int", rng: Range | None = None,
              what: str = "config key") -> None:
    """ConfigError, one line naming the key, the value and what it must be, unless ``value`` is
    in ``rng`` (``RANGES[key]`` by default). Raised the same on every rank (nothing crosses)."""
    rng = rng or RANGES[key]
    integer = kind in ("int", "ints")
    if kind == "ints":
        ok = isinstance(value, list | tuple) and all(rng.admits(v, True) for v in value)
        must = f"a list of {rng.describe(True).replace('an integer', 'integers')}"
    else:
        ok = rng.admits(value, integer)
        must = rng.describe(integer)
    if not ok:
        shown = json.dumps(value) if isinstance(value, int | float | str | list | tuple) \
            else repr(value)
        raise ConfigError(f'{what} "{key}" = {shown} is out of range: must be {must}')


def check_ranges(cls: type, values: Mapping[str, Any]) -> None:
    """Check every numeric key of ``values`` (given to the dataclass ``cls``) against its Range."""
    kinds = numeric_fields(cls)
    for key, value in values.items():
        rng = range_of(cls, key)
        if key in kinds and rng is not None:
            check_key(key, value, kinds[key], rng)


class ConfigHooks:
    """What shared code asks of a config, with the answer of a config that lacks the keys
    behind it. A base or an algorithm that has those keys overrides the method, so that a key
    stays valid only where it means something (DQN still refuses normalize_observations). The
    bases with fields (``CommonConfig``, ``AllreduceConfig``) both derive from it, so that an
    override in either wins over these defaults whatever the order of an algorithm's bases.
    Each answer is the same on every rank: the config crosses to each rank whole, once."""

    def observation_normalization(self) -> bool:
        """Whether rollout workers normalize observations by running statistics the driver
        merges (and checkpoints, evaluation and export apply them); the ``normalize_observations``
        key where a config has it."""
        return False

    def samples_per_iteration(self, rollout_slots: int) -> int:
        """What one iteration samples (the trainer's ``train_batch_size``: the manifest's, and
        what minibatches divide): ``rollout_fragment_length`` steps from each of the rollout
        workers' ``rollout_slots`` env slots. A config without that key overrides it."""
        return rollout_slots * self.rollout_fragment_length

    def discount(self) -> float:
        """The discount rollout workers compute returns, advantages and time-limit bootstraps
        with, and offline shards their returns-to-go (``gamma``); 1 where they compute none."""
        return 1.0

    def replay_ranks(self) -> int:
        """The ranks of the layout that hold replay shards (``num_replay_shards``); 0 for a
        config without replay."""
        return 0

    def target_updates(self) -> tuple[int, float]:
        """How a Q learner's target network follows the online one: copied every so many SGD
        steps (``target_network_update_freq``), and moved by a soft update of this rate after
        every step (``tau``; 1: none). Read on each learner rank; (1, 1.0) without targets."""
        return 1, 1.0

    def advantage_lambda(self) -> float:
        """The GAE lambda of the advantages rollout workers compute (``gae_lambda``); 1 where
        they compute none or plain discounted returns."""
        return 1.0

    def centralizes_critic(self) -> bool:
        """Whether a multi-agent policy's critic also sees the env's global state (PPO's
        ``centralized_critic``)."""
        return False

    def custom_models(self) -> list[str]:
        """The user's own models this config builds ("module:Class"), which ``check_model``
        tries on a sampled observation before a run starts."""
        return [self.custom_model] if self.custom_model else []

    def allreduce_options(self) -> tuple[str, str]:
        """The learners' gradient allreduce: (``learner_backend``, ``learner_master_addr``);
        ("auto", "") for a config without them (A3C's learner makes no allreduce)."""
        return "auto", ""


@dataclass
class CommonConfig(ConfigHooks):
    """The fields of every algorithm: layout, sampling, model and compute, bookkeeping."""

    callbacks: str = ""
    """A ``mpirl.Callbacks`` subclass as "module:Class", importable on every rank; its hooks run
    on the driver, rollout and learner ranks (see the Callbacks page). "" runs none."""

    multiagent: dict = dataclasses.field(default_factory=dict)
    """Multi-agent runs: {"policies": {ID: {overrides}}, "policy_mapping": {...},
    "policies_to_train": [...]}; see the Multi-agent page. {} with a multi-agent env gives one
    shared policy (or one per agent when their spaces differ)."""

    # Environment
    env_config: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments for the environment's constructor: gym.make(id, **env_config),
    Class(**env_config), or a PettingZoo factory's. For Atari they go to ale-py's AtariEnv
    (repeat_action_probability, full_action_space, mode, difficulty; mpirl passes frameskip 1
    and obs_type itself unless given here), or with env_backend "envpool" to
    envpool.make_gymnasium."""
    clip_rewards: str | bool = "auto"
    """Train on the sign of each reward (-1, 0 or 1) instead of the reward; episode returns
    are still reported unclipped (the game score). "auto" clips on Atari games only; true or
    false. ES and ARS, which optimize returns themselves, never clip."""
    atari_noop_max: int = 30
    """Atari: after each reset, a random number of no-op actions from 1 to this (the ALE is
    deterministic; this varies the starts). 0 turns no-op starts off."""
    atari_frame_skip: int = 4
    """Atari: repeat each action this many frames, summing the rewards and observing the
    pixel-wise maximum of the last two frames. 1 turns it off (every frame is observed)."""
    atari_frame_size: int = 84
    """Atari: resize frames to this many pixels a side (area averaging). 0 keeps the full
    210x160 frame."""
    atari_grayscale: bool = True
    """Atari: grayscale frames (drawn so by the ALE); false keeps RGB."""
    atari_frame_stack: int = 4
    """Atari: observe the last this many frames, stacked channels first (4, 84, 84). 1 turns
    stacking off (one frame, still channels first)."""
    env_backend: str = "gymnasium"
    """How rollout workers run Atari games: "gymnasium" (a vector env of ale-py envs with
    mpirl's preprocessing wrappers) or "envpool" (EnvPool's batched C++ envs with the same
    preprocessing: pip install envpool). Other envs always run in gymnasium."""

    # Logging
    tensorboard_histograms_every: int = 10
    """Every this many iterations, TensorBoard gets histograms of learner 0's weights (per
    parameter tensor) and of the gradient norms of its SGD steps since the last ones; 0: never."""
    wandb_project: str = ""
    """Log every progress row to this Weights & Biases project (pip install 'mpirl[wandb]');
    the run is named after the run directory. "" leaves W&B off."""
    mlflow_experiment: str = ""
    """Log every progress row to this MLflow experiment (pip install 'mpirl[mlflow]'; the server
    or store comes from MLFLOW_TRACKING_URI). "" leaves MLflow off."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the learners leave. 0 samples in the driver."""
    num_learners: int = 0
    """Learner ranks (data-parallel SGD). 0 trains in the driver's process."""
    ranks_per_env: int = 0
    """Ranks of each env instance (an env group) for an mpirl.Simulation env: each rollout
    rank's num_envs_per_worker groups of this many ranks follow it in the world. 0 steps the
    envs inside the rollout process, as for any other env."""

    # Sampling
    num_envs_per_worker: int = 8
    """Environments each rollout worker steps together (a gymnasium vector env)."""
    max_env_failures: int = 10
    """Failures of one environment (an exception in reset or step) that end the run when they
    come in a row, or within its last env_failure_window steps. Fewer are recovered: the env is
    rebuilt and its partial episode dropped. 1 ends the run on the first failure."""
    env_failure_window: int = 1_000
    """Steps of one environment over which max_env_failures failures end the run even with
    successful steps between them (an env failing every 50 steps, say); 1 counts only failures
    in a row."""
    env_step_timeout_s: float = 120.0
    """Longest wait for one env group's reply to a reset or step (ranks_per_env >= 1); past it
    the run ends naming the group and the step."""

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
    encoder: str = "auto"
    """How observations are encoded: auto (a CNN for images, Box of rank 3: nature_cnn from 36
    pixels a side, small_cnn below; flattened vectors otherwise; one encoder per component of
    Dict and Tuple observations), nature_cnn, impala_cnn, small_cnn, or mlp (images
    flattened)."""
    cnn_dense_size: int = 512
    """Units of the dense ReLU layer that ends every CNN encoder; image models' heads are linear
    on it, and hidden_sizes applies to vector observations."""
    custom_model: str = ""
    """Your own torch model as "module:Class", built on every rank as Class(observation_space,
    action_space, custom_model_config); see the Models page for what forward returns. "" takes
    mpirl's model."""
    custom_model_config: dict = dataclasses.field(default_factory=dict)
    """Options passed to custom_model's (and custom_q_model's) constructor as its config."""
    use_lstm: bool = False
    """A recurrent policy (PPO, A2C, A3C, IMPALA): an LSTM between the encoder and the actor
    and critic heads. Rollout ranks carry each env's state across fragments (and checkpoints);
    the learners train on sequences of max_seq_len steps (IMPALA: whole fragments), with the
    state reset at every episode start."""
    lstm_cell_size: int = 64
    """Units of the LSTM's cell with use_lstm."""
    max_seq_len: int = 20
    """Steps per training sequence with use_lstm (PPO, A2C, A3C): fragments are cut into
    sequences this long, each starting from the state the rollout rank had there."""
    torch_threads: int = 1
    """torch threads per rank; 1 avoids oversubscribing cores shared by many ranks."""

    # Bookkeeping
    metrics_window: int = 100
    """Episodes averaged into episode_return_mean."""
    seed: int = 0
    """Base seed; rank-specific seeds derive from it."""

    def __post_init__(self) -> None:
        # Direct construction (the Python API, tests) gets the checks the CLI's build() makes.
        check_ranges(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        for key, allowed in (("clip_rewards", ("auto", True, False)),
                             ("env_backend", ("gymnasium", "envpool"))):
            value = getattr(self, key)
            # True == 1 in a tuple: only the very objects listed are accepted.
            if not any(value is word or (isinstance(word, str) and value == word)
                       for word in allowed):
                must = ", ".join(json.dumps(word) for word in allowed)
                shown = json.dumps(value, default=repr)
                raise ConfigError(f'config key "{key}" = {shown} is not one of {must}')
        if not isinstance(self.env_config, dict):
            raise ConfigError(f'config key "env_config" must be a JSON object of keyword '
                              f'arguments, got {json.dumps(self.env_config, default=repr)}')

    def live_columns(self, env: Any) -> list[tuple[str, tuple[str, ...]]] | None:
        """What the live line shows of a run on ``env`` in place of the episodes' return and
        length, as (label, progress-row keys) pairs, each shown as ``label v1/v2/...``; None
        keeps return and length, which is what most algorithms' episodes mean."""
        return None

    def live_values(self) -> tuple[tuple[str, str], ...]:
        """(label, progress-row key) pairs of the plan's own the live line shows after the
        returns, as ``label 0.123``, while the row has a value; a narrow terminal drops them
        after memory and env failures. Read on rank 0 only; nothing crosses ranks."""
        return ()

    def reports_eval_return(self) -> bool:
        """Whether the plan's rows carry ``eval_return_mean`` (its own evaluations), so that
        ``--stop eval_return_mean`` can be reached; checked on rank 0 before anything
        starts."""
        return False


@dataclass
class AllreduceConfig(ConfigHooks):
    """Keys of algorithms whose learners average gradients with an allreduce (all but A3C)."""

    learner_backend: str = "auto"
    """Gradient allreduce: auto (NCCL where each learner has a GPU of its own, else MPI), mpi,
    gloo or nccl."""
    learner_master_addr: str = ""
    """Address of learner 0's host that the other learners reach it on, to start gloo or NCCL;
    "" takes MASTER_ADDR, else the address on the route to the MPI launcher's host."""

    def allreduce_options(self) -> tuple[str, str]:
        return self.learner_backend, self.learner_master_addr


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

    def observation_normalization(self) -> bool:
        return self.normalize_observations

    def discount(self) -> float:
        return self.gamma


@dataclass
class ReplayConfig(CommonConfig, AllreduceConfig):
    """Algorithms that learn from a (possibly sharded, possibly prioritized) replay buffer."""

    # Layout
    num_rollout_workers: int = -1
    """Rollout ranks; -1 takes every rank the replay shards and learners leave."""
    num_replay_shards: int = 0
    """Replay ranks, each holding buffer_size / num_replay_shards rows. 0 keeps the buffer in
    the driver's process."""

    def replay_ranks(self) -> int:
        return self.num_replay_shards

    # Sampling
    num_envs_per_worker: int = 4
    """Environments each rollout worker steps together."""
    rollout_fragment_length: int = 64
    """Steps per environment per iteration."""
    max_env_failures: int = 10
    """Failures of one environment, in a row or within env_failure_window steps, that end the
    run; fewer are recovered."""

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
    grad_clip: float = 10.0
    """Global gradient-norm clip; 0 turns it off."""

    # Model and compute
    activation: str = "relu"
    torch_threads: int = 1
    """torch threads per rank."""

    def discount(self) -> float:
        return self.gamma


@dataclass
class QLearningConfig(ReplayConfig):
    """Replay algorithms with a Q network: DQN and Ape-X."""

    target_network_update_freq: int = 128
    """SGD steps between copies of the online network into the target network."""
    double_q: bool = True
    """Choose the bootstrap action with the online network (double DQN)."""
    dueling: bool = True
    """Split Q into a state value and action advantages."""
    hidden_sizes: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the Q network."""

    def target_updates(self) -> tuple[int, float]:
        return self.target_network_update_freq, 1.0


@dataclass
class OfflineConfig(CommonConfig, AllreduceConfig):
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
    """Failures of one evaluation environment, in a row or within env_failure_window steps,
    that end the run; fewer are recovered (the env is rebuilt and its episode dropped)."""

    # Bookkeeping
    metrics_window: int = 0
    """Episodes averaged into episode_return_mean; 0 means evaluation_episodes, so that it is
    the mean of the latest evaluation."""

    ranges: ClassVar[dict[str, Range]] = {"metrics_window": at_least(0)}

    def __post_init__(self) -> None:
        super().__post_init__()
        self.metrics_window = self.metrics_window or self.evaluation_episodes

    def samples_per_iteration(self, rollout_slots: int) -> int:
        """Dataset rows trained on per iteration, over all learners."""
        return self.train_batch_size * self.num_sgd_steps_per_iteration


def field_docs(cls: type) -> dict[str, str]:
    """Each field of the dataclass ``cls`` -> its docstring, the most derived one along the MRO
    (a field redeclared without a docstring keeps its base's)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    names = {f.name for f in dataclasses.fields(cls)}
    return {name: doc for name, doc in docs.items() if name in names}
