"""Ape-X's learner: a ``QLearner`` that, in streamed runs (``fragments_per_call``), asks the
serving shard ranks for minibatches itself, trains on them and reports each iteration to the
driver (``train_from_shards``), for as long as the driver lets its call run.

What crosses ranks: requests to the shards and their minibatches, the TD errors back, the weights
posted to the rollout ranks, and a report to the driver per iteration (all on the data channel).
"""

from __future__ import annotations

import time
from typing import Any

from mpirl.data.sample_tally import SampleTally
from mpirl.runtime.core import RankContext
from mpirl.runtime.host import DRIVER_RANK, latest_stopped_round
from mpirl.runtime.ulfm import flush_to_survivors, isend_to_survivors
from mpirl.runtime.waiting import Backoff
from mpirl.workers.learner import LearnerSettings
from mpirl.workers.q_workers import QLearner

REPLY_GRACE_S = 2.0
"""How long a streaming learner still waits for a shard's answer once told to stop."""


class ApexLearner(QLearner):
    """Ape-X's learner: ``QLearner``'s calls, and the streamed one, ``train_from_shards``."""

    MESSAGES = (*QLearner.MESSAGES, "train_from_shards")

    def __init__(self, context: RankContext, settings: LearnerSettings) -> None:
        super().__init__(context, settings)
        self.stopped_round = -1  # the driver's last word to stop (``train_from_shards``)
        self.shard_sizes: dict[int, int] = {}  # shard rank -> its rows, as it last said
        self.unanswered: dict[int, int] = {}  # shard rank -> requests given up on (stopped)

    def train_from_shards(self, stream_round: int, shards: list[int], batches_per_train: int,
                          batch_size: int, beta: float | None, pace: tuple[int, int, int, float],
                          min_rows: int, post_weights_to: list[int] = (), post_every: int = 0,
                          report: tuple[int, int, int] | None = None) -> dict[str, Any]:
        """Until the driver's word to stop ``stream_round`` comes: ask the serving shard ranks
        ``shards`` in turn for ``batches_per_train`` minibatches of ``batch_size`` rows
        (its sample-request tag), take one SGD step on each and send its TD errors back to its
        shard; post the weights to ``post_weights_to`` every ``post_every`` steps. A shard with
        fewer than ``min_rows`` rows is asked for none (its answer says how many it has).

        ``pace`` is ``(env_steps, sgd_steps, learning_starts, sgd_steps_per_env_step)``: the SGD
        steps taken stay within ``sgd_steps_per_env_step`` of the env steps stored past
        ``learning_starts``, those being ``env_steps`` (stored before this call) plus what the
        shards say they stored since. Returns the mean loss statistics and ``sgd_steps``.

        ``report`` is ``(env_steps, first_iteration, histograms_every)``: once the chunks whose
        metrics the shards' replies carried hold ``env_steps`` env steps, the learner sends the
        driver (its report tag) what the call returns, for the SGD steps and chunks since its
        last report: that is an iteration (``first_iteration`` the first), with the
        histograms every ``histograms_every`` iterations. The answer then covers what no report
        did. Each chunk's weights lag is its weights' SGD steps behind the learner's when the
        learner hears of it (``weights_lags``)."""
        channel = self.context.data_channel
        env_steps, sgd_before, learning_starts, per_env_step = pace
        served = dict.fromkeys(shards, 0)  # env steps each shard stored during its serve()
        sizes = self.shard_sizes  # as each shard last said, kept across calls
        totals: dict[str, float] = {}
        steps = turn = reported_steps = reports = 0
        tally, lags = SampleTally(), []
        idle = Backoff(spin_s=0.0, min_sleep_s=2e-4, max_sleep_s=0.01)
        while True:
            self.stopped_round = latest_stopped_round(channel, self.stopped_round,
                                                     self.tags.stop_stream)
            if stream_round <= self.stopped_round:
                break
            shard = shards[turn % len(shards)]
            turn += 1
            budget = ((env_steps + sum(served.values()) - learning_starts) * per_env_step
                      - sgd_before - steps)
            ask = batches_per_train if budget >= batches_per_train and \
                sizes.get(shard, 0) >= min_rows else 0
            # Every send of this loop survives a rollout rank's death (ULFM): a weight post to
            # it still pending fails the test of each later send on the channel.
            isend_to_survivors(channel, (ask, batch_size, beta), [shard], self.tags.sample_request,
                               self.failed_ranks)
            message = self._shard_reply(shard, stream_round)
            if message is None:  # stopped while waiting: the shard may have failed
                break
            if "error" in message:
                raise RuntimeError(message["error"])
            served[shard], sizes[shard] = message["env_steps_served"], message["size"]
            if (samples := message.get("samples")) is not None:
                # The versions turn into lags here; the driver gets the lags, not them.
                lags += [max(0, self.updates - v) for v in samples.weights_versions]
                samples.weights_versions = []
                tally.add(samples)
                if report is not None and tally.env_steps >= report[0]:
                    first, every = report[1], report[2]
                    update = self._report(totals, steps - reported_steps, tally, lags)
                    if every and (first + reports) % every == 0:
                        update["histograms"] = self.histograms()
                    isend_to_survivors(channel, update, [DRIVER_RANK], self.tags.report,
                                       self.failed_ranks)
                    reports, reported_steps = reports + 1, steps
                    totals, tally, lags = {}, SampleTally(), []
            if not message["batches"]:
                if turn % len(shards) == 0:
                    idle.sleep()  # nothing to train on yet: ask again a little later
                continue
            idle.reset()
            isend_to_survivors(channel, self._train_on_minibatches(message, totals), [shard],
                               self.tags.priority, self.failed_ranks)
            steps += len(message["batches"])
            self._post_weights(post_weights_to, post_every)
        flush_to_survivors(channel, self.failed_ranks)
        return self._report(totals, steps - reported_steps, tally, lags) | {"reports": reports}

    def _report(self, totals: dict[str, float], steps: int, tally: SampleTally,
                lags: list[int]) -> dict[str, Any]:
        stats = {k: v / max(steps, 1) for k, v in totals.items()}
        return stats | {"sgd_steps": steps, "samples": tally, "weights_lags": lags,
                        "num_target_updates": self.updates // self.target_update_freq}

    def _shard_reply(self, shard: int, stream_round: int) -> dict | None:
        """The answer of serving shard rank ``shard`` to this learner's last request, or None
        if it has not come ``REPLY_GRACE_S`` after the driver's word to stop ``stream_round``
        (the driver stops the shards only after the learner, so a live shard answers in time;
        one that failed answers nothing, and its error reaches the driver from its call). An
        answer given up on is taken, and dropped, before that shard's next one."""
        channel = self.context.data_channel
        backoff = Backoff()
        give_up_at = None
        while True:
            item = channel.poll(shard, self.tags.sample)
            if item is not None:
                if self.unanswered.get(shard):
                    self.unanswered[shard] -= 1
                    continue
                return item[0]
            if give_up_at is None:
                self.stopped_round = latest_stopped_round(channel, self.stopped_round,
                                                     self.tags.stop_stream)
                if stream_round <= self.stopped_round:
                    give_up_at = time.monotonic() + REPLY_GRACE_S
            elif time.monotonic() > give_up_at:
                self.unanswered[shard] = self.unanswered.get(shard, 0) + 1
                return None
            backoff.sleep()
