"""AlphaZero's workers: self-play on the rollout ranks, and a learner with a FIFO replay of
positions.

``SelfPlayWorker`` (rollout ranks) keeps ``games_per_worker`` games in play in one
``SelfPlay`` with a ``TorchEvaluator``: the network runs in torch on these ranks (AlphaZero's
residual tower has no NumPy forward), one batched forward per simulation for all its games. It
takes the weights by the run's weight broadcast and returns the positions of finished games.
It also plays its share of the driver's evaluation and gating matches (``play_matches``), in
models of their own, so that self-play's games in progress go on untouched.

``AlphaZeroLearner`` (a learner rank, or the driver's process) keeps the newest
``replay_capacity`` positions in a FIFO window of its own, draws uniform minibatches, applies a
random symmetry of the game to each sample (``mpirl.search.symmetries``) and takes AdamW steps
on ``alphazero_loss``; weight decay is AdamW's. One learner only: the positions reach it through
the driver (no data-parallel SGD, no replay shards yet).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.alphazero import TorchEvaluator
from mpirl.models.alphazero_spec import AlphaZeroSpec
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.ulfm import bcast_weights
from mpirl.search.mcts import SearchConfig
from mpirl.search.players import Player, RawPolicyPlayer, SearchPlayer, make_player, play_match
from mpirl.search.symmetries import augment, symmetries
from mpirl.workers.env_spec import GameEnvSpec
from mpirl.workers.learner import LossFn
from mpirl.workers.self_play import SelfPlay, SelfPlayBatch


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
    search: SearchConfig
    games_per_worker: int
    """Games in play at once on the rank, searched together."""
    seed: int
    """The run's seed; rollout worker i draws from ``seed + 1000 * i``."""
    torch_threads: int = 1

    @classmethod
    def from_config(cls, config: Any, *, env: GameEnvSpec, policy: AlphaZeroSpec,
                    dump: Any = None) -> SelfPlaySettings:
        """The settings of a run with ``config`` (an AlphaZero config); ``dump`` is not used:
        self-play positions are no trajectory dataset."""
        return cls(env=env, policy=policy, search=search_config(config),
                   games_per_worker=config.games_per_worker, seed=config.seed,
                   torch_threads=config.torch_threads)


def search_config(config: Any) -> SearchConfig:
    """The self-play search of an AlphaZero config."""
    return SearchConfig(simulations=config.simulations, c_puct=config.c_puct,
                        gumbel=config.gumbel, temperature_moves=config.temperature_moves,
                        dirichlet_epsilon=config.dirichlet_epsilon)


class SelfPlayWorker(Worker):
    """Plays games against itself on a rollout rank; returns finished positions."""

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
        self.weights = self.model.get_flat_weights()
        self.rng = np.random.default_rng(settings.seed + 1000 * context.role_index)
        self.games_finished = self.positions_finished = 0
        self._match_models: list = []  # built when a match is first played
        self._start_games()

    def _start_games(self) -> None:
        self.self_play = SelfPlay(self.game, TorchEvaluator(self.model), self.settings.search,
                                  self.settings.games_per_worker, self.rng)

    def play(self, games: int) -> tuple[SelfPlayBatch, float]:
        """Play until at least ``games`` games have ended; their positions and the seconds it
        took."""
        start = time.perf_counter()
        batch = self.self_play.play(games)
        self.games_finished += batch.games
        self.positions_finished += len(batch)
        return batch, time.perf_counter() - start

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
        """The weights, the rng and the counters. The games in play are not saved (a few moves
        each): a restored worker starts new ones."""
        return {"weights": self.weights.copy(), "rng": self.rng.bit_generator.state,
                "games_finished": self.games_finished,
                "positions_finished": self.positions_finished, "torch_rng": capture_rng()}

    def set_state(self, state: dict[str, Any]) -> bool:
        self.set_weights(state["weights"])
        self.rng.bit_generator.state = state["rng"]
        self.games_finished = state["games_finished"]
        self.positions_finished = state["positions_finished"]
        restore_rng(state["torch_rng"])
        self._start_games()
        return True

    def finish_dump(self) -> None:
        return None

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
        evaluate = TorchEvaluator(model)
        if share.simulations:
            search = replace(self.settings.search, simulations=share.simulations,
                             gumbel=share.gumbel)
            return SearchPlayer(self.game, evaluate, search, rng, name=name)
        return RawPolicyPlayer(evaluate)


@dataclass(frozen=True, kw_only=True)
class AlphaZeroLearnerSettings:
    """What AlphaZero's learner is built from."""

    policy: AlphaZeroSpec
    loss: LossFn
    loss_config: Any
    lr: float
    weight_decay: float
    grad_clip: float
    replay_capacity: int
    """Positions kept (the newest)."""
    seed: int
    torch_threads: int = 1

    @classmethod
    def from_config(cls, config: Any, *, policy: AlphaZeroSpec, loss: LossFn
                    ) -> AlphaZeroLearnerSettings:
        return cls(policy=policy, loss=loss, loss_config=config, lr=config.lr,
                   weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                   replay_capacity=config.replay_capacity, seed=config.seed,
                   torch_threads=config.torch_threads)


