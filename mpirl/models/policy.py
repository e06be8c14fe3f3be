"""Policies: a torch actor-critic, trajectory postprocessing (GAE), and observation normalization.

A ``Policy`` maps observations to an action distribution and a value estimate. Its weights cross
ranks as one flat float32 vector (``get_flat_weights`` / ``set_flat_weights``), so a broadcast of
the whole model is one MPI call. Losses are plain functions ``(policy, batch) -> (loss, stats)``
that live with their algorithm.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from mpirl.errors import ConfigError
from mpirl.models.encoders import (
    Encoder,
    build_custom_model,
    head_sizes,
    model_options,
    observation_tensor,
)

# Torch-free halves of this module, imported from here as before they moved.
from mpirl.models.policy_spec import PolicySpec as PolicySpec
from mpirl.models.spaces import action_layout, env_actions
from mpirl.models.statistics import RunningMeanStd as RunningMeanStd
from mpirl.models.statistics import compute_gae as compute_gae

__all__ = ["FlatParameters", "Policy", "evaluate_batch", "actor_critic_model", "ACTIVATIONS", "mlp"]

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}


def mlp(sizes: list[int], activation: str, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        linear = nn.Linear(sizes[i], sizes[i + 1])
        last = i == len(sizes) - 2
        # Orthogonal init with a small output gain keeps the first policy near uniform.
        nn.init.orthogonal_(linear.weight, out_gain if last else np.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(ACTIVATIONS[activation]())
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
    """An actor and a critic over the encoder's features, or the user's ``custom_model``.

    The encoder comes from the observation space (``mpirl.models.encoders``): vectors are
    flattened and the actor and critic are separate MLPs on them; images go through one CNN that
    actor and critic share, with linear heads. Action spaces: Discrete (categorical),
    MultiDiscrete and MultiBinary (independent categoricals), Box (diagonal Gaussian with a
    state-independent log std, or the custom model's; the environment gets the action clipped to
    its bounds, the loss sees the unclipped sample).

    A custom model is ``Class(observation_space, action_space, config)`` whose ``forward(obs)``
    returns ``(distribution_inputs, value)``: logits for Discrete (concatenated per component
    for MultiDiscrete), mean and log std concatenated for Box; value ``[B]``.
    """

    def __init__(self, spec: PolicySpec) -> None:
        super().__init__()
        if spec.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                              f"got {spec.activation!r}")
        self.spec = spec
        obs_space, act_space = spec.observation_space, spec.action_space
        layout = action_layout(act_space)
        if layout is None:
            raise ConfigError(f"action space {act_space} is not supported; mpirl policies take "
                              f"Discrete, MultiDiscrete, MultiBinary and Box actions")
        self.kind, self.nvec, out = layout
        if self.kind == "box":
            self.register_buffer("action_low", torch.as_tensor(act_space.low, dtype=torch.float32))
            self.register_buffer("action_high",
                                 torch.as_tensor(act_space.high, dtype=torch.float32))
        # Distribution inputs: logits (per component for MultiDiscrete), or a Gaussian's mean
        # and, from a custom model, its log std.
        self.out_dim = 2 * out if self.kind == "box" and spec.model.custom_model else out
        self.custom: nn.Module | None = None
        self.lstm: nn.LSTMCell | None = None
        if spec.model.custom_model:
            if spec.critic_inputs:
                raise ConfigError("a centralized critic needs mpirl's own model; custom_model "
                                  "computes its value from the agent's observation")
            self.custom = build_custom_model(spec.model.custom_model, obs_space, act_space,
                                             spec.model.custom_model_config)
            self.encoder = None
            if spec.model.use_lstm:
                raise ConfigError("use_lstm wraps mpirl's own model; a custom_model keeps its "
                                  "own state if it needs one. Leave one of them out.")
            return
        if self.kind == "box":
            self.log_std = nn.Parameter(torch.zeros(out))
        # Parameter-free for vectors, so that their parameter order (log_std, actor, critic)
        # is what it was before encoders existed: older checkpoints load.
        self.encoder = Encoder(obs_space, spec.model)
        hidden = list(head_sizes(obs_space, spec.model, spec.hidden_sizes))
        features = self.encoder.out_dim
        if spec.model.use_lstm:
            if spec.critic_inputs:
                raise ConfigError("use_lstm and a centralized critic do not combine yet; leave "
                                  "one of them out")
            # Actor and critic share the recurrent core, stepped once per env step.
            self.lstm = nn.LSTMCell(features, spec.model.lstm_cell_size)
            features = spec.model.lstm_cell_size
        self.obs_dim = features
        self.actor = mlp([features, *hidden, out], spec.activation, out_gain=0.01)
        self.critic_dim = spec.critic_inputs or features
        self.critic = mlp([self.critic_dim, *hidden, 1], spec.activation, out_gain=1.0)

    # Observations and distributions.

    def encode(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A batch of observations as features ``[B, features]`` on the policy's device."""
        return self.encoder(obs)

    def heads(self, obs: Any, critic_obs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(distribution_inputs, values)`` of a batch of observations (with grad)."""
        if self.custom is not None:
            device = self.action_device()
            out = self.custom(observation_tensor(obs, self.spec.observation_space, device))
            if not isinstance(out, tuple | list) or len(out) != 2:
                raise TypeError(f"custom_model {self.spec.model.custom_model!r}: forward must "
                                f"return (distribution_inputs, value)")
            inputs, values = out
            rows = inputs.shape[0] if inputs.dim() else 0
            if inputs.dim() != 2 or inputs.shape[1] != self.out_dim or values.numel() != rows:
                raise TypeError(
                    f"custom_model {self.spec.model.custom_model!r}: forward returned "
                    f"distribution inputs {tuple(inputs.shape)} and value "
                    f"{tuple(values.shape)}; expected [B, {self.out_dim}] and [B]")
            return inputs, values.reshape(-1)
        x = self.encode(obs)
        return self.actor(x), self.critic(self.critic_input(x, critic_obs)).squeeze(-1)

    # Recurrent policies (use_lstm): a state [B, 2, cell] (h and c) per environment.

    @property
    def recurrent(self) -> bool:
        return self.lstm is not None

    def initial_state(self, count: int) -> np.ndarray:
        """Zero states for ``count`` environments (None for a memoryless policy)."""
        if self.lstm is None:
            return None
        return np.zeros((count, 2, self.lstm.hidden_size), np.float32)

    def _core(self, obs: Any, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One LSTM step: (features for the heads, the new state), both with grad."""
        x = self.encode(obs)
        state = torch.as_tensor(state, dtype=torch.float32, device=x.device)
        h, c = self.lstm(x, (state[:, 0], state[:, 1]))
        return h, torch.stack([h, c], 1)

    @torch.no_grad()
    def step(self, obs: np.ndarray, state: np.ndarray, deterministic: bool = False):
        """``act`` for a recurrent policy: ``(actions, log_probs, values, new_state)``."""
        core, new_state = self._core(obs, state)
        out, values = self.actor(core), self.critic(core).squeeze(-1)
        actions, logp = self._sample(self.distribution(out), deterministic)
        return (actions.cpu().numpy(), logp.cpu().numpy(), values.cpu().numpy(),
                new_state.cpu().numpy())

    def evaluate_sequences(self, obs: torch.Tensor, actions: torch.Tensor,
                           state_in: torch.Tensor, resets: torch.Tensor):
        """``(log_prob, entropy, value, final_state)`` along sequences (with grad): ``obs``
        ``[S, L, ...]``, ``state_in`` ``[S, 2, cell]`` the state before each sequence's first
        step, ``resets`` ``[S, L]`` 1 where a step starts an episode (its state starts at
        zero). The first three are ``[S, L]``; ``final_state`` follows the last step."""
        rows, length = resets.shape
        x = self.encode(obs.flatten(0, 1)).view(rows, length, -1)  # the encoder, batched
        state = torch.as_tensor(state_in, dtype=torch.float32, device=x.device)
        h, c = state[:, 0], state[:, 1]
        keep = (1.0 - resets.float()).unsqueeze(-1)
        outputs = []
        for t in range(length):
            h, c = self.lstm(x[:, t], (h * keep[:, t], c * keep[:, t]))
            outputs.append(h)
        core = torch.stack(outputs, 1).flatten(0, 1)
        dist = self.distribution(self.actor(core))
        logp, entropy = self.log_prob_entropy(dist, actions.flatten(0, 1))
        values = self.critic(core).squeeze(-1)
        return (logp.view(rows, length), entropy.view(rows, length), values.view(rows, length),
                torch.stack([h, c], 1))

    def values_after(self, obs: Any, state: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
        """Values of ``obs`` one step after ``state`` (zeroed where ``reset`` is 1)."""
        state = state * (1.0 - reset.float()).view(-1, 1, 1)
        return self.critic(self._core(obs, state)[0]).squeeze(-1)

    def action_device(self) -> torch.device:
        return next(self.parameters()).device

    def distribution(self, out: torch.Tensor):
        """The action distribution of ``distribution_inputs``."""
        if self.kind == "box":
            if self.custom is not None:
                mean, log_std = out.chunk(2, -1)
                return Normal(mean, log_std.clamp(-20, 2).exp())
            return Normal(out, self.log_std.exp().expand_as(out))
        if self.kind == "discrete":
            return Categorical(logits=out)
        return [Categorical(logits=part) for part in torch.split(out, self.nvec, dim=-1)]

    def log_prob_entropy(self, dist, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "box":
            actions = actions.reshape(dist.mean.shape)
            return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)
        if self.kind == "discrete":
            return dist.log_prob(actions.long()), dist.entropy()
        actions = actions.long().reshape(len(actions), -1)
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
        """``(log_prob, entropy, value)`` of ``actions`` under the current policy (with grad).
        A recurrent policy evaluates sequences instead (``evaluate_batch``)."""
        if self.lstm is not None:
            raise ValueError("a recurrent policy evaluates sequences: use evaluate_batch")
        out, values = self.heads(obs, critic_obs)
        logp, entropy = self.log_prob_entropy(self.distribution(out), actions)
        return logp, entropy, values

    def values(self, obs: Any, critic_obs: Any = None) -> torch.Tensor:
        """The critic's values of a batch of observations (with grad)."""
        if self.custom is not None:
            return self.heads(obs)[1]
        return self.critic(self.critic_input(self.encode(obs), critic_obs)).squeeze(-1)

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = False, critic_obs: Any = None):
        """Sample actions for a batch: ``(actions, log_probs, values)`` as NumPy arrays."""
        if self.lstm is not None:
            raise ValueError("a recurrent policy acts through step(obs, state)")
        out, values = self.heads(obs, critic_obs)
        actions, logp = self._sample(self.distribution(out), deterministic)
        return actions.cpu().numpy(), logp.cpu().numpy(), values.cpu().numpy()

    def _sample(self, dist, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
        return actions, self.log_prob_entropy(dist, actions)[0]

    @torch.no_grad()
    def value(self, obs: np.ndarray, critic_obs: Any = None, state: Any = None) -> np.ndarray:
        """Values of a batch; a recurrent policy takes each environment's ``state``."""
        if self.lstm is not None:
            return self.critic(self._core(obs, state)[0]).squeeze(-1).cpu().numpy()
        return self.values(obs, critic_obs).cpu().numpy()

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Actions as the environment takes them (``mpirl.models.spaces.env_actions``)."""
        return env_actions(self.spec.action_space, self.kind, actions)


#: Fields of a recurrent policy's batch that describe its sequences rather than its steps.
SEQUENCE_FIELDS = ("obs", "actions", "state_in", "resets", "mask", "critic_obs")


def evaluate_batch(policy: Policy, batch: dict[str, torch.Tensor]):
    """``(log_prob, entropy, value, steps)`` of a minibatch under ``policy`` (with grad), where
    ``steps`` holds the minibatch's per-step fields (``logp``, ``advantages``, ...) aligned with
    the first three. A memoryless policy's minibatch is rows of steps and comes back as it is;
    a recurrent policy's holds sequences ``[S, L]`` with a ``mask``, and only the steps the mask
    keeps come out, flat. Losses written on it serve both."""
    if "state_in" not in batch:
        return (*policy.evaluate(batch["obs"], batch["actions"], batch.get("critic_obs")),
                batch)
    logp, entropy, values, _ = policy.evaluate_sequences(batch["obs"], batch["actions"],
                                                         batch["state_in"], batch["resets"])
    keep = batch["mask"].reshape(-1) > 0
    steps = {k: v.flatten(0, 1)[keep] for k, v in batch.items() if k not in SEQUENCE_FIELDS}
    return logp.reshape(-1)[keep], entropy.reshape(-1)[keep], values.reshape(-1)[keep], steps


def actor_critic_model(observation_space: gym.Space, action_space: gym.Space, config: Any
                       ) -> PolicySpec:
    """The actor-critic policy of the config's model keys (``hidden_sizes``, ``activation``,
    the encoder and custom-model keys): the ``model_spec`` of PPO, A2C, IMPALA, A3C, BC and
    MARWIL."""
    return PolicySpec(observation_space, action_space, tuple(config.hidden_sizes),
                      config.activation, model=model_options(config))

