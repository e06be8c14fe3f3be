"""What an environment is (a gymnasium id or module:Class, with kwargs, and for Atari games the
preprocessing); sent from the driver to every rollout rank, which builds its envs. And what every
worker that steps envs there is built from (``EnvWorkerSettings``)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from mpirl.config.imports import load_object
from mpirl.envs.atari import (
    INSTALL_HINT,
    AtariSettings,
    ale_kwargs,
    check_envpool,
    is_atari,
    preprocess,
    register_ale,
)
from mpirl.envs.parallel import load_factory, make_parallel
from mpirl.envs.simulation import Simulation, SimulationEnv
from mpirl.errors import ConfigError
from mpirl.models.spaces import flatten_structured

__all__ = ["EnvSpec", "env_spec_for", "EnvWorkerSettings"]


@dataclass(frozen=True)
class EnvSpec:
    """How to make the environment on any rank."""

    env_id: str
    """A registered gymnasium id, or ``module:ClassName`` for a class to instantiate."""
    env_module: str | None = None
    """A module to import first, for ids registered by a third-party package."""
    env_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's constructor."""
    atari: AtariSettings | None = None
    """The preprocessing of an Atari game (None for other envs, and for Atari unpreprocessed)."""
    clip_rewards: bool = False
    """Rollout workers train on the sign of each reward; the returns they report stay raw."""

    def is_multi_agent(self) -> bool:
        """True when the id names a PettingZoo-style multi-agent env (Parallel or AEC)."""
        self._import_env_module()
        return load_factory(self.env_id) is not None

    def make(self) -> gym.Env:
        """A fresh env: a gymnasium env, or for a multi-agent id one with the Parallel API."""
        self._import_env_module()
        factory = load_factory(self.env_id)
        if factory is not None:
            return make_parallel(self.env_id, factory, self.env_config)
        simulation = self.simulation_class()
        if simulation is not None:
            # k = 1 in the rollout process: local mode, ranks_per_env 0, mpirl evaluate.
            return SimulationEnv(simulation, **self.env_config)
        cls = self.check()
        if self.atari is not None:
            env = preprocess(gym.make(self.env_id, **ale_kwargs(self.atari, self.env_config)),
                             self.atari)
        elif cls is not None:
            env = cls(**self.env_config)
        else:
            env = gym.make(self.env_id, **self.env_config)
        # Dict and Tuple observations travel as one vector; the model cuts it apart again.
        return flatten_structured(env)

    def simulation_class(self) -> type[Simulation] | None:
        """The ``mpirl.Simulation`` subclass the id names (``module:Class``, or a gymnasium id
        registered with such a class as its entry point), else None. Nothing is constructed."""
        self._import_env_module()
        if ":" in self.env_id and self.env_id not in gym.registry:
            found = self.check()
        elif self.env_id in gym.registry and isinstance(
                gym.registry[self.env_id].entry_point, str):
            found = load_object(gym.registry[self.env_id].entry_point, "environment")
        else:
            return None
        return found if isinstance(found, type) and issubclass(found, Simulation) else None

    def check(self) -> type | None:
        """Raise ConfigError if the environment cannot be found; return the class for a
        ``module:ClassName`` id, None for a registered id or a multi-agent env. Cheap:
        nothing is constructed."""
        self._import_env_module()
        if load_factory(self.env_id) is not None:
            return None
        if ":" in self.env_id and self.env_id not in gym.registry:
            return load_object(self.env_id, "environment", "module:ClassName")
        if self.env_id not in gym.registry:
            close = difflib.get_close_matches(self.env_id, list(gym.registry), n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"unknown environment id {self.env_id!r}.{hint} Give a registered gymnasium id, "
                f"'module:ClassName' for your own class, or --env-module PACKAGE to import the "
                f"package that registers it."
                + (f" Atari games are ALE/Name-v5 ids, with {INSTALL_HINT}."
                   if "ALE" in self.env_id or "NoFrameskip" in self.env_id else "")
            )
        return None

    def _import_env_module(self) -> None:
        register_ale(self.env_id)
        if self.env_module:
            try:
                importlib.import_module(self.env_module)
            except ImportError as error:
                raise ConfigError(f"--env-module {self.env_module!r} could not be imported: "
                                  f"{error}") from None

    def spaces(self) -> tuple[gym.Space, gym.Space]:
        """The env's observation and action spaces. An env is built for them once per spec:
        the request's checks, the model check and the driver's setup all ask (an Atari env
        loads its ROM each time)."""
        cached = self.__dict__.get("_spaces")
        if cached is None:
            env = self.make()
            try:
                cached = (env.observation_space, env.action_space)
            finally:
                env.close()
            object.__setattr__(self, "_spaces", cached)  # not a field: equality ignores it
        return cached


def env_spec_for(env_id: str, env_module: str | None, config: Mapping[str, Any]) -> EnvSpec:
    """The EnvSpec of a run whose config values are ``config`` (a dict, as params.json and
    manifests hold them; keys it lacks take their defaults): its ``env_config``, and for an
    Atari game its preprocessing and reward clipping. ConfigError if the env cannot be found
    or the settings do not fit it."""
    spec = EnvSpec(env_id, env_module, dict(config.get("env_config") or {}))
    spec.check()
    atari = is_atari(env_id)
    settings = AtariSettings.from_config(config)
    if settings.backend == "envpool":
        if not atari:
            raise ConfigError(f'env_backend "envpool" runs Atari games only; {env_id!r} is not '
                              f'one. Leave env_backend at "gymnasium".')
        check_envpool(env_id)
    clip = config.get("clip_rewards", "auto")
    return dataclasses.replace(spec, atari=settings if atari else None,
                               clip_rewards=atari if clip == "auto" else bool(clip))


@dataclass(frozen=True, kw_only=True)
class EnvWorkerSettings:
    """What every worker that steps environments on a rollout rank is built from; the rollout,
    perturbation and multi-agent rollout workers' settings add what each uses besides."""

    env: EnvSpec
    """The environment its ``num_envs`` sub-envs are made from."""
    num_envs: int
    seed: int
    """The run's seed; rollout worker i seeds its envs and draws from ``seed + 1000 * i``."""
    torch_threads: int = 1
    max_env_failures: int = 10
    """Failures of one sub-env within ``env_failure_window`` of its steps that end the run."""
    env_failure_window: int = 1_000
    ranks_per_env: int = 0
    """Ranks of each env instance (an env group on ranks of its own); 0: in-process envs."""
    env_step_timeout_s: float = 120.0
    """Longest wait for an env group's reply."""

    @staticmethod
    def config_values(config: Any) -> dict[str, Any]:
        """The values of the fields above (but ``env``) in a run's config."""
        return {"num_envs": config.num_envs_per_worker, "seed": config.seed,
                "torch_threads": config.torch_threads,
                "max_env_failures": config.max_env_failures,
                "env_failure_window": config.env_failure_window,
                "ranks_per_env": config.ranks_per_env,
                "env_step_timeout_s": config.env_step_timeout_s}
