"""Board symmetries, to multiply training positions: tic-tac-toe's 8 and Connect Four's mirror.

A ``Symmetry`` maps a position's observation, legal mask and policy target together, so that an
augmented sample is a real position of the game with its own correct target. Each game's table
knows where its board sits in the observation (PettingZoo puts planes last, OpenSpiel first) and
how its actions index the board. A game not in the table has the identity only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from mpirl.algorithms.alphazero.games import Game


@dataclass(frozen=True)
class Symmetry:
    """One symmetry: ``observations`` maps arrays [..., *observation_shape]; action-indexed
    arrays (masks, policies, visit counts) [..., A] map by ``action_source``: the new value at
    action k is the old value at ``action_source[k]``."""

    name: str
    observations: Callable[[np.ndarray], np.ndarray]
    action_source: np.ndarray

    def actions(self, values: np.ndarray) -> np.ndarray:
        """Masks, policies or visit counts [..., A] of the transformed position."""
        return np.asarray(values)[..., self.action_source]

    def inverse_actions(self, values: np.ndarray) -> np.ndarray:
        """The inverse of ``actions``: from the transformed position's back to the original's."""
        values = np.asarray(values)
        out = np.empty_like(values)
        out[..., self.action_source] = values
        return out

    def action(self, action: int) -> int:
        """Where one move of the original position lands in the transformed one."""
        return int(np.flatnonzero(self.action_source == action)[0])

    def apply(self, observations: np.ndarray, masks: np.ndarray,
              policies: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch of training samples, transformed together."""
        return self.observations(observations), self.actions(masks), self.actions(policies)


def _identity(num_actions: int) -> Symmetry:
    return Symmetry("identity", lambda x: np.asarray(x), np.arange(num_actions))


def _square_board(size: int, axes: tuple[int, int]) -> list[Symmetry]:
    """The dihedral group of a ``size`` x ``size`` board whose cells are actions ``row * size +
    column`` in the order of the observation's board ``axes`` (negative: from the end)."""
    grid = np.arange(size * size).reshape(size, size)
    found = []
    for flipped in (False, True):
        for turns in range(4):
            def transform(x: np.ndarray, turns: int = turns, flipped: bool = flipped,
                          axes: tuple[int, int] = axes) -> np.ndarray:
                x = np.flip(x, axis=axes[0]) if flipped else x
                return np.ascontiguousarray(np.rot90(x, turns, axes=axes))
            name = ("flip+" if flipped else "") + f"rot{90 * turns}"
            source = transform(grid, axes=(0, 1)).ravel()
            found.append(Symmetry(name, transform, source))
    found[0] = Symmetry("identity", found[0].observations, found[0].action_source)
    return found


def _column_mirror(columns: int, column_axis: int) -> list[Symmetry]:
    """Identity and the left-right mirror of a board whose actions are its columns."""
    mirror = Symmetry("mirror", lambda x: np.ascontiguousarray(np.flip(x, axis=column_axis)),
                      np.arange(columns)[::-1].copy())
    return [_identity(columns), mirror]


#: Game id (OpenSpiel's without parameters) -> its symmetries. PettingZoo's tic-tac-toe
#: observation is [3, 3, planes] with action 3 * i + j at [i, j]; OpenSpiel's is [planes, 3, 3],
#: row-major. Connect Four's actions are its columns (any number in OpenSpiel's): PettingZoo's
#: observation is [6, 7, planes], OpenSpiel's [planes, rows, columns].
_TABLE: dict[str, Callable[[Game], list[Symmetry]]] = {
    "pettingzoo.classic.tictactoe_v3": lambda game: _square_board(3, (-3, -2)),
    "openspiel/tic_tac_toe": lambda game: _square_board(3, (-2, -1)),
    "pettingzoo.classic.connect_four_v3": lambda game: _column_mirror(7, -2),
    "openspiel/connect_four": lambda game: _column_mirror(game.num_actions, -1),
}


def symmetries(game: Game) -> list[Symmetry]:
    """The game's symmetries, identity first (only the identity for a game not in the table)."""
    make = _TABLE.get(game.name.partition("(")[0])
    return make(game) if make else [_identity(game.num_actions)]


def augment(table: Sequence[Symmetry], observations: np.ndarray, masks: np.ndarray,
            policies: np.ndarray, rng: np.random.Generator
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch of training samples, each under its own symmetry drawn uniformly from
    ``table`` (``symmetries(game)``): observation, mask and policy target of a sample move
    together; outcomes are unchanged by any symmetry, so they are not taken."""
    observations, masks, policies = (np.asarray(observations), np.asarray(masks),
                                     np.asarray(policies))
    if len(table) == 1:
        return table[0].apply(observations, masks, policies)
    choice = rng.integers(0, len(table), len(observations))
    out_obs, out_masks, out_policies = (np.empty_like(observations), np.empty_like(masks),
                                        np.empty_like(policies))
    # One call per symmetry over its samples, not one per sample.
    for index in np.unique(choice).tolist():
        rows = np.flatnonzero(choice == index)
        out_obs[rows], out_masks[rows], out_policies[rows] = table[index].apply(
            observations[rows], masks[rows], policies[rows])
    return out_obs, out_masks, out_policies