class PositionReplay:
    """The newest ``capacity`` positions (a FIFO ring), sampled uniformly."""

    FIELDS = ("observations", "masks", "policies", "outcomes")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.arrays: dict[str, np.ndarray] = {}
        self.size = self.next = 0
        self.added = 0

    def add(self, batch: SelfPlayBatch) -> None:
        rows = batch.as_dict()
        n = len(batch)
        if not n:
            return
        if not self.arrays:
            self.arrays = {k: np.zeros((self.capacity, *v.shape[1:]), v.dtype)
                           for k, v in rows.items()}
        # Only the newest capacity rows of an oversized batch can stay.
        rows = {k: v[-self.capacity:] for k, v in rows.items()}
        kept = min(n, self.capacity)
        index = (self.next + np.arange(kept)) % self.capacity
        for key, value in rows.items():
            self.arrays[key][index] = value
        self.next = int((self.next + kept) % self.capacity)
        self.size = min(self.size + kept, self.capacity)
        self.added += n

    def sample(self, count: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        rows = rng.integers(0, self.size, count)
        return {k: v[rows] for k, v in self.arrays.items()}

    def get_state(self) -> dict[str, Any]:
        return {"arrays": {k: v[:self.size].copy() for k, v in self.arrays.items()},
                "size": self.size, "next": self.next, "added": self.added}

    def set_state(self, state: dict[str, Any]) -> None:
        self.arrays, self.size = {}, state["size"]
        for key, value in state["arrays"].items():
            full = np.zeros((self.capacity, *value.shape[1:]), value.dtype)
            kept = min(len(value), self.capacity)
            full[:kept] = value[:kept]
            self.arrays[key] = full
        self.size = min(self.size, self.capacity)
        self.next = state["next"] % self.capacity
        self.added = state["added"]


class AlphaZeroLearner(Worker):
    """Replay of positions, AdamW on ``alphazero_loss``, and the weight broadcast's source."""

    MESSAGES = ("train", "use_symmetries", "get_weights", "set_weights", "broadcast_weights",
                "save_state", "load_state", "histograms", "replay_size")

    Settings: ClassVar[type[AlphaZeroLearnerSettings]] = AlphaZeroLearnerSettings

    def __init__(self, context: RankContext, settings: AlphaZeroLearnerSettings) -> None:
        super().__init__(context)
        torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.device = torch.device(context.device)
        self.model = build_torch_model(settings.policy, context.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr,
                                           weight_decay=settings.weight_decay)
        self.replay = PositionReplay(settings.replay_capacity)
        self.rng = np.random.default_rng(settings.seed + 7919 * (1 + context.role_index))
        self.table: list = []
        self.sgd_steps_total = 0

    def use_symmetries(self, env: GameEnvSpec) -> int:
        """Augment minibatches with the symmetries of ``env``'s game; how many it has."""
        self.table = symmetries(env.game())
        return len(self.table)

    def replay_size(self) -> int:
        return self.replay.size

    def train(self, batches: list[SelfPlayBatch], sgd_steps: int, batch_size: int,
              min_replay: int) -> dict[str, float]:
        """Add ``batches`` to replay; then, once it holds ``min_replay`` positions,
        ``sgd_steps`` AdamW steps on minibatches of ``batch_size``. Mean loss statistics."""
        for batch in batches:
            self.replay.add(batch)
        stats: dict[str, float] = {}
        steps = 0
        if self.replay.size >= max(min_replay, 1):
            self.model.train()
            for _ in range(sgd_steps):
                rows = self.replay.sample(batch_size, self.rng)
                if self.table:
                    rows["observations"], rows["masks"], rows["policies"] = augment(
                        self.table, rows["observations"], rows["masks"], rows["policies"],
                        self.rng)
                loss, step_stats = self.settings.loss(self.model, rows,
                                                      self.settings.loss_config)
                self.optimizer.zero_grad()
                loss.backward()
                if self.settings.grad_clip:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   self.settings.grad_clip)
                self.optimizer.step()
                for key, value in step_stats.items():
                    stats[key] = stats.get(key, 0.0) + float(value)
                steps += 1
            self.model.eval()
        self.sgd_steps_total += steps
        means = {key: value / steps for key, value in stats.items()} if steps else {}
        return {**means, "sgd_steps": steps, "sgd_steps_total": self.sgd_steps_total,
                "replay_size": self.replay.size, "positions_added": self.replay.added}

    def get_weights(self) -> np.ndarray:
        return self.model.get_flat_weights()

    def set_weights(self, flat: np.ndarray) -> None:
        self.model.set_flat_weights(flat)

    def broadcast_weights(self) -> None:
        """The root of the weight broadcast to every rollout rank (a collective)."""
        bcast_weights(self.context.weights_comm, self.model.get_flat_weights(),
                      self.context.collective_timeout_s)

    def histograms(self) -> dict[str, np.ndarray]:
        return {f"weights/{name}": p.detach().cpu().numpy().reshape(-1)
                for name, p in self.model.named_parameters()}

    def get_state(self) -> dict[str, Any]:
        """Weights (with batch norm's statistics), AdamW's state, the replay window, the
        minibatch rng and the SGD step count."""
        optimizer = {k: v for k, v in self.optimizer.state_dict().items()}
        optimizer["state"] = {k: {n: (t.cpu() if torch.is_tensor(t) else t)
                                  for n, t in s.items()}
                              for k, s in optimizer["state"].items()}
        return {"weights": self.model.get_flat_weights(), "optimizer": optimizer,
                "replay": self.replay.get_state(), "rng": self.rng.bit_generator.state,
                "sgd_steps_total": self.sgd_steps_total, "torch_rng": capture_rng()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.model.set_flat_weights(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # the run's config decides these
            group["lr"] = self.settings.lr
            group["weight_decay"] = self.settings.weight_decay
        self.replay.set_state(state["replay"])
        self.rng.bit_generator.state = state["rng"]
        self.sgd_steps_total = state["sgd_steps_total"]
        restore_rng(state["torch_rng"])
