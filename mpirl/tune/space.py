"""Search spaces of ``mpirl tune``: what ``--space`` and ``--mutations`` accept, sampling, grids,
and PBT's explore step.

A space is a JSON object from config keys to domains:

* a list ``[a, b, c]`` (or ``{"choice": [a, b, c]}``): categorical. Grid search runs every value;
  random search draws one; PBT's explore moves to a neighbour in the list.
* ``{"uniform": [low, high]}``, ``{"loguniform": [low, high]}``: floats.
* ``{"randint": [low, high]}``: integers, ``low <= x < high``.

Nothing here crosses ranks: every rank parses the same command line and, with the same seed,
draws the same configs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpirl.errors import ConfigError

#: PBT's explore: a numeric value is multiplied by one of these, chosen at random.
PERTURBATION_FACTORS = (0.8, 1.2)
DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint")


@dataclass(frozen=True)
class Domain:
    """One key's values: ``kind`` is one of ``DISTRIBUTIONS``; ``values`` the list (choice) or
    the bounds (the others)."""

    kind: str
    values: tuple

    @property
    def categorical(self) -> bool:
        return self.kind == "choice"

    def sample(self, rng: np.random.Generator) -> Any:
        if self.kind == "choice":
            return self.values[int(rng.integers(len(self.values)))]
        low, high = self.values
        if self.kind == "uniform":
            return float(rng.uniform(low, high))
        if self.kind == "loguniform":
            return float(math.exp(rng.uniform(math.log(low), math.log(high))))
        return int(rng.integers(low, high))

    def perturb(self, value: Any, rng: np.random.Generator) -> Any:
        """A neighbour of ``value`` (categorical: the next value up or down the list; numeric:
        ``value`` times 0.8 or 1.2)."""
        if self.kind == "choice":
            index = _index_of(self.values, value)
            if index is None:  # a value from outside the list (the run's own): start over
                return self.sample(rng)
            step = -1 if rng.random() < 0.5 else 1
            return self.values[min(max(index + step, 0), len(self.values) - 1)]
        factor = PERTURBATION_FACTORS[int(rng.integers(len(PERTURBATION_FACTORS)))]
        if self.kind == "randint":
            return int(round(value * factor))
        return float(value * factor)


def _index_of(values: tuple, value: Any) -> int | None:
    for index, candidate in enumerate(values):
        if candidate == value:
            return index
    return None


def parse_space(space: Any, flag: str) -> dict[str, Domain]:
    """Check a parsed ``--space``/``--mutations`` object; ConfigError naming what is wrong."""
    if not isinstance(space, dict):
        raise ConfigError(f"{flag} must be a JSON object of config keys, got {space!r}")
    domains = {}
    for key, spec in space.items():
        where = f"{flag} {key!r}"
        if isinstance(spec, list):
            spec = {"choice": spec}
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
            raise ConfigError(
                f"{where}: {json_text(spec)} is not a domain. Give a list of values, or one of "
                f'{{"choice": [...]}}, {{"uniform": [low, high]}}, {{"loguniform": [low, high]}}'
                f', {{"randint": [low, high]}}')
        kind, values = next(iter(spec.items()))
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: {kind} needs a non-empty list, got {json_text(values)}")
        if kind != "choice":
            numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
            if len(values) != 2 or not numeric or not values[0] < values[1]:
                raise ConfigError(f"{where}: {kind} needs [low, high] with low < high, got "
                                  f"{json_text(values)}")
            if kind == "loguniform" and values[0] <= 0:
                raise ConfigError(f"{where}: loguniform needs low > 0, got {values[0]}")
            if kind == "randint" and not all(isinstance(v, int) for v in values):
                raise ConfigError(f"{where}: randint needs integer bounds, got "
                                  f"{json_text(values)}")
        domains[key] = Domain(kind, tuple(values))
    return domains


def json_text(value: Any) -> str:
    import json

    return json.dumps(value)


def sample_config(space: dict[str, Domain], rng: np.random.Generator) -> dict[str, Any]:
    """One random draw of every key."""
    return {key: domain.sample(rng) for key, domain in space.items()}


def grid_configs(space: dict[str, Domain], rng: np.random.Generator) -> list[dict[str, Any]]:
    """Every combination of the categorical keys (in the order given); the other keys drawn
    once per combination."""
    categorical = [key for key, domain in space.items() if domain.categorical]
    configs = []
    for values in itertools.product(*(space[key].values for key in categorical)):
        config = dict(zip(categorical, values, strict=True))
        config.update({key: domain.sample(rng) for key, domain in space.items()
                       if not domain.categorical})
        configs.append({key: config[key] for key in space})
    return configs


def explore(config: dict[str, Any], space: dict[str, Domain], rng: np.random.Generator,
            resample_probability: float) -> dict[str, Any]:
    """PBT's explore step on the keys of ``space``: each is drawn afresh with probability
    ``resample_probability``, else perturbed (``Domain.perturb``). Other keys are kept."""
    new = dict(config)
    for key, domain in space.items():
        if key not in new or rng.random() < resample_probability:
            new[key] = domain.sample(rng)
        else:
            new[key] = domain.perturb(new[key], rng)
    return new
