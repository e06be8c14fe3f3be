"""The driver's copy of ES's and ARS's weights (their ``LEARNER``): the first weights, broadcast to
the rollout ranks, and rank 0's part in each generation's collectives. It lives in the driver's
process and imports torch there; the rollout ranks keep their own weights
(``perturbation_worker``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from mpirl.algorithms.evolution.generation_record import UPDATE_ROOT
from mpirl.algorithms.evolution.spec import DirectPolicySpec

from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.gathered import (
    NO_WEIGHTS,
    RoundWaits,
    agreed_or_gathered,
    gather_answers,
    start_round,
)
from mpirl.runtime.ulfm import bcast_bytes, bcast_weights


@dataclass(frozen=True, kw_only=True)
class DriverWeightsSettings:
    """What the driver's copy of the weights is built from."""

    policy: DirectPolicySpec
    seed: int
    """Torch's seed for the first weights, which every rollout rank then takes."""
    zero_init: bool = False
    """Start from all-zero weights (ARS)."""

    @classmethod
    def from_config(cls, config: Any, *, policy: DirectPolicySpec, loss: None = None
                    ) -> DriverWeightsSettings:
        """The settings of a run with ``config``; derivative-free, it takes no ``loss``."""
        return cls(policy=policy, seed=config.seed, zero_init=getattr(config, "zero_init", False))


class DriverWeights(Worker):
    """The driver's copy of the weights (in its process): the first weights, broadcast to the
    rollout ranks at start-up, and, before each checkpoint, rollout worker 0's current ones, so
    that ``learner_0.pkl`` holds the policy that ``mpirl evaluate`` and ``export`` read."""

    MESSAGES = ("broadcast_weights", "take_update", "take_generation", "get_weights",
                "set_weights", "save_state", "load_state", "histograms", "end_rounds")

    Settings: ClassVar[type[DriverWeightsSettings]] = DriverWeightsSettings

    def __init__(self, context: RankContext, settings: DriverWeightsSettings) -> None:
        super().__init__(context)
        import torch

        from mpirl.models.torch_model import build_torch_model

        torch.manual_seed(settings.seed)
        self.policy = build_torch_model(settings.policy)
        self.generation_waits, self.update_waits = RoundWaits(), RoundWaits()
        if settings.zero_init:
            self.policy.set_flat_weights(np.zeros(self.policy.num_weights(), np.float32))

    def broadcast_weights(self) -> None:
        bcast_weights(self.context.weights_comm, self.policy.get_flat_weights(),
                      self.context.collective_timeout_s)

    def take_update(self) -> None:
        """The driver's part in the update's broadcast over weights_comm, in which it only
        receives (its copy of the weights is refreshed only before checkpoints), from
        ``PerturbationWorker.receive_update``."""
        bcast_bytes(self.context.weights_comm, None, self.context.collective_timeout_s,
                    "the update broadcast")

    def take_generation(self, round_header: Any = None) -> tuple[bytes, bool, Any]:
        """The driver's part in a generation's call (``PerturbationWorker.
        _generation_then_update``): it joins the gather of the records with nothing, takes the
        update the root broadcasts, and is the root of the ranks' comparison of their answers.
        Returns the update (b"" when a rank failed) and ``(True, the answer)`` if the answers
        agreed, else ``(False, their answers gathered)`` (``agreed_or_gathered``).
        With ``round_header`` it first starts the generation of the ranks' standing
        ``generation_rounds`` calls."""
        context = self.context
        if round_header is not None:
            start_round(context, round_header, NO_WEIGHTS)
        gather_answers(context, self.generation_waits, root=UPDATE_ROOT)
        message = bcast_bytes(context.weights_comm, None, context.collective_timeout_s,
                              "the update broadcast")
        return (message, *agreed_or_gathered(context, self.update_waits))

    def end_rounds(self) -> None:
        """End the rollout ranks' standing ``generation_rounds`` calls: an empty header."""
        start_round(self.context, None, NO_WEIGHTS)

    def get_weights(self) -> np.ndarray:
        return self.policy.get_flat_weights()

    def set_weights(self, flat: np.ndarray) -> None:
        self.policy.set_flat_weights(flat)

    def get_state(self) -> dict[str, Any]:
        return {"weights": self.policy.get_flat_weights()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.policy.set_flat_weights(state["weights"])

    def histograms(self) -> dict[str, np.ndarray]:
        return {f"weights/{name}": p.detach().numpy().reshape(-1)
                for name, p in self.policy.named_parameters()}
