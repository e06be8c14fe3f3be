"""AlphaZero's workers: self-play on the rollout ranks, and data-parallel learners, each with a
FIFO replay shard of positions.

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

``AlphaZeroLearner`` (a learner rank, or the driver's process) keeps the newest positions that
reach it in a FIFO shard of its own (``replay_capacity`` split over the learners), draws uniform
minibatches from it (``train_batch_size`` split over the learners), applies a random symmetry
of the game to each sample (``mpirl.search.symmetries``) and takes AdamW steps on
``alphazero_loss``; weight decay is AdamW's. With several learners every step's gradient is
averaged over them by the ``Learner``'s allreduce (``GradientAllreduce``, weighted by rows, so a
learner whose shard is still empty adds nothing), and batch norm's running statistics are
averaged after each call, so all learners hold identical weights. Each call that changes the
weights makes a new weights version; the positions trained on report their policy lag (that
version minus the one that played them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from mpi4py import MPI

from mpirl.data.dump_writer import DumpTarget
from mpirl.data.episode_recorder import EpisodeRecorder
from mpirl.data.tags import DataTags
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.alphazero import TorchEvaluator
from mpirl.models.alphazero_spec import AlphaZeroSpec
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.ulfm import bcast_weights
from mpirl.search.mcts import SearchConfig
from mpirl.search.players import Player, make_player, network_player, play_match
from mpirl.search.symmetries import augment, symmetries
from mpirl.workers.callbacks import Episode, invoke, make_callbacks
from mpirl.workers.delivery import IN_ANSWER, Delivery, ToLearnerOf, ToRank
from mpirl.workers.env_spec import GameEnvSpec
from mpirl.workers.learner import GradientAllreduce, LossFn
from mpirl.workers.self_play import SelfPlay, SelfPlayBatch

__all__ = ["AlphaZeroLearner", "MatchShare", "SelfPlayWorker"]


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


def search_config(config: Any) -> SearchConfig:
    """The self-play search of an AlphaZero config."""
    return SearchConfig(simulations=config.simulations, c_puct=config.c_puct,
                        gumbel=config.gumbel, temperature_moves=config.temperature_moves,
                        dirichlet_epsilon=config.dirichlet_epsilon)


@dataclass
class VersionedPositions:
    """A self-play batch on its way to a learner, with the version of the weights that played
    it (the driver's count of the learners' updates, ``AlphaZeroLearner.version``). A game
    still in play when new weights came is stamped with the newer version: its first moves'
    lag is counted one short."""

    batch: SelfPlayBatch
    version: int


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
    """Positions kept (the newest) by all learners together: each shard keeps its share."""
    seed: int
    torch_threads: int = 1
    backend: str = "auto"
    """The gradient allreduce over several learners: auto, mpi, gloo or nccl."""
    master_addr: str = ""
    """The address learner 0's TCPStore listens on (gloo, nccl); empty picks one."""

    @classmethod
    def from_config(cls, config: Any, *, policy: AlphaZeroSpec, loss: LossFn
                    ) -> AlphaZeroLearnerSettings:
        return cls(policy=policy, loss=loss, loss_config=config, lr=config.lr,
                   weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                   replay_capacity=config.replay_capacity, seed=config.seed,
                   torch_threads=config.torch_threads, backend=config.learner_backend,
                   master_addr=config.learner_master_addr)


class PositionReplay:
    """The newest ``capacity`` positions (a FIFO ring), sampled uniformly; each with the
    version of the weights that played it (``versions``)."""

    FIELDS = ("observations", "masks", "policies", "outcomes", "versions")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.arrays: dict[str, np.ndarray] = {}
        self.size = self.next = 0
        self.added = 0

    def add(self, batch: SelfPlayBatch, version: int = 0) -> None:
        """Add ``batch``'s positions, played by the weights of ``version``."""
        n = len(batch)
        if not n:
            return
        rows = batch.as_dict() | {"versions": np.full(n, version, np.int64)}
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
        """``count`` positions drawn uniformly (``FIELDS``, ``versions`` among them)."""
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
        if self.arrays and "versions" not in self.arrays:  # saved before versions were kept
            self.arrays["versions"] = np.zeros(self.capacity, np.int64)
        self.size = min(self.size, self.capacity)
        self.next = state["next"] % self.capacity
        self.added = state["added"]


