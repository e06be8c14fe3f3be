"""PETS's learner: it keeps the real transitions and fits the dynamics ensemble to them.

``DynamicsLearner`` keeps every transition it got (``buffer_size`` newest), trains the ensemble
with ``EnsembleTrainer`` on all of them at each ``train`` call, and is the root of the weight
broadcast: the whole ensemble (``pack_ensemble``), not only its parameters. With several learner
ranks each trains a block of the members (see the class).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from mpirl.algorithms.model_based.dynamics import (
    DynamicsEnsemble,
    EnsembleTrainer,
    model_columns,
    pack_ensemble,
    unpack_ensemble,
)
from mpirl.algorithms.model_based.dynamics_spec import EnsembleTrainerSpec
from mpirl.algorithms.model_based.planner import PETSSpec
from mpirl.algorithms.model_based.transitions import (
    append_transitions,
    check_finite,
    received_transitions,
)

from mpirl.errors import CheckpointError
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.ulfm import bcast_weights
from mpirl.workers.callbacks import invoke, make_callbacks
from mpirl.workers.learner import LossFn


@dataclass(frozen=True, kw_only=True)
class DynamicsLearnerSettings:
    """What PETS's learner is built from."""

    policy: PETSSpec
    trainer: EnsembleTrainerSpec
    buffer_size: int
    """Transitions kept (the newest)."""
    seed: int
    torch_threads: int = 1
    callbacks: str = ""

    @classmethod
    def from_config(cls, config: Any, *, policy: PETSSpec, loss: LossFn | None
                    ) -> DynamicsLearnerSettings:
        return cls(policy=policy, trainer=config.trainer_spec(), buffer_size=config.buffer_size,
                   seed=config.seed, torch_threads=config.torch_threads,
                   callbacks=config.callbacks)


