"""AlphaZero's rollout worker: self-play on the rollout ranks.

``SelfPlayWorker`` (rollout ranks) keeps ``games_per_worker`` games in play in one
``SelfPlay`` with a ``TorchEvaluator``: the network runs in torch on these ranks (AlphaZero's
residual tower has no NumPy forward), one batched forward per simulation for all its games. It
takes the weights by the run's weight broadcast and delivers the positions of finished games,
stamped with the version of the weights that played them (``VersionedPositions``), where the
operator says (``mpirl.workers.delivery``): rollout worker i's to learner i mod L over the data
channel, or in its answer where the learner is in the driver's process (local mode,
``num_learners`` 0). The driver gets counts and game results only. It also plays its share of
the driver's evaluation and gating matches (``play_matches``), in models of their own, so that
self-play's games in progress go on untouched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from mpirl.algorithms.alphazero.game_env import GameEnvSpec
from mpirl.algorithms.alphazero.mcts import MCTSConfig
from mpirl.algorithms.alphazero.network import TorchEvaluator
from mpirl.algorithms.alphazero.players import Player, make_player, network_player, play_match
from mpirl.algorithms.alphazero.self_play import SelfPlay, SelfPlayBatch, VersionedPositions
from mpirl.algorithms.alphazero.spec import AlphaZeroSpec

from mpirl.data.dump_writer import DumpTarget
from mpirl.data.episode_recorder import EpisodeRecorder
from mpirl.data.tags import DataTags
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.ulfm import bcast_weights
from mpirl.workers.callbacks import Episode, invoke, make_callbacks
from mpirl.workers.delivery import IN_ANSWER, Delivery, ToLearnerOf, ToRank


@dataclass(frozen=True, kw_only=True)
class MatchShare:
    """One rollout rank's share of an evaluation or gating match (``play_matches``)."""

    opponent: str | np.ndarray
    """A player spec (``make_player``) or the flat weights of a network to play against."""
    games: int
    first: int
    """Of ``games``, how many the network moves first in."""
    seed: int
    """Seeds the share's rng: the opponent's, the search's and the order of the games."""
    simulations: int = 0
    """Search simulations a move for each network; 0 plays the raw policy."""
    gumbel: bool = False
    """Search with Gumbel's root search rather than PUCT."""
    weights: np.ndarray | None = None
    """The network's flat weights; None: the rank's current (self-play) ones."""
    opening_moves: int = 0
    """Uniformly random plies at the start of each game."""


@dataclass(frozen=True, kw_only=True)
class SelfPlaySettings:
    """What a self-play worker is built from; it crosses to each rollout rank once."""

    env: GameEnvSpec
    """The game, loaded on the rollout rank."""
    policy: AlphaZeroSpec
    search: MCTSConfig
    games_per_worker: int
    """Games in play at once on the rank, searched together."""
    seed: int
    """The run's seed; rollout worker i draws from ``seed + 1000 * i``."""
    torch_threads: int = 1
    dump: DumpTarget | None = None
    """Where the rank writes its self-play games (HDF5, one episode per game); None: nowhere."""
    callbacks: str = ""
    """The run's ``Callbacks`` class ("module:Class"): ``on_episode_end`` for each finished
    game, ``on_sample_end`` after each ``play``."""

    @classmethod
    def from_config(cls, config: Any, *, env: GameEnvSpec, policy: AlphaZeroSpec,
                    dump: DumpTarget | None = None) -> SelfPlaySettings:
        """The settings of a run with ``config`` (an AlphaZero config)."""
        return cls(env=env, policy=policy, search=search_config(config),
                   games_per_worker=config.games_per_worker, seed=config.seed,
                   torch_threads=config.torch_threads, dump=dump,
                   callbacks=config.callbacks)


def search_config(config: Any) -> MCTSConfig:
    """The self-play search of an AlphaZero config."""
    return MCTSConfig(simulations=config.simulations, c_puct=config.c_puct,
                        gumbel=config.gumbel, temperature_moves=config.temperature_moves,
                        dirichlet_epsilon=config.dirichlet_epsilon)


