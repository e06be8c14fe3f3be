"""ES's and ARS's update rules: how antithetic returns become a step of the weights, in NumPy.

Every rank that holds the weights applies the same update to the same inputs (noise indices and
returns, never weights), so the update must be a pure function of them: NumPy, fixed summation
order, no threads that could reorder a sum. Nothing here crosses ranks, and nothing imports torch.
``returns`` is [n, 2] throughout: the returns of theta + sigma*eps and theta - sigma*eps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
