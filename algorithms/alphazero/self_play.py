"""Self-play for AlphaZero: many games at once, searched together, yielding finished positions.

``SelfPlay(game, evaluate, search_config, num_games, rng)`` keeps ``num_games`` games in play in
one ``BatchedMCTS``. Each ``step()`` searches every game once (one evaluation per simulation for
all of them), plays each game's chosen move, and returns the positions of the games that just
ended; an ended game's slot starts a new game at once, so the batch stays full.

A position is (observation, legal mask, policy target, outcome z): the observation and mask of
the state searched, the search's policy target (visit distribution under PUCT, the improved
policy under Gumbel), and z = that game's final return for the player who moved there (+1, 0 or
-1 in win/draw/loss games). Positions leave only when their game is over, since z is unknown
before.

Checkpointing (``get_state``/``set_state``): the games in play, their positions so far and
their search trees (``BatchedMCTS.get_state``) with the counters, so that a resumed run plays on
exactly as the interrupted one would have; the rng and the evaluator's weights are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpirl.algorithms.alphazero.games import Game
from mpirl.algorithms.alphazero.mcts import BatchedMCTS, Evaluator, MCTSConfig

from mpirl.data.episode_recorder import EpisodeRecorder
from mpirl.errors import ConfigError


@dataclass
class SelfPlayBatch:
    """Positions of finished games, concatenated game after game."""

    observations: np.ndarray
    """[N, *observation_shape] float32."""
    masks: np.ndarray
    """[N, A] bool: legal moves."""
    policies: np.ndarray
    """[N, A] float32: the search's policy target."""
    outcomes: np.ndarray
    """[N] float32: the game's result for the player to move at that position."""
    game_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """[G] int: moves in each finished game (its positions, in order, are the batch's)."""
    first_player_returns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """[G] float32: each finished game's return for the player who moved first."""
    game_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """[G] int: the slot (of the games in play at once) that played each finished game."""

    def __len__(self) -> int:
        return len(self.outcomes)

    @property
    def games(self) -> int:
        return len(self.game_lengths)

    def as_dict(self) -> dict[str, np.ndarray]:
        """The training fields, as ``alphazero_loss`` takes them."""
        return {"observations": self.observations, "masks": self.masks,
                "policies": self.policies, "outcomes": self.outcomes}

    def stats(self) -> dict[str, float]:
        """Game length and result statistics, for the metrics."""
        if not self.games:
            return {"games": 0}
        lengths, returns = self.game_lengths, self.first_player_returns
        return {"games": self.games, "positions": len(self),
                "game_length_mean": float(lengths.mean()),
                "game_length_min": int(lengths.min()), "game_length_max": int(lengths.max()),
                "first_player_wins": float((returns > 0).mean()),
                "draws": float((returns == 0).mean())}

    @staticmethod
    def concatenate(batches: list[SelfPlayBatch], game: Game) -> SelfPlayBatch:
        """One batch of several (an empty one, shaped for ``game``, from none)."""
        if not batches:
            return _empty(game)
        return SelfPlayBatch(*(np.concatenate([getattr(b, name) for b in batches])
                               for name in ("observations", "masks", "policies", "outcomes",
                                            "game_lengths", "first_player_returns",
                                            "game_slots")))


@dataclass
class VersionedPositions:
    """A self-play batch on its way to a learner, with the version of the weights that played
    it (the driver's count of the learners' updates, ``AlphaZeroLearner.version``). A game
    still in play when new weights came is stamped with the newer version: its first moves'
    lag is counted one short."""

    batch: SelfPlayBatch
    version: int


def _empty(game: Game) -> SelfPlayBatch:
    actions = game.num_actions
    return SelfPlayBatch(np.zeros((0, *game.observation_shape), np.float32),
                         np.zeros((0, actions), bool), np.zeros((0, actions), np.float32),
                         np.zeros(0, np.float32))


@dataclass
class _InPlay:
    """One slot's game so far."""

    observations: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    policies: list[np.ndarray] = field(default_factory=list)
    movers: list[int] = field(default_factory=list)


