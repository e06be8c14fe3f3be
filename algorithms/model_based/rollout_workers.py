"""The rollout ranks of the model-based plans: real steps as transitions, sent to the learner.

``RealStepWorker`` (PETS's) steps its real envs through the rank's sampling core, acting with
its model as an exploring actor (``epsilon`` 1: uniformly random actions), and turns the blocks
of steps into transitions (``mpirl.algorithms.model_based.transitions``). They go straight to
the learner's rank over the data channel (or in the answer when both are in the driver's
process). PETS's model is a ``PlanningModel``, so its every action is planned.

``ModelRolloutWorker`` (MBPO's) is one that also runs the branched model rollouts: it takes
start states (real ones, sampled by the learner and passed on by the driver:
``rollout_batch_size x obs`` floats, far less than the transitions they become), rolls the
actor through the ensemble it was last sent for k steps (``MBPOActor.branched_rollouts``) and
sends the model transitions to the learner the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from mpirl.algorithms.model_based.transitions import block_transitions, concat_transitions

from mpirl.data.tags import DataTags
from mpirl.runtime.core import RankContext
from mpirl.workers.callbacks import invoke
from mpirl.workers.env_runner import EXPLORE, EnvRunner
from mpirl.workers.rollout import (
    RolloutSettings,
    RolloutWorker,
    SamplingSettings,
    merge_sample_metrics,
)


class RealStepWorker(RolloutWorker):
    """A rollout rank whose real envs' steps go to the learner as transitions (PETS's: its
    model plans every action)."""

    MESSAGES = (*RolloutWorker.MESSAGES, "sample_steps")
    ACTING = EXPLORE

    @property
    def keep_terminated(self) -> bool:
        """Whether terminated steps are sent too: for a learned termination classifier."""
        return bool(self.policy.spec.dynamics.learn_termination)

    def sample_steps(self, steps_per_env: int, epsilon: float, dest: int | None
                     ) -> dict[str, Any]:
        """Step every env ``steps_per_env`` times (``epsilon`` 1: random actions, else the
        model's) and send the transitions to rank ``dest`` (None: in the answer,
        ``transitions``). Returns counts and episode metrics like ``sample``."""
        self.runner.set_epsilon(self.policy_id, epsilon)
        parts, metrics = [], None
        for block in self.runner.collect(self.policy_id, steps_per_env):
            parts.append(block_transitions(block, self.keep_terminated))
            metrics = (block.metrics() if metrics is None
                       else merge_sample_metrics(metrics, block.metrics()))
        transitions = concat_transitions(parts)
        if self.callbacks is not None:
            invoke(self.callbacks, "on_sample_end", self.where, worker=self, batch=transitions,
                   metrics=metrics)
        return self.deliver(transitions, dest, metrics)

    def deliver(self, transitions: dict[str, np.ndarray], dest: int | None,
                answer: dict[str, Any]) -> dict[str, Any]:
        """Send ``transitions`` to rank ``dest`` over the data channel, or (None: the receiver
        shares the driver's process) put them in ``answer`` as ``transitions``; ``answer``."""
        if dest is None:
            answer["transitions"] = transitions
        else:
            self.context.data_channel.flush()
            self.context.data_channel.isend(transitions, dest, DataTags().batch)
        return answer


class ModelRolloutWorker(RealStepWorker):
    """A rollout rank of MBPO: real steps with SAC's actor, and branched model rollouts."""

    MESSAGES = (*RealStepWorker.MESSAGES, "model_rollouts")
    #: SAC learns from terminated steps too (with a discount of 0).
    keep_terminated = True

    def __init__(self, context: RankContext, settings: SamplingSettings,
                 beside: EnvRunner | None = None) -> None:
        super().__init__(context, settings, beside)
        # A multi-agent policy's settings (beside the rank's sampling core) carry no seed.
        seed = settings.seed if isinstance(settings, RolloutSettings) else 0
        #: The model rollouts' draws (actions, members, model noise): checkpointed, so a
        #: resumed run rolls out what one never stopped would.
        self.model_rng = torch.Generator().manual_seed(seed * 1009 + 7 * context.role_index + 3)

    def model_rollouts(self, start_obs: np.ndarray, length: int, dest: int | None
                       ) -> dict[str, Any]:
        """Roll the actor through the ensemble for ``length`` steps from each of ``start_obs``
        and send the model transitions to rank ``dest`` (None: in the answer,
        ``transitions``); returns their count."""
        model = self.runner.actors[self.policy_id].model
        transitions = model.branched_rollouts(start_obs, length, self.model_rng)
        return self.deliver(transitions, dest, {"model_steps": len(transitions["obs"])})

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "model_rng": self.model_rng.get_state()}

    def set_state(self, state: dict[str, Any]) -> bool:
        continued = super().set_state(state)
        if "model_rng" in state:
            self.model_rng.set_state(state["model_rng"])
        return continued