class AlphaZeroLearner(Worker):
    """A replay shard of positions, AdamW on ``alphazero_loss`` with the gradient averaged over
    the learners, and (learner 0) the weight broadcast's source."""

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
        self.comm = context.role_comm
        learners = self.comm.Get_size()
        self.allreduce = GradientAllreduce(context, settings.backend, settings.master_addr)
        if learners > 1:  # every learner starts from learner 0's weights
            flat = self.model.get_flat_weights()
            self.comm.Bcast(flat, root=0)
            self.model.set_flat_weights(flat)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.lr,
                                           weight_decay=settings.weight_decay)
        self.replay = PositionReplay(-(-settings.replay_capacity // learners))
        self.rng = np.random.default_rng(settings.seed + 7919 * (1 + context.role_index))
        self.table: list = []
        self.sgd_steps_total = 0
        #: Weights versions made: calls of ``train`` that changed the weights.
        self.version = 0
        self.callbacks = make_callbacks(getattr(settings.loss_config, "callbacks", ""))

    def use_symmetries(self, env: GameEnvSpec) -> int:
        """Augment minibatches with the symmetries of ``env``'s game; how many it has."""
        self.table = symmetries(env.game())
        return len(self.table)

    def replay_size(self) -> int:
        return self.replay.size

    def train(self, sources: list[int], batches: list[VersionedPositions] | None,
              sgd_steps: int, batch_size: int, min_replay: int) -> dict[str, float]:
        """Add the positions of rollout ranks ``sources`` (received over the data channel) and
        of ``batches`` (given in the call) to this learner's shard; then, once the shards of all
        learners hold ``min_replay`` positions together, take ``sgd_steps`` AdamW steps, each on
        ``batch_size`` positions of this shard, with the gradient averaged over the learners
        (every learner must be called: each step is an allreduce). Mean loss statistics of this
        learner's minibatches; counts summed over the learners' shards (``replay_size``,
        ``positions_added``); ``weights_version`` after the call; ``policy_lag_mean``, the mean
        over the positions trained on of the version trained minus the one that played it."""
        received = (self.context.data_channel.recv_each(sources, DataTags().batch)
                    if sources else [])
        for positions in [*(batches or []), *received]:
            self.replay.add(positions.batch, positions.version)
        several = self.comm.Get_size() > 1
        total = sum(self.comm.allgather(self.replay.size)) if several else self.replay.size
        stats: dict[str, float] = {}
        steps = losses = 0
        lag = np.zeros(2)  # sum, positions
        rows: dict[str, np.ndarray] = {}
        if total >= max(min_replay, 1):
            self.model.train()
            for _ in range(sgd_steps):
                if self.replay.size:
                    rows = self.replay.sample(batch_size, self.rng)
                    versions = rows.pop("versions")
                    lag += (float((self.version - versions).sum()), len(versions))
                    losses += self._sgd_step(rows, stats)
                else:
                    self._sgd_step(None, stats)
                steps += 1
            self.model.eval()
            if several:
                self._share_buffers()
        if steps:
            self.version += 1
        self.sgd_steps_total += steps
        counts = np.array([self.replay.size, self.replay.added, *lag], np.float64)
        if several:
            self.comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
        means = {key: value / losses for key, value in stats.items()} if losses else {}
        result = {**means, "sgd_steps": steps, "sgd_steps_total": self.sgd_steps_total,
                  "replay_size": int(counts[0]), "positions_added": int(counts[1]),
                  "weights_version": self.version,
                  "policy_lag_mean": counts[2] / counts[3] if counts[3] else float("nan"),
                  "learner_samples": batch_size * losses}
        if self.callbacks is not None:  # with the call's last minibatch, as Learner's hook
            invoke(self.callbacks, "on_learn_on_batch",
                   f"learner {self.context.role_index} on rank {self.context.rank}",
                   learner=self, batch=rows, result=result)
        return result

    def _sgd_step(self, rows: dict[str, np.ndarray] | None, stats: dict[str, float]) -> bool:
        """One AdamW step on ``rows`` (None: this shard is empty, its learner adds no rows to
        the step the others take); the loss statistics added to ``stats``."""
        if rows is not None:
            if self.table:
                rows["observations"], rows["masks"], rows["policies"] = augment(
                    self.table, rows["observations"], rows["masks"], rows["policies"], self.rng)
            loss, step_stats = self.settings.loss(self.model, rows, self.settings.loss_config)
            self.optimizer.zero_grad()
            loss.backward()
            for key, value in step_stats.items():
                stats[key] = stats.get(key, 0.0) + float(value)
        if self.comm.Get_size() > 1 and not self._average_gradient(
                0 if rows is None else len(rows["outcomes"])):
            return False
        if self.settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip)
        self.optimizer.step()
        return rows is not None

    def _average_gradient(self, rows: int) -> bool:
        """Replace this learner's gradient (of a mean over ``rows`` positions) by that of all
        learners' rows: the ``Learner``'s allreduce. False when no learner had rows."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        flat, total = self.allreduce(flat, float(rows))
        if not total:
            return False
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return True

    def _share_buffers(self) -> None:
        """Average batch norm's running statistics over the learners (each updated them on its
        own minibatches), so that every learner's weights are the same."""
        buffers = [b for b in self.model.buffers() if b.dtype.is_floating_point]
        if not buffers:
            return
        flat, _ = self.allreduce(torch.cat([b.reshape(-1) for b in buffers]), 1.0)
        offset = 0
        for b in buffers:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()

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
        """Weights (with batch norm's statistics), AdamW's state, this learner's replay shard,
        the minibatch rng, the SGD step count and the weights version."""
        optimizer = {k: v for k, v in self.optimizer.state_dict().items()}
        optimizer["state"] = {k: {n: (t.cpu() if torch.is_tensor(t) else t)
                                  for n, t in s.items()}
                              for k, s in optimizer["state"].items()}
        return {"weights": self.model.get_flat_weights(), "optimizer": optimizer,
                "replay": self.replay.get_state(), "rng": self.rng.bit_generator.state,
                "sgd_steps_total": self.sgd_steps_total, "torch_rng": capture_rng(),
                "version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        self.model.set_flat_weights(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # the run's config decides these
            group["lr"] = self.settings.lr
            group["weight_decay"] = self.settings.weight_decay
        self.replay.set_state(state["replay"])
        self.rng.bit_generator.state = state["rng"]
        self.sgd_steps_total = state["sgd_steps_total"]
        self.version = state.get("version", 0)  # absent before weights were versioned
        restore_rng(state["torch_rng"])
