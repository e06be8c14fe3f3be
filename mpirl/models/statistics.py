"""Statistics of trajectories, in NumPy: generalized advantage estimation, and running
observation statistics that merge across ranks. Rollout ranks compute them without torch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RunningMeanStd"]


def compute_gae(rewards: np.ndarray, values: np.ndarray, dones: np.ndarray,
                last_values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation over a ``[T, N]`` block (time by environments).

    ``dones[t]`` ends the episode after step t (no bootstrap across it); truncated steps should
    already have ``gamma * V(final_obs)`` folded into their reward. Returns
    ``(advantages, value_targets)``, both ``[T, N]`` float32.
    """
    steps = rewards.shape[0]
    advantages = np.zeros_like(rewards, dtype=np.float32)
    running = np.zeros(rewards.shape[1], dtype=np.float32)
    next_values = last_values
    for t in reversed(range(steps)):
        live = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * live - values[t]
        running = delta + gamma * lam * live * running
        advantages[t] = running
        next_values = values[t]
    return advantages, (advantages + values).astype(np.float32)


class RunningMeanStd:
    """Running mean and variance of observations, mergeable across ranks (Chan et al.)."""

    def __init__(self, shape: tuple[int, ...], count: float = 0.0) -> None:
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = count

    def update(self, batch: np.ndarray) -> None:
        self.merge(batch.mean(0), batch.var(0), batch.shape[0])

    def merge(self, mean: np.ndarray, var: np.ndarray, count: float) -> None:
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        m2 = self.var * self.count + var * count + delta**2 * self.count * count / total
        self.mean = self.mean + delta * count / total
        self.var = m2 / total
        self.count = total

    def merge_stacked(self, counts: np.ndarray, means: np.ndarray, variances: np.ndarray
                      ) -> None:
        """``merge`` each delta of ``counts`` [R], ``means`` and ``variances`` [R, *shape],
        combined first in a few array operations (the driver merges one per rollout rank: 16 µs
        each one by one)."""
        total = counts.sum()
        if total == 0:
            return
        weights = (counts / total).reshape(-1, *[1] * self.mean.ndim)
        mean = (weights * means).sum(0)
        var = (weights * (variances + (means - mean) ** 2)).sum(0)
        self.merge(mean, var, float(total))

    def state(self) -> tuple[np.ndarray, np.ndarray, float]:
        return self.mean.copy(), self.var.copy(), self.count

    def normalize(self, obs: np.ndarray, clip: float = 10.0) -> np.ndarray:
        return np.clip((obs - self.mean) / np.sqrt(self.var + 1e-8), -clip, clip).astype(
            np.float32)
