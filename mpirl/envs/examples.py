"""Small multi-agent envs with PettingZoo's Parallel API, and a scripted policy.

* ``MultiAgentCartPole``: ``num_agents`` independent CartPole-v1 copies, one per agent; an agent
  leaves when its pole falls (or at 500 steps), and the episode ends when all have left.
* ``MixedAgents``: two agents with different spaces that come and go: ``picker`` (Discrete
  actions, one-hot target) plays steps 0-19; ``steerer`` (a Box action that should match a
  number it sees) joins at step 3 and is truncated at step 15.
* ``NumberDuel``: a symmetric zero-sum game for self-play (the higher number wins a round).
* ``BeatLastMove``: a scripted rock-paper-scissors policy that plays what beats its opponent's
  last move (PettingZoo's ``rps_v2`` observation).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class MultiAgentCartPole:
    """``num_agents`` CartPole-v1 copies stepped together; agent ``cart_i`` drives copy i."""

    metadata = {"name": "multi_cartpole", "is_parallelizable": True}

    def __init__(self, num_agents: int = 2) -> None:
        self.possible_agents = [f"cart_{i}" for i in range(num_agents)]
        self.agents: list[str] = []
        self._envs = {a: gym.make("CartPole-v1") for a in self.possible_agents}

    def observation_space(self, agent: str) -> gym.Space:
        return self._envs[agent].observation_space

    def action_space(self, agent: str) -> gym.Space:
        return self._envs[agent].action_space

    def reset(self, seed: int | None = None, options: dict | None = None):
        self.agents = list(self.possible_agents)
        obs = {}
        for i, agent in enumerate(self.possible_agents):
            obs[agent], _ = self._envs[agent].reset(seed=None if seed is None else seed + i)
        self._last = dict(obs)
        return obs, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]):
        obs, rewards, terminations, truncations, infos = {}, {}, {}, {}, {}
        for agent in self.agents:
            o, r, term, trunc, _ = self._envs[agent].step(int(actions[agent]))
            obs[agent], rewards[agent] = o, float(r)
            terminations[agent], truncations[agent], infos[agent] = term, trunc, {}
            self._last[agent] = o
        self.agents = [a for a in self.agents if not (terminations[a] or truncations[a])]
        return obs, rewards, terminations, truncations, infos

    def state(self) -> np.ndarray:
        return np.concatenate([self._last[a] for a in self.possible_agents]).astype(np.float32)

    def close(self) -> None:
        for env in self._envs.values():
            env.close()


class FourAgentCartPole(MultiAgentCartPole):
    """``MultiAgentCartPole`` with four agents."""

    def __init__(self) -> None:
        super().__init__(num_agents=4)


class MixedAgents:
    """Two agents with different spaces that join and leave at different steps."""

    metadata = {"name": "mixed_agents", "is_parallelizable": True}
    LENGTH, JOIN, LEAVE = 20, 3, 15

    def __init__(self) -> None:
        self.possible_agents = ["picker", "steerer"]
        self.agents: list[str] = []
        self._spaces = {
            "picker": (gym.spaces.Box(0.0, 1.0, (3,), np.float32), gym.spaces.Discrete(3)),
            "steerer": (gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
                        gym.spaces.Box(-1.0, 1.0, (1,), np.float32)),
        }
        self.rng = np.random.default_rng()

    def observation_space(self, agent: str) -> gym.Space:
        return self._spaces[agent][0]

    def action_space(self, agent: str) -> gym.Space:
        return self._spaces[agent][1]

    def _observe(self) -> dict[str, np.ndarray]:
        obs = {}
        if "picker" in self.agents:
            self.target = int(self.rng.integers(3))
            obs["picker"] = np.eye(3, dtype=np.float32)[self.target]
        if "steerer" in self.agents:
            self.goal = float(self.rng.uniform(-0.8, 0.8))
            obs["steerer"] = np.array([self.goal, 1.0], np.float32)
        return obs

    def reset(self, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.t = 0
        self.agents = ["picker"]
        return self._observe(), {"picker": {}}

    def step(self, actions: dict[str, Any]):
        rewards, terminations, truncations, infos = {}, {}, {}, {}
        if "picker" in self.agents:
            rewards["picker"] = 1.0 if int(actions["picker"]) == self.target else 0.0
        if "steerer" in self.agents:
            action = float(np.asarray(actions["steerer"]).reshape(-1)[0])
            rewards["steerer"] = -abs(action - self.goal)
        self.t += 1
        acting = list(self.agents)
        for agent in acting:
            terminations[agent] = agent == "picker" and self.t >= self.LENGTH
            truncations[agent] = agent == "steerer" and self.t >= self.LEAVE
            infos[agent] = {"t": self.t}
        self.agents = [a for a in acting if not (terminations[a] or truncations[a])]
        if self.t == self.JOIN:
            self.agents.append("steerer")
            infos["steerer"] = {"t": self.t}
        obs = self._observe()
        # Agents that just left still get a last observation, as PettingZoo envs give.
        for agent in acting:
            if agent not in obs:
                obs[agent] = np.zeros(self._spaces[agent][0].shape, np.float32)
        return obs, rewards, terminations, truncations, infos

    def state(self) -> np.ndarray:
        return np.array([self.t / self.LENGTH], np.float32)

    def close(self) -> None:
        pass


class NumberDuel:
    """A symmetric zero-sum game for self-play: for ``ROUNDS`` rounds both players pick a
    number from 0 to 4; the higher wins the round (+1, the other -1), a tie scores 0. Each sees
    the opponent's last pick and the round. Always 4 is the best answer to everything."""

    metadata = {"name": "number_duel", "is_parallelizable": True}
    ROUNDS = 10

    def __init__(self) -> None:
        self.possible_agents = ["first", "second"]
        self.agents: list[str] = []
        self._obs_space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
        self._action_space = gym.spaces.Discrete(5)

    def observation_space(self, agent: str) -> gym.Space:
        return self._obs_space

    def action_space(self, agent: str) -> gym.Space:
        return self._action_space

    def reset(self, seed: int | None = None, options: dict | None = None):
        self.t = 0
        self.agents = list(self.possible_agents)
        start = np.zeros(2, np.float32)
        return {a: start for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]):
        a, b = int(actions["first"]), int(actions["second"])
        score = float(np.sign(a - b))
        self.t += 1
        done = self.t >= self.ROUNDS
        obs = {"first": np.array([b / 4, self.t / self.ROUNDS], np.float32),
               "second": np.array([a / 4, self.t / self.ROUNDS], np.float32)}
        rewards = {"first": score, "second": -score}
        flags = {agent: done for agent in self.agents}
        if done:
            self.agents = []
        return obs, rewards, flags, dict.fromkeys(flags, False), {a: {} for a in flags}

    def close(self) -> None:
        pass


class BeatLastMove:
    """Plays what beats the opponent's last move in ``rps_v2`` (observation: 0 rock, 1 paper,
    2 scissors, 3 none yet); a random move before the first."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 config: dict[str, Any] | None = None) -> None:
        self.rng = np.random.default_rng((config or {}).get("seed", 0))

    def compute_actions(self, obs: np.ndarray) -> np.ndarray:
        last = np.asarray(obs).reshape(len(obs), -1)[:, 0].astype(np.int64)
        random = self.rng.integers(3, size=len(last))
        return np.where(last < 3, (last + 1) % 3, random)
