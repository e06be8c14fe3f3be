"""The contract of an algorithm module: every name it defines, checked when it is loaded.

``mpirl train --algo NAME`` loads a built-in algorithm (``mpirl.algorithms.<name>``) or any
importable module (``my_package.my_algo``) through ``load_algorithm``, which refuses a module
that lacks a piece of ``AlgorithmModule``, or defines one of the wrong kind, with one line that
names the piece (exit code 2). Nothing reads a module's names any other way. Defaults a module
may import and assign: ``RolloutWorker``, ``Learner``, ``actor_critic_model``,
``no_config_checks`` and ``stateless`` (all in ``mpirl.execution``).

A few pieces are optional (``OPTIONAL_PIECES``): a module that leaves one out gets its default,
which ``env_spec_of`` and ``matches_of`` supply. What ``--env`` names is the module's
``env_spec`` (a gymnasium or PettingZoo env unless it says otherwise: AlphaZero's is a board
game), and ``mpirl evaluate --opponent`` and ``mpirl play`` play the checkpoints of a module
whose ``MATCHES`` is not None.

What a plan keeps between iterations is its ``PlanState``, made by the module's ``setup``, given
to every ``training_step`` and checkpointed with the run.

Whether a module can drive one policy of a multi-agent run follows from its workers: its
``ROLLOUT_WORKER`` and ``LEARNER`` both declare ``SERVES_A_POLICY`` (``drives_a_policy``); the
others are refused as a policy at start (``refuse_as_policy``). A run records a module by
``name_of`` (PPO, or a plug-in's module path), which ``load_algorithm`` loads it back by; a name
as typed is spelled so by ``algorithm_name``, and by nothing else.

What shared code calls on a module's workers is typed here too (``RolloutWorkerClass``,
``LearnerClass`` and their settings' Protocols), and checked at load (``worker_gaps``); what it
asks of a config is ``mpirl.config.fields.ConfigHooks``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Generic, Protocol, TextIO, cast, runtime_checkable

import gymnasium as gym
import numpy as np

from mpirl.config.fields import CommonConfig
from mpirl.errors import ConfigError
from mpirl.runtime.core import WEIGHTS_KEY, RankContext, Worker
from mpirl.runtime.dispatch import WorkerGroup
from mpirl.workers.env_spec import EnvSpec, env_spec_for
from mpirl.workers.learner import LossFn

__all__ = ["ALGORITHMS", "WEIGHTS_KEY", "AlgorithmModule", "LearnerClass", "LearnerSettingsClass",
           "PlanState", "PolicyLearnerSettings", "PolicyRolloutWorkerClass", "RolloutSettingsClass",
           "RolloutWorkerClass", "algorithm_name", "check_contract", "drives_a_policy",
           "env_spec_of", "gymnasium_env_spec", "load_algorithm", "Matches", "matches_of",
           "name_of", "no_config_checks", "OPTIONAL_PIECES", "policy_algorithms",
           "refuse_as_policy", "stateless", "worker_gaps"]

#: Algorithm name on the command line -> module.
ALGORITHMS = {"PPO": "mpirl.algorithms.ppo", "A2C": "mpirl.algorithms.a2c",
              "BC": "mpirl.algorithms.bc", "MARWIL": "mpirl.algorithms.marwil",
              "DQN": "mpirl.algorithms.q_learning.dqn",
              "APEX": "mpirl.algorithms.q_learning.apex",
              "SAC": "mpirl.algorithms.sac",
              "IMPALA": "mpirl.algorithms.impala", "A3C": "mpirl.algorithms.a3c",
              "ES": "mpirl.algorithms.evolution.es", "ARS": "mpirl.algorithms.evolution.ars",
              "AlphaZero": "mpirl.algorithms.alphazero.alphazero",
              "PETS": "mpirl.algorithms.model_based.pets",
              "MBPO": "mpirl.algorithms.model_based.mbpo"}
#: Each built-in name in capitals -> its name as written (ppo, alphazero: any case works); read
#: only by ``algorithm_name``.
_BY_UPPER = {name.upper(): name for name in ALGORITHMS}


class PlanState:
    """What a plan keeps between iterations, owned by the plan and checkpointed with the run.

    The module's ``setup(trainer)`` makes it once the run's rollout workers and learners exist;
    the trainer passes it to every ``training_step(trainer, state)``. This base keeps nothing
    (``stateless``): a plan subclasses it for groups of its own (replay shards), calls it keeps
    running across iterations (asynchronous requests), or values a resumed run must continue
    from (SGD steps owed)."""

    def groups(self) -> list[WorkerGroup]:
        """Worker groups of the plan's own (replay shards, say): their workers' state goes into
        checkpoints after the learners' and rollout workers'."""
        return []

    def settle(self) -> None:
        """Before a checkpoint, a restore and the end of a run: bring the calls the plan keeps
        running across iterations to a stop, with what they sampled counted; the next
        iteration starts them again."""

    def get_state(self) -> dict[str, Any]:
        """The driver-side values a resumed run needs, saved in driver.pkl under ``plan``."""
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """Take back ``get_state``'s values."""

    def restored_empty(self, group: WorkerGroup, timesteps_total: int) -> None:
        """``group`` (one of the run's, the plan's own included) was not in the checkpoint just
        restored: its workers start empty at ``timesteps_total`` env steps (replay shards, on a
        resume from a checkpoint written without ``checkpoint_replay``)."""

    def histograms(self, learners: WorkerGroup) -> dict[str, np.ndarray]:
        """Learner 0's TensorBoard histograms for this iteration; a plan whose learner call runs
        across iterations takes them from that call's reports instead."""
        return learners[0].call("histograms")


