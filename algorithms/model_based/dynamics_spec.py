"""The dynamics ensemble's specs (model-based RL, PETS and MBPO): torch-free plain data.

``DynamicsSpec`` is what every rank needs to build the same ensemble;
``build_torch_model(spec)`` makes the torch ``DynamicsEnsemble`` its ``NETWORK`` names
(``mpirl.algorithms.model_based.dynamics``), which this module never imports.
``EnsembleTrainerSpec`` holds what only the rank that trains it uses (``EnsembleTrainer``).
Both check their values when they are made: a wrong one is a ``ConfigError`` of one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from mpirl.config.imports import load_object
from mpirl.errors import ConfigError

__all__ = ["EnsembleTrainerSpec", "dynamics_spec_for"]

#: The activations a member's hidden layers may use (SiLU is PETS's and MBPO's "swish").
DYNAMICS_ACTIVATIONS = ("silu", "relu", "tanh", "elu")

#: A termination function's signature, for messages.
TERMINATION_FORM = "module:function"


@dataclass(frozen=True)
class DynamicsSpec:
    """What every rank needs to build the same dynamics ensemble: K probabilistic members, each
    an MLP from (normalized observation, action) to a diagonal Gaussian over the normalized
    (observation change, reward), with learned soft bounds on its log-variance."""

    #: The torch module ``build_torch_model`` makes of it.
    NETWORK: ClassVar[str] = "mpirl.algorithms.model_based.dynamics:DynamicsEnsemble"

    observation_size: int
    """Length of the (flat) observation vector."""
    action_size: int
    """Length of the (flat, continuous) action vector."""
    ensemble_size: int = 7
    """K, the number of members (PETS and MBPO: 7)."""
    elites: int = 5
    """Members kept for prediction: those with the lowest held-out error (MBPO: 5)."""
    hidden_sizes: tuple[int, ...] = (200, 200, 200, 200)
    """Hidden widths of every member: MBPO's 4 x 200. On a CPU a smaller one (2 x 64, 3 x 128)
    trains Pendulum's model several times faster to about the same one-step error; the
    default stays the paper's so that results compare with it."""
    activation: str = "silu"
    """The hidden layers' activation, one of ``DYNAMICS_ACTIVATIONS``."""
    learn_reward: bool = True
    """Predict the reward as one more Gaussian output. Off, ``predict`` returns no rewards and
    the planner supplies its own reward function."""
    learn_termination: bool = False
    """Learn a termination classifier (one logit per member, cross-entropy on ``terminated``).
    Exclusive with ``termination_fn``."""
    termination_fn: str = ""
    """The user's termination function, ``"module:function"``, called as
    ``fn(obs, action, next_obs)`` on NumPy batches ``[N, ...]`` and returning a bool array
    ``[N]``. "" with ``learn_termination`` off: model transitions never terminate."""
    min_logvar: float = -10.0
    """Initial value of the learned lower bound on each output's log-variance (MBPO: -10)."""
    max_logvar: float = 0.5
    """Initial value of the learned upper bound on each output's log-variance (MBPO: 0.5)."""

    def __post_init__(self) -> None:
        for key in ("observation_size", "action_size"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"dynamics {key} must be at least 1, got {getattr(self, key)}")
        if self.ensemble_size < 1:
            raise ConfigError(f"ensemble_size must be at least 1, got {self.ensemble_size}")
        if self.elites < 1:
            raise ConfigError(f"elites must be at least 1, got {self.elites}")
        if self.elites > self.ensemble_size:
            raise ConfigError(f"elites ({self.elites}) cannot exceed ensemble_size "
                              f"({self.ensemble_size}): the elites are chosen among the members")
        if any(int(width) < 1 for width in self.hidden_sizes):
            raise ConfigError(f"dynamics hidden_sizes must be positive widths, got "
                              f"{tuple(self.hidden_sizes)}")
        if self.activation not in DYNAMICS_ACTIVATIONS:
            raise ConfigError(f"dynamics activation {self.activation!r}: use one of "
                              f"{', '.join(DYNAMICS_ACTIVATIONS)}")
        if not self.min_logvar < self.max_logvar:
            raise ConfigError(f"dynamics min_logvar ({self.min_logvar}) must be below "
                              f"max_logvar ({self.max_logvar})")
        if self.learn_termination and self.termination_fn:
            raise ConfigError(f"termination_fn {self.termination_fn!r} and learn_termination "
                              f"both give model terminations: set one of them")
        if self.termination_fn:
            self.load_termination_fn()

    @property
    def target_size(self) -> int:
        """Gaussian outputs per member: the observation change, then the reward if learned."""
        return self.observation_size + int(self.learn_reward)

    def load_termination_fn(self) -> Callable[[Any, Any, Any], Any] | None:
        """The user's termination function, or None when there is none. One that cannot be
        imported, or is not callable, is a ConfigError naming it."""
        if not self.termination_fn:
            return None
        fn = load_object(self.termination_fn, "termination_fn", TERMINATION_FORM)
        if not callable(fn):
            raise ConfigError(f"termination_fn {self.termination_fn!r} is a "
                              f"{type(fn).__name__}, not a function: give {TERMINATION_FORM!r} "
                              f"naming fn(obs, action, next_obs) -> bool array")
        return fn


