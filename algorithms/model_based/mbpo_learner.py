"""MBPO's learner: it keeps both buffers and trains the ensemble and SAC.

Its rollout ranks (``ModelRolloutWorker``, ``rollout_workers``) send it real transitions, the
terminated steps included: SAC needs them (with a discount of 0), though the ensemble does not
(their next observation is unknown), and the model transitions of their branched rollouts.

``MBPOLearner`` is SAC's ``QLearner`` (its ``sac_loss`` steps and soft target updates) with the
real buffer (``buffer_size`` newest), the model buffer (FIFO, its capacity set by the driver at
each retrain), the dynamics ensemble and its ``EnsembleTrainer``. Its minibatches mix
``real_ratio`` real rows with model rows. It is the root of the weight broadcast: SAC's weights
and the whole ensemble in one vector (``MBPOActor``'s layout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from mpirl.algorithms.model_based.dynamics import (
    MODEL_STATS,
    DynamicsEnsemble,
    EnsembleTrainer,
    model_columns,
    pack_ensemble,
    unpack_ensemble,
)
from mpirl.algorithms.model_based.dynamics_spec import EnsembleTrainerSpec
from mpirl.algorithms.model_based.model_rollouts import MBPOSpec
from mpirl.algorithms.model_based.transitions import (
    append_transitions,
    check_finite,
    concat_transitions,
    received_transitions,
)

from mpirl.models.soft_q import SAC_STATS
from mpirl.runtime.core import RankContext
from mpirl.workers.learner import LearnerSettings, LossFn
from mpirl.workers.q_workers import QLearner


@dataclass(frozen=True, kw_only=True)
class MBPOLearnerSettings(LearnerSettings):
    """What MBPO's learner is built from: SAC's learner settings with ``policy`` the whole
    model's spec (``MBPOSpec``), and the ensemble trainer's."""

    trainer: EnsembleTrainerSpec
    buffer_size: int
    """Real transitions kept (the newest)."""
    real_ratio: float
    """Share of each SAC minibatch drawn from the real buffer."""
    train_batch_size: int
    gamma: float

    @classmethod
    def from_config(cls, config: Any, *, policy: MBPOSpec, loss: LossFn
                    ) -> MBPOLearnerSettings:
        # One learner, no allreduce: the backend keys keep their defaults.
        return cls(policy=policy, loss=loss, loss_config=config, lr=config.lr,
                   grad_clip=config.grad_clip, seed=config.seed,
                   torch_threads=config.torch_threads, trainer=config.trainer_spec(),
                   buffer_size=config.buffer_size, real_ratio=config.real_ratio,
                   train_batch_size=config.train_batch_size, gamma=config.gamma)


def _size(buffer: dict[str, np.ndarray]) -> int:
    return len(buffer["obs"]) if buffer else 0


class MBPOLearner(QLearner):
    """SAC on real and model transitions, the ensemble and its trainer, both buffers; the
    weight broadcast's root (see the module's docstring)."""

    MESSAGES = (*QLearner.MESSAGES, "add", "add_model", "train_model", "start_states",
                "train_sac", "sizes")

    Settings: ClassVar[type[MBPOLearnerSettings]] = MBPOLearnerSettings

    def __init__(self, context: RankContext, settings: MBPOLearnerSettings) -> None:
        # The SGD steps, the optimizer and the target critics are SAC's alone.
        super().__init__(context, dataclasses.replace(settings, policy=settings.policy.sac))
        self.settings = settings
        self.ensemble = DynamicsEnsemble(settings.policy.dynamics)
        self.model_trainer = EnsembleTrainer(self.ensemble, settings.trainer,
                                             seed=settings.seed + 31)
        self.real: dict[str, np.ndarray] = {}
        self.model_data: dict[str, np.ndarray] = {}
        self.model_capacity = 1
        self.model_stats = dict.fromkeys(MODEL_STATS, float("nan"))

    def sizes(self) -> dict[str, int]:
        return {"real_buffer_size": _size(self.real), "model_buffer_size": _size(self.model_data)}

    def add(self, sources: list[int], batches: list[dict[str, np.ndarray]] | None
            ) -> dict[str, int]:
        """Keep the real transitions of rollout ranks ``sources`` (over the data channel) and
        of ``batches`` (in the call); non-finite values raise ``NonFiniteDataError``."""
        parts = received_transitions(self.context, sources, batches)
        check_finite(parts)
        self.real = append_transitions(self.real, parts, self.settings.buffer_size)
        return self.sizes()

    def add_model(self, sources: list[int], batches: list[dict[str, np.ndarray]] | None,
                  capacity: int) -> dict[str, int]:
        """Keep the model transitions of ``sources`` and ``batches`` in the model buffer, whose
        capacity is now ``capacity`` (it follows the rollout length)."""
        self.model_capacity = max(1, int(capacity))
        self.model_data = append_transitions(
            self.model_data, received_transitions(self.context, sources, batches),
            self.model_capacity)
        return self.sizes()

    def train_model(self) -> dict[str, float]:
        """Fit the ensemble to the real transitions with an observed next state, and with
        ``learn_termination`` to the terminated ones too, for the classifier (their next state
        unknown: only their reward and termination are targets). A ``ModelDivergedError``
        from the trainer goes up as it is."""
        if self.ensemble.spec.learn_termination:
            data = self.real
        else:
            seen = self.real["terminated"] < 0.5
            data = {key: value[seen] for key, value in self.real.items()}
        if len(data["obs"]) < 2:
            return dict(self.model_stats)
        stats = self.model_trainer.train(data)
        self.model_stats = model_columns(stats, self.model_trainer.trained_epochs)
        return dict(self.model_stats)

    def start_states(self, count: int) -> np.ndarray:
        """``count`` observations drawn uniformly from the real buffer (the branch points)."""
        rows = self.rng.integers(_size(self.real), size=count)
        return self.real["obs"][rows]

    def _minibatch(self) -> dict[str, np.ndarray]:
        size = self.settings.train_batch_size
        n_model = _size(self.model_data)
        n_real = size if not n_model else int(round(size * self.settings.real_ratio))
        picks = []
        for buffer, count in ((self.real, n_real), (self.model_data, size - n_real)):
            if count:
                rows = self.rng.integers(_size(buffer), size=count)
                picks.append({key: value[rows] for key, value in buffer.items()})
        batch = concat_transitions(picks)
        return {"obs": batch["obs"], "actions": batch["actions"], "rewards": batch["rewards"],
                "next_obs": batch["next_obs"],
                "discounts": (self.settings.gamma * (1.0 - batch["terminated"])
                              ).astype(np.float32),
                "weights": np.ones(len(batch["obs"]), np.float32)}

    def train_sac(self, num_steps: int) -> dict[str, float]:
        """``num_steps`` SAC SGD steps on minibatches mixing real and model rows; the mean
        loss statistics and ``sgd_steps``."""
        totals: dict[str, float] = {}
        steps = num_steps if _size(self.real) else 0
        for _ in range(steps):
            self._replay_step(self._minibatch(), totals)
        stats = {key: totals.get(key, float("nan")) / steps if steps else float("nan")
                 for key in SAC_STATS}
        return stats | {"sgd_steps": float(steps)}

    # -- the weight vector: SAC's, then the ensemble's (MBPOActor's layout) --------------------

    def _vector(self) -> np.ndarray:
        return np.concatenate([self.policy.get_flat_weights(), pack_ensemble(self.ensemble)])

    def get_weights(self) -> np.ndarray:
        return self._vector()

    def set_weights(self, flat: np.ndarray) -> None:
        n = self.policy.num_weights()
        self.policy.set_flat_weights(flat[:n])
        unpack_ensemble(self.ensemble, flat[n:])

    def histograms(self) -> dict[str, np.ndarray]:
        values = super().histograms()
        values.update({f"model/{name}": p.detach().cpu().numpy().reshape(-1)
                       for name, p in self.ensemble.named_parameters()})
        return values

    def get_state(self) -> dict[str, Any]:
        """SAC's learner state with ``weights`` the broadcast vector (``mpirl evaluate`` acts
        with its SAC part), both buffers, the ensemble and its trainer."""
        state = super().get_state()
        return {**state, "weights": self._vector(),
                "real": {k: v.copy() for k, v in self.real.items()},
                "model_data": {k: v.copy() for k, v in self.model_data.items()},
                "model_capacity": self.model_capacity, "model_stats": dict(self.model_stats),
                "model_trainer": self.model_trainer.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        n = self.policy.num_weights()
        super().set_state({**state, "weights": state["weights"][:n]})
        self.model_trainer.set_state(state["model_trainer"])
        self.real = dict(state["real"])
        self.model_data = dict(state["model_data"])
        self.model_capacity = state["model_capacity"]
        self.model_stats = dict(state["model_stats"])