def stateless(trainer: Any) -> PlanState:
    """``setup`` of a plan that keeps nothing between iterations (PPO, A2C, BC, MARWIL)."""
    return PlanState()


def no_config_checks(config: Any, env: EnvSpec) -> None:
    """``check_config`` of a plan whose config needs no look at the environment."""


# What shared code asks of a module's workers. The trainer, the checkpoints and the commands
# call these on every algorithm's ROLLOUT_WORKER and LEARNER, by name through MESSAGES (each
# call crosses to the worker's rank) or as class attributes on the driver. A plan calls further
# methods of its own workers by name (``"sample"``, PETS's ``"sample_steps"``, AlphaZero's
# ``"play"``): those need only be in the worker's MESSAGES. RolloutWorker and Learner have all
# of it; the test tests/test_contract.py checks every built-in against these Protocols.


@runtime_checkable
class RolloutSettingsClass(Protocol):
    """``ROLLOUT_WORKER.Settings``: what a rollout worker is built from."""

    @classmethod
    def from_config(cls, config: Any, *, env: EnvSpec, policy: Any, dump: Any = None) -> Any:
        """The settings of a single-agent run with ``config`` on ``env``, acting with the model
        spec ``policy`` and writing episodes to ``dump`` (``--dump-trajectories``; None
        without). Made once on the driver; they cross to each rollout rank when it spawns."""


@runtime_checkable
class LearnerSettingsClass(Protocol):
    """``LEARNER.Settings``: what a learner is built from."""

    @classmethod
    def from_config(cls, config: Any, *, policy: Any, loss: LossFn | None) -> Any:
        """The settings of a run with ``config``, training the model spec ``policy`` with the
        module's ``loss``. Made once on the driver; they cross to each learner rank when it
        spawns."""


@runtime_checkable
class PolicyLearnerSettings(Protocol):
    """What ``LEARNER.Settings.from_config`` returns where the learner ``SERVES_A_POLICY``."""

    def for_policy(self, *, members: list[int], policy_index: int,
                   weights_to: list[int]) -> Any:
        """These settings for one policy of a multi-agent run: its learners are the learner
        indices ``members``, its messages' tags follow from ``policy_index``, and its weights
        go by message to the rollout ranks ``weights_to``."""


@runtime_checkable
class RolloutWorkerClass(Protocol):
    """An algorithm's ``ROLLOUT_WORKER``: built on each rollout rank as ``cls(context,
    settings)`` from ``Settings.from_config``'s settings (a policy's, from ``mpirl``'s
    ``SamplingSettings.for_policy``, beside the rank's shared sampling core)."""

    Settings: ClassVar[type]
    """Its settings class (a ``RolloutSettingsClass``)."""
    MESSAGES: ClassVar[tuple[str, ...]]
    """The methods the driver may call by name: the ones below and its plan's own."""
    SERVES_A_POLICY: ClassVar[bool]
    """Whether it can take one policy's steps of a multi-agent run (then it has ``ACTING``)."""

    def __init__(self, context: RankContext, settings: Any) -> None: ...

    def get_weights(self) -> np.ndarray:
        """The flat float32 weights it acts with."""

    def set_weights(self, flat: np.ndarray) -> None:
        """Act with ``flat`` from now on (``broadcast_weights`` to a worker in the driver's
        process, a checkpoint's weights)."""

    def receive_weights(self) -> None:
        """Take part in learner 0's weight broadcast (a collective on the weights
        communicator), or take its policy's weights by message."""

    def finish_dump(self) -> Any:
        """With ``--dump-trajectories``, at the end of a run and before a checkpoint: write out
        its completed episodes and return what the driver's dump index records (None
        without dumps)."""

    def save_state(self, directory: str, name: str) -> dict[str, Any]:
        """Write its checkpoint file (``Worker.save_state``) on its own rank."""

    def load_state(self, path: str, entry: dict[str, Any]) -> Any:
        """Read back its checkpoint file (``Worker.load_state``)."""


