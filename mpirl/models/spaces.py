"""Spaces and model options, without torch: what every rank needs to know about observations and
the model keys before (or instead of) building a torch model. The rollout ranks' NumPy policy and
the env wrappers use this module; ``mpirl.models.encoders`` builds the torch encoders on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.config.fields import CommonConfig
from mpirl.errors import ConfigError

__all__ = ["ModelOptions", "has_image", "is_image"]

ENCODERS = ("auto", "mlp", "nature_cnn", "impala_cnn", "small_cnn")
#: Images at least this many pixels a side get the Nature CNN by default (its first layer is an
#: 8x8 stride-4 convolution, and three layers need 36 pixels to leave one).
NATURE_MIN_SIZE = 36


@dataclass(frozen=True)
class ModelOptions:
    """The model keys every algorithm's config has, as the model builders take them."""

    encoder: str = "auto"
    cnn_dense_size: int = 512
    custom_model: str = ""
    custom_model_config: Mapping[str, Any] = field(default_factory=dict)
    use_lstm: bool = False
    lstm_cell_size: int = 64
    max_seq_len: int = 20

    def __hash__(self) -> int:  # the config dict is not hashable; the class path identifies it
        return hash((self.encoder, self.cnn_dense_size, self.custom_model, self.use_lstm,
                     self.lstm_cell_size, self.max_seq_len))


def model_options(config: CommonConfig) -> ModelOptions:
    """The ModelOptions of an algorithm config (its model keys, which every config has)."""
    return ModelOptions(config.encoder, config.cnn_dense_size, config.custom_model,
                        dict(config.custom_model_config or {}), bool(config.use_lstm),
                        int(config.lstm_cell_size), int(config.max_seq_len))


# Structured (Dict and Tuple) observations.

_INTEGRAL = (gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)


def _leaves(space: gym.Space) -> list[gym.Space]:
    if isinstance(space, gym.spaces.Dict):
        return [leaf for sub in space.spaces.values() for leaf in _leaves(sub)]
    if isinstance(space, gym.spaces.Tuple):
        return [leaf for sub in space.spaces for leaf in _leaves(sub)]
    return [space]


class StructuredBox(gym.spaces.Box):
    """A Dict or Tuple space flattened into one vector (gymnasium's ``flatten`` order), with the
    original in ``structure`` so that the encoder can cut it apart again. uint8 when every
    component is a uint8 Box or integral (Discrete, MultiDiscrete, MultiBinary become one-hot or
    0/1), so images inside a Dict travel as bytes; float32 otherwise."""

    def __init__(self, structure: gym.Space) -> None:
        leaves = _leaves(structure)
        unsupported = [leaf for leaf in leaves
                       if not isinstance(leaf, (gym.spaces.Box, *_INTEGRAL))]
        if unsupported:
            raise ConfigError(f"observation space component {unsupported[0]} is not supported; "
                              f"Dict and Tuple observations may hold Box, Discrete, "
                              f"MultiDiscrete and MultiBinary spaces")
        small = all(isinstance(leaf, _INTEGRAL) or leaf.dtype == np.uint8 for leaf in leaves)
        dtype = np.uint8 if small else np.float32
        flat = gym.spaces.flatten_space(structure)
        info = np.iinfo(dtype) if small else np.finfo(dtype)
        super().__init__(np.clip(flat.low, info.min, info.max).astype(dtype),
                         np.clip(flat.high, info.min, info.max).astype(dtype), flat.shape, dtype)
        self.structure = structure

    def flatten(self, obs: Any) -> np.ndarray:
        return gym.spaces.flatten(self.structure, obs).astype(self.dtype, copy=False)

    def __repr__(self) -> str:
        return f"StructuredBox({self.structure})"


class FlattenStructuredObservation(gym.ObservationWrapper):
    """Dict and Tuple observations as one ``StructuredBox`` vector, so that batches, replay and
    dumps handle them as any Box; the model cuts them apart again."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = StructuredBox(env.observation_space)

    def observation(self, observation: Any) -> np.ndarray:
        return self.observation_space.flatten(observation)


def flatten_structured(env: gym.Env) -> gym.Env:
    """``env`` with its Dict or Tuple observations flattened; other envs unchanged."""
    if isinstance(env.observation_space, gym.spaces.Dict | gym.spaces.Tuple):
        return FlattenStructuredObservation(env)
    return env


# Images.

def is_image(space: gym.Space) -> bool:
    return isinstance(space, gym.spaces.Box) and len(space.shape) == 3 \
        and not isinstance(space, StructuredBox)


def channels_first(shape: tuple[int, ...]) -> bool:
    """CHW when the first axis is the smallest and the last is not (frame stacks such as Atari's
    (4, 84, 84)); HWC otherwise, gymnasium's convention for rendered frames."""
    return shape[0] < shape[-1] and shape[0] <= min(shape[1], shape[2])


def has_image(space: gym.Space) -> bool:
    """True when some component of ``space`` is an image (so an encoder ends in a dense layer)."""
    if isinstance(space, StructuredBox):
        return any(is_image(leaf) for leaf in _leaves(space.structure))
    return is_image(space)


def head_sizes(space: gym.Space, options: ModelOptions, hidden: tuple[int, ...]
               ) -> tuple[int, ...]:
    """Hidden widths of the heads after the encoder: ``hidden_sizes`` for vectors and structured
    observations; none after a lone image's CNN, whose dense layer is the hidden layer."""
    if is_image(space) and options.encoder != "mlp":
        return ()
    return tuple(hidden)


# Actions.


def action_layout(space: gym.Space) -> tuple[str, list[int], int] | None:
    """How an actor-critic's head covers ``space``: ``(kind, nvec, outputs)`` with kind
    "discrete" (one categorical), "multi_discrete" (one per component; MultiBinary is one
    two-way categorical per bit) or "box" (a diagonal Gaussian); None for any other space."""
    if isinstance(space, gym.spaces.Discrete):
        return "discrete", [int(space.n)], int(space.n)
    if isinstance(space, gym.spaces.MultiDiscrete | gym.spaces.MultiBinary):
        nvec = ([2] * int(np.prod(space.shape)) if isinstance(space, gym.spaces.MultiBinary)
                else [int(n) for n in np.asarray(space.nvec).ravel()])
        return "multi_discrete", nvec, sum(nvec)
    if isinstance(space, gym.spaces.Box):
        return "box", [], int(np.prod(space.shape))
    return None


def env_actions(space: gym.Space, kind: str, actions: np.ndarray) -> np.ndarray:
    """Sampled actions as the env takes them: Box actions clipped to the bounds, MultiDiscrete
    and MultiBinary in the space's shape and dtype, Discrete as they are."""
    if kind == "box":
        return np.clip(actions, space.low, space.high).reshape(-1, *space.shape)
    if kind == "multi_discrete":
        return actions.reshape(-1, *space.shape).astype(space.dtype, copy=False)
    return actions
