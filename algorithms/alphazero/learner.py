"""AlphaZero's data-parallel learner, each with a FIFO replay shard of positions.

``AlphaZeroLearner`` (a learner rank, or the driver's process) keeps the newest positions that
reach it in a FIFO shard of its own (``PositionReplay``; ``replay_capacity`` split over the
learners), draws uniform minibatches from it (``train_batch_size`` split over the learners),
applies a random symmetry of the game to each sample (``symmetries``) and takes AdamW steps on
``alphazero_loss``; weight decay is AdamW's. With several learners every step's gradient is
averaged over them as the ``Learner``'s are (``share_gradient``: weighted by rows, so a learner
whose shard is still empty adds nothing), and batch norm's running statistics are averaged
after each call, so all learners hold identical weights. Each call that changes the weights
makes a new weights version; the positions trained on report their policy lag (that version
minus the one that played them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from mpi4py import MPI
from mpirl.algorithms.alphazero.game_env import GameEnvSpec
from mpirl.algorithms.alphazero.replay import PositionReplay
from mpirl.algorithms.alphazero.self_play import VersionedPositions
from mpirl.algorithms.alphazero.spec import AlphaZeroSpec
from mpirl.algorithms.alphazero.symmetries import augment, symmetries

from mpirl.data.tags import DataTags
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.ulfm import bcast_weights
from mpirl.workers.callbacks import invoke, make_callbacks
from mpirl.workers.learner import GradientAllreduce, LossFn, share_gradient


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
        if self.comm.Get_size() > 1 and share_gradient(
                self.params, self.allreduce,
                0.0 if rows is None else float(len(rows["outcomes"]))) is None:
            return False
        if self.settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip)
        self.optimizer.step()
        return rows is not None

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
