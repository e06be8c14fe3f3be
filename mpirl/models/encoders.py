"""The model catalog's encoders: observations to one feature vector, chosen from the space.

* Box of rank 3 (an image, HWC or CHW): a CNN. ``nature_cnn`` (Mnih et al. 2015) is the default
  for images of at least 36 pixels a side, ``small_cnn`` below that; ``impala_cnn`` (Espeholt et
  al. 2018's residual stack) on request. uint8 images are scaled to [0, 1] inside the model, so
  they cross ranks, sit in replay and in dumps as uint8.
* Box of any other rank: flattened (the MLP heads that follow do the work). Discrete: one-hot.
* Dict and Tuple: the env's observations are flattened into one vector on the rollout ranks
  (``StructuredBox``, ``FlattenStructuredObservation``); the encoder cuts it back into its
  components and encodes each as above (a CNN per image, one-hot for Discrete and MultiDiscrete,
  as gymnasium's flatten writes them), then concatenates.

Nothing here crosses ranks by itself: every rank builds the same encoder from the same spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from mpirl.config.imports import load_object
from mpirl.errors import ConfigError

# The torch-free part of the catalog; imported from here too, as before it moved.
from mpirl.models.spaces import ENCODERS as ENCODERS
from mpirl.models.spaces import NATURE_MIN_SIZE as NATURE_MIN_SIZE
from mpirl.models.spaces import FlattenStructuredObservation as FlattenStructuredObservation
from mpirl.models.spaces import ModelOptions as ModelOptions
from mpirl.models.spaces import StructuredBox as StructuredBox
from mpirl.models.spaces import channels_first as channels_first
from mpirl.models.spaces import flatten_structured as flatten_structured
from mpirl.models.spaces import has_image as has_image
from mpirl.models.spaces import head_sizes as head_sizes
from mpirl.models.spaces import is_image as is_image
from mpirl.models.spaces import model_options as model_options

__all__ = ["Encoder", "build_custom_model", "head_sizes", "model_options", "observation_tensor"]

# Image encoders.


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def _conv_stack(kind: str, channels: int) -> nn.Sequential:
    if kind == "nature_cnn":
        return nn.Sequential(nn.Conv2d(channels, 32, 8, 4), nn.ReLU(),
                             nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
    if kind == "small_cnn":
        return nn.Sequential(nn.Conv2d(channels, 16, 3, 1, padding=1), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, 2, padding=1), nn.ReLU(), nn.Flatten())
    layers: list[nn.Module] = []
    for depth in (16, 32, 32):  # impala_cnn
        layers += [nn.Conv2d(channels, depth, 3, padding=1), nn.MaxPool2d(3, 2, padding=1),
                   _Residual(depth), _Residual(depth)]
        channels = depth
    return nn.Sequential(*layers, nn.ReLU(), nn.Flatten())


class ImageEncoder(nn.Module):
    """A CNN over one image input ``[B, *shape]``, ending in ``dense`` ReLU units."""

    def __init__(self, space: gym.spaces.Box, kind: str, dense: int) -> None:
        super().__init__()
        shape = tuple(space.shape)
        self.shape = shape
        self.to_chw = not channels_first(shape)
        chw = (shape[2], shape[0], shape[1]) if self.to_chw else shape
        if kind == "auto":
            kind = "nature_cnn" if min(chw[1:]) >= NATURE_MIN_SIZE else "small_cnn"
        if kind == "nature_cnn" and min(chw[1:]) < NATURE_MIN_SIZE:
            raise ConfigError(f"encoder 'nature_cnn' needs images of at least {NATURE_MIN_SIZE} "
                              f"pixels a side; this observation is {shape}. Use 'small_cnn' or "
                              f"'impala_cnn'.")
        self.kind = kind
        # uint8 pixels are scaled here, on the learner's device, not on the wire.
        self.scale = 1.0 / 255.0 if space.dtype == np.uint8 else 1.0
        self.convs = _conv_stack(kind, chw[0])
        with torch.no_grad():
            width = self.convs(torch.zeros(1, *chw)).shape[1]
        self.dense = nn.Sequential(nn.Linear(width, dense), nn.ReLU())
        self.out_dim = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, *self.shape).float() * self.scale
        if self.to_chw:
            x = x.permute(0, 3, 1, 2)
        return self.dense(self.convs(x))


# The encoder of a whole observation space.

class Encoder(nn.Module):
    """Observations ``[B, ...]`` (NumPy or torch, any dtype) to float features ``[B, out_dim]``.

    ``parts`` cut a flat observation into components: (start, stop, image encoder or None);
    None passes the slice through as floats. A plain flat Box is one pass-through part, and
    such an encoder has no parameters (a Discrete observation is one-hot encoded first)."""

    def __init__(self, space: gym.Space, options: ModelOptions) -> None:
        super().__init__()
        if options.encoder not in ENCODERS:
            raise ConfigError(f"encoder must be one of {', '.join(ENCODERS)}, got "
                              f"{options.encoder!r}")
        self.space = space
        # Moves with .to() like the parameters, so that a parameter-free encoder knows its device.
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)
        self.one_hot = int(space.n) if isinstance(space, gym.spaces.Discrete) else 0
        if not isinstance(space, gym.spaces.Box | gym.spaces.Discrete):
            raise ConfigError(f"observation space {space} is not supported; mpirl models take "
                              f"Box (vectors and images), Discrete, Dict and Tuple observations")
        self.images = nn.ModuleList()
        self.parts: list[tuple[int, int, int]] = []  # (start, stop, image index or -1)
        if self.one_hot:
            self.in_dim = self.one_hot
            self.parts.append((0, self.one_hot, -1))
        elif isinstance(space, StructuredBox):
            self.in_dim = int(space.shape[0])
            self._cut(space.structure, 0, options)
        elif is_image(space) and options.encoder != "mlp":
            self.in_dim = int(np.prod(space.shape))
            self._add_image(space, options, 0)
        else:
            if options.encoder not in ("auto", "mlp"):
                raise ConfigError(f"encoder {options.encoder!r} is for image observations "
                                  f"(Box of rank 3); this one is {space}. Use 'auto' or 'mlp'.")
            self.in_dim = int(np.prod(space.shape))
            self.parts.append((0, self.in_dim, -1))
        self.out_dim = sum(self.images[i].out_dim if i >= 0 else stop - start
                           for start, stop, i in self.parts)
        # One slice that is the whole input needs no cutting (the common case: vectors).
        self.whole = len(self.parts) == 1 and self.parts[0][2] == -1

    def _add_image(self, space: gym.spaces.Box, options: ModelOptions, start: int) -> int:
        kind = "auto" if options.encoder == "mlp" else options.encoder
        self.images.append(ImageEncoder(space, kind, options.cnn_dense_size))
        stop = start + int(np.prod(space.shape))
        self.parts.append((start, stop, len(self.images) - 1))
        return stop

    def _cut(self, space: gym.Space, start: int, options: ModelOptions) -> int:
        if isinstance(space, gym.spaces.Dict):
            for sub in space.spaces.values():
                start = self._cut(sub, start, options)
            return start
        if isinstance(space, gym.spaces.Tuple):
            for sub in space.spaces:
                start = self._cut(sub, start, options)
            return start
        if is_image(space):
            return self._add_image(space, options, start)
        stop = start + gym.spaces.flatdim(space)
        self.parts.append((start, stop, -1))
        return stop

    def forward(self, obs: Any) -> torch.Tensor:
        device = self.device()
        if self.one_hot:
            index = torch.as_tensor(obs, device=device).long().view(-1)
            return nn.functional.one_hot(index, self.one_hot).float()
        x = torch.as_tensor(obs, device=device).reshape(-1, self.in_dim)
        if self.whole:
            return x.float()
        out = []
        for start, stop, i in self.parts:
            part = x[:, start:stop]
            out.append(part.float() if i < 0 else self.images[i](part))
        return torch.cat(out, -1) if len(out) > 1 else out[0]

    def device(self) -> torch.device:
        return self._anchor.device

# Custom models.

def load_model_class(path: str, key: str = "custom_model") -> type:
    """The class named by ``"module:Class"``; ConfigError if it cannot be loaded."""
    cls = load_object(path, key, "module:Class")
    if not callable(cls):
        raise ConfigError(f"{key} {path!r} is not a class")
    return cls


def build_custom_model(path: str, observation_space: gym.Space, action_space: gym.Space,
                       config: Mapping[str, Any], key: str = "custom_model") -> nn.Module:
    """``Class(observation_space, action_space, config)``, checked to be a torch Module with
    parameters."""
    cls = load_model_class(path, key)
    try:
        model = cls(observation_space, action_space, dict(config))
    except Exception as error:  # noqa: BLE001 - the user's constructor may raise anything
        raise ConfigError(f"{key} {path!r} could not be built: {type(error).__name__}: "
                          f"{error}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{key} {path!r} built a {type(model).__name__}, not a "
                          f"torch.nn.Module")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"{key} {path!r} has no parameters to train")
    return model


def observation_tensor(obs: Any, space: gym.Space, device: torch.device) -> torch.Tensor:
    """What a custom model's forward gets: the observations as float32 ``[B, *shape]``
    (Discrete: their indices as float32 ``[B]``; Dict and Tuple: the flattened vector)."""
    shape = () if isinstance(space, gym.spaces.Discrete) else tuple(space.shape)
    return torch.as_tensor(obs, device=device).reshape(-1, *shape).float()
