"""Ape-X's own driver side: its per-worker epsilons and the asynchronous loops in which rollout,
replay and learner ranks run side by side (``AsyncReplayLoop``, and ``StreamedReplayLoop`` where
the answers gather), each the plan state of its run. The replay group and config checks are the
ones DQN and SAC share (``mpirl.execution.replay_ops``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpirl.algorithms.q_learning.network import DQN_STATS

from mpirl.data.sample_tally import SampleTally
from mpirl.errors import ConfigError, RemoteError
from mpirl.execution.async_ops import SHARED_RANKS_REFUSED, AsyncRequests, Done
from mpirl.execution.contract import PlanState
from mpirl.execution.operators import (
    SampleResult,
    add_sample_metrics,
    mean_stats,
    replay_dest,
)
from mpirl.execution.replay_ops import replay_beta
from mpirl.runtime.dispatch import Completions, Future, WorkerGroup
from mpirl.runtime.ulfm import poll_any_source
from mpirl.workers.env_guard import unwrap_env_failure


def apex_epsilons(num_workers: int, epsilon: float, alpha: float) -> list[float]:
    """Ape-X's fixed per-worker exploration: eps_i = epsilon ** (1 + alpha * i / (N - 1)).
    A lone worker takes the middle of that range, epsilon ** (1 + alpha / 2) (0.016 with the
    defaults): the paper's formula has no value for N = 1, and ``epsilon`` itself (0.4) explores
    so much that its episodes can never show what the greedy policy has learned."""
    if num_workers == 1:
        return [epsilon ** (1 + alpha / 2)]
    return [epsilon ** (1 + alpha * i / (num_workers - 1)) for i in range(num_workers)]


INSERT_CALLS_PER_ROUND = 4
"""Insert calls a replay shard gets per round of fragments from the rollout ranks it feeds on:
each carries a quarter of them (1 with up to 7 ranks per shard, as before; 4 with 16)."""


@dataclass
class UnsentInserts:
    """Fragments a shard's rollout ranks sampled that it has not been told to insert yet."""

    sources: list[int] = field(default_factory=list)  # ranks whose chunks wait on the data channel
    chunks: list[dict] = field(default_factory=list)  # chunks that came in the answers
    env_steps: int = 0

    @property
    def fragments(self) -> int:
        return len(self.sources) + len(self.chunks)


def replay_row(trainer: Any, sgd_steps_total: int, learner_stats: dict[str, float],
               lags: list[int]) -> dict[str, float]:
    """An Ape-X iteration's row: the learner's loss statistics (NaN where it took no step), the
    SGD steps so far, beta, and how many SGD steps older than the learner's (as the driver last
    heard) the weights were that each sampling call used (``lags``): the cost of the async
    sync."""
    config = trainer.config
    stats = dict.fromkeys(DQN_STATS, math.nan) | learner_stats
    stats["sgd_steps_total"] = sgd_steps_total
    if config.prioritized_replay:
        stats["prioritized_replay_beta"] = replay_beta(config, trainer.timesteps_total)
    stats["weights_lag_sgd_steps"] = float(np.mean(lags)) if lags else math.nan
    return stats


def count_transitions(trainer: Any, epsilon: float, least_epsilon: float,
                      metrics: dict[str, Any]) -> None:
    """Count a ``sample_transitions`` answer of a worker exploring with ``epsilon``: an
    explorer's episodes (epsilon above ``metrics_max_epsilon`` while some worker's is not) say
    little about the policy, so they are counted, not averaged."""
    sample = SampleResult()
    add_sample_metrics(sample, metrics)
    limit = trainer.config.metrics_max_epsilon
    if epsilon > limit and least_epsilon <= limit:
        trainer.episodes_total += len(sample.episode_returns)
        sample.episode_returns, sample.episode_lengths = [], []
        sample.custom_metrics = []
    trainer.count(sample)