class DynamicsLearner(Worker):
    """The real transitions, the ensemble and its trainer; the weight broadcast's root.

    With L learner ranks, every one keeps the same transitions (learner 0 receives them from
    the rollout ranks and broadcasts them over the learners' communicator) and trains only its
    block of the K members (``member_block``: contiguous, as one batched module); learner 0
    gathers the blocks into the whole ensemble after each ``train`` and chooses the elites among
    all members. With one learner (or in the driver's process) the whole ensemble is one
    module, trained at once."""

    MESSAGES = ("add", "train", "get_weights", "set_weights", "broadcast_weights",
                "save_state", "load_state", "histograms", "size")

    Settings: ClassVar[type[DynamicsLearnerSettings]] = DynamicsLearnerSettings

    def __init__(self, context: RankContext, settings: DynamicsLearnerSettings) -> None:
        super().__init__(context)
        torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.callbacks = make_callbacks(settings.callbacks)
        self.where = f"learner {context.role_index} on rank {context.rank}"
        # The whole ensemble on every learner, initialized alike (the same seed): a learner's
        # block starts as the same members that one learner would train.
        self.model = DynamicsEnsemble(settings.policy.dynamics)
        # Config refuses more learners than members: every learner has a block.
        k, learners = settings.policy.dynamics.ensemble_size, self.learners
        self.block = member_block(k, learners, context.role_index)
        self.shard = self.model
        agree = None
        if learners > 1:
            self.shard = DynamicsEnsemble(dataclasses.replace(
                settings.policy.dynamics, ensemble_size=len(self.block),
                elites=min(settings.policy.dynamics.elites, len(self.block))))
            for i, m in enumerate(self.block):
                self.shard.load_member_state(i, self.model.member_state(m))
            agree = self._agree
        self.trainer = EnsembleTrainer(self.shard, settings.trainer, seed=settings.seed + 31,
                                       member_ids=self.block, agree=agree)
        self.data: dict[str, np.ndarray] = {}
        self.added = 0
        self.iterations = 0

    @property
    def learners(self) -> int:
        """Learner ranks that share the ensemble (1 in the driver's process)."""
        return 1 if self.context.local else self.context.role_size

    def _agree(self, improved: bool, divergence: str | None) -> tuple[bool, str | None]:
        """Every learner's (some member improved, divergence message) this epoch, combined:
        one allgather over the learners' communicator."""
        answers = self.context.role_comm.allgather((improved, divergence))
        return (any(a for a, _ in answers),
                next((message for _, message in answers if message is not None), None))

    def size(self) -> int:
        return len(self.data["obs"]) if self.data else 0

    def add(self, sources: list[int], batches: list[dict[str, np.ndarray]] | None) -> int:
        """Keep the transitions of rollout ranks ``sources`` (received over the data channel)
        and of ``batches`` (given in the call); the number kept in all. With several learners
        every one is called: learner 0 receives (the others get no sources) and broadcasts the
        new transitions to the others over the learners' communicator. Non-finite values raise
        ``NonFiniteDataError`` on every learner alike."""
        parts = received_transitions(self.context, sources, batches)
        if self.learners > 1:
            parts = self.context.role_comm.bcast(
                parts if self.context.role_index == 0 else None, root=0)
        check_finite(parts)
        self.added += sum(len(p["obs"]) for p in parts)
        self.data = append_transitions(self.data, parts, self.settings.buffer_size)
        return self.size()

    def train(self) -> dict[str, float]:
        """Fit the ensemble to every transition kept (``EnsembleTrainer.train``); its held-out
        error (``model_error``), epochs, last training NLL and the elites' count. With several
        learners a collective over them: learner 0 answers for all, the others with {}."""
        self.iterations += 1
        if self.size() < 2:
            return {}
        stats = self.trainer.train(self.data)
        if self.callbacks is not None:  # this rank's members' training, before any gather
            invoke(self.callbacks, "on_learn_on_batch", self.where, learner=self,
                   batch=self.data, result=stats)
        if self.learners > 1:
            stats = self._gather(stats)
            if stats is None:
                return {}
        return {**model_columns(stats, self.trainer.trained_epochs), "transitions": self.size()}

    def _gather(self, stats: dict[str, Any]) -> dict[str, Any] | None:
        """Learner 0 gathers every block's members (weights, held-out errors, training NLLs)
        into the whole ensemble and chooses its elites; the others get None."""
        shard = self.shard
        mine = (self.block, [shard.member_state(i) for i in range(len(self.block))],
                stats["member_mse"], stats["member_train_nll"])
        blocks = self.context.role_comm.gather(mine, root=0)
        if blocks is None:
            return None
        k = self.model.spec.ensemble_size
        mse, nll = np.empty(k), np.empty(k)
        for block, states, block_mse, block_nll in blocks:
            for m, state, e, n in zip(block, states, block_mse, block_nll, strict=True):
                self.model.load_member_state(m, state)
                mse[m], nll[m] = e, n
        # The normalizers come from the same transitions on every learner: this one's are all's.
        with torch.no_grad():
            for name in ("input_mean", "input_std", "target_mean", "target_std"):
                getattr(self.model, name).copy_(getattr(shard, name))
        self.model.input_stats, self.model.target_stats = shard.input_stats, shard.target_stats
        self.model.elites = sorted(int(m) for m in np.argsort(mse, kind="stable")
                                   [:self.model.spec.elites])
        return {**stats, "member_mse": mse.tolist(), "member_train_nll": nll.tolist(),
                "elites": self.model.elites}

    def get_weights(self) -> np.ndarray:
        return pack_ensemble(self.model)

    def set_weights(self, flat: np.ndarray) -> None:
        unpack_ensemble(self.model, flat)

    def broadcast_weights(self) -> None:
        """The root of the weight broadcast to every rollout rank (a collective)."""
        bcast_weights(self.context.weights_comm, pack_ensemble(self.model),
                      self.context.collective_timeout_s)

    def histograms(self) -> dict[str, np.ndarray]:
        return {f"weights/{name}": p.detach().cpu().numpy().reshape(-1)
                for name, p in self.model.named_parameters()}

    def get_state(self) -> dict[str, Any]:
        """The transitions, this learner's members with their trainer (optimizer, generators)
        and the torch rng; ``weights`` is the broadcast vector (the whole ensemble on learner
        0), which ``mpirl evaluate`` plans with. Each learner writes its own: a run resumes
        with the same number of learners."""
        return {"weights": pack_ensemble(self.model),
                "data": {k: v.copy() for k, v in self.data.items()}, "added": self.added,
                "trainer": self.trainer.get_state(), "iterations": self.iterations,
                "torch_rng": capture_rng(), "block": list(self.block), "learners": self.learners,
                "ensemble": self.model.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        block = state.get("block", list(range(self.model.spec.ensemble_size)))
        if list(block) != list(self.block):
            written = state.get("learners", 1)
            raise CheckpointError(
                f"this checkpoint's ensemble was trained on {written} learner rank"
                f"{'s' if written > 1 else ''} (this one's members {_span(block)}), this run has "
                f"{self.learners} (members {_span(self.block)}): resume with num_learners "
                f"{written}")
        self.data = dict(state["data"])
        self.added = state["added"]
        self.trainer.set_state(state["trainer"])
        if "ensemble" in state and self.shard is not self.model:
            self.model.set_state(state["ensemble"])
        self.iterations = state["iterations"]
        restore_rng(state["torch_rng"])


def member_block(members: int, learners: int, index: int) -> list[int]:
    """The contiguous members learner ``index`` of ``learners`` trains (sizes differ by at most
    one)."""
    return [int(m) for m in np.array_split(np.arange(members), learners)[index]]


def _span(block: list[int]) -> str:
    return f"{block[0]}..{block[-1]}" if block else "none"

