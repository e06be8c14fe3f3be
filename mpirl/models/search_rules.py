"""Derivative-free search (ES, ARS) without torch: the policy's spec, its forward pass for many
weight vectors at once in NumPy, and the update rules that turn antithetic returns into a step.

Rollout ranks of ES and ARS import only this: for vector observations they never load torch
(about 60 MB a rank instead of about 300). The torch ``DirectPolicy`` (``mpirl.models.evolution``)
serves the driver, image observations and anything ``numpy_unsupported`` names; both take the same
flat weight vector. Every rank that holds the weights applies the same update to the same inputs
(noise indices and returns, never weights), so the update must be a pure function of them:
NumPy, fixed summation order, no threads that could reorder a sum. Nothing here crosses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from mpirl.models.numpy_policy import ACTIVATIONS
from mpirl.models.spaces import ModelOptions, has_image, is_image


@dataclass(frozen=True)
class DirectPolicySpec:
    """A deterministic policy from observations to actions; ``hidden_sizes`` () is linear (ARS)."""

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
