"""Scripted baselines for the bundled simulations: the return of a policy over episodes on one
rank (``MPI.COMM_SELF``), and the best gain of a proportional controller. What a learned policy
is measured against in their docstrings, tests and benchmarks. Nothing crosses ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mpi4py import MPI

from mpirl.envs.simulation import Simulation

__all__ = ["episode_return", "mean_return", "best_gain"]


def episode_return(simulation: type[Simulation], policy: Callable[[Any], Any], seed: int,
                   **env_config: Any) -> float:
    """The return of one episode of ``simulation`` from ``seed``; ``policy(obs) -> action``."""
    env = simulation(MPI.COMM_SELF, **env_config)
    obs, total, done = env.reset(seed), 0.0, False
    while not done:
        obs, reward, terminated, truncated = env.step(policy(obs))
        total += reward
        done = terminated or truncated
    return total


def mean_return(simulation: type[Simulation], policy: Callable[[Any], Any],
                seeds: Iterable[int], **env_config: Any) -> float:
    """The mean return of ``policy`` over episodes from ``seeds``."""
    returns = [episode_return(simulation, policy, seed, **env_config) for seed in seeds]
    return sum(returns) / len(returns)


def best_gain(simulation: type[Simulation], controller: Callable[..., Any],
              gains: Sequence[float], seeds: Iterable[int],
              **env_config: Any) -> tuple[float, float]:
    """(gain, mean return) of the best ``controller(gain, **env_config)`` among ``gains``."""
    seeds = list(seeds)
    scored = [(mean_return(simulation, controller(g, **env_config), seeds, **env_config), g)
              for g in gains]
    value, gain = max(scored)
    return gain, value
