"""The contract of an algorithm module: every name it defines, checked when it is loaded.

``mpirl train --algo NAME`` loads a built-in algorithm (``mpirl.algorithms.<name>``) or any
importable module (``my_package.my_algo``) through ``load_algorithm``, which refuses a module
that lacks a piece of ``AlgorithmModule``, or defines one of the wrong kind, with one line that
names the piece (exit code 2). Nothing reads a module's names any other way. Defaults a module
may import and assign: ``RolloutWorker``, ``Learner``, ``actor_critic_model``,
``no_config_checks`` and ``stateless`` (all in ``mpirl.execution``).

What ``--env`` names follows from the base of a module's ``Config``: a ``GameConfig`` plays
two-player board games (``env_spec_of`` reads a game), any other base a gymnasium or PettingZoo
env.

What a plan keeps between iterations is its ``PlanState``, made by the module's ``setup``, given
to every ``training_step`` and checkpointed with the run.

Whether a module can drive one policy of a multi-agent run follows from its workers: its
``ROLLOUT_WORKER`` and ``LEARNER`` both declare ``SERVES_A_POLICY`` (``drives_a_policy``); the
others are refused as a policy at start (``refuse_as_policy``). A run records a module by
``name_of`` (PPO, or a plug-in's module path), which ``load_algorithm`` loads it back by.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, cast

import gymnasium as gym
import numpy as np

from mpirl.config.fields import CommonConfig, GameConfig
from mpirl.errors import ConfigError
from mpirl.runtime.core import Worker
from mpirl.runtime.dispatch import WorkerGroup
from mpirl.workers.env_spec import EnvSpec, env_spec_for, game_env_spec
from mpirl.workers.learner import LossFn

#: Algorithm name on the command line -> module.
ALGORITHMS = {"PPO": "mpirl.algorithms.ppo", "A2C": "mpirl.algorithms.a2c",
              "BC": "mpirl.algorithms.bc", "MARWIL": "mpirl.algorithms.marwil",
              "DQN": "mpirl.algorithms.dqn", "APEX": "mpirl.algorithms.apex",
              "SAC": "mpirl.algorithms.sac",
              "IMPALA": "mpirl.algorithms.impala", "A3C": "mpirl.algorithms.a3c",
              "ES": "mpirl.algorithms.es", "ARS": "mpirl.algorithms.ars",
              "AlphaZero": "mpirl.algorithms.alphazero",
              "PETS": "mpirl.algorithms.model_based.pets",
              "MBPO": "mpirl.algorithms.model_based.mbpo"}
#: Each built-in name in capitals -> its name as written (ppo, alphazero: any case works).
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
        """Take back ``get_state``'s values. From a checkpoint written before plans kept their
        own, ``state`` holds the old top-level keys of driver.pkl (``sgd_step_debt``,
        ``replay_empty_at``, ``sgd_steps_total``) that were saved."""

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


class AlgorithmModule(Protocol):
    """What an algorithm module defines. Every name is required; a module may assign the
    defaults of ``mpirl.execution`` (``setup = stateless``, say)."""

    Config: type[CommonConfig]
    """Its ``--config`` keys: a dataclass that subclasses one of ``mpirl.config.fields``'
    bases, with a docstring under every field."""

    loss: LossFn | None
    """``loss(policy, batch, config) -> (loss, stats)``, run on the learners for each minibatch:
    a scalar torch loss and floats averaged into the progress row. None for a derivative-free
    plan (ES, ARS), whose learner differentiates nothing."""

    ROLLOUT_WORKER: type[Worker]
    """The rollout worker class its plan calls, built on every rollout rank from its
    ``Settings`` (``RolloutWorker`` for on-policy plans)."""

    LEARNER: type[Worker]
    """The learner class its plan calls, built on every learner rank (or in the driver's
    process) from its ``Settings`` (``Learner`` for on-policy plans)."""

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


@dataclass(frozen=True)
class Piece:
    """One name of ``AlgorithmModule``: what it should be, and a check of its kind."""

    name: str
    should_be: str
    is_right_kind: Callable[[Any], bool]


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

_ABSENT = object()


def algorithm_name(name: str) -> str:
    """The name a run records for ``name``: PPO for ppo, a plug-in's module path as given."""
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
    builtin = ALGORITHMS.get(_BY_UPPER.get(name.upper(), ""))
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


def plays_games(module: AlgorithmModule) -> bool:
    """Whether ``module``'s ``--env`` is a board game (its ``Config`` is a ``GameConfig``)."""
    return issubclass(module.Config, GameConfig)


def env_spec_of(module: AlgorithmModule, name: str, env_id: str, env_module: str | None,
                config: Any) -> EnvSpec:
    """What ``--env env_id`` is for a run of ``module`` (named ``name``) with ``config``: a game
    for a board-game algorithm, a gymnasium or PettingZoo env for the others; ConfigError,
    naming what would be right, for an id it cannot run."""
    keys = dataclasses.asdict(config)
    if plays_games(module):
        return game_env_spec(env_id, env_module, keys, algorithm_name(name))
    return env_spec_for(env_id, env_module, keys)


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
    for piece in PIECES:
        value = defined[piece.name]
        if not piece.is_right_kind(value):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
            raise ConfigError(f"algorithm module {name!r} defines {piece.name} as {shown}, but "
                              f"it should be {piece.should_be}; see docs/plugins.md")
    return cast(AlgorithmModule, module)