class ApexState(PlanState):
    """What Ape-X's plan keeps: its replay shards, and the SGD steps of the training calls
    started so far. The count is checkpointed, so that a resumed run paces sampling against the
    learner from where it was rather than from 0 (which made the learner redo every SGD step
    while sampling waited)."""

    def __init__(self, replay: WorkerGroup) -> None:
        self.replay = replay
        self.sgd_steps_total = 0

    def groups(self) -> list[WorkerGroup]:
        return [self.replay]

    def get_state(self) -> dict[str, Any]:
        return {"sgd_steps_total": self.sgd_steps_total}

    def set_state(self, state: dict[str, Any]) -> None:
        self.sgd_steps_total = state.get("sgd_steps_total", 0)


class AsyncReplayLoop(ApexState):
    """Ape-X's asynchronous driver loop: sampling, storing and training overlap.

    Every rollout worker always has one ``sample_transitions`` call in flight, whose steps go to
    its replay shard; when it returns the driver tells the shard to store them and starts the
    next. The learners always have up to ``max_trains_in_flight`` ``train_replay`` calls queued,
    each fed by one shard (round-robin) with ``batches_per_train`` minibatches; the TD errors go
    back to the shard, which applies them at its next call. Learner 0 posts its weights to every
    rollout rank every ``weight_sync_every`` SGD steps; a rollout worker takes the newest at the
    start of its next call. Nobody waits on a collective. One iteration of the plan::

        while stored < min_env_steps_per_iteration:
            loop.start_sampling()
            loop.start_training()
            env_steps, results = loop.take_finished()
        row = loop.finish_iteration(all results)
    """

    def __init__(self, trainer: Any, replay: WorkerGroup, epsilons: list[float],
                 batches_per_train: int = 16, max_trains_in_flight: int = 2) -> None:
        super().__init__(replay)
        self.trainer, self.epsilons = trainer, epsilons
        self.config = trainer.config
        self.batches_per_train = batches_per_train
        self.max_trains_in_flight = max_trains_in_flight
        self.samples: dict[int, Any] = {}  # rollout index -> future
        self.trains: list[Any] = []
        # Rollout indices with no sample call running, and the calls that finished: the loop's
        # work per answer is O(1) in the rollout ranks.
        self.idle: list[int] = list(range(len(trainer.rollouts)))
        self.finished = Completions()
        self.inserts: list[Any] = []
        # Per shard. One insert call takes several fragments: rank 0 handles fewer messages.
        self.unsent_inserts: dict[int, UnsentInserts] = {}
        feeding = math.ceil(len(trainer.rollouts) / max(1, len(replay)))
        self.insert_batch = max(1, feeding // INSERT_CALLS_PER_ROUND)
        self.next_shard = 0
        self.stored = [0] * len(replay)  # env steps each shard was told to insert
        # SGD steps of the training calls that have returned; from a checkpoint, the count it
        # holds (the learner saved after every call started before)
        self.sgd_done = 0
        self.lags: list[int] = []
        self.weight_ranks = [w.rank for w in trainer.rollouts if not w.in_process]

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.sgd_done = self.sgd_steps_total

    def _start_sample(self, i: int) -> None:
        worker = self.trainer.rollouts[i]
        shard = self.replay[i % len(self.replay)]
        self.samples[i] = worker.call_async("sample_transitions",
                                            self.config.rollout_fragment_length,
                                            self.epsilons[i], replay_dest(worker, shard))
        self.finished.watch(self.samples[i], i)

    def _start_train(self, shard: Any) -> None:
        replay, learners = self.replay, self.trainer.learners
        rows = max(1, self.config.train_batch_size // len(learners))
        for learner in learners:
            dest = replay_dest(shard, learner)
            sent = shard.call_async("sample", self.batches_per_train, rows, dest,
                                    replay_beta(self.config, self.trainer.timesteps_total))
            messages = [sent.result()] if dest is None else None
            dests = {k: replay_dest(learner, s) for k, s in enumerate(replay)}
            post = self.weight_ranks if learner.index == 0 else []
            entry = (shard, learner.call_async(
                "train_replay", [] if dest is None else [shard.rank], messages, dests, post,
                self.config.weight_sync_every))
            self.trains.append(entry)
            self.finished.watch(entry[1], entry)
        self.sgd_steps_total += self.batches_per_train

    def start_sampling(self) -> None:
        """A sample call on every idle rollout worker, unless training calls run and
        sampling is too far ahead of them (``throttle_sampling``)."""
        if self.idle and (self._may_sample() or not self.trains):
            for i in self.idle:
                self._start_sample(i)
            self.idle = []

    def start_training(self) -> None:
        """Training calls, up to ``max_trains_in_flight``, each fed by the next shard with rows,
        while their SGD steps stay within ``sgd_steps_per_env_step`` of the env steps stored
        past ``learning_starts``."""
        config = self.config
        budget = (self.trainer.timesteps_total - config.learning_starts) * \
            config.sgd_steps_per_env_step
        while (len(self.trains) < self.max_trains_in_flight
               and self.sgd_steps_total + self.batches_per_train <= budget
               and (shard := self._next_shard()) is not None):
            self._start_train(shard)

    def take_finished(self) -> tuple[int, list[dict[str, float]]]:
        """Wait for the first calls to finish. Returns the env steps the sample calls among
        them stored (their fragments are counted and sent to be inserted) and the statistics
        of the training calls among them (their TD errors go back to their shards)."""
        finished = self.finished.take(waiting_on=itertools.chain(
            self.samples.values(), (f for _, f in self.trains)))
        env_steps, results = 0, []
        # Samples first, then training calls, each in the order they finished.
        for i in [item for item in finished if isinstance(item, int)]:
            env_steps += self._stored(i, self.samples.pop(i))
            self.idle.append(i)
        for entry in [item for item in finished if not isinstance(item, int)]:
            self.trains.remove(entry)
            results.append(self._trained(*entry))
        return env_steps, results

    def finish_iteration(self, results: list[dict[str, float]]) -> dict[str, float]:
        """Send the fragments left over to be inserted, raise the error of an insert that
        failed, and return the iteration's row of the training calls' ``results``."""
        for k in list(self.unsent_inserts):
            self._insert(k)
        self._check_inserts()
        stats = replay_row(self.trainer, self.sgd_steps_total, mean_stats(results), self.lags)
        self.lags = []
        return stats

    def _may_sample(self) -> bool:
        """With ``throttle_sampling``, sampling waits while it is more than one round of calls
        ahead of what the learner has trained on (at ``sgd_steps_per_env_step``)."""
        config, trainer = self.config, self.trainer
        if not config.throttle_sampling:
            return True
        rounds = len(trainer.rollouts) * config.num_envs_per_worker * \
            config.rollout_fragment_length
        covered = config.learning_starts + self.sgd_steps_total / config.sgd_steps_per_env_step
        return trainer.timesteps_total < covered + 2 * rounds

    def _next_shard(self) -> Any:
        """The next shard, round-robin, among those holding a few minibatches' worth of rows
        (a shard that no rollout worker feeds is never asked)."""
        replay = self.replay
        for _ in range(len(replay)):
            k = self.next_shard % len(replay)
            self.next_shard += 1
            if self.stored[k] >= 4 * self.config.train_batch_size:
                return replay[k]
        return None

    def _stored(self, i: int, future: Any) -> int:
        try:
            metrics = future.result()
        except RemoteError as error:
            raise unwrap_env_failure(error) from None
        worker = self.trainer.rollouts[i]
        if self.weight_ranks:
            self.lags.append(max(0, self.sgd_done - metrics["weights_version"]))
        chunk = metrics.get("chunk")
        k = i % len(self.replay)
        unsent = self.unsent_inserts.setdefault(k, UnsentInserts())
        if chunk:
            unsent.chunks.append(chunk)
        else:
            unsent.sources.append(worker.rank)
        unsent.env_steps += metrics["env_steps"]
        if unsent.fragments >= self.insert_batch:
            self._insert(k)
        count_transitions(self.trainer, self.epsilons[i], min(self.epsilons), metrics)
        return metrics["env_steps"]

    def _insert(self, k: int) -> None:
        """Tell shard ``k`` to store the fragments that came for it since its last insert."""
        unsent = self.unsent_inserts.pop(k)
        self.inserts.append(self.replay[k].call_async("insert", unsent.sources,
                                                      unsent.chunks or None))
        # Counted once asked for: a training call is never sent to a shard still empty.
        self.stored[k] += unsent.env_steps

    def _check_inserts(self) -> None:
        """Forget the insert calls that finished, raising the error of one that failed (a
        shard that could not store its rows must not go unnoticed)."""
        running = []
        for future in self.inserts:
            if future.done(poll=False):
                future.result()
            else:
                running.append(future)
        self.inserts = running

    def _trained(self, shard: Any, future: Any) -> dict[str, float]:
        result = future.result()
        self.sgd_done += result["sgd_steps"]
        updates = [update for _, update in result.pop("priorities")]
        if updates:
            shard.call_async("update_priorities", 0, updates).result()
        rollouts = self.trainer.rollouts
        if not self.weight_ranks and len(rollouts):  # world size 1: no data channel
            weights = self.trainer.learners[0].call("get_weights")
            for worker in rollouts:
                worker.call("set_weights", weights)
        return result


class StreamedReplayLoop(ApexState):
    """Ape-X with ``fragments_per_call``: rank 0 reads one message per iteration, however many
    rollout ranks there are.

    Every call runs from one checkpoint to the next. Each rollout rank's
    ``sample_transitions`` call samples chunk after chunk and sends each to its shard with the
    chunk's metrics (a ``SampleTally``). Each shard's ``serve`` call stores the chunks as they
    come, from any rank, answers the learner's requests for minibatches with the metrics of
    the chunks stored since its last answer, and applies the TD errors. The learner's
    ``train_from_shards`` call asks the shards in turn, trains, sends the TD errors back, posts
    weights to the rollout ranks and, each time the metrics it was given hold
    ``min_env_steps_per_iteration`` env steps, reports an iteration to rank 0 (its report tag).
    The learner keeps its SGD steps within ``sgd_steps_per_env_step`` of the steps the shards
    say they stored, and with ``throttle_sampling`` each rollout rank waits, before a chunk,
    while it is too far ahead of the SGD steps its learner's posted weights say were taken
    (``_pace``). Before a checkpoint (and at the end of a run) ``settle`` stops the calls: the
    rollout calls first, then the learner, then the shards, which first store every chunk
    sent to them."""

    SETTLE_WAIT_S = 10.0
    """Longest a shard waits, before a checkpoint, for the chunks sent to it but not yet stored."""

    def __init__(self, trainer: Any, replay: WorkerGroup, epsilons: list[float],
                 fragments_per_call: int, batches_per_train: int = 16) -> None:
        super().__init__(replay)
        learners, rollouts = trainer.learners, trainer.rollouts
        if any(worker.shares_rank for worker in rollouts):
            raise ConfigError(SHARED_RANKS_REFUSED.format(policy=trainer.policy_id))
        if len(learners) != 1 or any(w.in_process for w in (*learners, *replay, *rollouts)):
            raise ConfigError(
                "fragments_per_call streams chunks to replay ranks and minibatches to one "
                "learner rank, each on a rank of its own; this layout has workers in the "
                "driver's process or more than one learner. Give num_learners 1, "
                "num_replay_shards >= 1 and enough ranks for them and the rollout workers, or "
                "set fragments_per_call 0")
        self.trainer, self.epsilons, self.config = trainer, epsilons, trainer.config
        self.fragments = fragments_per_call
        self.batches_per_train = batches_per_train
        self.round = 0  # the serve and train calls' rounds: each ends at a stop word
        self.settles = 0  # the rollout calls' rounds: bumped by each settle
        self.serving: list[Future] = []  # the shards' serve calls, then the learner's, running
        self.ended = Completions()  # those of them that ended
        self.reports = 0  # the learner's reports taken from its running call
        self.sent: dict[int, int] = {}  # rollout rank -> chunks it said it sent, since settled
        self.reported_histograms: dict[str, np.ndarray] = {}
        limit, least = self.config.metrics_max_epsilon, min(epsilons)

        def make_args(worker: Any) -> tuple:
            epsilon = epsilons[worker.index]
            return (self.config.rollout_fragment_length, epsilon,
                    replay[worker.index % len(replay)].rank, None, self.settles, self._pace(),
                    bool(epsilon > limit and least <= limit))

        self.requests = AsyncRequests(rollouts, "sample_transitions", 1, make_args)

    def _pace(self) -> tuple[int, float, float] | None:
        """With ``throttle_sampling``, what each rollout rank waits on before a chunk (see
        ``TransitionWorker.sample_transitions``): sampling may run two rounds of
        ``fragments_per_call`` chunks per rank ahead of the learner's SGD steps, and far
        enough past ``learning_starts`` to fill every shard to what the learner asks of it (so
        that the learner always has rows and a budget)."""
        config = self.config
        if not config.throttle_sampling:
            return None
        workers = len(self.trainer.rollouts)
        round_steps = (workers * config.num_envs_per_worker * config.rollout_fragment_length
                       * self.fragments)
        fill = 4 * config.train_batch_size * len(self.replay)
        ahead = config.learning_starts + 2 * round_steps + fill
        return workers, float(ahead), config.sgd_steps_per_env_step

    def next_report(self, min_env_steps: int) -> dict[str, float]:
        """Wait for the learner's next report (``min_env_steps`` env steps stored since the
        last); return its statistics. The calls are started first where none runs."""
        try:
            if not self.serving:
                self._start_serving(min_env_steps)
            self.requests.top_up()
            report = self._next_report()
        except BaseException:
            # An env that failed too often, say: stop every call, so that the job's shutdown
            # finds the ranks free, then let the error end the run.
            self._stop_all()
            raise
        self.reports += 1
        return self._take_report(report)

    def _start_serving(self, min_env_steps: int) -> None:
        trainer, config, replay = self.trainer, self.config, self.replay
        self.serving = [shard.call_async("serve", self.round) for shard in replay]
        self.serving.append(trainer.learners[0].call_async(
            "train_from_shards", self.round, replay.ranks, self.batches_per_train,
            max(1, config.train_batch_size), replay_beta(config, trainer.timesteps_total),
            (trainer.timesteps_total, self.sgd_steps_total, config.learning_starts,
             config.sgd_steps_per_env_step),
            4 * config.train_batch_size, [w.rank for w in trainer.rollouts],
            config.weight_sync_every,
            (max(1, min_env_steps), trainer.iteration + 1,
             config.tensorboard_histograms_every)))
        self.ended = Completions()
        for future in self.serving:
            self.ended.watch(future, future)
        self.reports = 0

    def _next_report(self) -> dict[str, Any]:
        """The learner's next report; meanwhile, a rollout call that ended is restarted, and
        a serving call that ended (it failed, or its rank was lost) raises."""
        driver = self.trainer.driver
        channel = driver.context.data_channel
        found: list[dict[str, Any]] = []

        def arrived() -> bool:
            # From any source (only the learner sends reports): under ULFM a probe of a failed
            # learner would raise here; this way the dispatcher's own probe reports the loss.
            if (item := poll_any_source(channel, self.trainer.tags.report)) is not None:
                found.append(item[0])
                return True
            return self.ended.any_finished or self.requests.any_finished

        while True:
            driver.dispatcher.wait_for(arrived, None, self.serving)
            if found:
                return found[0]
            for done in self.requests.finished():  # raises for an env that failed too often
                self._note_sent(done)
            self.requests.top_up()
            for future in self.ended.take_finished():
                future.result()  # its error, or its rank's loss
                raise RuntimeError(f"{future.method}() on {future.role} rank {future.rank} "
                                   f"ended before the driver's word to stop")

    def _take_report(self, report: dict[str, Any]) -> dict[str, float]:
        self._count_report(report)
        self.reported_histograms = report.pop("histograms", {})
        lags = report.pop("weights_lags")
        return replay_row(self.trainer, self.sgd_steps_total, report, lags)

    def _count_report(self, report: dict[str, Any]) -> None:
        """Count a learner's report (or its final answer): its SGD steps and samples, both
        popped."""
        self.sgd_steps_total += report.pop("sgd_steps")
        count_tally(self.trainer, report.pop("samples"))

    def histograms(self, learners: WorkerGroup) -> dict[str, np.ndarray]:
        """Learner 0's histograms, as its last report carried them (its call is running)."""
        histograms, self.reported_histograms = self.reported_histograms, {}
        return histograms

    def _note_sent(self, done: Done) -> None:
        rank = done.worker.rank
        self.sent[rank] = self.sent.get(rank, 0) + done.result["fragments"]

    def settle(self) -> None:
        """Before a checkpoint or the end of a run: the rollout calls stop after the chunk they
        are sampling, the learner after its step, and each shard once it stored the chunks sent
        to it, so that a checkpoint holds them; what they sampled is counted."""
        rollouts, replay = self.trainer.rollouts, self.replay
        channel = self.trainer.driver.context.data_channel
        if self.requests.calls_in_flight:
            rollouts.progress()  # a rank lost by now is sent nothing
            self._stop_rollouts()
            for done in self.requests.drain():
                self._note_sent(done)
        self.settles += 1
        stored: dict[int, int] = {}
        if self.serving:
            *shards, training = self.serving
            channel.isend(self.round, training.rank, self.trainer.tags.stop_stream)
            final = training.result()
            # Reports it sent before stopping and not read yet are counted, not lost.
            while self.reports < final["reports"]:
                self._count_report(channel.recv(training.rank, self.trainer.tags.report))
                self.reports += 1
            self._count_report(final)
            channel.isend_many(self.round, replay.ranks, self.trainer.tags.stop_stream)
            self._served([future.result() for future in shards], stored)
            self.round += 1
            self.serving = []
        shard_of = {w.rank: w.index % len(replay) for w in rollouts}
        owed = [0] * len(replay)
        for rank, sent in self.sent.items():
            owed[shard_of[rank]] += max(0, sent - stored.get(rank, 0))
        self.sent = {}
        if any(owed):
            # A round of its own, ended by the chunks coming (or the wait), not by a stop word.
            futures = [shard.call_async("serve", self.round, owed[k], self.SETTLE_WAIT_S)
                       for k, shard in enumerate(replay)]
            self._served([future.result() for future in futures], stored)
            self.round += 1

    def _served(self, results: list[dict[str, Any]], stored: dict[int, int]) -> None:
        for result in results:
            count_tally(self.trainer, result["samples"])
            for rank, chunks in result["chunks"].items():
                stored[rank] = stored.get(rank, 0) + chunks

    def _stop_all(self) -> None:
        """Tell every running call to stop, without waiting for any (the run is ending on an
        error)."""
        try:
            if self.requests.calls_in_flight:
                self._stop_rollouts()
            if self.serving:
                self.trainer.driver.context.data_channel.isend_many(
                    self.round, [f.rank for f in self.serving], self.trainer.tags.stop_stream)
        except Exception:  # noqa: BLE001 - the error that ends the run is the one to report
            pass

    def _stop_rollouts(self) -> None:
        """The stop word to the live rollout ranks' calls of this round."""
        self.trainer.driver.context.data_channel.isend_many(
            self.settles, [w.rank for w in self.trainer.rollouts if not w.lost],
            self.trainer.tags.stop_stream)


def count_tally(trainer: Any, tally: SampleTally) -> None:
    """Count what a streamed Ape-X learner or shard says its chunks held."""
    trainer.count(SampleResult(
        env_steps=tally.env_steps, env_failures=tally.env_failures,
        episode_returns=tally.episode_returns, episode_lengths=tally.episode_lengths,
        dumped=tally.dumped, custom_metrics=tally.custom_metrics))
    trainer.episodes_total += tally.episodes_counted_only
