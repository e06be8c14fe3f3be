"""ES's and ARS's policy in torch: the deterministic policy evaluated for many weight vectors at
once, for the driver, image observations and what ``NumpyDirectPolicy`` cannot run.

Its spec and the NumPy forward pass live in ``spec`` (no torch), which names this module's
``DirectPolicy`` as its ``NETWORK``; ``build_torch_model`` builds it from there.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from mpirl.algorithms.evolution.spec import DirectPolicySpec, direct_actions
from torch import nn

from mpirl.errors import ConfigError
from mpirl.models.encoders import Encoder
from mpirl.models.policy import ACTIVATIONS, FlatParameters

__all__ = ["DirectPolicy"]


class DirectPolicy(FlatParameters):
    """An MLP (or a linear map) from the encoder's features to a Discrete action (argmax) or a
    Box action (clipped to the space's bounds). No value function, no distribution: ES and ARS
    score whole episodes. Vectors go in as they are; images through a CNN (the catalog's), whose
    weights are perturbed like the rest."""

    def __init__(self, spec: DirectPolicySpec) -> None:
        super().__init__()
        if spec.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                              f"got {spec.activation!r}")
        obs_space, act_space = spec.observation_space, spec.action_space
        if isinstance(act_space, gym.spaces.Discrete):
            self.kind, out = "discrete", int(act_space.n)
        elif isinstance(act_space, gym.spaces.Box):
            self.kind, out = "box", int(np.prod(act_space.shape))
        else:
            raise ConfigError(f"action space {act_space} is not supported by ES/ARS; they take "
                              f"Discrete and Box actions")
        self.spec = spec
        self.encoder = Encoder(obs_space, spec.model)
        self.obs_dim = self.encoder.out_dim
        # A CNN's population is evaluated through torch.func (vmap over weight vectors); the
        # vector case keeps its batched matmuls.
        self.functional = any(True for _ in self.encoder.parameters())
        sizes = [self.obs_dim, *spec.hidden_sizes, out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:],
                                                                     strict=False))
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=1.0 / np.sqrt(layer.in_features))
            nn.init.zeros_(layer.bias)
        self.layers[-1].weight.data.mul_(0.1)
        self.activation = ACTIVATIONS[spec.activation]()

    def population_outputs(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Outputs ``[K, out]`` of K weight vectors ``params [K, P]`` (in ``get_flat_weights``
        order), each on its own observation ``x [K, ...]``: one batched matmul per layer."""
        if self.functional:
            return self._population_functional(params, x)
        k, offset, h = params.shape[0], 0, x.float().reshape(len(x), -1).unsqueeze(-1)
        for i, layer in enumerate(self.layers):
            out, inp = layer.out_features, layer.in_features
            weight = params[:, offset:offset + out * inp].view(k, out, inp)
            offset += out * inp
            bias = params[:, offset:offset + out].view(k, out, 1)
            offset += out
            h = torch.bmm(weight, h) + bias
            if i < len(self.layers) - 1:
                h = self.activation(h)
        return h.squeeze(-1)

    def _population_functional(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        shapes = [(name, p.shape, p.numel()) for name, p in self.named_parameters()]

        def one(flat: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
            tensors, offset = {}, 0
            for name, shape, size in shapes:
                tensors[name] = flat[offset:offset + size].view(shape)
                offset += size
            return torch.func.functional_call(self, tensors, (obs.unsqueeze(0),)).squeeze(0)

        return torch.func.vmap(one)(params, x)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = self.encoder(obs)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.activation(x)
        return x

    def to_actions(self, outputs: np.ndarray) -> np.ndarray:
        """Network outputs ``[B, out]`` as env actions (argmax, or clipped to the bounds)."""
        return direct_actions(self.spec.action_space, outputs)

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = True, critic_obs=None):
        """``(actions, None, None)`` for a batch, as ``Policy.act`` returns (evaluation)."""
        outputs = self(obs).numpy()
        return (outputs.argmax(-1) if self.kind == "discrete" else outputs), None, None

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        if self.kind == "discrete":
            return actions
        return direct_actions(self.spec.action_space, actions)
