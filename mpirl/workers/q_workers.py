"""The Q-learning workers.

* ``TransitionWorker`` (``mpirl.workers.transition_worker``, torch-free): a ``RolloutWorker``
  that acts epsilon-greedily and sends its steps straight to a replay shard rank.
* ``QLearner``: a ``Learner`` that receives minibatches from replay shard ranks, takes one
  (allreduced) SGD step per minibatch against a target network, and sends the TD errors back to
  the shard each minibatch came from. (Ape-X's streamed learner, which asks the shards for
  minibatches itself, is Ape-X's own: ``mpirl.algorithms.q_learning.apex_learner``.)
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from mpirl.runtime.core import RankContext
from mpirl.runtime.ulfm import isend_to_survivors
from mpirl.workers.learner import Learner, LearnerSettings, minibatch_rows
from mpirl.workers.transition_worker import TransitionWorker

__all__ = ["QLearner", "TransitionWorker"]

class QLearner(Learner):
    """A learner on replay: minibatches from shard ranks, a target network, TD errors back."""

    MESSAGES = (*Learner.MESSAGES, "train_replay")

    def __init__(self, context: RankContext, settings: LearnerSettings) -> None:
        super().__init__(context, settings)
        self.target = copy.deepcopy(self.policy).requires_grad_(False)
        self.target_update_freq, self.tau = self.loss_config.target_updates()
        self.updates = 0
        self.posted = 0

    def train_replay(self, sources: list[int], messages: list[dict] | None,
                     priority_dests: dict[int, int | None], post_weights_to: list[int] = (),
                     post_every: int = 0, lr: float | None = None) -> dict[str, Any]:
        """Train on the minibatches replay ranks ``sources`` sent (or ``messages`` given in the
        call): one SGD step each, averaged over learners. The TD errors of shard k's minibatches
        go back to rank ``priority_dests[k]``, or in the result (``priorities``) where that is
        None. With ``post_weights_to``, learner 0 sends its weights to those rollout ranks every
        ``post_every`` updates, without waiting for them to be received. ``lr``: the learning
        rate from this call on (None keeps the one it has)."""
        self._set_lr(lr)
        received = list(messages or [])
        if sources:
            received += self.context.data_channel.recv_each(sources, self.tags.sample)
        totals: dict[str, float] = {}
        returned, steps = [], 0
        for message in received:
            if "error" in message:
                raise RuntimeError(message["error"])
            update = self._train_on_minibatches(message, totals)
            steps += len(message["batches"])
            dest = priority_dests.get(message["shard"])
            if dest is None:
                returned.append((message["shard"], update))
            else:
                self.context.data_channel.isend(update, dest, self.tags.priority)
        if self.context.data_channel is not None:
            self.context.data_channel.flush()
        self._post_weights(post_weights_to, post_every)
        stats = {k: v / max(steps, 1) for k, v in totals.items()}
        result = stats | {"sgd_steps": steps, "priorities": returned,
                          "num_target_updates": self.updates // self.target_update_freq}
        if received and received[-1].get("batches"):
            self.learned_on(received[-1]["batches"][-1], result)
        return result

    def _train_on_minibatches(self, message: dict, totals: dict[str, float]
                              ) -> dict[str, np.ndarray]:
        """One SGD step on each minibatch of a shard's ``message``; returns their TD errors as
        the priority update for that shard."""
        batches = message["batches"]
        errors = [self._replay_step(batch, totals) for batch in batches]
        return {"indices": np.concatenate([b["indices"] for b in batches]),
                "generations": np.concatenate([b["generations"] for b in batches]),
                "td": np.concatenate(errors)}

    def _post_weights(self, ranks: list[int], every: int) -> None:
        """Send the weights, with the SGD step count, to rollout ``ranks`` if ``every`` steps
        passed since the last post, without waiting (not to ranks that failed, under ULFM)."""
        if ranks and every and self.updates - self.posted >= every:
            # With the count of the ranks still alive, as far as this learner knows: a
            # throttled rank paces itself on the whole run's sampling.
            live = sum(rank not in self.failed_ranks for rank in ranks)
            isend_to_survivors(self.context.data_channel,
                               (self.updates, self.policy.get_flat_weights(), live),
                               list(ranks), self.tags.weights, self.failed_ranks)
            self.posted = self.updates

    def _replay_step(self, batch: dict[str, np.ndarray], totals: dict[str, float]
                     ) -> np.ndarray:
        tensors = self.transfer({k: v for k, v in batch.items()
                                 if k not in ("indices", "generations")})
        loss, td, stats = self.loss(self.policy, self.target, tensors, self.loss_config)
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self._apply_shared_gradient(minibatch_rows(tensors))
        self.updates += 1
        if self.tau < 1.0:  # soft update every step (SAC)
            with torch.no_grad():
                for mine, theirs in zip(self.target.parameters(), self.policy.parameters(),
                                        strict=True):
                    mine.lerp_(theirs, self.tau)
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
