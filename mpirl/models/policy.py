"""Policies: a torch actor-critic, trajectory postprocessing (GAE), and observation normalization.

A ``Policy`` maps observations to an action distribution and a value estimate. Its weights cross
ranks as one flat float32 vector (``get_flat_weights`` / ``set_flat_weights``), so a broadcast of
the whole model is one MPI call. Losses are plain functions ``(policy, batch) -> (loss, stats)``
that live with their algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from mpirl.errors import ConfigError


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

    def build(self, device: str = "cpu") -> Policy:
        return Policy(self).to(device)


_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}


def _mlp(sizes: list[int], activation: str, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        linear = nn.Linear(sizes[i], sizes[i + 1])
        last = i == len(sizes) - 2
        # Orthogonal init with a small output gain keeps the first policy near uniform.
        nn.init.orthogonal_(linear.weight, out_gain if last else np.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(_ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class FlatParameters(nn.Module):
    """A module whose parameters cross ranks as one flat float32 vector: weight broadcasts and
    posts, checkpoints, and A3C's gradients. Policy, QNetwork and SACModel are such modules."""

    def num_weights(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def get_flat_weights(self) -> np.ndarray:
        """All parameters concatenated into one float32 vector (a copy, on the CPU)."""
        return torch.cat([p.detach().reshape(-1) for p in self.parameters()]).cpu().numpy()

    @torch.no_grad()
    def set_flat_weights(self, flat: np.ndarray) -> None:
        flat_t = torch.as_tensor(flat, dtype=torch.float32)
        if flat_t.numel() != self.num_weights():
            raise ValueError(f"weight vector has {flat_t.numel()} values, the policy has "
                             f"{self.num_weights()}")
        for p, part in self._split(flat_t):
            p.copy_(part)

    def get_flat_gradients(self) -> np.ndarray:
        """All parameters' gradients as one float32 vector in the order of the weights (zeros
        for a parameter the loss left unused), on the CPU."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.parameters()]).detach().cpu().numpy()

    def set_flat_gradients(self, flat: np.ndarray) -> None:
        """Set every parameter's ``.grad`` from one flat vector (``get_flat_gradients``'s)."""
        for p, part in self._split(torch.as_tensor(flat, dtype=torch.float32)):
            p.grad = part.to(p.device).clone()

    def _split(self, flat: torch.Tensor):
        """(parameter, its slice of ``flat`` shaped like it), in parameter order."""
        offset = 0
        for p in self.parameters():
            n = p.numel()
            yield p, flat[offset:offset + n].view_as(p)
            offset += n


class Policy(FlatParameters):
    """Separate actor and critic MLPs over a flattened observation.

    Action spaces: Discrete (categorical), MultiDiscrete (independent categoricals), Box
    (diagonal Gaussian with a state-independent log std; the environment gets the action clipped
    to its bounds, the loss sees the unclipped sample). Observation spaces: Box (flattened) and
    Discrete (one-hot).
    """

    def __init__(self, spec: PolicySpec) -> None:
        super().__init__()
        if spec.activation not in _ACTIVATIONS:
            raise ConfigError(f"activation must be one of {sorted(_ACTIVATIONS)}, "
                              f"got {spec.activation!r}")
        self.spec = spec
        obs_space, act_space = spec.observation_space, spec.action_space
        if isinstance(obs_space, gym.spaces.Box):
            self.obs_dim = int(np.prod(obs_space.shape))
        elif isinstance(obs_space, gym.spaces.Discrete):
            self.obs_dim = int(obs_space.n)
        else:
            raise ConfigError(f"observation space {obs_space} is not supported; mpirl policies "
                              f"take Box and Discrete observations")
        if isinstance(act_space, gym.spaces.Discrete):
            self.kind, self.nvec, out = "discrete", [int(act_space.n)], int(act_space.n)
        elif isinstance(act_space, gym.spaces.MultiDiscrete):
            self.kind = "multi_discrete"
            self.nvec = [int(n) for n in np.asarray(act_space.nvec).ravel()]
            out = sum(self.nvec)
        elif isinstance(act_space, gym.spaces.Box):
            self.kind, out = "box", int(np.prod(act_space.shape))
            self.log_std = nn.Parameter(torch.zeros(out))
            self.register_buffer("action_low", torch.as_tensor(act_space.low, dtype=torch.float32))
            self.register_buffer("action_high",
                                 torch.as_tensor(act_space.high, dtype=torch.float32))
        else:
            raise ConfigError(f"action space {act_space} is not supported; mpirl policies take "
                              f"Discrete, MultiDiscrete and Box actions")
        hidden = list(spec.hidden_sizes)
        self.actor = _mlp([self.obs_dim, *hidden, out], spec.activation, out_gain=0.01)
        self.critic_dim = spec.critic_inputs or self.obs_dim
        self.critic = _mlp([self.critic_dim, *hidden, 1], spec.activation, out_gain=1.0)

    # Observations and distributions.

    def encode(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A batch of observations as a float tensor ``[B, obs_dim]`` on the policy's device."""
        device = next(self.parameters()).device
        if isinstance(self.spec.observation_space, gym.spaces.Discrete):
            index = torch.as_tensor(obs, device=device).long().view(-1)
            return nn.functional.one_hot(index, self.obs_dim).float()
        return torch.as_tensor(obs, dtype=torch.float32, device=device).reshape(-1, self.obs_dim)

    def distribution(self, x: torch.Tensor):
        out = self.actor(x)
        if self.kind == "box":
            return Normal(out, self.log_std.exp().expand_as(out))
        if self.kind == "discrete":
            return Categorical(logits=out)
        return [Categorical(logits=part) for part in torch.split(out, self.nvec, dim=-1)]

    def log_prob_entropy(self, dist, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "box":
            return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)
        if self.kind == "discrete":
            return dist.log_prob(actions.long()), dist.entropy()
        actions = actions.long()
        logp = sum(d.log_prob(actions[:, i]) for i, d in enumerate(dist))
        return logp, sum(d.entropy() for d in dist)

    def critic_input(self, x: torch.Tensor, critic_obs: Any = None) -> torch.Tensor:
        """What the critic sees: the encoded observations ``x``, or with a centralized critic
        ``critic_obs`` (``[B, critic_inputs]``)."""
        if not self.spec.critic_inputs:
            return x
        if critic_obs is None:
            raise ValueError("this policy's critic is centralized: give critic_obs")
        return torch.as_tensor(critic_obs, dtype=torch.float32,
                               device=x.device).reshape(-1, self.critic_dim)

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor, critic_obs: Any = None):
        """``(log_prob, entropy, value)`` of ``actions`` under the current policy (with grad)."""
        x = self.encode(obs)
        logp, entropy = self.log_prob_entropy(self.distribution(x), actions)
        return logp, entropy, self.critic(self.critic_input(x, critic_obs)).squeeze(-1)

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = False, critic_obs: Any = None):
        """Sample actions for a batch: ``(actions, log_probs, values)`` as NumPy arrays."""
        x = self.encode(obs)
        dist = self.distribution(x)
        if deterministic:
            if self.kind == "box":
                actions = dist.mean
            elif self.kind == "discrete":
                actions = dist.probs.argmax(-1)
            else:
                actions = torch.stack([d.probs.argmax(-1) for d in dist], -1)
        elif self.kind == "multi_discrete":
            actions = torch.stack([d.sample() for d in dist], -1)
        else:
            actions = dist.sample()
        logp, _ = self.log_prob_entropy(dist, actions)
        values = self.critic(self.critic_input(x, critic_obs)).squeeze(-1)
        return actions.cpu().numpy(), logp.cpu().numpy(), values.cpu().numpy()

    @torch.no_grad()
    def value(self, obs: np.ndarray, critic_obs: Any = None) -> np.ndarray:
        x = self.encode(obs)
        return self.critic(self.critic_input(x, critic_obs)).squeeze(-1).cpu().numpy()

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Actions as the environment takes them (Box actions clipped to the space's bounds)."""
        if self.kind == "box":
            space = self.spec.action_space
            return np.clip(actions, space.low, space.high).reshape(-1, *space.shape)
        return actions


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

    def state(self) -> tuple[np.ndarray, np.ndarray, float]:
        return self.mean.copy(), self.var.copy(), self.count

    def normalize(self, obs: np.ndarray, clip: float = 10.0) -> np.ndarray:
        return np.clip((obs - self.mean) / np.sqrt(self.var + 1e-8), -clip, clip).astype(
            np.float32)


def model_spec(module: ModuleType, observation_space: gym.Space, action_space: gym.Space,
               config: Any) -> Any:
    """The spec of the model an algorithm trains: its own ``model_spec`` (DQN's Q network,
    SAC's actor-critics), else the actor-critic policy."""
    if hasattr(module, "model_spec"):
        return module.model_spec(observation_space, action_space, config)
    return PolicySpec(observation_space, action_space, tuple(config.hidden_sizes),
                      config.activation)