class SelfPlayWorker(Worker):
    """Plays games against itself on a rollout rank; delivers finished positions."""

    MESSAGES = ("play", "receive_weights", "set_weights", "get_weights", "save_state",
                "load_state", "finish_dump", "play_matches")

    Settings: ClassVar[type[SelfPlaySettings]] = SelfPlaySettings

    def __init__(self, context: RankContext, settings: SelfPlaySettings) -> None:
        super().__init__(context)
        torch.set_num_threads(settings.torch_threads)
        self.settings = settings
        self.game = settings.env.game()
        self.model = build_torch_model(settings.policy)
        self.model.eval()
        #: the network it searches with (``on_sample_end`` callbacks see it)
        self.policy = self.model
        self.weights = self.model.get_flat_weights()
        self.rng = np.random.default_rng(settings.seed + 1000 * context.role_index)
        self.games_finished = self.positions_finished = 0
        self.where = f"self-play worker {context.role_index} on rank {context.rank}"
        self.callbacks = make_callbacks(settings.callbacks)
        self.recorder: EpisodeRecorder | None = None
        if settings.dump is not None:
            observation_space, action_space = settings.env.spaces()
            self.recorder = EpisodeRecorder(
                settings.dump, context.role_index, settings.games_per_worker,
                settings.env.env_id, observation_space, action_space, settings.seed)
        self._match_models: list = []  # built when a match is first played
        self._start_games()

    def _start_games(self) -> None:
        self.self_play = SelfPlay(self.game, TorchEvaluator(self.model), self.settings.search,
                                  self.settings.games_per_worker, self.rng,
                                  recorder=self.recorder)

    def play(self, games: int, version: int = 0, deliver: Delivery = IN_ANSWER
             ) -> dict[str, Any]:
        """Play until at least ``games`` games have ended, with the weights of ``version``;
        deliver their positions as ``deliver`` says (in the answer, as ``batch``, or to a
        learner rank over the data channel). Returns the counts and each game's length and
        first player's return (``add_sample_metrics``'s keys), and ``play_s``."""
        start = time.perf_counter()
        batch = self.self_play.play(games)
        self.games_finished += batch.games
        self.positions_finished += len(batch)
        metrics: dict[str, Any] = {
            "env_steps": len(batch), "env_failures": 0,
            "episode_returns": [float(r) for r in batch.first_player_returns],
            "episode_lengths": [int(n) for n in batch.game_lengths],
            "play_s": time.perf_counter() - start}
        if self.callbacks is not None:
            metrics["custom_metrics"] = self._games_ended(batch)
        if self.recorder is not None:
            # Written and flushed before the driver hears of them: an indexed game is on disk.
            metrics["dumped"] = (self.recorder.path.name, self.recorder.flush())
        if self.callbacks is not None:
            rows = batch.as_dict()
            invoke(self.callbacks, "on_sample_end", self.where, worker=self,
                   batch={"obs": rows.pop("observations"), **rows}, metrics=metrics)
        positions = VersionedPositions(batch, version)
        if deliver is IN_ANSWER:
            metrics["batch"] = positions
        else:
            assert isinstance(deliver, ToRank | ToLearnerOf), deliver
            channel = self.context.data_channel
            channel.flush()
            channel.isend(positions, deliver.rank_for(self.context.role_index),
                          DataTags().batch)
        return metrics

    def _games_ended(self, batch: SelfPlayBatch) -> list[dict[str, float]]:
        """``on_episode_end`` for each game of ``batch`` (its return for the first player);
        the custom metrics each set."""
        custom = []
        for ret, length, slot in zip(batch.first_player_returns.tolist(),
                                     batch.game_lengths.tolist(), batch.game_slots.tolist(),
                                     strict=True):
            episode = Episode(float(ret), int(length), self.context.role_index, int(slot))
            invoke(self.callbacks, "on_episode_end", self.where, episode=episode, worker=self)
            custom.append({k: float(v) for k, v in episode.custom_metrics.items()})
        return custom

    def receive_weights(self) -> None:
        """Take part in the weight broadcast from learner 0 (a collective)."""
        bcast_weights(self.context.weights_comm, self.weights, self.context.collective_timeout_s)
        self.model.set_flat_weights(self.weights)

    def set_weights(self, flat: np.ndarray) -> None:
        self.weights = np.array(flat, np.float32)
        self.model.set_flat_weights(self.weights)

    def get_weights(self) -> np.ndarray:
        return self.weights.copy()

    def get_state(self) -> dict[str, Any]:
        """The weights, the rng, the counters and the games in play with their search trees:
        a resumed rank plays on as this one would have."""
        return {"weights": self.weights.copy(), "rng": self.rng.bit_generator.state,
                "games_finished": self.games_finished,
                "positions_finished": self.positions_finished, "torch_rng": capture_rng(),
                "games_in_play": self.self_play.get_state()}

    def set_state(self, state: dict[str, Any]) -> bool:
        self.set_weights(state["weights"])
        self.rng.bit_generator.state = state["rng"]
        self.games_finished = state["games_finished"]
        self.positions_finished = state["positions_finished"]
        restore_rng(state["torch_rng"])
        self._start_games()
        if self.settings.games_per_worker == len(state["games_in_play"]["in_play"]):
            self.self_play.set_state(state["games_in_play"])
        # else: a changed games_per_worker starts new games (the finished positions are kept)
        return True

    def finish_dump(self) -> tuple[str, list[tuple[int, int]]] | None:
        """At the end of a run: (file name, [(episode id, steps)]) of the games written but not
        reported yet, once all are on disk; None without a dump."""
        if self.recorder is None:
            return None
        return self.recorder.path.name, self.recorder.close()

    def play_matches(self, shares: list[MatchShare]) -> list[dict[str, int]]:
        """Play each share of a match (one after the other) with the network, from its side;
        each one's ``MatchResult.as_dict()``. Self-play's games in progress, its model and its
        rng are left as they were: the match has models and an rng of its own."""
        return [self._play_share(share) for share in shares]

    def _play_share(self, share: MatchShare) -> dict[str, int]:
        rng = np.random.default_rng(share.seed)
        agent = self._network_player(share.weights, share, rng, 0, "network")
        if isinstance(share.opponent, str):
            opponent = make_player(share.opponent, self.game, rng)
        else:
            opponent = self._network_player(share.opponent, share, rng, 1, "best network")
        return play_match(self.game, agent, opponent, share.games, rng, first=share.first,
                          opening_moves=share.opening_moves).as_dict()

    def _network_player(self, weights: np.ndarray | None, share: MatchShare,
                        rng: np.random.Generator, slot: int, name: str) -> Player:
        """A player with ``weights`` (None: this worker's current ones) in a match model of its
        own (``slot`` 0 or 1), searching as ``share`` says or, with 0 simulations, the raw
        policy."""
        if weights is None:
            weights = self.weights
        while len(self._match_models) <= slot:
            model = build_torch_model(self.settings.policy)
            model.eval()
            self._match_models.append(model)
        model = self._match_models[slot]
        model.set_flat_weights(np.asarray(weights, np.float32))
        return network_player(self.game, TorchEvaluator(model),
                              replace(self.settings.search, gumbel=share.gumbel),
                              share.simulations, rng, name=name)
