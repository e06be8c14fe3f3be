"""The torch model of a spec, and the check that it builds and acts.

The specs (``PolicySpec``, ``QSpec``, a family's own) are plain data in torch-free modules,
so that rollout ranks acting in NumPy never import torch; the torch modules import their spec,
never the other way round. ``build_torch_model`` is the one way from a spec to its network, for
every rank that needs one (learners, the driver's checks, rollout ranks acting in torch). Nothing
here crosses ranks: every rank builds the same model from the same spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from torch import nn

from mpirl.config.imports import load_object
from mpirl.errors import ConfigError
from mpirl.models.policy import Policy
from mpirl.models.policy_spec import PolicySpec
from mpirl.models.soft_q import SACModel, SACSpec

__all__ = ["build_torch_model"]

#: Each of mpirl's specs and the torch module built from it.
NETWORKS: tuple[tuple[type, type[nn.Module]], ...] = (
    (PolicySpec, Policy), (SACSpec, SACModel))


def build_torch_model(spec: Any, device: str = "cpu") -> Any:
    """The torch network of ``spec`` on ``device``. A spec of an algorithm family's own names
    its torch module by path, as a class attribute ``NETWORK = "module:Class"`` (a spec module
    stays torch-free and never imports its network). A plug-in's ``model_spec`` may return a
    spec of its own: that one builds itself, with ``spec.build(device)``."""
    path = getattr(type(spec), "NETWORK", None)
    if isinstance(path, str):
        return load_object(path, f"{type(spec).__name__}.NETWORK", "module:Class")(spec).to(device)
    for spec_type, network in NETWORKS:
        if isinstance(spec, spec_type):
            return network(spec).to(device)
    build = getattr(spec, "build", None)
    if not callable(build):
        raise ConfigError(
            f"model_spec returned a {type(spec).__name__}, which mpirl cannot build: return a "
            f"PolicySpec, QSpec or SACSpec, or a spec of your own with build(device) -> "
            f"torch.nn.Module")
    return build(device)


def check_model(model_spec: Callable[[gym.Space, gym.Space, Any], Any], recurrent: bool,
                algo: str, config: Any, observation_space: gym.Space, action_space: gym.Space
                ) -> None:
    """Build the model of ``model_spec`` (an algorithm's) once and act on one sampled
    observation, on the rank that checks the request before anything starts: an unknown
    encoder, a custom model that cannot be built or returns the wrong shapes, or a space no
    model takes is a ConfigError here, not a traceback on every rank later. ``use_lstm`` needs
    an algorithm whose plan is ``recurrent``."""
    if config.use_lstm and not recurrent:
        raise ConfigError(
            f"use_lstm is for PPO, A2C, A3C and IMPALA, whose rollout ranks carry the state "
            f"along each episode; {algo} learns from stored single steps (replay, dumps or "
            f"perturbations) with no state to resume from. Leave use_lstm out.")
    model = build_torch_model(model_spec(observation_space, action_space, config))
    names = config.custom_models()
    if not names:
        return
    sample = np.asarray(observation_space.sample())[None]
    try:
        model.act(sample)
    except Exception as error:  # noqa: BLE001 - whatever the user's forward raised
        raise ConfigError(f"custom model {' / '.join(map(repr, names))} failed on a sampled "
                          f"observation: {type(error).__name__}: {error}. See the Models page "
                          f"for what forward must return.") from None
