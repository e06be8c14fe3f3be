"""Small environments that each need one part of the model catalog, and that a policy without it
cannot solve: pixels (a CNN), a Dict of an image and a Discrete cue, MultiDiscrete actions, and a
cue to remember (a recurrent policy). They train in seconds, for tests and for trying a model.

Use them as ``--env mpirl.envs.probes:PixelTarget`` and so on.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class PixelTarget(gym.Env):
    """Reach the target on a ``size`` x ``size`` grid seen only as an RGB image (uint8, HWC, each
    cell ``cell`` pixels a side): the agent is red, the target green. Actions: up, down, left,
    right. Reward 1 on reaching the target (the episode ends), 0 otherwise; episodes are cut at
    ``max_steps``. Optimal return 1; a uniformly random policy reaches the target in about a
    third of the episodes on the default 5 x 5 grid."""

    MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))

    def __init__(self, size: int = 5, cell: int = 2, max_steps: int = 12) -> None:
        self.size, self.cell, self.max_steps = size, cell, max_steps
        side = size * cell
        self.observation_space = gym.spaces.Box(0, 255, (side, side, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self.agent = self.target = (0, 0)
        self.t = 0

    def _obs(self) -> np.ndarray:
        image = np.zeros(self.observation_space.shape, np.uint8)
        for (row, col), channel in ((self.agent, 0), (self.target, 1)):
            image[row * self.cell:(row + 1) * self.cell,
                  col * self.cell:(col + 1) * self.cell, channel] = 255
        return image

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        cells = self.np_random.choice(self.size * self.size, 2, replace=False)
        self.agent, self.target = (tuple(divmod(int(c), self.size)) for c in cells)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        dr, dc = self.MOVES[int(action)]
        self.agent = (min(max(self.agent[0] + dr, 0), self.size - 1),
                      min(max(self.agent[1] + dc, 0), self.size - 1))
        self.t += 1
        reached = self.agent == self.target
        return self._obs(), float(reached), reached, self.t >= self.max_steps and not reached, {}


class DictCue(gym.Env):
    """Dict observations: ``view``, a uint8 image with one lit column, and ``flip``, a Discrete(2)
    cue. The right action is the lit column, or its mirror image when ``flip`` is 1, so neither
    part alone is enough. Reward 1 per right action; ``length`` independent steps an episode.
    Optimal return ``length``; chance ``length / width``."""

    def __init__(self, width: int = 4, length: int = 10) -> None:
        self.width, self.length = width, length
        self.observation_space = gym.spaces.Dict({
            "view": gym.spaces.Box(0, 255, (width, width, 1), np.uint8),
            "flip": gym.spaces.Discrete(2)})
        self.action_space = gym.spaces.Discrete(width)
        self.column = self.flip = self.t = 0

    def _obs(self) -> dict[str, Any]:
        self.column = int(self.np_random.integers(self.width))
        self.flip = int(self.np_random.integers(2))
        view = np.zeros((self.width, self.width, 1), np.uint8)
        view[:, self.column] = 255
        return {"view": view, "flip": self.flip}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        right = self.width - 1 - self.column if self.flip else self.column
        reward = float(int(action) == right)
        self.t += 1
        return self._obs(), reward, self.t >= self.length, False, {}


class MultiDiscreteMatch(gym.Env):
    """MultiDiscrete actions: the observation shows ``len(nvec)`` digits (each scaled to [0, 1]),
    and each action component earns 1 for naming its digit. ``length`` steps an episode.
    Optimal return ``length * len(nvec)``; chance ``length * sum(1 / n)``."""

    def __init__(self, nvec: tuple[int, ...] = (3, 4), length: int = 10) -> None:
        self.nvec = np.asarray(nvec, np.int64)
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, (len(nvec),), np.float32)
        self.action_space = gym.spaces.MultiDiscrete(self.nvec)
        self.digits = np.zeros(len(nvec), np.int64)
        self.t = 0

    def _obs(self) -> np.ndarray:
        self.digits = self.np_random.integers(0, self.nvec)
        return (self.digits / np.maximum(self.nvec - 1, 1)).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float((np.asarray(action).reshape(-1) == self.digits).sum())
        self.t += 1
        return self._obs(), reward, self.t >= self.length, False, {}


class RecallCue(gym.Env):
    """Memory: the first observation shows a cue (one of ``cues``, one-hot); after ``delay``
    blank steps the agent must name it. Reward 1 for the right answer on the last step, nothing
    before; the actions before then do nothing. A memoryless policy sees the same blank
    observation at the answer whatever the cue was, so it earns ``1 / cues`` on average; a
    recurrent one can earn 1. The last element of the observation marks the answer step."""

    def __init__(self, cues: int = 2, delay: int = 5) -> None:
        self.cues, self.delay = cues, delay
        self.observation_space = gym.spaces.Box(0.0, 1.0, (cues + 1,), np.float32)
        self.action_space = gym.spaces.Discrete(cues)
        self.cue = self.t = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.cues + 1, np.float32)
        if self.t == 0:
            obs[self.cue] = 1.0
        if self.t == self.delay:
            obs[-1] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.cue = int(self.np_random.integers(self.cues))
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        answered = self.t == self.delay
        reward = float(answered and int(action) == self.cue)
        self.t += 1
        return self._obs(), reward, answered, False, {}
