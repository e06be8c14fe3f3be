"""PETS's workers: rollout ranks that plan each action with CEM over the dynamics ensemble, and a
learner that keeps the real transitions and fits the ensemble to them.

``PlanningWorker`` steps its real envs through the rank's sampling core, acting with a
``PlanningModel`` (``mpirl.models.planner``; epsilon 1: uniformly random actions), and turns the
blocks of steps into transitions ``(obs, actions, rewards, next_obs, terminated)``: the next
observation of a step is the following step's, the block's ``last_obs`` for its last step, or
the final observation of a truncated episode. A step that ended its episode by termination has
no observed next state, and a failed step no transition: neither is kept. The transitions go
straight to the learner's rank over the data channel (or in the answer when both are in the
driver's process).

``DynamicsLearner`` keeps every transition it got (``buffer_size`` newest), trains the ensemble
with ``EnsembleTrainer`` on all of them at each ``train`` call, and is the root of the weight
broadcast: the whole ensemble (``pack_ensemble``), not only its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from mpirl.data.tags import DataTags
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.dynamics import DATASET_KEYS, DynamicsEnsemble, EnsembleTrainer
from mpirl.models.dynamics_spec import EnsembleTrainerSpec
from mpirl.models.planner import PETSSpec, pack_ensemble, unpack_ensemble
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.ulfm import bcast_weights
from mpirl.workers.callbacks import invoke
from mpirl.workers.learner import LossFn
from mpirl.workers.rollout import merge_sample_metrics
from mpirl.workers.transition_worker import TransitionWorker


def block_transitions(block: Any) -> dict[str, np.ndarray]:
    """A block's steps as transitions (see the module's docstring)."""
    obs, steps, slots = block.obs, block.steps, block.slots
    next_obs = np.empty_like(obs)
    next_obs[:-1] = obs[1:]
    next_obs[-1] = block.last_obs
    truncated = block.truncated & ~block.terminated & ~block.failed
    t_idx, s_idx = np.nonzero(truncated)  # row-major (t, slot): final_obs's order
    if len(t_idx):
        next_obs[t_idx, s_idx] = np.asarray(block.final_obs).reshape(len(t_idx), *obs.shape[2:])
    keep = ~block.failed & ~block.terminated & np.asarray(block.keep, bool)
    if block.active is not None:
        keep &= block.active
    rows = keep.reshape(-1)
    flat = (steps * slots,)
    return {"obs": obs.reshape(*flat, -1)[rows].astype(np.float32),
            "actions": np.asarray(block.actions, np.float32).reshape(*flat, -1)[rows],
            "rewards": np.asarray(block.rewards, np.float32).reshape(-1)[rows],
            "next_obs": next_obs.reshape(*flat, -1)[rows].astype(np.float32),
            "terminated": np.asarray(block.terminated, np.float32).reshape(-1)[rows]}


def concat_transitions(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([part[key] for part in parts]) for key in DATASET_KEYS}


class PlanningWorker(TransitionWorker):
    """A rollout rank of PETS: its envs act on CEM plans over the ensemble it was sent."""

    MESSAGES = (*TransitionWorker.MESSAGES, "sample_steps")

    def sample_steps(self, steps_per_env: int, epsilon: float, dest: int | None
                     ) -> dict[str, Any]:
        """Step every env ``steps_per_env`` times (``epsilon`` 1: random actions, else planned)
        and send the transitions to rank ``dest`` (None: in the answer, ``transitions``).
        Returns counts and episode metrics like ``sample``."""
        self.runner.set_epsilon(self.policy_id, epsilon)
        parts, metrics = [], None
        for block in self.runner.collect(self.policy_id, steps_per_env):
            parts.append(block_transitions(block))
            metrics = (block.metrics() if metrics is None
                       else merge_sample_metrics(metrics, block.metrics()))
        transitions = concat_transitions(parts)
        if self.callbacks is not None:
            invoke(self.callbacks, "on_sample_end", self.where, worker=self, batch=transitions,
                   metrics=metrics)
        if dest is None:
            metrics["transitions"] = transitions
        else:
            self.context.data_channel.flush()
            self.context.data_channel.isend(transitions, dest, DataTags().batch)
        return metrics


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
    """The real transitions, the ensemble and its trainer; the weight broadcast's root."""

    MESSAGES = ("add", "train", "get_weights", "set_weights", "broadcast_weights",
                "save_state", "load_state", "histograms", "size")

    Settings: ClassVar[type[DynamicsLearnerSettings]] = DynamicsLearnerSettings

    def __init__(self, context: RankContext, settings: DynamicsLearnerSettings) -> None:
        super().__init__(context)
        torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.model = DynamicsEnsemble(settings.policy.dynamics)
        self.trainer = EnsembleTrainer(self.model, settings.trainer, seed=settings.seed + 31)
        self.data: dict[str, np.ndarray] = {}
        self.added = 0
        self.iterations = 0

    def size(self) -> int:
        return len(self.data["obs"]) if self.data else 0

    def add(self, sources: list[int], batches: list[dict[str, np.ndarray]] | None) -> int:
        """Keep the transitions of rollout ranks ``sources`` (received over the data channel)
        and of ``batches`` (given in the call); the number kept in all."""
        received = (self.context.data_channel.recv_each(sources, DataTags().batch)
                    if sources else [])
        parts = [*(batches or []), *received]
        if self.data:
            parts.insert(0, self.data)
        if parts:
            joined = concat_transitions(parts)
            self.added += sum(len(p["obs"]) for p in parts) - self.size()
            self.data = {k: v[-self.settings.buffer_size:] for k, v in joined.items()}
        return self.size()

    def train(self) -> dict[str, float]:
        """Fit the ensemble to every transition kept (``EnsembleTrainer.train``); its held-out
        error (``model_error``), epochs, last training NLL and the elites' count."""
        self.iterations += 1
        if self.size() < 2:
            return {}
        stats = self.trainer.train(self.data)
        return {"model_error": stats["model_error"], "model_epochs": stats["epochs"],
                "model_train_nll": stats["train_nll"],
                "model_error_max": float(np.max(stats["member_mse"])),
                "transitions": self.size(), "model_epochs_total": self.trainer.trained_epochs}

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
        """The transitions, the ensemble with its trainer (optimizer, generator) and the torch
        rng; ``weights`` is the broadcast vector, which ``mpirl evaluate`` plans with."""
        return {"weights": pack_ensemble(self.model),
                "data": {k: v.copy() for k, v in self.data.items()}, "added": self.added,
                "trainer": self.trainer.get_state(), "iterations": self.iterations,
                "torch_rng": capture_rng()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.data = dict(state["data"])
        self.added = state["added"]
        self.trainer.set_state(state["trainer"])
        self.iterations = state["iterations"]
        restore_rng(state["torch_rng"])
