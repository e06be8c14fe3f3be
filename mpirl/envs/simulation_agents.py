"""A multi-agent view of one simulation: each actuator (each component of a Box action) is an
agent, and the agents share one simulation instance.

    mpirl train --algo PPO --env mpirl.envs.simulation_agents:SimulationAgents \\
        --config '{"env_config": {"simulation": "mpirl/ReactionDiffusion-v0", "max_steps": 50}}'

``SimulationAgents`` has PettingZoo's Parallel API, so multi-agent runs (policy mapping,
composition, self-play keys) treat it as any multi-agent env. Agent ``actuator_i`` observes the
simulation's whole observation followed by a one-hot of i (so one shared policy can tell the
actuators apart), acts with component i of the action (a Box of one), and gets the simulation's
reward: the agents cooperate. ``state()`` is the simulation's observation. Every agent's episode
ends with the simulation's.

The simulation runs in the rollout process on ``MPI.COMM_SELF`` (k = 1): env groups
(``ranks_per_env`` >= 1) drive single-agent simulations only. Nothing crosses ranks.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from mpi4py import MPI

from mpirl.config.imports import load_object
from mpirl.envs.simulation import Simulation
from mpirl.errors import ConfigError

__all__ = ["SimulationAgents", "agent_name"]


def agent_name(index: int) -> str:
    """The id of the agent that drives action component ``index``."""
    return f"actuator_{index}"


def _simulation_class(name: str) -> type[Simulation]:
    """The Simulation subclass ``name`` names: a gymnasium id registered with one as its entry
    point (the bundled ones are), or ``module:Class``."""
    entry = gym.registry[name].entry_point if name in gym.registry else name
    found = load_object(entry, "env_config simulation", "module:Class") if isinstance(
        entry, str) and ":" in entry else entry
    if not (isinstance(found, type) and issubclass(found, Simulation)):
        raise ConfigError(f"SimulationAgents env_config simulation {name!r} is not an "
                          f"mpirl.Simulation (give a gymnasium id such as "
                          f"mpirl/ReactionDiffusion-v0, or module:Class of a Simulation)")
    return found


class SimulationAgents:
    """One ``Simulation`` (env_config ``simulation``: its id or ``module:Class``; the other
    keys are its own env_config) whose Box action is split among one agent per component."""

    metadata = {"name": "simulation_agents", "is_parallelizable": True}

    def __init__(self, simulation: str | type[Simulation] = "mpirl/ReactionDiffusion-v0",
                 **env_config: Any) -> None:
        cls = _simulation_class(simulation) if isinstance(simulation, str) else simulation
        self.simulation = cls(MPI.COMM_SELF, **env_config)
        space = self.simulation.action_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
            raise ConfigError(f"SimulationAgents gives each component of a simulation's Box "
                              f"action to an agent; {cls.__name__}'s action space is {space}. "
                              f"Train it as a single-agent env instead")
        self._action_space = space
        self.possible_agents = [agent_name(i) for i in range(space.shape[0])]
        self.agents: list[str] = []
        observed = self.simulation.observation_space
        n = len(self.possible_agents)
        low = np.concatenate([np.broadcast_to(observed.low, observed.shape), np.zeros(n)])
        high = np.concatenate([np.broadcast_to(observed.high, observed.shape), np.ones(n)])
        self._obs_space = gym.spaces.Box(low.astype(np.float32), high.astype(np.float32),
                                         dtype=np.float32)
        self._one_hot = np.eye(n, dtype=np.float32)
        self._last = np.zeros(observed.shape, np.float32)

    def observation_space(self, agent: str) -> gym.spaces.Box:
        return self._obs_space

    def action_space(self, agent: str) -> gym.spaces.Box:
        i = self.possible_agents.index(agent)
        low, high = self._action_space.low[i:i + 1], self._action_space.high[i:i + 1]
        return gym.spaces.Box(low, high, dtype=self._action_space.dtype)

    def _observations(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        self._last = np.asarray(obs, np.float32)
        return {agent: np.concatenate([self._last, self._one_hot[i]])
                for i, agent in enumerate(self.possible_agents)}

    def reset(self, seed: int | None = None, options: dict | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
        self.agents = list(self.possible_agents)
        return self._observations(self.simulation.reset(seed)), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        action = np.zeros(self._action_space.shape, self._action_space.dtype)
        for i, agent in enumerate(self.possible_agents):
            if agent in actions:
                action[i] = np.asarray(actions[agent]).reshape(-1)[0]
        obs, reward, terminated, truncated = self.simulation.step(action)
        observations = self._observations(obs)
        agents, self.agents = self.agents, ([] if terminated or truncated else self.agents)
        return ({a: observations[a] for a in agents}, dict.fromkeys(agents, float(reward)),
                dict.fromkeys(agents, bool(terminated)), dict.fromkeys(agents, bool(truncated)),
                {a: {} for a in agents})

    def state(self) -> np.ndarray:
        return self._last.copy()

    def close(self) -> None:
        self.simulation.close()
