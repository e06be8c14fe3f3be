"""Asynchronous operators: keep rollout workers busy, take what finishes first, track policy lag.

``AsyncRequests`` keeps up to ``max_in_flight`` calls of one rollout-worker method (``sample``
for IMPALA, ``compute_gradients`` for A3C) in flight on every rollout worker. Each ``ready()``
waits for the first call to finish, not for all of them, so a slow worker (a straggler) never
holds up the others: its results are used whenever they come. Every call is tagged with the
version of the weights its worker holds when it runs (workers run their calls in the order sent,
so a call sent after ``set_weights`` of version v samples with version v); the difference to
the version trained on is the *policy lag*, reported as ``policy_lag_mean`` / ``policy_lag_max``.

What crosses ranks: the call and its small result (counts, episode returns; A3C's flat
gradient) between the driver and each rollout rank; IMPALA's batches go rollout → learner on
the data plane, as in ``parallel_rollouts``; new weights go to the workers whose results were
just used, one point-to-point message each, so nobody waits for a collective.

The plan states built on it (made by the plan's ``setup``, settled before each checkpoint):
``SampleRequests`` (IMPALA), ``GradientRequests`` (A3C) and ``FragmentStream`` (IMPALA's
streamed sampling). Operators on them:

* ``async_sample``: the batches of the sample calls that have finished, routed to learners, as
  one ``SampleResult``; train on it with ``train_one_step``.
* ``async_apply_gradients``: every finished gradient applied by learner 0 as it comes
  (first come, first applied), each worker then getting the new weights.
* ``sync_weights``: learner 0's weights, as a new version, to the workers just used.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpirl.errors import ConfigError, RankLost, RemoteError
from mpirl.execution.contract import PlanState
from mpirl.execution.operators import (
    SampleResult,
    add_sample,
    add_sample_metrics,
    learner_stats,
    train_one_step,
)
from mpirl.models.policy import RunningMeanStd
from mpirl.runtime.dispatch import Completions, Future, WorkerGroup, WorkerHandle, call_all
from mpirl.workers.delivery import IN_ANSWER, ToRank
from mpirl.workers.env_guard import unwrap_env_failure
from mpirl.workers.rollout import FRAGMENTS

__all__ = ["AsyncRequests", "SampleRequests", "GradientRequests", "FragmentStream", "async_sample",
           "sync_weights", "async_apply_gradients", "Done", "SHARED_RANKS_REFUSED"]

SHARED_RANKS_REFUSED = (
    "fragments_per_call keeps calls running on the rollout ranks from one checkpoint to the "
    "next, and in a multi-agent run those ranks step the envs for every policy: set "
    "fragments_per_call 0 for policy {policy!r}")

def check_in_flight(value: int) -> None:
    """ConfigError unless ``max_requests_in_flight_per_worker`` is a usable bound."""
    if value < 1:
        raise ConfigError(f"max_requests_in_flight_per_worker must be >= 1 (calls kept running "
                          f"on each rollout worker), got {value}")


@dataclass
class Done:
    """One finished call: its worker, the weights version it ran with, and its result."""

    worker: WorkerHandle
    version: int
    result: dict[str, Any]


class AsyncRequests:
    """Up to ``max_in_flight`` calls of ``method`` kept running on every rollout worker.

    ``make_args(worker)`` gives each call's arguments when it is sent, so they can change
    between calls (the observation filter's statistics, say)."""

    def __init__(self, rollouts: WorkerGroup, method: str, max_in_flight: int,
                 make_args: Callable[[WorkerHandle], tuple],
                 weights_in_calls: bool = False,
                 args_key: Callable[[WorkerHandle], Hashable] | None = None,
                 on_send: Callable[[list[WorkerHandle]], None] | None = None) -> None:
        check_in_flight(max_in_flight)
        self.rollouts = rollouts
        self.method = method
        self.max_in_flight = max_in_flight
        self.make_args = make_args
        # Workers with equal keys get equal arguments when topped up together: their calls
        # (and new weights, if the same) go as one group call, pickled once.
        self.args_key = args_key
        self.on_send = on_send  # told of each group of calls sent
        #: weights version the learners are at; bumped by every update
        self.version = 0
        self._worker_version: dict[int, int] = {}  # worker index -> version it holds
        # Calls not yet returned by ready() or drain(), in the order sent: (worker, version,
        # future) by id(future); those that finished are also in _completions.
        self._in_flight: dict[int, tuple[WorkerHandle, int, Future]] = {}
        self._completions = Completions()
        self._running: dict[int, int] = {}  # worker index -> its calls in _in_flight
        # Workers whose calls finished since the last top_up (None: every worker, at the start
        # or after a drain): topping up only them keeps the driver's work per answer O(1).
        self._refill: list[WorkerHandle] | None = None
        self._acks = Completions()  # set_weights calls
        # With weights_in_calls, ``method`` takes ``weights=``: new weights wait here for the
        # worker's next call (one message, not a set_weights call and its answer as well).
        self.weights_in_calls = weights_in_calls
        self._new_weights: dict[int, np.ndarray] = {}
        self._lags: list[int] = []
        #: whether a call was ever sent (a plan state has nothing to settle before)
        self.started = False

    def top_up(self) -> None:
        """Send calls until every live worker has ``max_in_flight`` of them running. Calls
        that are the same (equal ``args_key``, the same new weights or none) go out together,
        pickled once (``call_all``): the workers just used by one update all take its
        weights."""
        if self._refill is None:
            workers = list(self.rollouts)
        else:
            # A worker whose calls both finished is in _refill twice: topped up once.
            workers = list({w.index: w for w in self._refill if not w.lost}.values())
        self._refill = []
        for turn in range(self.max_in_flight):
            # (args_key, new weights) -> the new weights (None: none) and the workers
            groups: dict[Hashable, tuple[Any, list[WorkerHandle]]] = {}
            for worker in workers:
                if self._running.get(worker.index, 0) + turn >= self.max_in_flight:
                    continue
                new = self._new_weights.pop(worker.index, None) if turn == 0 else None
                key = (worker.index if self.args_key is None else self.args_key(worker),
                       id(new))
                groups.setdefault(key, (new, []))[1].append(worker)
            for new, group in groups.values():
                self._send(group, new)
        for worker in workers:
            self._running[worker.index] = self.max_in_flight

    def _send(self, group: list[WorkerHandle], new: Any) -> None:
        """One call of ``method`` to each worker of ``group``, whose arguments are equal, with
        the new weights ``new`` unless None."""
        kwargs = {} if new is None else {"weights": new}
        futures = call_all(group, self.method, *self.make_args(group[0]), **kwargs)
        self.started = True
        if self.on_send is not None:
            self.on_send(group)
        for worker, future in zip(group, futures, strict=True):
            entry = (worker, self._worker_version.get(worker.index, 0), future)
            self._in_flight[id(future)] = entry
            self._completions.watch(future, entry)

    def ready(self, timeout: float | None = None) -> list[Done]:
        """Top up, then wait for the first call to finish; return every call finished by then.
        A worker whose rank was lost (survived, under ULFM) is left out; an environment that
        failed too often raises ``EnvFailureError``."""
        self.top_up()
        if not self._in_flight:
            raise RankLost("no rollout worker is left to send requests to", -1)
        # The calls that finished, as they finished: O(1) per answer, however many calls run.
        return self._taken(self._completions.take(
            timeout, (f for _, _, f in self._in_flight.values())))

    @property
    def any_finished(self) -> bool:
        """Whether a call finished that ``ready`` or ``finished`` did not return yet (without
        polling: as of the dispatcher's last look)."""
        return self._completions.any_finished

    @property
    def calls_in_flight(self) -> int:
        """Calls sent and not yet returned by ``ready``, ``finished`` or ``drain``."""
        return len(self._in_flight)

    def finished(self) -> list[Done]:
        """Every call that has finished since the last ``ready`` or ``finished``, without
        waiting (there may be none); lost workers and failed environments as in ``ready``."""
        self.rollouts.progress()
        return self._taken(self._completions.take_finished())

    def _taken(self, finished: list[tuple[WorkerHandle, int, Future]]) -> list[Done]:
        for entry in finished:
            del self._in_flight[id(entry[2])]
            self._running[entry[0].index] -= 1
            self._refill.append(entry[0])
        self._check_acks()
        return self._results(finished)

    def drain(self) -> list[Done]:
        """Wait for every call in flight and return them all; none is left running (before a
        checkpoint: it holds no requests, so a resumed run starts clean)."""
        finished, self._in_flight = list(self._in_flight.values()), {}
        self._running, self._refill = {}, None
        self._completions = Completions()  # the calls above are taken here, finished or not
        self._check_acks(wait_all=True)
        return self._results(finished)

    def _results(self, finished: list[tuple[WorkerHandle, int, Future]]) -> list[Done]:
        done = []
        for worker, version, future in finished:
            try:
                done.append(Done(worker, version, future.result()))
            except RankLost:
                continue
            except RemoteError as error:
                raise unwrap_env_failure(error) from None
        self.rollouts.discard_lost()
        return done

    def used(self, done: Done) -> None:
        """Record the policy lag of a result trained on now, at ``self.version``."""
        self._lags.append(self.version - done.version)

    def set_weights(self, workers: list[WorkerHandle], weights: np.ndarray) -> None:
        """Send ``weights`` (the learners' current version) to ``workers``, point to point. The
        driver does not wait: each worker takes them before its next call (with
        ``weights_in_calls``, in that call: a worker runs its calls in order, so the calls it has
        running already use the weights they would have used)."""
        if self.weights_in_calls:
            for worker in workers:
                self._new_weights[worker.index] = weights
                self._worker_version[worker.index] = self.version
            return
        for worker in workers:
            ack = worker.call_async("set_weights", weights)
            self._acks.watch(ack, ack)
            self._worker_version[worker.index] = self.version

    def _check_acks(self, wait_all: bool = False) -> None:
        """Take the answers to set_weights that came (all of them with ``wait_all``): a worker
        that failed to take the weights raises here."""
        acks = self._acks.take_finished()
        while wait_all and self._acks.pending:
            acks += self._acks.take()
        for ack in acks:
            try:
                ack.result()
            except RankLost:
                pass

    def metrics(self) -> dict[str, float]:
        """Policy lag over the results used since the last call, and calls in flight."""
        lags, self._lags = self._lags, []
        return {"policy_lag_mean": float(np.mean(lags)) if lags else 0.0,
                "policy_lag_max": float(max(lags, default=0)),
                "requests_in_flight": float(len(self._in_flight))}


# IMPALA: asynchronous sampling, batches straight to the learners.


class SampleRequests(AsyncRequests, PlanState):
    """IMPALA's plan state: asynchronous ``sample`` calls returning fragments for V-trace
    (``form=FRAGMENTS``); rollout worker i's batches go to learner i mod L. Before a
    checkpoint the calls in flight are finished and their batches received and dropped (counted
    as sampled, not trained on)."""

    def __init__(self, trainer: Any, steps_per_env: int, max_in_flight: int) -> None:
        learners = trainer.learners

        def make_args(worker: WorkerHandle) -> tuple:
            deliver = (IN_ANSWER if worker.in_process
                       else ToRank(learners[worker.index % len(learners)].rank))
            state = trainer.obs_filter.state() if trainer.obs_filter is not None else None
            return steps_per_env, state, deliver, FRAGMENTS

        # Workers that feed one learner are sent equal calls.
        super().__init__(trainer.rollouts, "sample", max_in_flight, make_args,
                         weights_in_calls=True,
                         args_key=lambda worker: worker.index % len(learners))
        self.trainer = trainer

    def settle(self) -> None:
        if not self.started:
            return
        learners = self.trainer.learners
        samples = collect_samples(self.drain(), learners, self.trainer.obs_filter)
        self.trainer.count(samples)
        train_one_step(learners, samples, num_epochs=0, num_minibatches=1, standardize=())


@dataclass
class AsyncSampleResult(SampleResult):
    """A ``SampleResult`` that also names the workers whose samples it holds."""

    workers: list[WorkerHandle] = field(default_factory=list)


def async_sample(requests: AsyncRequests, learners: WorkerGroup,
                 obs_filter: RunningMeanStd | None = None,
                 min_env_steps: int = 0) -> AsyncSampleResult:
    """The sample calls that have finished once the first ones holding ``min_env_steps`` env
    steps have (at least one call), as one ``SampleResult`` whose batches wait on the learners'
    ranks; their policy lag is recorded. A fixed batch size per update keeps the learner's cost
    per env step the same however the calls' arrivals interleave."""
    done = requests.ready()
    while sum(item.result["env_steps"] for item in done) < min_env_steps:
        done += requests.ready()
    for item in done:
        requests.used(item)
    return collect_samples(done, learners, obs_filter)


def collect_samples(done: list[Done], learners: WorkerGroup,
                    obs_filter: RunningMeanStd | None) -> AsyncSampleResult:
    """The finished sample calls ``done`` as one result; worker i's batch is on learner i mod L."""
    result = AsyncSampleResult(workers=[item.worker for item in done])
    for item in done:
        add_sample(result, item.worker.index % len(learners), item.worker, item.result,
                   obs_filter)
    return result


def sync_weights(requests: AsyncRequests, learners: WorkerGroup,
                 samples: AsyncSampleResult) -> None:
    """After a learner update: a new weights version, sent to the workers whose samples it
    used; the other workers keep sampling undisturbed."""
    requests.version += 1
    requests.set_weights(samples.workers, learners[0].call("get_weights"))
    requests.top_up()


# IMPALA, streamed: fragments go to the learners as they are sampled, weights come back from them.


class FragmentStream(PlanState):
    """IMPALA's sampling with ``fragments_per_call``: each call of a rollout worker samples that
    many fragments (``RolloutWorker.sample_fragments``) and streams each to its learner (rollout
    worker i's to learner i mod L) as soon as it is done. Each update, every learner takes the
    fragments that came, from whichever ranks, trains on them and pushes the new weights to those
    ranks itself (``Learner.train_streamed``). Rank 0 starts the updates and gets one answer
    per call (episodes, counts, observation statistics): ``fragments_per_call`` times fewer
    answers than one per fragment, and no weights pass through it.

    It keeps count of the fragments each learner is owed (asked of its workers, not yet taken),
    so that a learner never waits for fragments no call will send; a worker's rank lost
    (survived, under ULFM) takes its share out."""

    WAIT_S = 10.0
    """Longest a learner waits for fragments before training on those it has: it waits that
    long only for a rank that died before the driver saw it lost."""

    def __init__(self, trainer: Any, steps_per_env: int, fragments_per_call: int,
                 max_in_flight: int) -> None:
        learners = self.learners = trainer.learners
        if any(worker.shares_rank for worker in trainer.rollouts):
            raise ConfigError(SHARED_RANKS_REFUSED.format(policy=trainer.policy_id))
        if any(worker.in_process for worker in trainer.rollouts):
            raise ConfigError("fragments_per_call streams fragments between ranks, and this run "
                              "has rollout workers in the driver's process: launch it with "
                              "rollout ranks of their own (mpiexec -n 2 or more), or set "
                              "fragments_per_call 0")
        self.trainer = trainer
        self.fragments = fragments_per_call
        self.owed = [0] * len(learners)  # learner index -> fragments asked for, not taken
        self.asked: dict[int, int] = {}  # rollout rank -> fragments asked of it in all
        self.taken: dict[int, int] = {}  # rollout rank -> fragments its learner took
        self.live = len(trainer.rollouts)
        self.round = 0  # bumped by each settle, whose calls it cuts short
        self._lag_sum = self._lag_count = self._lag_max = 0

        def make_args(worker: WorkerHandle) -> tuple:
            state = trainer.obs_filter.state() if trainer.obs_filter is not None else None
            return (fragments_per_call, steps_per_env, state,
                    learners[worker.index % len(learners)].rank, self.round)

        # Workers that feed one learner are sent equal calls, as one group.
        self.requests = AsyncRequests(trainer.rollouts, "sample_fragments", max_in_flight,
                                      make_args, args_key=lambda w: w.index % len(learners),
                                      on_send=self._asked)

    def _asked(self, group: list[WorkerHandle]) -> None:
        self.owed[group[0].index % len(self.learners)] += self.fragments * len(group)
        for worker in group:
            self.asked[worker.rank] = self.asked.get(worker.rank, 0) + self.fragments

    def update(self, min_env_steps: int, env_steps: int, **train_args: Any
               ) -> tuple[dict[str, float], int]:
        """Train until the learners took ``env_steps`` steps (fewer if fewer are owed), in
        updates of at least ``min_env_steps`` each, the learners pushing the new weights to
        the ranks whose fragments they used after each. ``train_args`` go to
        ``Learner.train``. Returns the learners' mean statistics and the env steps taken."""
        self.requests.top_up()
        if not self.requests.calls_in_flight:
            raise RankLost("no rollout worker is left to send requests to", -1)
        return self._train(min_env_steps, env_steps, **train_args)

    def _train(self, min_env_steps: int, env_steps: int, **train_args: Any
               ) -> tuple[dict[str, float], int]:
        count = len(self.learners)
        futures = [learner.call_async("train_streamed", -(-min_env_steps // count),
                                      -(-env_steps // count), self.owed[i], self.WAIT_S,
                                      **train_args)
                   for i, learner in enumerate(self.learners)]
        results = [future.result() for future in futures]
        taken = 0
        for i, result in enumerate(results):
            for rank, fragments in result.pop("received").items():
                self.taken[rank] = self.taken.get(rank, 0) + fragments
                self.owed[i] -= fragments
                self._lag_count += fragments
            self._lag_sum += result.pop("policy_lag_sum")
            self._lag_max = max(self._lag_max, result.pop("policy_lag_max"))
            taken += result.pop("env_steps_received")
        return learner_stats(results), taken

    def take_answers(self, env_steps: int) -> SampleResult:
        """What the calls that finished since the last take sampled (episodes, env failures),
        their observation statistics merged into the run's filter, with ``env_steps`` (those
        the learners took: a fragment counts when it is trained on, or dropped before a
        checkpoint); a lost worker's share of the fragments owed is taken out."""
        return self._answers(self.requests.finished(), env_steps)

    def _answers(self, done: list[Done], env_steps: int) -> SampleResult:
        samples = SampleResult()
        obs_filter = self.trainer.obs_filter
        for item in done:
            # A call cut short (before a checkpoint) owes fewer fragments.
            short = self.fragments - item.result["fragments"]
            if short:
                self.owed[item.worker.index % len(self.learners)] -= short
                self.asked[item.worker.rank] -= short
            add_sample_metrics(samples, item.result)
            if obs_filter is not None and item.result["filter_delta"] is not None:
                obs_filter.merge(*item.result["filter_delta"])
        samples.env_steps = env_steps
        if len(self.trainer.rollouts) != self.live:
            self._recount_owed()
        return samples

    def _recount_owed(self) -> None:
        """The fragments owed, from the live workers only (a lost rank sends no more)."""
        self.live = len(self.trainer.rollouts)
        self.owed = [0] * len(self.learners)
        for worker in self.trainer.rollouts:
            self.owed[worker.index % len(self.learners)] += (
                self.asked.get(worker.rank, 0) - self.taken.get(worker.rank, 0))

    def settle(self) -> None:
        """Before a checkpoint: finish every call, let the learners take the fragments in flight
        (counted as sampled, not trained on), and let every worker take the weights pushed to
        it, so that nothing is left in flight."""
        if not self.requests.started:
            return
        # Each call stops after the fragment it is sampling: a checkpoint waits for one
        # fragment, not for fragments_per_call times max_in_flight of them.
        rollouts = self.trainer.rollouts
        rollouts.progress()  # a rank lost by now is sent nothing
        ranks = [worker.rank for worker in rollouts if not worker.lost]
        channel = self.trainer.driver.context.data_channel
        channel.isend_many(self.round, ranks, self.trainer.tags.stop_stream)
        samples = self._answers(self.requests.drain(), 0)
        self.round += 1
        while any(self.owed):
            before = list(self.owed)
            samples.env_steps += self._train(2**62, 2**62, num_epochs=0, num_minibatches=1)[1]
            if self.owed == before:
                raise RankLost(f"the learners were owed {sum(self.owed)} fragments that never "
                               f"came within {self.WAIT_S:g} s", -1)
        self.trainer.count(samples)
        pushed: dict[int, int] = {}
        for learner in self.learners:
            pushed |= learner.call("pushes_sent")
        futures = [(worker, worker.call_async(
            "take_pushed_weights", self.learners[worker.index % len(self.learners)].rank,
            pushed.get(worker.rank, 0))) for worker in rollouts]
        for _, future in futures:
            try:
                future.result()
            except RankLost:
                continue

    def metrics(self) -> dict[str, float]:
        """Policy lag of the fragments trained on since the last call (weight versions behind
        the learner's), and calls in flight."""
        mean = self._lag_sum / self._lag_count if self._lag_count else 0.0
        row = {"policy_lag_mean": mean, "policy_lag_max": float(self._lag_max),
               "requests_in_flight": float(self.requests.calls_in_flight)}
        self._lag_sum = self._lag_count = self._lag_max = 0
        return row


# A3C: gradients computed on the rollout workers, applied as they come.


class GradientRequests(AsyncRequests, PlanState):
    """A3C's plan state: asynchronous ``compute_gradients`` calls of ``loss`` with the run's
    config. Before a checkpoint the calls in flight are finished and their gradients dropped
    (their samples counted)."""

    def __init__(self, trainer: Any, steps_per_env: int, loss: Callable,
                 max_in_flight: int) -> None:
        if len(trainer.learners) != 1:
            raise ConfigError(f"{trainer.name} applies gradients on one learner (num_learners 0 "
                              f"or 1), got {len(trainer.learners)}")

        def make_args(worker: WorkerHandle) -> tuple:
            state = trainer.obs_filter.state() if trainer.obs_filter is not None else None
            return steps_per_env, loss, trainer.config, state

        super().__init__(trainer.rollouts, "compute_gradients", max_in_flight, make_args,
                         weights_in_calls=True, args_key=lambda worker: 0)
        self.trainer = trainer

    def settle(self) -> None:
        if not self.started:
            return
        for item in self.drain():
            _count(self.trainer, item)


def async_apply_gradients(trainer: Any, requests: AsyncRequests) -> list[dict[str, float]]:
    """Apply every gradient that has come, in the order they came, each as its own update of
    learner 0; the worker that sent it gets the new weights at once. Returns the workers' loss
    statistics, one dict per gradient."""
    stats = []
    for item in requests.ready():
        _count(trainer, item)
        if item.result["gradients"] is None:  # env failures left the fragment no rows
            continue
        requests.used(item)
        weights = trainer.learners[0].call("apply_gradients", item.result["gradients"])
        requests.version += 1
        requests.set_weights([item.worker], weights)
        stats.append(item.result["stats"])
    requests.top_up()
    return stats


def _count(trainer: Any, item: Done) -> None:
    samples = SampleResult()
    add_sample(samples, 0, item.worker, item.result, trainer.obs_filter)
    trainer.count(samples)
