"""AlphaZero's network spec and a uniform evaluator: torch-free, for ranks that only search.

``AlphaZeroSpec`` is what every rank needs to build the same network;
``build_torch_model(spec)`` makes the torch ``AlphaZeroNet`` (``network``, named by the spec's
``NETWORK``).

Board layout: a rank-3 observation is a stack of board planes. PettingZoo's classic games give
them channels last (tic-tac-toe [3, 3, 2], Connect Four [6, 7, 2]); OpenSpiel's give them
channels first ([planes, rows, columns]). Shape alone cannot tell them apart (OpenSpiel's
tic-tac-toe is [3, 3, 3]), so ``alphazero_spec(game)`` sets ``channels_last`` from where the game
comes from, and the network moves channels first itself: observations cross ranks and sit in
replay exactly as the game gives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from mpirl.algorithms.alphazero.games import OPENSPIEL_PREFIX, Game

from mpirl.errors import ConfigError

__all__ = ["AlphaZeroSpec"]


@dataclass(frozen=True)
class AlphaZeroSpec:
    """What every rank needs to build the same AlphaZero network: a ResNet over board planes
    (rank-3 observations) or an MLP over anything else, with a policy head (logits [B, A]) and
    a value head (tanh, [B], from the mover's perspective)."""

    #: The torch module ``build_torch_model`` makes of it, by path: a spec imports no torch.
    NETWORK: ClassVar[str] = "mpirl.algorithms.alphazero.network:AlphaZeroNet"

    observation_shape: tuple[int, ...]
    """The game's ``observation_shape``."""
    num_actions: int
    """The game's ``num_actions``: policy logits have this length."""
    channels_last: bool = True
    """Board planes are [H, W, C] (PettingZoo) rather than [C, H, W] (OpenSpiel)."""
    channels: int = 32
    """Width of the residual tower (boards)."""
    blocks: int = 2
    """Residual blocks after the stem (boards)."""
    hidden_sizes: tuple[int, ...] = (128, 128)
    """The MLP trunk's widths (vector observations)."""
    value_hidden: int = 64
    """Width of the value head's hidden layer."""

    def __post_init__(self) -> None:
        if self.num_actions < 1:
            raise ConfigError(f"num_actions must be at least 1, not {self.num_actions}")
        if not self.observation_shape or min(self.observation_shape) < 1:
            raise ConfigError(f"observation_shape {self.observation_shape} has an empty axis")
        if self.channels < 1 or self.blocks < 0 or self.value_hidden < 1:
            raise ConfigError(f"channels ({self.channels}) and value_hidden "
                              f"({self.value_hidden}) must be positive, blocks ({self.blocks}) "
                              f"0 or more")
        if any(width < 1 for width in self.hidden_sizes):
            raise ConfigError(f"hidden_sizes {self.hidden_sizes} must be positive")

    @property
    def is_board(self) -> bool:
        """True when the trunk is the residual tower (rank-3 observations)."""
        return len(self.observation_shape) == 3

    @property
    def board_chw(self) -> tuple[int, int, int]:
        """The board's (channels, height, width), whichever order the game gives."""
        if not self.is_board:
            raise ValueError(f"observation shape {self.observation_shape} is not a board")
        a, b, c = self.observation_shape
        return (c, a, b) if self.channels_last else (a, b, c)


def alphazero_spec(game: Game, **options: object) -> AlphaZeroSpec:
    """The spec for ``game``, its board layout set from where the game comes from; ``options``
    are the other ``AlphaZeroSpec`` fields."""
    channels_last = not game.name.startswith(OPENSPIEL_PREFIX)
    return AlphaZeroSpec(observation_shape=tuple(game.observation_shape),
                         num_actions=game.num_actions, channels_last=channels_last,
                         **options)  # type: ignore[arg-type]


def uniform_evaluate(observations: np.ndarray, masks: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """An ``Evaluator`` with no network: uniform priors over the legal moves, value 0 (a draw).
    Search with it is plain MCTS without rollouts; for tests and as an untrained baseline."""
    masks = np.asarray(masks, bool)
    legal = masks.sum(axis=1, keepdims=True)
    priors = (masks / np.maximum(legal, 1)).astype(np.float32)
    return priors, np.zeros(len(masks), np.float32)