class SelfPlay:
    """``num_games`` games of ``game`` played against themselves with ``BatchedMCTS``."""

    def __init__(self, game: Game, evaluate: Evaluator, search_config: MCTSConfig,
                 num_games: int, rng: np.random.Generator, max_moves: int | None = None,
                 recorder: EpisodeRecorder | None = None) -> None:
        if num_games < 1:
            raise ConfigError(f"num_games must be at least 1, not {num_games}")
        if max_moves is not None and max_moves < 1:
            raise ConfigError(f"max_moves must be at least 1, not {max_moves}")
        self.game = game
        self.num_games = num_games
        self.max_moves = max_moves
        """A game this long ends as a draw for training (None: games end by their rules)."""
        self.games_finished = 0
        self.positions_finished = 0
        self.recorder = recorder
        """Where every move of every game goes, as one slot's episode per game (HDF5 dumps):
        the mover's observation, the move, the mover's reward (the outcome on the last move),
        and log pi of the search's policy target at the move."""
        if recorder is not None:
            recorder.begin()
        self._mcts = BatchedMCTS(game, evaluate, search_config, num_games, rng)
        self._in_play = [_InPlay() for _ in range(num_games)]
        for slot in range(num_games):
            self._mcts.reset(slot, game.new_initial_state())

    def step(self) -> SelfPlayBatch:
        """One move in every game; the positions of the games that ended (often none)."""
        slots = np.arange(self.num_games)
        for slot in slots.tolist():
            state = self._mcts.root_state(slot)
            record = self._in_play[slot]
            record.observations.append(np.asarray(state.observation(), np.float32))
            record.masks.append(np.asarray(state.legal_action_mask(), bool))
            record.movers.append(state.current_player())
        result = self._mcts.search(slots)
        if self.recorder is not None:
            observations = np.stack([record.observations[-1] for record in self._in_play])
            movers = np.array([record.movers[-1] for record in self._in_play])
        rewards = np.zeros(self.num_games, np.float32)
        terminated = np.zeros(self.num_games, bool)
        truncated = np.zeros(self.num_games, bool)
        finals: dict[int, np.ndarray] = {}
        finished = []
        for slot, action, policy in zip(slots.tolist(), result.actions.tolist(),
                                        result.policies, strict=True):
            record = self._in_play[slot]
            record.policies.append(policy)
            self._mcts.advance(slot, action)
            state = self._mcts.root_state(slot)
            ended = state.is_terminal()
            if ended or (self.max_moves is not None and len(record.movers) >= self.max_moves):
                returns = (np.asarray(state.returns(), np.float32) if ended
                           else np.zeros(2, np.float32))
                if self.recorder is not None:
                    rewards[slot] = returns[movers[slot]]
                    terminated[slot], truncated[slot] = ended, not ended
                    finals[slot] = state.observation_for(movers[slot])
                finished.append(self._finish(slot, returns))
        if self.recorder is not None:
            chosen = result.policies[slots, result.actions]
            logp = np.log(np.maximum(chosen, 1e-30)).astype(np.float32)
            self.recorder.step(observations, result.actions.astype(np.int64), rewards,
                               terminated, truncated, logp, finals, None)
        return SelfPlayBatch.concatenate(finished, self.game)

    def play(self, games: int) -> SelfPlayBatch:
        """Step until at least ``games`` games have ended; their positions (every game that
        ended in the last step is kept, so there may be a few more)."""
        batches: list[SelfPlayBatch] = []
        done = 0
        while done < games:
            batch = self.step()
            if batch.games:
                batches.append(batch)
                done += batch.games
        return SelfPlayBatch.concatenate(batches, self.game)

    def get_state(self) -> dict[str, Any]:
        """The games in play (positions so far and search trees) and the counters."""
        return {"in_play": [vars(record) for record in self._in_play],
                "mcts": self._mcts.get_state(), "games_finished": self.games_finished,
                "positions_finished": self.positions_finished}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue ``get_state()``'s games (the same number of games, the same game)."""
        if len(state["in_play"]) != self.num_games:
            raise ValueError(f"a checkpoint of {len(state['in_play'])} games in play cannot "
                             f"restore {self.num_games}")
        self._mcts.set_state(state["mcts"])
        if self.recorder is not None:
            self.recorder.untrack()  # their first moves are in the interrupted run's file
        self._in_play = [_InPlay(**record) for record in state["in_play"]]
        self.games_finished = state["games_finished"]
        self.positions_finished = state["positions_finished"]

    def _finish(self, slot: int, returns: np.ndarray) -> SelfPlayBatch:
        """Score the slot's positions by the game's returns and start a new game there."""
        record = self._in_play[slot]
        movers = np.asarray(record.movers)
        batch = SelfPlayBatch(observations=np.stack(record.observations),
                              masks=np.stack(record.masks),
                              policies=np.stack(record.policies).astype(np.float32),
                              outcomes=returns[movers].astype(np.float32),
                              game_lengths=np.array([len(movers)], np.int64),
                              first_player_returns=returns[:1].copy(),
                              game_slots=np.array([slot], np.int64))
        self._in_play[slot] = _InPlay()
        self._mcts.reset(slot, self.game.new_initial_state())
        self.games_finished += 1
        self.positions_finished += len(movers)
        return batch
