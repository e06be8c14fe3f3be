"""AlphaZero's network, its evaluator for search, and its loss.

* ``AlphaZeroNet(spec)``: board planes go through a conv stem and ``spec.blocks`` residual blocks
  (conv-BN-ReLU-conv-BN plus the skip, as in AlphaGo Zero), then a policy head (1x1 conv, dense
  to ``num_actions`` logits) and a value head (1x1 conv, dense, tanh). Other observations go
  through an MLP trunk to the same two heads. ``forward(obs) -> (logits [B, A], values [B])``.
* ``TorchEvaluator(model)``: the network as ``mcts.Evaluator``: numpy in and out, one
  forward per call, no grad, eval mode (batch norm's running statistics), illegal moves'
  logits masked to -inf before the softmax.
* ``alphazero_loss(model, batch)``: cross-entropy of the masked policy with the search's target
  plus the value's squared error to the outcome z. AlphaZero's L2 term is left to the optimizer
  (``weight_decay`` of SGD or AdamW), so the loss is what the stats report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mpirl.algorithms.alphazero.spec import AlphaZeroSpec
from torch import nn

__all__ = ["AlphaZeroNet", "alphazero_loss"]


class _Block(nn.Module):
    """One residual block: conv-BN-ReLU-conv-BN, plus the input, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm0 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm0(self.conv0(x)))
        return torch.relu(x + self.norm1(self.conv1(y)))


class AlphaZeroNet(nn.Module):
    """The policy-value network of an ``AlphaZeroSpec``."""

    def __init__(self, spec: AlphaZeroSpec) -> None:
        super().__init__()
        self.spec = spec
        actions = spec.num_actions
        if spec.is_board:
            planes, height, width = spec.board_chw
            channels = spec.channels
            self.trunk: nn.Module = nn.Sequential(
                nn.Conv2d(planes, channels, 3, padding=1, bias=False),
                nn.BatchNorm2d(channels), nn.ReLU(),
                *[_Block(channels) for _ in range(spec.blocks)])
            cells = height * width
            self.policy_head: nn.Module = nn.Sequential(
                nn.Conv2d(channels, 2, 1, bias=False), nn.BatchNorm2d(2), nn.ReLU(),
                nn.Flatten(), nn.Linear(2 * cells, actions))
            self.value_head: nn.Module = nn.Sequential(
                nn.Conv2d(channels, 1, 1, bias=False), nn.BatchNorm2d(1), nn.ReLU(),
                nn.Flatten(), nn.Linear(cells, spec.value_hidden), nn.ReLU(),
                nn.Linear(spec.value_hidden, 1))
        else:
            layers: list[nn.Module] = [nn.Flatten()]
            width = int(np.prod(spec.observation_shape))
            for size in spec.hidden_sizes:
                layers += [nn.Linear(width, size), nn.ReLU()]
                width = size
            self.trunk = nn.Sequential(*layers)
            self.policy_head = nn.Linear(width, actions)
            self.value_head = nn.Sequential(nn.Linear(width, spec.value_hidden), nn.ReLU(),
                                            nn.Linear(spec.value_hidden, 1))

    def _tensors(self) -> list[torch.Tensor]:
        """What crosses ranks: the parameters, then batch norm's running means and variances
        (search evaluates in eval mode, on those statistics); not its batch counters."""
        return [*self.parameters(),
                *(b for b in self.buffers() if b.dtype.is_floating_point)]

    def num_weights(self) -> int:
        return sum(t.numel() for t in self._tensors())

    def get_flat_weights(self) -> np.ndarray:
        """Parameters and batch norm statistics as one float32 vector (a copy, on the CPU)."""
        return torch.cat([t.detach().reshape(-1).float() for t in self._tensors()]).cpu().numpy()

    @torch.no_grad()
    def set_flat_weights(self, flat: np.ndarray) -> None:
        flat_t = torch.as_tensor(np.asarray(flat, np.float32))
        if flat_t.numel() != self.num_weights():
            raise ValueError(f"weight vector has {flat_t.numel()} values, the network has "
                             f"{self.num_weights()}")
        offset = 0
        for t in self._tensors():
            n = t.numel()
            t.copy_(flat_t[offset:offset + n].view_as(t))
            offset += n

    def forward(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B, A], values [B] in [-1, 1])`` of observations as the game gives them."""
        x = observations.float()
        if self.spec.is_board and self.spec.channels_last:
            x = x.permute(0, 3, 1, 2)  # the game's [B, H, W, C] to conv's [B, C, H, W]
        features = self.trunk(x)
        values = torch.tanh(self.value_head(features)).squeeze(-1)
        return self.policy_head(features), values


def masked_logits(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits`` with illegal moves at -inf, so a softmax gives them probability 0."""
    return logits.masked_fill(~masks.bool(), float("-inf"))


class TorchEvaluator:
    """An ``AlphaZeroNet`` as search's ``Evaluator``: float32 numpy in and out, one forward per
    call under ``no_grad`` in eval mode. The model is shared, not copied: load new weights into
    it and the next call uses them."""

    def __init__(self, model: AlphaZeroNet, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)

    def __call__(self, observations: np.ndarray, masks: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        # Switching modes walks every submodule (a fifth of a search's time on tic-tac-toe,
        # one position a call): only a model left in training mode is switched, and back.
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            with torch.no_grad():
                obs = torch.as_tensor(np.asarray(observations, np.float32), device=self.device)
                legal = torch.as_tensor(np.asarray(masks, bool), device=self.device)
                logits, values = self.model(obs)
                # A row with no legal move (never asked by search) would be NaN: search falls
                # back to uniform priors for it.
                priors = torch.softmax(masked_logits(logits.float(), legal), dim=-1)
        finally:
            if was_training:
                self.model.train()
        return (priors.cpu().numpy().astype(np.float32, copy=False),
                values.float().cpu().numpy().astype(np.float32, copy=False))


def alphazero_loss(model: AlphaZeroNet, batch: Mapping[str, Any]
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """AlphaZero's loss on ``batch`` (``observations`` [B, ...], ``masks`` [B, A] bool,
    ``policies`` [B, A] summing to 1 over legal moves, ``outcomes`` [B] in {-1, 0, 1} for the
    mover): ``CE(target, softmax(masked logits)) + (z - v)^2``, batch means. L2 regularization
    is the optimizer's ``weight_decay``. Stats: ``policy_loss``, ``value_loss``,
    ``policy_entropy`` (of the network's masked policy) and ``loss``."""
    device = next(model.parameters()).device

    def tensor(key: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(batch[key]), device=device).to(dtype)

    observations = tensor("observations", torch.float32)
    masks = tensor("masks", torch.bool)
    targets = tensor("policies", torch.float32)
    outcomes = tensor("outcomes", torch.float32)
    logits, values = model(observations)
    log_probs = torch.log_softmax(masked_logits(logits, masks), dim=-1)
    # Illegal moves have log-probability -inf and target 0; 0 * -inf is NaN, so leave them out.
    policy_loss = -torch.where(masks, targets * log_probs, 0.0).sum(-1).mean()
    value_loss = F.mse_loss(values, outcomes)
    loss = policy_loss + value_loss
    with torch.no_grad():
        entropy = -torch.where(masks, log_probs.exp() * log_probs, 0.0).sum(-1).mean()
    return loss, {"loss": float(loss.detach()), "policy_loss": float(policy_loss.detach()),
                  "value_loss": float(value_loss.detach()), "policy_entropy": float(entropy)}
