"""Custom models: your own torch modules in place of mpirl's catalog.

    PYTHONPATH=examples mpiexec -n 3 mpirl train --algo PPO --env CartPole-v1 \
        --config '{"custom_model": "custom_models:ActorCritic",
                   "custom_model_config": {"hidden": 64}}'

Every rank builds ``Class(observation_space, action_space, config)``, where ``config`` is the
``custom_model_config`` dict. ``forward`` gets a batch of observations as a float32 tensor
``[B, *observation_space.shape]``.
"""

import gymnasium as gym
import numpy as np
import torch
from torch import nn


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                         nn.Tanh(), nn.Linear(hidden, outputs))



def _sizes(observation_space: gym.Space, action_space: gym.Space) -> tuple[int, int]:
    """A flat observation's length, and the policy head's outputs: logits for Discrete actions,
    mean and log std for Box."""
    outputs = (int(action_space.n) if isinstance(action_space, gym.spaces.Discrete)
               else 2 * int(np.prod(action_space.shape)))
    return int(np.prod(observation_space.shape)), outputs

class ActorCritic(nn.Module):
    """For PPO, A2C, A3C, IMPALA, BC and MARWIL: ``forward(obs) -> (distribution_inputs,
    value)``. Logits for Discrete actions; mean and log std concatenated for Box."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: dict):
        super().__init__()
        inputs, outputs = _sizes(observation_space, action_space)
        hidden = int(config.get("hidden", 64))
        self.pi = mlp(inputs, hidden, outputs)
        self.vf = mlp(inputs, hidden, 1)
        with torch.no_grad():  # a near-uniform first policy
            self.pi[-1].weight.mul_(0.01)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = obs.flatten(1)
        return self.pi(x), self.vf(x).squeeze(-1)


class SharedTrunk(nn.Module):
    """For the same algorithms as ``ActorCritic``: one trunk (two tanh layers of ``hidden``
    units, 32 by default) under a policy head and a value head, as RLlib's ``vf_share_layers``.
    The value loss's gradients reach the trunk too, so ``vf_loss_coeff`` weighs them against the
    policy's."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: dict):
        super().__init__()
        inputs, outputs = _sizes(observation_space, action_space)
        hidden = int(config.get("hidden", 32))
        self.trunk = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(),
                                   nn.Linear(hidden, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, outputs)
        self.vf = nn.Linear(hidden, 1)
        with torch.no_grad():  # a near-uniform first policy
            self.pi.weight.mul_(0.01)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(obs.flatten(1))
        return self.pi(features), self.vf(features).squeeze(-1)


class QModel(nn.Module):
    """For DQN and Ape-X: ``forward(obs) -> Q values [B, n]``."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: dict):
        super().__init__()
        inputs = int(np.prod(observation_space.shape))
        hidden = int(config.get("hidden", 256))
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, int(action_space.n)))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.flatten(1))


class TwinCritic(nn.Module):
    """For SAC's ``custom_q_model`` (built twice, Q1 and Q2): ``forward(obs, action) -> Q [B]``,
    the action scaled to [-1, 1]."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: dict):
        super().__init__()
        inputs = int(np.prod(observation_space.shape)) + int(np.prod(action_space.shape))
        self.net = mlp(inputs, int(config.get("hidden", 64)), 1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs.flatten(1), action], -1)).squeeze(-1)