@runtime_checkable
class PolicyRolloutWorkerClass(RolloutWorkerClass, Protocol):
    """A ``ROLLOUT_WORKER`` that ``SERVES_A_POLICY``."""

    ACTING: ClassVar[str]
    """How the rank's shared sampling core acts for its policy (``mpirl.workers.actors``'
    SAMPLE, say)."""


@runtime_checkable
class LearnerClass(Protocol):
    """An algorithm's ``LEARNER``: built on each learner rank (or in the driver's process) as
    ``cls(context, settings)`` from ``Settings.from_config``'s settings."""

    Settings: ClassVar[type]
    """Its settings class (a ``LearnerSettingsClass``)."""
    MESSAGES: ClassVar[tuple[str, ...]]
    """The methods the driver may call by name: the ones below and its plan's own."""
    SERVES_A_POLICY: ClassVar[bool]
    """Whether it can train one policy of a multi-agent run on a slice of the learner ranks
    (then its settings are a ``PolicyLearnerSettings``)."""

    def __init__(self, context: RankContext, settings: Any) -> None: ...

    def get_weights(self) -> np.ndarray:
        """The flat float32 weights of the model it trains: what rollout workers act with."""

    def set_weights(self, flat: np.ndarray) -> None:
        """Train from ``flat`` on."""

    def broadcast_weights(self, gather_answers: bool = False,
                          round_header: Any = None) -> Any:
        """Learner 0: send ``get_weights()`` to every rollout rank, the root of the
        broadcast each rollout worker's ``receive_weights`` joins."""

    def histograms(self) -> dict[str, np.ndarray]:
        """TensorBoard's histograms of this iteration (``PlanState.histograms``)."""

    def get_state(self) -> dict[str, Any]:
        """Its checkpoint: a dict whose ``WEIGHTS_KEY`` entry is ``get_weights()``'s vector,
        which ``mpirl evaluate``, ``export`` and ``play`` load the model from."""

    def save_state(self, directory: str, name: str) -> dict[str, Any]:
        """Write ``get_state()`` to its checkpoint file on its own rank."""

    def load_state(self, path: str, entry: dict[str, Any]) -> Any:
        """Read back its checkpoint file."""


def protocol_members(protocol: type) -> list[str]:
    """The names ``protocol`` asks for (its attributes and methods), as a plug-in author reads
    them."""
    names = set()
    for klass in protocol.__mro__:
        if klass in (Protocol, object, Generic) or not getattr(klass, "_is_protocol", False):
            continue
        names |= set(vars(klass).get("__annotations__", {}))
        names |= {name for name, value in vars(klass).items()
                  if callable(value) or isinstance(value, classmethod)}
    return sorted(name for name in names if not name.startswith("_"))


