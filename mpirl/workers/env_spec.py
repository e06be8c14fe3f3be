"""What an environment is (a gymnasium id or module:Class, with kwargs); sent from the driver to
every rollout rank, which builds its envs."""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from mpirl.envs.parallel import load_factory, make_parallel
from mpirl.errors import ConfigError
from mpirl.models.encoders import flatten_structured


@dataclass(frozen=True)
class EnvSpec:
    """How to make the environment on any rank."""

    env_id: str
    """A registered gymnasium id, or ``module:ClassName`` for a class to instantiate."""
    env_module: str | None = None
    """A module to import first, for ids registered by a third-party package."""
    env_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's constructor."""

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
        cls = self.check()
        env = cls(**self.env_config) if cls is not None else gym.make(self.env_id,
                                                                      **self.env_config)
        # Dict and Tuple observations travel as one vector; the model cuts it apart again.
        return flatten_structured(env)

    def check(self) -> type | None:
        """Raise ConfigError if the environment cannot be found; return the class for a
        ``module:ClassName`` id, None for a registered id or a multi-agent env. Cheap:
        nothing is constructed."""
        self._import_env_module()
        if load_factory(self.env_id) is not None:
            return None
        if ":" in self.env_id and self.env_id not in gym.registry:
            module_name, _, class_name = self.env_id.partition(":")
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError) as error:
                raise ConfigError(f"environment {self.env_id!r}: cannot load {class_name} from "
                                  f"module {module_name}: {error}") from None
            return cls
        if self.env_id not in gym.registry:
            close = difflib.get_close_matches(self.env_id, list(gym.registry), n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"unknown environment id {self.env_id!r}.{hint} Give a registered gymnasium id, "
                f"'module:ClassName' for your own class, or --env-module PACKAGE to import the "
                f"package that registers it."
            )
        return None

    def _import_env_module(self) -> None:
        if self.env_module:
            try:
                importlib.import_module(self.env_module)
            except ImportError as error:
                raise ConfigError(f"--env-module {self.env_module!r} could not be imported: "
                                  f"{error}") from None

    def spaces(self) -> tuple[gym.Space, gym.Space]:
        env = self.make()
        try:
            return env.observation_space, env.action_space
        finally:
            env.close()
