"""Multi-agent environments: PettingZoo's Parallel API, as mpirl loads and checks them.

An env id names a multi-agent environment in one of three ways: ``module:Name`` where ``Name``
is a ParallelEnv class or a factory returning one; ``package.module`` for a module with
PettingZoo's ``parallel_env()`` (``mpe2.simple_spread_v3``); or either of those giving an AEC
env, converted with PettingZoo's own ``aec_to_parallel`` when the env says it may be
(``metadata["is_parallelizable"]``). The API is duck-typed, so mpirl's own envs need no
PettingZoo: ``possible_agents``, ``agents``, ``observation_space(agent)``,
``action_space(agent)``, ``reset(seed, options) -> (obs, infos)`` and ``step(actions) ->
(obs, rewards, terminations, truncations, infos)``, dicts keyed by agent id.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.config.imports import load_object
from mpirl.envs.simulation import Simulation
from mpirl.errors import ConfigError


def is_parallel_env(obj: Any) -> bool:
    """True for an object with PettingZoo's Parallel API."""
    return (hasattr(obj, "possible_agents") and callable(getattr(obj, "observation_space", None))
            and callable(getattr(obj, "step", None)) and not is_aec_env(obj))


def is_aec_env(obj: Any) -> bool:
    """True for a PettingZoo AEC env (one agent acts at a time). PettingZoo's wrappers hide
    ``agent_selection`` until reset, so the turn-taking methods tell."""
    return hasattr(obj, "possible_agents") and callable(getattr(obj, "agent_iter", None)) \
        and callable(getattr(obj, "last", None))


def load_factory(env_id: str) -> Callable[..., Any] | None:
    """What builds the multi-agent env ``env_id`` names, or None when it names no multi-agent
    env (a gymnasium id or class). Imports, but constructs nothing."""
    if env_id in gym.registry:
        return None
    if ":" in env_id:
        try:
            target = load_object(env_id, "environment")
        except ConfigError:
            return None  # EnvSpec.check reports it
        if inspect.isclass(target) and issubclass(target, (gym.Env, Simulation)):
            return None
        return target
    try:
        module = importlib.import_module(env_id)
    except ImportError:
        return None
    for name in ("parallel_env", "env"):
        if callable(getattr(module, name, None)):
            return getattr(module, name)
    raise ConfigError(f"environment module {env_id!r} has no parallel_env() (nor env()): a "
                      f"PettingZoo environment module defines one; or give 'module:Name' for a "
                      f"ParallelEnv class or factory")


def make_parallel(env_id: str, factory: Callable[..., Any], env_config: dict[str, Any]) -> Any:
    """Build the env and return it with the Parallel API: an AEC env is converted with
    PettingZoo's ``aec_to_parallel`` where that is valid; anything else is a ConfigError."""
    env = factory(**env_config)
    if is_parallel_env(env):
        return env
    if is_aec_env(env):
        if not env.metadata.get("is_parallelizable", False):
            raise ConfigError(
                f"environment {env_id!r} is a PettingZoo AEC env that does not declare "
                f"metadata['is_parallelizable']: its agents act in turns that depend on each "
                f"other, so it cannot run as a Parallel env, and mpirl trains Parallel envs. "
                f"Wrap it in a ParallelEnv of your own that collects each turn's actions.")
        from pettingzoo.utils.conversions import aec_to_parallel

        return aec_to_parallel(env)
    if isinstance(env, gym.Env):
        raise ConfigError(f"environment {env_id!r} is a single-agent gymnasium env; give its "
                          f"class as module:ClassName without a multiagent config")
    raise ConfigError(
        f"environment {env_id!r} gave a {type(env).__name__}, which is neither a PettingZoo "
        f"ParallelEnv nor an AEC env (it needs possible_agents, observation_space(agent), "
        f"action_space(agent), reset() and step())")


def agent_spaces(env: Any) -> dict[str, tuple[gym.Space, gym.Space]]:
    """Every possible agent's (observation space, action space)."""
    return {agent: (env.observation_space(agent), env.action_space(agent))
            for agent in env.possible_agents}


def flat_size(space: gym.Space) -> int:
    """Floats an observation takes in a joint vector: a Box's values, a Discrete's one-hot."""
    if isinstance(space, gym.spaces.Discrete):
        return int(space.n)
    return int(np.prod(space.shape))


def with_last_action(observation_space: gym.Space, action_space: gym.Space) -> gym.spaces.Box:
    """What a policy with ``last_action_in_obs`` sees: its observation (one-hot when Discrete)
    followed by its agent's previous action (one-hot when Discrete, zeros before the first)."""
    for space in (observation_space, action_space):
        if not isinstance(space, gym.spaces.Box | gym.spaces.Discrete):
            raise ConfigError(f"last_action_in_obs takes Box and Discrete spaces, not {space}")
    size = flat_size(observation_space) + flat_size(action_space)
    return gym.spaces.Box(-np.inf, np.inf, (size,), np.float32)


def flatten_value(value: Any, space: gym.Space) -> np.ndarray:
    """A value of ``space`` as floats: one-hot for Discrete, flattened for Box; zeros for None."""
    out = np.zeros(flat_size(space), np.float32)
    if value is None:
        return out
    if isinstance(space, gym.spaces.Discrete):
        out[int(value) - int(space.start)] = 1.0
        return out
    return np.asarray(value, np.float32).reshape(-1)
