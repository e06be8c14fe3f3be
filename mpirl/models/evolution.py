"""Derivative-free search (ES, ARS): a deterministic policy evaluated for many weight vectors at
once, and the update rules that turn antithetic returns into a step.

Every rank that holds the weights applies the same update to the same inputs (noise indices and
returns, never weights), so the update must be a pure function of them: NumPy, fixed summation
order, no threads that could reorder a sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from mpirl.errors import ConfigError
from mpirl.models.encoders import Encoder, ModelOptions
from mpirl.models.policy import _ACTIVATIONS, FlatParameters


@dataclass(frozen=True)
class DirectPolicySpec:
    """A deterministic policy from observations to actions; ``hidden_sizes`` () is linear (ARS)."""

    observation_space: gym.Space
    action_space: gym.Space
    hidden_sizes: tuple[int, ...] = (32,)
    activation: str = "tanh"
    model: ModelOptions = field(default_factory=ModelOptions)

    def build(self, device: str = "cpu") -> DirectPolicy:
        return DirectPolicy(self).to(device)


class DirectPolicy(FlatParameters):
    """An MLP (or a linear map) from the encoder's features to a Discrete action (argmax) or a
    Box action (clipped to the space's bounds). No value function, no distribution: ES and ARS
    score whole episodes. Vectors go in as they are; images through a CNN (the catalog's), whose
    weights are perturbed like the rest."""

    def __init__(self, spec: DirectPolicySpec) -> None:
        super().__init__()
        if spec.activation not in _ACTIVATIONS:
            raise ConfigError(f"activation must be one of {sorted(_ACTIVATIONS)}, "
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
        self.activation = _ACTIVATIONS[spec.activation]()

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
        if self.kind == "discrete":
            return outputs.argmax(-1)
        space = self.spec.action_space
        return np.clip(outputs, space.low.ravel(), space.high.ravel()).reshape(-1, *space.shape)

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = True, critic_obs=None):
        """``(actions, None, None)`` for a batch, as ``Policy.act`` returns (evaluation)."""
        outputs = self(obs).numpy()
        return (outputs.argmax(-1) if self.kind == "discrete" else outputs), None, None

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        if self.kind == "discrete":
            return actions
        space = self.spec.action_space
        return np.clip(actions, space.low.ravel(), space.high.ravel()).reshape(-1, *space.shape)


# Update rules. ``returns`` is [n, 2]: the returns of theta + sigma*eps and theta - sigma*eps.


def centered_ranks(values: np.ndarray) -> np.ndarray:
    """Each value's rank over all of ``values``, mapped to [-0.5, 0.5] (Salimans et al.'s
    fitness shaping); ties keep their order of appearance."""
    ranks = np.empty(values.size, np.float64)
    ranks[np.argsort(values.ravel(), kind="stable")] = np.arange(values.size)
    return (ranks / max(values.size - 1, 1) - 0.5).reshape(values.shape)


def weighted_noise_sum(weights: np.ndarray, indices: np.ndarray, noise: np.ndarray,
                       size: int, chunk: int = 256) -> np.ndarray:
    """``sum_i weights[i] * noise[indices[i]:indices[i] + size]`` in float64, in chunks of rows
    (a fixed order, so every rank gets the same bits)."""
    total = np.zeros(size, np.float64)
    for start in range(0, len(indices), chunk):
        rows = np.stack([noise[i:i + size] for i in indices[start:start + chunk]])
        total += weights[start:start + chunk].astype(np.float64) @ rows.astype(np.float64)
    return total


@dataclass
class Adam:
    """Adam on a flat vector, in float64 state (Kingma and Ba); ``step`` returns the change."""

    size: int
    stepsize: float
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        self.m = np.zeros(self.size, np.float64)
        self.v = np.zeros(self.size, np.float64)
        self.t = 0

    def step(self, gradient: np.ndarray) -> np.ndarray:
        self.t += 1
        a = self.stepsize * np.sqrt(1 - self.beta2**self.t) / (1 - self.beta1**self.t)
        self.m = self.beta1 * self.m + (1 - self.beta1) * gradient
        self.v = self.beta2 * self.v + (1 - self.beta2) * gradient * gradient
        return -a * self.m / (np.sqrt(self.v) + self.epsilon)

    def state(self) -> dict:
        return {"m": self.m.copy(), "v": self.v.copy(), "t": self.t}

    def load(self, state: dict) -> None:
        self.m, self.v, self.t = state["m"].copy(), state["v"].copy(), state["t"]


def es_step(theta: np.ndarray, indices: np.ndarray, returns: np.ndarray, noise: np.ndarray,
            optimizer: Adam, l2_coeff: float) -> tuple[np.ndarray, dict[str, float]]:
    """OpenAI-ES: centered-rank shaping of all 2n returns, the antithetic gradient estimate,
    Adam on ``-g + l2_coeff * theta``. Returns the new theta and statistics."""
    shaped = centered_ranks(returns)
    g = weighted_noise_sum(shaped[:, 0] - shaped[:, 1], indices, noise, theta.size)
    g /= returns.size
    change = optimizer.step(-g + l2_coeff * theta.astype(np.float64))
    new = (theta.astype(np.float64) + change).astype(np.float32)
    return new, {"grad_norm": float(np.linalg.norm(g)),
                 "update_ratio": float(np.linalg.norm(change)
                                       / max(np.linalg.norm(theta), 1e-12))}


def ars_step(theta: np.ndarray, indices: np.ndarray, returns: np.ndarray, noise: np.ndarray,
             stepsize: float, rollouts_used: int) -> tuple[np.ndarray, dict[str, float]]:
    """ARS (Mania et al. 2018): keep the ``rollouts_used`` directions with the best
    max(r+, r-), step ``stepsize / (b * sigma_R)`` along their (r+ - r-)-weighted sum, where
    sigma_R is the standard deviation of the 2b returns used."""
    b = min(rollouts_used, len(indices))
    best = np.argsort(-returns.max(axis=1), kind="stable")[:b]
    used = returns[best]
    sigma = float(used.std()) or 1.0
    g = weighted_noise_sum(used[:, 0] - used[:, 1], indices[best], noise, theta.size)
    change = stepsize / (b * sigma) * g
    new = (theta.astype(np.float64) + change).astype(np.float32)
    return new, {"grad_norm": float(np.linalg.norm(g)), "returns_std_used": sigma,
                 "update_ratio": float(np.linalg.norm(change)
                                       / max(np.linalg.norm(theta), 1e-12))}