@dataclass(frozen=True)
class EnsembleTrainerSpec:
    """How ``EnsembleTrainer`` fits the ensemble to real transitions (MBPO's defaults)."""

    learning_rate: float = 1e-3
    """Adam's step size."""
    weight_decay: float = 5e-5
    """L2 penalty on the members' weights (Adam's ``weight_decay``; biases and the log-variance
    bounds are not decayed). MBPO decays its layers by 2.5e-5 to 1e-4."""
    batch_size: int = 256
    """Transitions per member in one minibatch."""
    holdout_ratio: float = 0.2
    """Share of the transitions held out (never trained on) for early stopping and elites."""
    max_holdout: int = 5000
    """At most this many held-out transitions (MBPO: 5000)."""
    patience: int = 5
    """Stop after this many epochs in which no member improved its held-out error by more than
    ``improvement`` (relative); each member keeps the weights of its best epoch."""
    improvement: float = 0.01
    """Relative decrease of a member's held-out error that counts as an improvement (1%)."""
    max_epochs: int = 100
    """Upper bound on epochs in one ``train`` call, whatever the early stopping says."""
    logvar_bound_coef: float = 0.01
    """Weight of the regularizer ``sum(max_logvar) - sum(min_logvar)`` that keeps the learned
    log-variance bounds tight (PETS's and MBPO's 0.01)."""

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ConfigError(f"dynamics learning_rate must be positive, got "
                              f"{self.learning_rate}")
        if self.weight_decay < 0:
            raise ConfigError(f"dynamics weight_decay must be 0 or more, got "
                              f"{self.weight_decay}")
        if self.batch_size < 1:
            raise ConfigError(f"dynamics batch_size must be at least 1, got {self.batch_size}")
        if not 0.0 <= self.holdout_ratio < 1.0:
            raise ConfigError(f"holdout_ratio must be in [0, 1), got {self.holdout_ratio}")
        if self.max_holdout < 0:
            raise ConfigError(f"max_holdout must be 0 or more, got {self.max_holdout}")
        if self.patience < 1:
            raise ConfigError(f"dynamics patience must be at least 1 epoch, got "
                              f"{self.patience}")
        if self.improvement < 0:
            raise ConfigError(f"dynamics improvement must be 0 or more, got {self.improvement}")
        if self.max_epochs < 1:
            raise ConfigError(f"dynamics max_epochs must be at least 1, got {self.max_epochs}")
        if self.logvar_bound_coef < 0:
            raise ConfigError(f"logvar_bound_coef must be 0 or more, got "
                              f"{self.logvar_bound_coef}")


def dynamics_spec_for(algo: str, observation_space: Any, action_space: Any, config: Any, *,
                      hidden_sizes: tuple[int, ...], activation: str) -> DynamicsSpec:
    """The ensemble a model-based algorithm's ``config`` asks for (its ``ensemble_size``,
    ``elites``, ``termination_fn`` and ``learn_termination`` keys) on these spaces; a
    ConfigError naming ``algo`` for observations that are not a Box."""
    import gymnasium as gym

    if not isinstance(observation_space, gym.spaces.Box):
        raise ConfigError(f"{algo} models vector observations (a Box), not {observation_space}")
    return DynamicsSpec(
        observation_size=math.prod(observation_space.shape),
        action_size=math.prod(action_space.shape), ensemble_size=config.ensemble_size,
        elites=config.elites, hidden_sizes=tuple(hidden_sizes), activation=activation,
        termination_fn=config.termination_fn, learn_termination=config.learn_termination)
