"""The Q network's spec and its forward pass in NumPy, for rollout ranks that only act: no torch.

``QSpec`` is what every rank needs to build the same Q network;
``mpirl.models.torch_model.build_torch_model(spec)`` makes the torch ``QNetwork`` that its
``NETWORK`` names (DQN's and Ape-X's, ``mpirl.algorithms.q_learning.network``).
``NumpyQPolicy(spec)`` takes that network's flat float32 weights (the same parameter order)
and gives the same greedy and epsilon-greedy actions, for vector and Discrete observations
through dense layers. Images, custom models and other
activations need torch: ``numpy_unsupported`` says why. Nothing here crosses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from mpirl.models.numpy_policy import ACTIVATIONS, FlatNumpyModel
from mpirl.models.spaces import ModelOptions, has_image, head_sizes, is_image

__all__ = ["QSpec"]


@dataclass(frozen=True)
class QSpec:
    """What every rank needs to build the same Q network."""

    #: Its torch module, which ``build_torch_model`` loads (this module stays torch-free).
    NETWORK: ClassVar[str] = "mpirl.algorithms.q_learning.network:QNetwork"

    observation_space: gym.Space
    action_space: gym.Space
    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: str = "relu"
    dueling: bool = True
    model: ModelOptions = field(default_factory=ModelOptions)


def numpy_unsupported(spec: QSpec) -> str | None:
    """Why ``spec``'s Q network needs torch to act, or None when ``NumpyQPolicy`` can run it."""
    if spec.model.custom_model:
        return "a custom_model is a torch module"
    obs = spec.observation_space
    if is_image(obs) or has_image(obs):
        return "image observations go through a CNN"
    if not isinstance(obs, gym.spaces.Box | gym.spaces.Discrete):
        return f"observation space {obs}"
    if spec.activation not in ACTIVATIONS:
        return f"activation {spec.activation!r}"
    if not isinstance(spec.action_space, gym.spaces.Discrete):
        return f"action space {spec.action_space}"
    return None


class NumpyQPolicy(FlatNumpyModel):
    """``QNetwork.act`` and ``explore`` without torch, for the specs ``numpy_unsupported``
    accepts."""

    WHAT = "Q network"

    def __init__(self, spec: QSpec) -> None:
        reason = numpy_unsupported(spec)
        if reason is not None:
            raise ValueError(f"NumpyQPolicy cannot run this Q network: {reason}")
        self.spec = spec
        obs = spec.observation_space
        self._set_inputs(obs)
        self.num_actions = int(spec.action_space.n)
        self.activation = ACTIVATIONS[spec.activation]
        hidden = list(head_sizes(obs, spec.model, spec.hidden_sizes))
        # QNetwork's parameter order: the body's layers (every one followed by the
        # activation), then the advantage head, then the value head (dueling).
        sizes = [self.in_dim, *hidden]
        self.body = len(hidden)
        shapes: list[tuple[str, tuple[int, ...]]] = []
        for i in range(self.body):
            shapes += [(f"body.{i}.weight", (sizes[i + 1], sizes[i])),
                       (f"body.{i}.bias", (sizes[i + 1],))]
        width = sizes[-1]
        shapes += [("advantage.weight", (self.num_actions, width)),
                   ("advantage.bias", (self.num_actions,))]
        if spec.dueling:
            shapes += [("value.weight", (1, width)), ("value.bias", (1,))]
        self._set_shapes(shapes)

    def q_values(self, obs: Any) -> np.ndarray:
        """Q values ``[B, n]`` of a batch of observations."""
        x, p = self._features(obs), self.params
        for i in range(self.body):
            x = self.activation(x @ p[f"body.{i}.weight"].T + p[f"body.{i}.bias"])
        advantage = x @ p["advantage.weight"].T + p["advantage.bias"]
        if not self.spec.dueling:
            return advantage
        value = x @ p["value.weight"].T + p["value.bias"]
        return value + advantage - advantage.mean(-1, keepdims=True)

    def act(self, obs: Any, deterministic: bool = True):
        """Greedy actions, as ``QNetwork.act`` returns them: ``(actions, log_probs, values)``."""
        q = self.q_values(obs)
        return q.argmax(-1), np.zeros(len(q), np.float32), q.max(-1)

    def explore(self, obs: Any, epsilon: float, rng: np.random.Generator) -> np.ndarray:
        """Epsilon-greedy actions for a batch of observations (the draws QNetwork makes)."""
        greedy = self.act(obs)[0]
        random = rng.integers(0, self.num_actions, len(greedy))
        return np.where(rng.random(len(greedy)) < epsilon, random, greedy)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        return actions
