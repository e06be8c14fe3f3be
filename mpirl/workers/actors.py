"""Actors: how each kind of model acts inside the sampling core (``mpirl.workers.env_runner``).

A rollout rank acts with one actor per policy. Three kinds, one shape of call:

* ``PolicyActor``: an actor-critic (``NumpyPolicy`` where it can run, else the torch ``Policy``);
  samples actions and reports their log-probabilities and the critic's values, which on-policy
  postprocessing needs; recurrent policies carry a state per slot;
* ``ExploringActor``: a Q network or SAC's actor, epsilon-greedy (epsilon 1: uniformly random
  actions, SAC's warm-up); its steps go to replay, which needs neither log-probs nor values;
* ``ScriptedActor``: a user's ``compute_actions(obs)`` that never learns.

Nothing here crosses ranks: weights arrive through the rollout worker that owns the actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpirl.models.numpy_policy import NumpyPolicy, numpy_unsupported
from mpirl.models.policy_spec import PolicySpec
from mpirl.models.q_spec import NumpyQPolicy, QSpec
from mpirl.models.q_spec import numpy_unsupported as q_numpy_unsupported


@dataclass
class Acted:
    """One forward pass over a batch of observations: the actions in the policy's space and as
    the env takes them; an actor-critic's log-probs and values, and a recurrent policy's next
    state (None where the actor has none)."""

    actions: np.ndarray
    env_actions: np.ndarray
    logp: np.ndarray | None = None
    values: np.ndarray | None = None
    next_state: np.ndarray | None = None


def build_model(spec: Any, seed: int, torch_threads: int = 1) -> Any:
    """The model a rollout rank acts with: ``NumpyPolicy`` for an actor-critic it can run, or
    ``NumpyQPolicy`` for a Q network (no torch in the process: about 1 s and 200 MB less per
    rank), else the torch model of ``spec`` on ``torch_threads`` threads. The actor-critics
    sample with a generator seeded from ``seed``."""
    if isinstance(spec, PolicySpec) and numpy_unsupported(spec) is None:
        return NumpyPolicy(spec, seed=seed)
    if isinstance(spec, QSpec) and q_numpy_unsupported(spec) is None:
        return NumpyQPolicy(spec)
    import torch

    from mpirl.models.torch_model import build_torch_model

    torch.set_num_threads(torch_threads)
    torch.manual_seed(seed)
    return build_torch_model(spec)


class PolicyActor:
    """An actor-critic: sampled actions with their log-probs and values."""

    #: What its steps carry besides observations, actions and rewards.
    collects_values = True

    def __init__(self, model: Any) -> None:
        self.model = model
        self.recurrent = bool(getattr(model, "recurrent", False))
        #: A centralized critic's input size (0: the critic sees the actor's observation).
        self.critic_inputs = int(getattr(getattr(model, "spec", None), "critic_inputs", 0))

    def initial_state(self, count: int) -> np.ndarray | None:
        return self.model.initial_state(count) if self.recurrent else None

    def act(self, obs: np.ndarray, state: np.ndarray | None = None,
            critic_obs: np.ndarray | None = None, deterministic: bool = False) -> Acted:
        model = self.model
        if state is not None:
            actions, logp, values, next_state = model.step(obs, state, deterministic)
        elif critic_obs is not None:
            actions, logp, values = model.act(obs, deterministic, critic_obs)
            next_state = None
        else:
            actions, logp, values = model.act(obs, deterministic)
            next_state = None
        return Acted(actions, model.env_actions(actions), logp, values, next_state)

    def value(self, obs: np.ndarray, state: np.ndarray | None = None,
              critic_obs: np.ndarray | None = None) -> np.ndarray:
        if state is not None:
            return self.model.value(obs, state=state)
        if critic_obs is not None:
            return self.model.value(obs, critic_obs)
        return self.model.value(obs)

    def set_weights(self, flat: np.ndarray) -> None:
        self.model.set_flat_weights(flat)

    def get_weights(self) -> np.ndarray:
        return self.model.get_flat_weights()

    def rng_state(self) -> Any:
        """Its sampling generator's state (NumPy actors), for checkpoints; None for torch."""
        return self.model.rng.bit_generator.state if isinstance(self.model, NumpyPolicy) \
            else None

    def set_rng_state(self, state: Any) -> None:
        if state is not None and isinstance(self.model, NumpyPolicy):
            self.model.rng.bit_generator.state = state

    def reseed(self, seed: Any) -> None:
        """Draw from a generator of its own from now on (a member of a population that copied
        another's checkpoint must not act as its clone)."""
        if isinstance(self.model, NumpyPolicy):
            self.model.rng = np.random.default_rng(seed)


class ExploringActor:
    """Epsilon-greedy acting of a Q network, or SAC's actor with uniform random actions at the
    rate ``epsilon``; set by its rollout worker before each call."""

    collects_values = False
    recurrent = False
    critic_inputs = 0

    def __init__(self, model: Any, seed: int) -> None:
        self.model = model
        self.epsilon = 0.0
        self.rng = np.random.default_rng(seed)

    def initial_state(self, count: int) -> None:
        return None

    def act(self, obs: np.ndarray, state: Any = None, critic_obs: Any = None,
            deterministic: bool = False) -> Acted:
        if deterministic:
            actions = np.asarray(self.model.act(obs, True)[0])
        else:
            actions = self.model.explore(obs, self.epsilon, self.rng)
        return Acted(actions, self.model.env_actions(actions))

    def value(self, obs: np.ndarray, state: Any = None, critic_obs: Any = None) -> None:
        return None

    def set_weights(self, flat: np.ndarray) -> None:
        self.model.set_flat_weights(flat)

    def get_weights(self) -> np.ndarray:
        return self.model.get_flat_weights()

    def rng_state(self) -> Any:
        return self.rng.bit_generator.state

    def set_rng_state(self, state: Any) -> None:
        if state is not None:
            self.rng.bit_generator.state = state

    def reseed(self, seed: Any) -> None:
        self.rng = np.random.default_rng(seed)


class ScriptedActor:
    """A policy that never learns: ``compute_actions(obs_batch)`` of the user's class."""

    collects_values = False
    recurrent = False
    critic_inputs = 0

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def initial_state(self, count: int) -> None:
        return None

    def act(self, obs: np.ndarray, state: Any = None, critic_obs: Any = None,
            deterministic: bool = False) -> Acted:
        actions = np.asarray(self.policy.compute_actions(obs))
        return Acted(actions, actions)

    def value(self, obs: np.ndarray, state: Any = None, critic_obs: Any = None) -> None:
        return None

    def rng_state(self) -> None:
        return None

    def set_rng_state(self, state: Any) -> None:
        pass

    def reseed(self, seed: Any) -> None:
        pass


def make_actor(spec: Any, seed: int, torch_threads: int = 1, exploring: bool = False) -> Any:
    """The actor of a learning policy built from its model ``spec``: epsilon-greedy
    (``exploring``: Q networks, SAC) or an actor-critic."""
    model = build_model(spec, seed, torch_threads)
    return ExploringActor(model, seed + 17) if exploring else PolicyActor(model)
