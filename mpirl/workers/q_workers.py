"""The Q-learning workers.

* ``TransitionWorker`` (``mpirl.workers.transition_worker``, torch-free): a ``RolloutWorker``
  that acts epsilon-greedily and sends its steps straight to a replay shard rank.
* ``QLearner``: a ``Learner`` that receives minibatches from replay shard ranks, takes one
  (allreduced) SGD step per minibatch against a target network, and sends the TD errors back to
  the shard each minibatch came from.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from mpirl.data.replay_buffer import (
    PRIORITY_TAG,
    SAMPLE_TAG,
    WEIGHTS_TAG,
)
from mpirl.runtime.core import RankContext
from mpirl.workers.learner import Learner, minibatch_rows
from mpirl.workers.transition_worker import TransitionWorker

__all__ = ["QLearner", "TransitionWorker"]


class QLearner(Learner):
    """A learner on replay: minibatches from shard ranks, a target network, TD errors back."""

    MESSAGES = (*Learner.MESSAGES, "train_replay")
    #: Data-channel tags of minibatches in and TD errors out (a multi-agent policy's differ).
    sample_tag, priority_tag = SAMPLE_TAG, PRIORITY_TAG

    def __init__(self, context: RankContext, *args: Any, **kwargs: Any) -> None:
        super().__init__(context, *args, **kwargs)
        self.target = copy.deepcopy(self.policy).requires_grad_(False)
        # SAC has no such key: its soft update (tau) runs after every step.
        self.target_update_freq = getattr(self.loss_config, "target_network_update_freq", 1)
        self.updates = 0
        self.posted = 0

    def train_replay(self, sources: list[int], messages: list[dict] | None,
                     priority_dests: dict[int, int | None], post_weights_to: list[int] = (),
                     post_every: int = 0) -> dict[str, Any]:
        """Train on the minibatches replay ranks ``sources`` sent (or ``messages`` given in the
        call): one SGD step each, averaged over learners. The TD errors of shard k's minibatches
        go back to rank ``priority_dests[k]``, or in the result (``priorities``) where that is
        None. With ``post_weights_to``, learner 0 sends its weights to those rollout ranks every
        ``post_every`` updates, without waiting for them to be received."""
        received = list(messages or [])
        if sources:
            received += self.context.data_channel.recv_each(sources, self.sample_tag)
        totals: dict[str, float] = {}
        returned, steps = [], 0
        for message in received:
            if "error" in message:
                raise RuntimeError(message["error"])
            errors = []
            for batch in message["batches"]:
                errors.append(self._replay_step(batch, totals))
                steps += 1
            update = {"indices": np.concatenate([b["indices"] for b in message["batches"]]),
                      "generations": np.concatenate([b["generations"]
                                                     for b in message["batches"]]),
                      "td": np.concatenate(errors)}
            dest = priority_dests.get(message["shard"])
            if dest is None:
                returned.append((message["shard"], update))
            else:
                self.context.data_channel.isend(update, dest, self.priority_tag)
        if self.context.data_channel is not None:
            self.context.data_channel.flush()
        if post_weights_to and post_every and self.updates - self.posted >= post_every:
            flat = self.policy.get_flat_weights()
            for rank in post_weights_to:
                self.context.data_channel.isend((self.updates, flat), rank, WEIGHTS_TAG)
            self.posted = self.updates
        stats = {k: v / max(steps, 1) for k, v in totals.items()}
        result = stats | {"sgd_steps": steps, "priorities": returned,
                          "num_target_updates": self.updates // self.target_update_freq}
        if received and received[-1].get("batches"):
            self.learned_on(received[-1]["batches"][-1], result)
        return result

    def _replay_step(self, batch: dict[str, np.ndarray], totals: dict[str, float]
                     ) -> np.ndarray:
        tensors = self.transfer({k: v for k, v in batch.items()
                                 if k not in ("indices", "generations")})
        loss, td, stats = self.loss(self.policy, self.target, tensors, self.loss_config)
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self._apply_shared_gradient(minibatch_rows(tensors))
        self.updates += 1
        tau = getattr(self.loss_config, "tau", 1.0)
        if tau < 1.0:  # soft update every step (SAC)
            with torch.no_grad():
                for mine, theirs in zip(self.target.parameters(), self.policy.parameters(),
                                        strict=True):
                    mine.lerp_(theirs, tau)
        elif self.updates % self.target_update_freq == 0:
            self.target.load_state_dict(self.policy.state_dict())
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + float(value)
        return td.detach().cpu().numpy()

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "target": self.target.get_flat_weights(),
                "updates": self.updates, "posted": self.posted}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.target.set_flat_weights(state["target"])
        self.updates, self.posted = state["updates"], state["posted"]