def lacks(value: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``value`` (a class, a settings object) does not
    have; empty when it meets it."""
    return [name for name in protocol_members(protocol) if not hasattr(value, name)]


def worker_gaps(module: AlgorithmModule) -> list[str]:
    """What ``module``'s ROLLOUT_WORKER and LEARNER lack of the Protocols above, one
    ``WHERE lacks NAME`` each (empty for a module that meets them)."""
    rollout, learner = module.ROLLOUT_WORKER, module.LEARNER
    checks: list[tuple[str, Any, type]] = [
        ("ROLLOUT_WORKER", rollout, RolloutWorkerClass),
        ("ROLLOUT_WORKER.Settings", rollout.Settings, RolloutSettingsClass),
        ("LEARNER", learner, LearnerClass),
        ("LEARNER.Settings", learner.Settings, LearnerSettingsClass)]
    if rollout.SERVES_A_POLICY:
        checks.append(("ROLLOUT_WORKER", rollout, PolicyRolloutWorkerClass))
    if learner.SERVES_A_POLICY:
        checks.append(("LEARNER.Settings", learner.Settings, PolicyLearnerSettings))
    gaps = [f"{where} lacks {name}" for where, value, protocol in checks
            for name in lacks(value, protocol)]
    for where, cls, protocol in (("ROLLOUT_WORKER", rollout, RolloutWorkerClass),
                                 ("LEARNER", learner, LearnerClass)):
        called = {name for name in protocol_members(protocol)
                  if name not in ("Settings", "MESSAGES", "SERVES_A_POLICY", "get_state")}
        gaps += [f"{where}.MESSAGES lacks {name!r}"
                 for name in sorted(called - set(cls.MESSAGES))]
    return gaps


def gymnasium_env_spec(env_id: str, env_module: str | None, config: Any) -> EnvSpec:
    """``env_spec`` of a module that leaves it out: ``--env`` is a gymnasium id,
    ``module:Class`` or a PettingZoo env, with the config's ``env_config`` and Atari keys."""
    return env_spec_for(env_id, env_module, dataclasses.asdict(config))


class Matches(Protocol):
    """How ``mpirl evaluate --opponent`` and ``mpirl play`` play a module's checkpoint, in one
    process without MPI (nothing crosses ranks): a board-game agent (AlphaZero's) against a
    reference player or a person. ``checkpoint`` is its folder, ``manifest`` its manifest."""

    def evaluate(self, checkpoint: Path, manifest: dict[str, Any], opponent: str, games: int,
                 simulations: int | None, seed: int) -> dict[str, Any]:
        """Play ``games`` games against ``opponent`` (a player spec), half moving first; the
        counts and rates from the agent's side, as a JSON-able dict."""

    def describe(self, summary: dict[str, Any]) -> str:
        """``evaluate``'s result as one line for the terminal."""

    def play(self, checkpoint: Path, manifest: dict[str, Any], simulations: int | None,
             first: bool, seed: int, stdin: TextIO, stdout: TextIO) -> int:
        """A person against the agent, by moves on ``stdin``; the command's exit code."""


class AlgorithmModule(Protocol):
    """What an algorithm module defines. Every name is required but ``env_spec`` and
    ``MATCHES`` (``OPTIONAL_PIECES``); a module may assign the defaults of ``mpirl.execution``
    (``setup = stateless``, say)."""

    Config: type[CommonConfig]
    """Its ``--config`` keys: a dataclass that subclasses one of ``mpirl.config.fields``'
    bases, with a docstring under every field."""

    loss: LossFn | None
    """``loss(policy, batch, config) -> (loss, stats)``, run on the learners for each minibatch:
    a scalar torch loss and floats averaged into the progress row. None for a derivative-free
    plan (ES, ARS), whose learner differentiates nothing."""

    ROLLOUT_WORKER: type[Worker]
    """The rollout worker class its plan calls, built on every rollout rank from its
    ``Settings`` (``RolloutWorker`` for on-policy plans); a ``RolloutWorkerClass``."""

    LEARNER: type[Worker]
    """The learner class its plan calls, built on every learner rank (or in the driver's
    process) from its ``Settings`` (``Learner`` for on-policy plans); a ``LearnerClass``."""

    RECURRENT: bool
    """Whether ``use_lstm`` works: its rollout workers carry each env's recurrent state and its
    loss takes sequences."""

    def model_spec(self, observation_space: gym.Space, action_space: gym.Space,
                   config: Any) -> Any:
        """The spec of the model it trains, which every rank builds (``actor_critic_model``
        for an actor-critic)."""

    def check_config(self, config: Any, env: EnvSpec) -> None:
        """ConfigError for a config this env cannot run, before anything starts
        (``no_config_checks`` for none)."""

    def setup(self, trainer: Any) -> PlanState:
        """Once the run's workers exist, on the driver: the groups and values its plan keeps
        (``stateless`` for none). ``trainer`` is the run's ``Trainer``."""

    def training_step(self, trainer: Any, state: Any) -> dict[str, float]:
        """One iteration of its plan on the driver, over the operators of ``mpirl.execution``;
        ``state`` is what ``setup`` returned. Its floats join the progress row."""

    MATCHES: Matches | None
    """Optional (default None: its checkpoints are evaluated by episodes): how ``mpirl
    evaluate --opponent`` and ``mpirl play`` play its checkpoints (AlphaZero's board games)."""

    def env_spec(self, env_id: str, env_module: str | None, config: Any) -> EnvSpec:
        """Optional (default ``gymnasium_env_spec``): what ``--env env_id`` is for a run with
        ``config``, on the driver before anything starts; the ``EnvSpec`` then crosses to every
        rank that builds envs. ConfigError, naming what would be right, for an id it cannot
        run."""


@dataclass(frozen=True)
class Piece:
    """One name of ``AlgorithmModule``: what it should be, and a check of its kind."""

    name: str
    should_be: str
    is_right_kind: Callable[[Any], bool]
    default: Any = None
    """What a module that leaves an optional piece out gets (``OPTIONAL_PIECES``)."""


def _is_config(value: Any) -> bool:
    return (isinstance(value, type) and dataclasses.is_dataclass(value)
            and issubclass(value, CommonConfig))


def _is_worker_class(value: Any) -> bool:
    """A Worker subclass with a ``Settings`` class (found along its bases), which the trainer
    builds it from."""
    return (isinstance(value, type) and issubclass(value, Worker)
            and any(isinstance(vars(base).get("Settings"), type) for base in value.__mro__))


#: The pieces of the contract, in the order ``load_algorithm`` checks them.
PIECES = (
    Piece("Config", "a dataclass of its --config keys that subclasses one of mpirl.config.fields' "
          "bases (OnPolicyConfig, say)", _is_config),
    Piece("loss", "loss(policy, batch, config) -> (loss, stats), or None for a derivative-free "
          "plan", lambda value: value is None or callable(value)),
    Piece("ROLLOUT_WORKER", "the rollout worker class its plan calls "
          "(mpirl.workers.rollout.RolloutWorker for on-policy plans)", _is_worker_class),
    Piece("LEARNER", "the learner class its plan calls (mpirl.workers.learner.Learner for "
          "on-policy plans)", _is_worker_class),
    Piece("RECURRENT", "True or False: whether use_lstm works with its plan",
          lambda value: isinstance(value, bool)),
    Piece("model_spec", "model_spec(observation_space, action_space, config) -> the spec of "
          "its model (mpirl.execution.actor_critic_model for an actor-critic)", callable),
    Piece("check_config", "check_config(config, env), the checks that need the env "
          "(mpirl.execution.no_config_checks for none)", callable),
    Piece("setup", "setup(trainer) -> PlanState, what its plan keeps between iterations "
          "(mpirl.execution.stateless for nothing)", callable),
    Piece("training_step", "training_step(trainer, state) -> dict of floats, one iteration of "
          "its plan", callable),
)

#: The pieces a module may leave out, each with its default.
OPTIONAL_PIECES = (
    Piece("env_spec", "env_spec(env_id, env_module, config) -> the EnvSpec of --env",
          callable, gymnasium_env_spec),
    Piece("MATCHES", "None, or an object with evaluate, describe and play (the Matches "
          "protocol) for mpirl evaluate --opponent and mpirl play",
          lambda value: value is None or all(callable(getattr(value, method, None))
                                             for method in ("evaluate", "describe", "play"))),
)

_ABSENT = object()


def _optional(module: AlgorithmModule, name: str) -> Any:
    """The optional piece ``name`` of ``module``, or its default when the module leaves it
    out."""
    piece = next(piece for piece in OPTIONAL_PIECES if piece.name == name)
    return vars(cast(ModuleType, module)).get(name, piece.default)


def algorithm_name(name: str) -> str:
    """The one spelling of the algorithm ``name`` (as typed after ``--algo``, or in a policy's
    overrides) that runs record, name their directories by and load it back by: a built-in's
    as ``ALGORITHMS`` writes it (PPO for ppo, AlphaZero for ALPHAZERO), a plug-in's module path
    as given. Every comparison or lookup of a typed name goes through it."""
    return _BY_UPPER.get(name.upper(), name)


def name_of(module: AlgorithmModule) -> str:
    """The name a run of ``module`` records (manifest, params.json, dumps), which
    ``load_algorithm`` loads it back by: PPO for mpirl.algorithms.ppo, a plug-in's module path
    as imported (``userpkg.myppo``)."""
    path = cast(ModuleType, module).__name__
    return next((name for name, builtin in ALGORITHMS.items() if builtin == path), path)


def load_algorithm(name: str) -> AlgorithmModule:
    """A built-in algorithm by name (PPO), or any importable module that defines every piece of
    ``AlgorithmModule`` (``my_package.my_algo``), as the built-in ones do; ConfigError if not."""
    builtin = ALGORITHMS.get(algorithm_name(name))
    if builtin is not None:
        return check_contract(importlib.import_module(builtin), builtin)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is None or not name.startswith(error.name):
            raise  # the plug-in itself imports something missing: its own traceback says what
        raise ConfigError(
            f"unknown algorithm {name!r}: neither a built-in one ({', '.join(ALGORITHMS)}) nor "
            f"an importable module (no module named {error.name!r}; a plug-in module must be "
            f"importable on every rank: installed, or on PYTHONPATH)") from None
    except ImportError as error:
        raise ConfigError(f"algorithm module {name!r} could not be imported: {error}") from None
    return check_contract(module, name)


def drives_a_policy(module: AlgorithmModule) -> bool:
    """Whether ``module`` can drive one policy of a multi-agent run: its rollout worker and its
    learner both serve a policy among others (``Worker.SERVES_A_POLICY``)."""
    return module.ROLLOUT_WORKER.SERVES_A_POLICY and module.LEARNER.SERVES_A_POLICY


def policy_algorithms() -> list[str]:
    """The built-in algorithms that can drive a policy of a multi-agent run."""
    return [name for name in ALGORITHMS if drives_a_policy(load_algorithm(name))]


def refuse_as_policy(module: AlgorithmModule, name: str, policy_id: str) -> None:
    """ConfigError, in one line, when ``module`` (named ``name``) cannot drive the policy
    ``policy_id`` of a multi-agent run, naming the algorithms that can."""
    if drives_a_policy(module):
        return
    workers = [cls.__name__ for cls in (module.ROLLOUT_WORKER, module.LEARNER)
               if not cls.SERVES_A_POLICY]
    raise ConfigError(
        f"policy {policy_id!r}: {name} cannot drive a policy of a multi-agent run (its "
        f"{' and '.join(workers)} serve{'s' if len(workers) == 1 else ''} a whole run, not one "
        f"policy among others). Policies can use {', '.join(policy_algorithms())}, or a "
        f"plug-in built on RolloutWorker and Learner (docs/plugins.md); or train {name} alone, "
        f"or make the policy scripted with \"policy_class\"")


def env_spec_of(module: AlgorithmModule, env_id: str, env_module: str | None,
                config: Any) -> EnvSpec:
    """What ``--env env_id`` is for a run of ``module`` with ``config``: its ``env_spec``'s
    answer (a gymnasium or PettingZoo env by default; a board game for AlphaZero)."""
    return _optional(module, "env_spec")(env_id, env_module, config)


def matches_of(module: AlgorithmModule) -> Matches | None:
    """How ``mpirl evaluate --opponent`` and ``mpirl play`` play ``module``'s checkpoints (its
    ``MATCHES``); None when they are evaluated by episodes."""
    return _optional(module, "MATCHES")


def check_contract(module: ModuleType, name: str) -> AlgorithmModule:
    """``module`` as an ``AlgorithmModule``; ConfigError, in one line, naming the first piece
    it lacks (and the others) or defines with the wrong kind."""
    defined = vars(module)
    missing = [piece for piece in PIECES if defined.get(piece.name, _ABSENT) is _ABSENT]
    if missing:
        first, others = missing[0], [piece.name for piece in missing[1:]]
        also = f" (nor {', '.join(others)})" if others else ""
        raise ConfigError(f"algorithm module {name!r} does not define {first.name}{also}: "
                          f"{first.should_be}; see docs/plugins.md")
    for piece in PIECES + OPTIONAL_PIECES:
        value = defined.get(piece.name, piece.default)
        if not piece.is_right_kind(value):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
            raise ConfigError(f"algorithm module {name!r} defines {piece.name} as {shown}, but "
                              f"it should be {piece.should_be}; see docs/plugins.md")
    gaps = worker_gaps(cast(AlgorithmModule, module))
    if gaps:
        also = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
        raise ConfigError(f"algorithm module {name!r}: its {gaps[0]}{also}, which mpirl calls "
                          f"on every algorithm's workers (mpirl.execution.contract."
                          f"RolloutWorkerClass, LearnerClass); see docs/plugins.md")
    return cast(AlgorithmModule, module)
