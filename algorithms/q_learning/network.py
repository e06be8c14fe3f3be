"""DQN's and Ape-X's Q network and loss (double Q, n-step, Huber).

``QNetwork`` is an MLP (optionally dueling) from observations to one value per discrete action.
Its weights cross ranks as one flat float32 vector, like ``Policy``'s.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from mpirl.errors import ConfigError
from mpirl.execution.replay_ops import check_discrete
from mpirl.models.encoders import (
    Encoder,
    build_custom_model,
    head_sizes,
    model_options,
    observation_tensor,
)
from mpirl.models.policy import ACTIVATIONS, FlatParameters, mlp
from mpirl.models.q_spec import QSpec

__all__ = ["QNetwork", "DQN_STATS", "dqn_loss", "q_model_spec"]


class QNetwork(FlatParameters):
    """Q values for every action of a Discrete space; dueling splits them into V + A - mean(A).

    The encoder comes from the observation space as for ``Policy`` (a CNN for images, then the
    hidden layers for vectors). A ``custom_model`` is ``Class(observation_space, action_space,
    config)`` whose ``forward(obs)`` returns the Q values ``[B, n]``."""

    def __init__(self, spec: QSpec) -> None:
        super().__init__()
        if spec.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                              f"got {spec.activation!r}")
        check_discrete(spec.action_space, "a Q network")
        self.spec = spec
        self.num_actions = int(spec.action_space.n)
        self.custom: nn.Module | None = None
        if spec.model.custom_model:
            self.custom = build_custom_model(spec.model.custom_model, spec.observation_space,
                                             spec.action_space, spec.model.custom_model_config)
            return
        self.encoder = Encoder(spec.observation_space, spec.model)
        self.obs_dim = self.encoder.out_dim
        hidden = list(head_sizes(spec.observation_space, spec.model, spec.hidden_sizes))
        body = mlp([self.obs_dim, *hidden], spec.activation, out_gain=np.sqrt(2))
        self.body = nn.Sequential(*body, ACTIVATIONS[spec.activation]()) if hidden \
            else nn.Identity()
        width = hidden[-1] if hidden else self.obs_dim
        self.advantage = nn.Linear(width, self.num_actions)
        self.value = nn.Linear(width, 1) if spec.dueling else None

    def encode(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        return self.encoder(obs)

    def forward(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        if self.custom is not None:
            device = next(self.parameters()).device
            q = self.custom(observation_tensor(obs, self.spec.observation_space, device))
            if not isinstance(q, torch.Tensor) or q.shape[-1] != self.num_actions:
                raise TypeError(f"custom_model {self.spec.model.custom_model!r}: forward must "
                                f"return Q values [B, {self.num_actions}]")
            return q.reshape(-1, self.num_actions)
        x = self.body(self.encode(obs))
        advantage = self.advantage(x)
        if self.value is None:
            return advantage
        return self.value(x) + advantage - advantage.mean(-1, keepdim=True)

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = True):
        """Greedy actions, as ``Policy.act`` returns them: ``(actions, log_probs, values)``."""
        q = self(obs)
        values, actions = q.max(-1)
        return actions.cpu().numpy(), np.zeros(len(actions), np.float32), values.cpu().numpy()

    def explore(self, obs: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
        """Epsilon-greedy actions for a batch of observations."""
        greedy = self.act(obs)[0]
        random = rng.integers(0, self.num_actions, len(greedy))
        return np.where(rng.random(len(greedy)) < epsilon, random, greedy)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        return actions


#: The statistics dqn_loss reports. Every iteration reports them (NaN before training starts),
#: so that progress.csv has their columns from its first row (a later one rewrites the file).
DQN_STATS = ("td_loss", "q_mean", "td_error_abs")


def dqn_loss(policy: QNetwork, target: QNetwork, batch: dict[str, torch.Tensor], config: Any):
    """Huber loss of Q(s, a) against the n-step target ``r + discount * Q_target(s', a')``,
    weighted by the importance weights of prioritized replay. ``a'`` is the online network's
    argmax with ``double_q`` (double DQN), else the target network's."""
    q = policy(batch["obs"]).gather(1, batch["actions"].long().view(-1, 1)).squeeze(1)
    with torch.no_grad():
        next_target = target(batch["next_obs"])
        chooser = policy(batch["next_obs"]) if config.double_q else next_target
        best = chooser.argmax(-1, keepdim=True)
        targets = batch["rewards"] + batch["discounts"] * next_target.gather(1, best).squeeze(1)
    td = q - targets
    loss = (batch["weights"] * nn.functional.smooth_l1_loss(q, targets, reduction="none")).mean()
    stats = {"td_loss": loss.item(), "q_mean": q.mean().item(),
             "td_error_abs": td.abs().mean().item()}
    return loss, td, stats


def q_model_spec(observation_space: gym.Space, action_space: gym.Space, config: Any) -> QSpec:
    return QSpec(observation_space, action_space, tuple(config.hidden_sizes), config.activation,
                 config.dueling, model_options(config))
