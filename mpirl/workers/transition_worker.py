"""The epsilon-greedy rollout worker of the Q-learning algorithms (DQN, Ape-X; SAC acts with it
too). It takes its policy's blocks of steps from the rank's sampling core like any rollout
worker, and sends them as chunks (observations, actions, rewards, terminations, truncations with
final observations) straight to a replay shard rank, not to a learner. New weights come from the
synchronous broadcast or, asynchronously, from the newest weights message learner 0 posted to
it. With a Q network ``NumpyQPolicy`` can run, its rank never imports torch.
"""

from __future__ import annotations

import time
from typing import Any

from mpirl.data.sample_tally import SampleTally
from mpirl.runtime.core import RankContext
from mpirl.runtime.ulfm import poll_any_source
from mpirl.runtime.waiting import Backoff
from mpirl.workers.callbacks import invoke
from mpirl.workers.env_runner import EXPLORE, EnvRunner
from mpirl.workers.postprocess import replay_chunk
from mpirl.workers.rollout import (
    RolloutWorker,
    SamplingSettings,
    empty_sample_metrics,
    merge_sample_metrics,
)

PACE_WAIT_S = 10.0
"""Longest a streaming worker waits for the learner before each chunk (``sample_transitions``'s
``pace``): a learner that posts nothing (lost, or stalled) slows sampling, never stops it."""


class TransitionWorker(RolloutWorker):
    """An epsilon-greedy rollout worker whose steps go to a replay shard."""

    MESSAGES = (*RolloutWorker.MESSAGES, "sample_transitions")
    ACTING = EXPLORE

    def __init__(self, context: RankContext, settings: SamplingSettings,
                 beside: EnvRunner | None = None) -> None:
        super().__init__(context, settings, beside)
        # Each chunk's number: a shard joins a chunk to this worker's streams only when it
        # stored the one numbered just before. Resetting the envs outside sampling skips a
        # number, and so does a chunk lost in flight at a checkpoint.
        self.chunks_sent = 0
        self.weights_taken = 0
        self.weights_version = 0  # learner 0's SGD step count when it posted these weights
        self.ranks_sampling: int | None = None  # rollout ranks alive, as learner 0 last said

    def _take_posted_weights(self) -> None:
        """Apply the newest weights learner 0 posted (asynchronous sync); older ones are
        skipped."""
        channel = self.context.data_channel
        newest = None
        # From any source: under ULFM, a failed rank anywhere must not raise here.
        while channel is not None and (
                item := poll_any_source(channel, self.tags.weights)) is not None:
            newest = item[0]
        if newest is not None:
            self.weights_version, flat, self.ranks_sampling = newest
            self.runner.set_weights(self.policy_id, flat)
            self.weights_taken += 1

    def sample_transitions(self, steps_per_env: int, epsilon: float, dest: int | None,
                           fragments: int | None = 1, stream_round: int | None = None,
                           pace: tuple[int, float, float] | None = None,
                           counted_only: bool | None = None) -> dict[str, Any]:
        """Step every environment ``steps_per_env`` times, epsilon-greedily; send the chunk of
        steps to replay rank ``dest`` (or return it in ``chunk`` when ``dest`` is None).
        Returns counts and episode metrics like ``sample``.

        With ``fragments`` > 1 (``dest`` a rank), up to that many chunks in a row, each sent as
        soon as it is done and each sampled with the newest weights posted by then; the answer
        sums their metrics (``RolloutWorker.stream_calls``) and says how many went (``fragments``).
        Once the driver's word to stop round ``stream_round`` came, no more are sampled.
        ``fragments`` None: until then.

        ``counted_only`` not None: each chunk carries its own metrics to the shard, as a
        ``SampleTally`` (its episodes only counted if ``counted_only``, an explorer's), and the
        answer has none but ``fragments``.

        ``pace`` is ``(num_workers, env_steps_ahead, sgd_steps_per_env_step)``: before each
        chunk the worker waits while the run's env steps, estimated as its own times
        ``num_workers``, exceed ``env_steps_ahead`` plus the steps that the learner's SGD steps
        (the count its last posted weights carry) cover, so that sampling does not run away
        from a learner short of CPU; it waits at most ``PACE_WAIT_S`` per chunk."""
        if fragments == 1 and stream_round is None:
            return self._sample_chunk(steps_per_env, epsilon, dest)

        def one_chunk() -> dict[str, Any]:
            if pace is not None:
                self._wait_for_learner(pace, steps_per_env * self.lane.slots, stream_round)
            return self._sample_chunk(steps_per_env, epsilon, dest, counted_only)

        total = self.stream_calls(fragments, stream_round, one_chunk)
        total["weights_taken"] = self.weights_taken
        total["weights_version"] = self.weights_version
        return total

    def _wait_for_learner(self, pace: tuple[int, float, float], chunk_steps: int,
                          stream_round: int | None) -> None:
        num_workers, ahead, per_env_step = pace
        if self.ranks_sampling:  # fewer once ranks were lost (ULFM)
            num_workers = min(num_workers, self.ranks_sampling)
        deadline = time.monotonic() + PACE_WAIT_S
        backoff = Backoff(spin_s=0.0, min_sleep_s=1e-3, max_sleep_s=0.02)
        while ((self.chunks_sent + 1) * chunk_steps * num_workers
               > ahead + self.weights_version / per_env_step
               and time.monotonic() < deadline):
            backoff.sleep()
            self._take_posted_weights()
            # A settle waits for this call: the stop word ends the wait (the chunk is sampled,
            # and the call ends after it).
            if self.stop_came(stream_round):
                return

    def _sample_chunk(self, steps_per_env: int, epsilon: float, dest: int | None,
                      counted_only: bool | None = None) -> dict[str, Any]:
        self._take_posted_weights()
        self.runner.set_epsilon(self.policy_id, epsilon)
        chunks, metrics = [], None
        for block in self.runner.collect(self.policy_id, steps_per_env):
            if block.after_reset:
                self.chunks_sent += 1  # the envs were reset: the streams start again
            chunks.append(replay_chunk(block, self.context.role_index, self.chunks_sent))
            self.chunks_sent += 1
            metrics = (block.metrics() if metrics is None
                       else merge_sample_metrics(metrics, block.metrics()))
        chunk = chunks[0] if len(chunks) == 1 else {"chunks": chunks}
        metrics["weights_taken"] = self.weights_taken
        metrics["weights_version"] = self.weights_version
        dumped = self.runner.take_dumped(self.policy_id)
        if dumped is not None:
            metrics["dumped"] = dumped
        if self.callbacks is not None:
            invoke(self.callbacks, "on_sample_end", self.where, worker=self, batch=None,
                   metrics=metrics)
        if counted_only is not None:
            chunk["metrics"] = SampleTally.of_chunk(metrics, counted_only)
            metrics = empty_sample_metrics()
        if dest is None:
            metrics["chunk"] = chunk
        else:
            self.context.data_channel.flush()
            self.context.data_channel.isend(chunk, dest, self.tags.insert)
        return metrics

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "chunks_sent": self.chunks_sent}

    def set_state(self, state: dict[str, Any]) -> bool:
        continued = super().set_state(state)
        # Environments restored with their episodes in progress continue their streams, so a
        # resumed run stores what one never stopped would; reset ones start new streams.
        self.chunks_sent = state.get("chunks_sent", 0) + (0 if continued else 1)
        return continued
