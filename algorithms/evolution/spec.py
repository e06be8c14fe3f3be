"""ES's and ARS's policy without torch: its spec, and its forward pass for many weight vectors at
once in NumPy.

Rollout ranks of ES and ARS import only this and the update rules (``update_rules``): for vector
observations they never load torch (about 60 MB a rank instead of about 300). The torch
``DirectPolicy`` (``network``) serves the driver, image observations and anything
``numpy_unsupported`` names; both take the same flat weight vector. Nothing here crosses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import gymnasium as gym
import numpy as np

from mpirl.models.numpy_policy import ACTIVATIONS
from mpirl.models.spaces import ModelOptions, has_image, is_image


@dataclass(frozen=True)
class DirectPolicySpec:
    """A deterministic policy from observations to actions; ``hidden_sizes`` () is linear (ARS)."""

    #: Its torch module, which ``build_torch_model`` loads (this module stays torch-free).
    NETWORK: ClassVar[str] = "mpirl.algorithms.evolution.network:DirectPolicy"

    observation_space: gym.Space
    action_space: gym.Space
    hidden_sizes: tuple[int, ...] = (32,)
    activation: str = "tanh"
    model: ModelOptions = field(default_factory=ModelOptions)


def numpy_unsupported(spec: DirectPolicySpec) -> str | None:
    """Why ``spec``'s policy needs torch, or None when ``NumpyDirectPolicy`` can run it: flat
    Box observations through dense layers, Discrete or Box actions."""
    obs, act = spec.observation_space, spec.action_space
    if is_image(obs) or has_image(obs):
        return "image observations go through a CNN"
    if not isinstance(obs, gym.spaces.Box):
        return f"observation space {obs}"
    if spec.activation not in ACTIVATIONS:
        return f"activation {spec.activation!r}"
    if not isinstance(act, gym.spaces.Discrete | gym.spaces.Box):
        return f"action space {act}"
    return None


class NumpyDirectPolicy:
    """``DirectPolicy.population_outputs`` and ``to_actions`` in NumPy, for the specs
    ``numpy_unsupported`` accepts. Weights come as the torch module's flat vector: each layer's
    weight ``[out, in]``, then its bias."""

    def __init__(self, spec: DirectPolicySpec) -> None:
        reason = numpy_unsupported(spec)
        if reason is not None:
            raise ValueError(f"NumpyDirectPolicy cannot run this policy: {reason}")
        self.spec = spec
        act = spec.action_space
        self.kind = "discrete" if isinstance(act, gym.spaces.Discrete) else "box"
        out = int(act.n) if self.kind == "discrete" else int(np.prod(act.shape))
        self.obs_dim = int(np.prod(spec.observation_space.shape))
        sizes = [self.obs_dim, *spec.hidden_sizes, out]
        self.layers = list(zip(sizes[:-1], sizes[1:], strict=True))  # (in, out) of each
        self.activation = ACTIVATIONS[spec.activation]
        self.weights = np.zeros(self.num_weights(), np.float32)

    def num_weights(self) -> int:
        return sum(out * inp + out for inp, out in self.layers)

    def set_flat_weights(self, flat: np.ndarray) -> None:
        """The unperturbed weights (the torch module's ``get_flat_weights()`` order)."""
        flat = np.array(flat, dtype=np.float32)
        if flat.size != self.num_weights():
            raise ValueError(f"weight vector has {flat.size} values, the policy has "
                             f"{self.num_weights()}")
        self.weights = flat

    def get_flat_weights(self) -> np.ndarray:
        return self.weights.copy()

    def population_outputs(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Outputs ``[K, out]`` of K weight vectors ``params [K, P]``, each on its own
        observation ``x [K, ...]``: one batched matmul per layer, in float32."""
        k, offset = params.shape[0], 0
        h = np.asarray(x, np.float32).reshape(len(x), -1)
        for i, (inp, out) in enumerate(self.layers):
            weight = params[:, offset:offset + out * inp].reshape(k, out, inp)
            offset += out * inp
            bias = params[:, offset:offset + out]
            offset += out
            h = np.matmul(weight, h[:, :, None])[:, :, 0] + bias
            if i < len(self.layers) - 1:
                h = self.activation(h)
        return h

    def to_actions(self, outputs: np.ndarray) -> np.ndarray:
        """Outputs ``[B, out]`` as env actions (argmax, or clipped to the bounds)."""
        return direct_actions(self.spec.action_space, outputs)


def direct_actions(space: gym.Space, outputs: np.ndarray) -> np.ndarray:
    """A direct policy's outputs ``[B, out]`` as env actions: argmax for Discrete, clipped to
    the bounds for Box."""
    if isinstance(space, gym.spaces.Discrete):
        return outputs.argmax(-1)
    return np.clip(outputs, space.low.ravel(), space.high.ravel()).reshape(-1, *space.shape)
