"""What every rank needs to build the same actor-critic, without torch: ``PolicySpec``.
``mpirl.models.torch_model.build_torch_model(spec)`` makes the torch ``Policy``
(``mpirl.models.policy``); rollout ranks that only act may run
``mpirl.models.numpy_policy.NumpyPolicy`` on the same spec instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gymnasium as gym

from mpirl.models.spaces import ModelOptions


@dataclass(frozen=True)
class PolicySpec:
    """What every rank needs to build the same policy: spaces and network shape."""

    observation_space: gym.Space
    action_space: gym.Space
    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    #: A centralized critic's input size (multi-agent PPO, MAPPO-style): the value function then
    #: takes this many floats (the env's global state, or every agent's observation) instead
    #: of the actor's observation. 0: the critic sees what the actor sees.
    critic_inputs: int = 0
    #: The encoder (chosen from the observation space) or the user's own model.
    model: ModelOptions = field(default_factory=ModelOptions)

