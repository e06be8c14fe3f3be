"""Soft actor-critic's model and loss: a squashed-Gaussian actor, twin Q critics, a learned
entropy temperature.

The model is one ``nn.Module``, so its weights cross ranks as one flat vector like every other
model's, and one Adam optimizer on the learner updates all three parts: the actor's loss reaches
only the actor (the critics enter it with their parameters detached), the critics' loss only the
critics, and the temperature's loss only ``log_alpha``. Replay holds actions as the environment
takes them; the critics see them rescaled to [-1, 1], the range of the actor's tanh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from mpirl.models.encoders import (
    Encoder,
    ModelOptions,
    build_custom_model,
    head_sizes,
    model_options,
    observation_tensor,
)
from mpirl.models.policy import ACTIVATIONS, FlatParameters, mlp

__all__ = ["SACSpec", "SACModel", "SAC_STATS", "sac_loss", "sac_model_spec"]


@dataclass(frozen=True)
class SACSpec:
    """What every rank needs to build the same SAC model."""

    observation_space: gym.Space
    action_space: gym.spaces.Box
    hidden_sizes: tuple[int, ...] = (256, 256)
    activation: str = "relu"
    initial_alpha: float = 1.0
    model: ModelOptions = field(default_factory=ModelOptions)
    #: The user's critic class ("module:Class"), built twice (Q1 and Q2): ``forward(obs,
    #: action)`` returns Q ``[B]`` of actions in [-1, 1]. "" takes mpirl's.
    custom_q_model: str = ""


class _EncodedCritic(nn.Module):
    """A critic's encoder and MLP as one module, built per call so that the model's own
    parameter order (actor, critic1, critic2, log_alpha) stays what checkpoints hold."""

    def __init__(self, encoder: Encoder, head: nn.Module) -> None:
        super().__init__()
        self.encoder, self.head = encoder, head

    def forward(self, obs: Any, squashed: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.encoder(obs), squashed], -1))


class SACModel(FlatParameters):
    """Actor (mean and log std of a Gaussian squashed by tanh) and critics Q1, Q2.

    The actor and each critic have their own encoder (a CNN each for images): the critics'
    losses then never move the actor's features. A ``custom_model`` replaces the actor: its
    ``forward(obs)`` returns mean and log std concatenated ``[B, 2 * action_dim]``; a
    ``custom_q_model`` replaces each critic: ``forward(obs, action)`` returns Q ``[B]``."""

    def __init__(self, spec: SACSpec) -> None:
        super().__init__()
        self.spec = spec
        obs_space = spec.observation_space
        self.act_dim = int(np.prod(spec.action_space.shape))
        hidden, act = list(head_sizes(obs_space, spec.model, spec.hidden_sizes)), spec.activation
        if act not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}")
        self.custom_actor = self.custom_critics = None
        if spec.model.custom_model:
            self.custom_actor = build_custom_model(spec.model.custom_model, obs_space,
                                                   spec.action_space,
                                                   spec.model.custom_model_config)
        else:
            self.actor_encoder = Encoder(obs_space, spec.model)
            self.obs_dim = self.actor_encoder.out_dim
            self.actor = mlp([self.obs_dim, *hidden, 2 * self.act_dim], act, out_gain=0.01)
        if spec.custom_q_model:
            self.custom_critics = nn.ModuleList(
                build_custom_model(spec.custom_q_model, obs_space, spec.action_space,
                                   spec.model.custom_model_config, key="custom_q_model")
                for _ in range(2))
        else:
            self.critic_encoders = nn.ModuleList(Encoder(obs_space, spec.model)
                                                 for _ in range(2))
            width = self.critic_encoders[0].out_dim
            self.critic1 = mlp([width + self.act_dim, *hidden, 1], act, out_gain=1.0)
            self.critic2 = mlp([width + self.act_dim, *hidden, 1], act, out_gain=1.0)
        self.log_alpha = nn.Parameter(torch.tensor(float(np.log(spec.initial_alpha))))
        low = torch.as_tensor(spec.action_space.low, dtype=torch.float32).reshape(-1)
        high = torch.as_tensor(spec.action_space.high, dtype=torch.float32).reshape(-1)
        self.register_buffer("action_mid", (high + low) / 2)
        self.register_buffer("action_half", (high - low) / 2)

    def _obs(self, obs: Any) -> torch.Tensor:
        return observation_tensor(obs, self.spec.observation_space, self.action_mid.device)

    def actor_outputs(self, obs: Any) -> torch.Tensor:
        if self.custom_actor is not None:
            out = self.custom_actor(self._obs(obs))
            if isinstance(out, tuple | list):  # an actor-critic's model: its value is unused
                out = out[0]
            return out.reshape(-1, 2 * self.act_dim)
        return self.actor(self.actor_encoder(obs))

    def sample(self, obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Squashed actions in [-1, 1] (with grad through the reparameterization) and their
        log-probabilities."""
        mean, log_std = self.actor_outputs(obs).chunk(2, -1)
        log_std = log_std.clamp(-20, 2)
        noise = torch.zeros_like(mean) if deterministic else torch.randn_like(mean)
        pre = mean + log_std.exp() * noise
        squashed = torch.tanh(pre)
        gauss = (-0.5 * noise.pow(2) - log_std - 0.5 * np.log(2 * np.pi)).sum(-1)
        # The tanh's change of variables, in a numerically stable form.
        correction = (2 * (np.log(2) - pre - nn.functional.softplus(-2 * pre))).sum(-1)
        return squashed, gauss - correction

    def q(self, obs, squashed: torch.Tensor, frozen: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q1 and Q2 of actions in [-1, 1]; ``frozen`` keeps gradients off the critics."""
        out = []
        for i in range(2):
            if self.custom_critics is not None:
                critic = self.custom_critics[i]
                inputs: tuple = (self._obs(obs), squashed)
            else:
                critic = _EncodedCritic(self.critic_encoders[i], (self.critic1, self.critic2)[i])
                inputs = (obs, squashed)
            if frozen:
                params = {k: v.detach() for k, v in critic.named_parameters()}
                out.append(functional_call(critic, params, inputs).reshape(-1))
            else:
                out.append(critic(*inputs).reshape(-1))
        return out[0], out[1]

    def to_env(self, squashed: torch.Tensor) -> torch.Tensor:
        return self.action_mid + self.action_half * squashed

    def from_env(self, actions: torch.Tensor) -> torch.Tensor:
        # Replay keeps actions in the env's dtype: a float64 Box's would meet float32 critics.
        actions = actions.reshape(len(actions), -1).to(self.action_mid.dtype)
        return ((actions - self.action_mid) / self.action_half).clamp(-1, 1)

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = False):
        """Actions as the environment takes them: ``(actions, log_probs, values)``."""
        squashed, logp = self.sample(obs, deterministic)
        actions = self.to_env(squashed).reshape(-1, *self.spec.action_space.shape)
        return actions.cpu().numpy(), logp.cpu().numpy(), np.zeros(len(actions), np.float32)

    def explore(self, obs: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
        """Policy samples; with probability ``epsilon`` a uniformly random action instead (1
        before learning starts)."""
        actions = self.act(obs)[0]
        space = self.spec.action_space
        random = rng.uniform(space.low, space.high, actions.shape).astype(actions.dtype)
        pick = (rng.random(len(actions)) < epsilon).reshape(-1, *[1] * len(space.shape))
        return np.where(pick, random, actions)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        return actions


#: The statistics sac_loss reports.
SAC_STATS = ("critic_loss", "actor_loss", "alpha", "entropy", "q_mean")


def sac_loss(model: SACModel, target: SACModel, batch: dict[str, torch.Tensor], config: Any):
    """Critic, actor and temperature losses summed (each reaches only its own parameters)."""
    alpha = model.log_alpha.exp().detach()
    with torch.no_grad():
        next_action, next_logp = model.sample(batch["next_obs"])
        next_q = torch.min(*target.q(batch["next_obs"], next_action)) - alpha * next_logp
        targets = batch["rewards"] + batch["discounts"] * next_q
    q1, q2 = model.q(batch["obs"], model.from_env(batch["actions"]))
    weights = batch["weights"]
    critic_loss = (weights * ((q1 - targets).pow(2) + (q2 - targets).pow(2))).mean() * 0.5
    action, logp = model.sample(batch["obs"])
    q_pi = torch.min(*model.q(batch["obs"], action, frozen=True))
    actor_loss = (alpha * logp - q_pi).mean()
    target_entropy = -float(model.act_dim) if config.target_entropy == "auto" \
        else float(config.target_entropy)
    alpha_loss = -(model.log_alpha * (logp.detach() + target_entropy)).mean()
    stats = {"critic_loss": critic_loss.item(), "actor_loss": actor_loss.item(),
             "alpha": alpha.item(), "entropy": -logp.mean().item(), "q_mean": q1.mean().item()}
    return critic_loss + actor_loss + alpha_loss, q1 - targets, stats


def sac_model_spec(observation_space: gym.Space, action_space: gym.Space, config: Any,
                   custom_q_model: str = "") -> SACSpec:
    """The actor-critic of ``config`` (SAC's keys, which MBPO shares); ``custom_q_model`` is
    SAC's own key (MBPO has none)."""
    return SACSpec(observation_space, action_space, tuple(config.hidden_sizes),
                   config.activation, config.initial_alpha, model_options(config),
                   custom_q_model)
