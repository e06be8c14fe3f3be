"""Population-Based Training's decisions (Jaderberg et al. 2017, as Ray Tune makes them).

At every perturbation boundary the members still training are ranked by the metric. Each member
in the bottom ``quantile_fraction`` *exploits* a member drawn from the top quantile (it continues
from that member's full state) and then *explores*: the copied config is mutated
(``space.explore``). Only decisions are made here; the controller carries them out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpirl.tune.space import Domain, explore


@dataclass(frozen=True)
class PBTSettings:
    """The scheduler's knobs (Ray Tune's names and defaults)."""

    perturbation_interval: float
    #: ``training_iteration`` or ``timesteps_total``: what ``perturbation_interval`` counts.
    time_attr: str = "training_iteration"
    quantile_fraction: float = 0.25
    resample_probability: float = 0.25


@dataclass(frozen=True)
class Exploit:
    """``loser`` continues from ``winner``'s state with ``new_config``."""

    loser: int
    winner: int
    old_config: dict[str, Any]
    new_config: dict[str, Any]


def quantiles(scores: dict[int, float], fraction: float) -> tuple[list[int], list[int]]:
    """(bottom, top) member ids for ``scores`` (higher is better). A quantile holds
    ``ceil(n * fraction)`` members, at most half of them, so no member is in both."""
    ranked = sorted(scores, key=lambda member: (scores[member], member))
    size = min(int(math.ceil(len(ranked) * fraction)), len(ranked) // 2)
    if size == 0:
        return [], []
    return ranked[:size], ranked[-size:]


#: Draws of explore before a member keeps the winner's values as they are.
EXPLORE_TRIES = 10


def decide(scores: dict[int, float], configs: dict[int, dict[str, Any]],
           space: dict[str, Domain], settings: PBTSettings, rng: np.random.Generator,
           valid: Callable[[dict[str, Any]], bool] = lambda config: True) -> list[Exploit]:
    """Exploit-and-explore for the members in ``scores`` (their metric, higher is better; NaN
    ranks lowest). ``configs`` holds each member's varying keys. An explored config that
    ``valid`` refuses (a value the algorithm does not take, such as gamma 1.2) is drawn again;
    after ``EXPLORE_TRIES`` refusals the winner's values are kept."""
    finite = {m: (s if not math.isnan(s) else -math.inf) for m, s in scores.items()}
    bottom, top = quantiles(finite, settings.quantile_fraction)
    decisions = []
    for loser in bottom:
        winner = top[int(rng.integers(len(top)))]
        new_config = dict(configs[winner])
        for _ in range(EXPLORE_TRIES):
            candidate = explore(configs[winner], space, rng, settings.resample_probability)
            if valid(candidate):
                new_config = candidate
                break
        decisions.append(Exploit(loser, winner, dict(configs[loser]), new_config))
    return decisions
