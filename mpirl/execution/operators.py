"""Operators: the eager steps that algorithm plans are written in.

Each is a plain function a ``training_step`` calls from top to bottom. What moves where:

* ``parallel_rollouts``: every rollout worker samples; batches go straight to learner ranks, the
  driver gets counts (env steps, env failures), episode metrics and observation-statistics
  deltas.
* ``train_one_step``: every learner receives its rollout ranks' batches and runs minibatch SGD
  with one gradient allreduce per step; the driver gets averaged loss statistics.
* ``broadcast_weights``: learner 0's weights go to every rollout rank in one ``Bcast``.
* ``sample_with_new_weights``: the two above in one call to each rollout worker (the broadcast,
  then the sampling), for synchronous plans that broadcast once per iteration.

Under ULFM the driver may survive the loss of a rollout rank (``survive_rollout_loss``). The
operators then go on without it: ``parallel_rollouts`` leaves out a worker whose rank was lost and
takes it out of the rollout group, learners receive only from the workers that answered, and the
weights communicator is shrunk to its live members before the next broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpirl.data.offline import OfflineInput
from mpirl.errors import ConfigError, ProcessFailure, RankLost, RemoteError, TaskTimeout
from mpirl.execution.standing_rounds import StandingRounds, rounds_may_stand
from mpirl.models.policy import RunningMeanStd
from mpirl.runtime.core import shrink_weights_comm
from mpirl.runtime.dispatch import Future, WorkerGroup, WorkerHandle, call_all
from mpirl.runtime.gathered import decode_answers, gathers_answers
from mpirl.workers.delivery import BROADCAST, IN_ANSWER, Gathered, ToLearnerOf, ToRank
from mpirl.workers.env_guard import unwrap_env_failure

__all__ = ["SampleResult", "parallel_rollouts", "discard_lost_rollouts",
           "train_one_step", "learner_stats", "mean_stats", "train_on_dataset", "evaluate_policy",
           "broadcast_weights", "sample_with_new_weights", "replay_dest", "store_to_replay",
           "train_from_replay", "count_and_evaluate",
           "settle_gathered", "add_sample_metrics", "weights_comm_collective", "add_samples"]


@dataclass
class SampleResult:
    """What the driver learns from one round of sampling (batches stay on the data plane)."""

    env_steps: int = 0
    #: environment exceptions recovered by rebuilding the env (their episodes were dropped)
    env_failures: int = 0
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    #: learner index -> rollout ranks whose batches it must receive
    sources: dict[int, list[int]] = field(default_factory=dict)
    #: learner index -> batches handed over in-process (local rollout workers)
    batches: dict[int, list[dict]] = field(default_factory=dict)
    #: with trajectory dumps on: (rank's file name, [(local episode id, steps)]) per worker
    dumped: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    #: with callbacks: each episode's custom metrics, in the order of ``episode_returns``
    custom_metrics: list[dict[str, float]] = field(default_factory=list)


def parallel_rollouts(rollouts: WorkerGroup, learners: WorkerGroup, steps_per_env: int,
                      obs_filter: RunningMeanStd | None = None) -> SampleResult:
    """Sample ``steps_per_env`` steps on every environment of every rollout worker, routing
    rollout worker i's batch to learner i mod L. Merges the workers' observation statistics
    into ``obs_filter``. An environment that failed ``max_env_failures`` times in a row raises
    ``EnvFailureError`` here. A worker whose rank is lost meanwhile (survived, under ULFM) is
    left out and taken out of ``rollouts``."""
    discard_lost_rollouts(learners, rollouts)
    filter_state = obs_filter.state() if obs_filter is not None else None
    result = SampleResult()
    futures = []
    for i, worker in enumerate(rollouts):
        target = i % len(learners)
        deliver = IN_ANSWER if worker.in_process else ToRank(learners[target].rank)
        futures.append((target, worker, worker.call_async("sample", steps_per_env, filter_state,
                                                          deliver)))
    add_samples(result, futures, obs_filter)
    discard_lost_rollouts(learners, rollouts)
    return result


def add_samples(result: SampleResult, calls: list[tuple[int, WorkerHandle, Future]],
                obs_filter: RunningMeanStd | None) -> None:
    """Wait for each ``(target, worker, future)`` of ``sample()`` calls, in order, and add its
    answer to ``result``. A worker whose rank was lost is left out; an environment that failed
    too often raises ``EnvFailureError``."""
    for target, worker, future in calls:
        try:
            metrics = future.result()
        except RankLost:
            continue  # its batch may never come: the learner is not told to wait for it
        except RemoteError as error:
            raise unwrap_env_failure(error) from None
        add_sample(result, target, worker, metrics, obs_filter)


def add_sample(result: SampleResult, target: int, worker: WorkerHandle, metrics: dict[str, Any],
               obs_filter: RunningMeanStd | None) -> None:
    """Add what one ``sample()`` call of ``worker`` returned to ``result``: its counts and
    episodes, where its batch is (sent to learner ``target``, or in ``metrics``), and its
    observation statistics, merged into ``obs_filter``."""
    if "batch" in metrics:
        result.batches.setdefault(target, []).append(metrics["batch"])
    elif not worker.in_process:
        result.sources.setdefault(target, []).append(worker.rank)
    add_sample_metrics(result, metrics)
    if obs_filter is not None and metrics["filter_delta"] is not None:
        mean, var, count = metrics["filter_delta"]
        obs_filter.merge(mean, var, count)


def discard_lost_rollouts(learners: WorkerGroup, rollouts: WorkerGroup) -> bool:
    """Take the workers of lost rollout ranks out of ``rollouts``; if there were any, shrink
    weights_comm to its live members. True if any were taken out."""
    if not rollouts.discard_lost():
        return False
    rebuild_weights_comm(learners, rollouts)
    return True


def rebuild_weights_comm(learners: WorkerGroup, rollouts: WorkerGroup) -> None:
    """Shrink weights_comm to its live members (learner 0 and the rollout ranks of
    ``rollouts``), without the ranks MPI reports failed; under ULFM only. Every live member takes
    part, so ``rollouts`` must hold every live rollout rank. Nothing to do where the rollout
    workers share their ranks' sampling core (multi-agent): their weights go by message."""
    if any(worker.shares_rank for worker in rollouts):
        return
    source = learners[0]
    members = [w for w in rollouts if not w.in_process]
    if not source.in_process:
        members.append(source)
    futures = [w.call_rank_async("shrink_weights_comm") for w in members]
    if source.in_process:  # the driver holds learner 0: its half of the collective runs here
        shrink_weights_comm(source.local_object.context, [source.local_object])
    for future in futures:
        try:
            future.result()
        except RankLost:
            pass  # it died after the others began to shrink; MPI leaves it out


def train_one_step(learners: WorkerGroup, samples: SampleResult, num_epochs: int,
                   num_minibatches: int, lr: float | None = None,
                   standardize: tuple[str, ...] = ("advantages",)) -> dict[str, float]:
    """Every learner runs ``Learner.train`` on its share of ``samples``: ``num_epochs`` passes
    of ``num_minibatches`` SGD steps (``lr`` replaces the optimizer's rate; ``standardize``
    names the batch columns standardized first). Returns statistics averaged over learners."""
    futures = [
        learner.call_async("train", samples.sources.get(i, []), samples.batches.get(i),
                           num_epochs=num_epochs, num_minibatches=num_minibatches, lr=lr,
                           standardize=standardize)
        for i, learner in enumerate(learners)
    ]
    return learner_stats([f.result() for f in futures])


def mean_stats(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the rows that have it (learners, or the updates of an iteration)."""
    keys = dict.fromkeys(k for row in rows for k in row)
    # Plain sums: np.mean costs about 4 us per call, and asynchronous plans call this per
    # update, once for every answer of a rollout rank.
    means = {}
    for k in keys:
        values = [float(row[k]) for row in rows if k in row]
        means[k] = sum(values) / len(values)
    return means


def learner_stats(results: list[dict[str, float]]) -> dict[str, float]:
    """Loss statistics averaged over learners; ``learner_samples`` summed."""
    # A learner that got no rows (env failures dropped them all, or its sources were lost) has
    # no loss statistics: means over those that have them.
    stats = mean_stats(results)
    stats["learner_samples"] = float(sum(r["learner_samples"] for r in results))
    return stats


def train_on_dataset(learners: WorkerGroup, source: OfflineInput, num_steps: int,
                     train_batch_size: int, **train_args: Any) -> dict[str, float]:
    """Every learner runs ``num_steps`` SGD steps on rows of its own shard of the dump
    ``source`` (read on the learner's rank; only the path crosses); returns statistics averaged
    over learners, with ``learner_samples`` the dataset rows trained on by all of them."""
    futures = learners.call_async("train_offline", source, num_steps, train_batch_size,
                                  **train_args)
    results, failure = [], None
    for future in futures:
        try:
            results.append(future.result())
        except RemoteError as error:
            failure = failure or error
    if failure is not None:
        # A shard that cannot be loaded is a ConfigError on every learner: report it as one.
        if failure.cause_type == _CONFIG_ERROR:
            raise ConfigError(failure.cause_message) from None
        raise failure
    return learner_stats(results)


def evaluate_policy(rollouts: WorkerGroup, episodes: int, deterministic: bool = False
                    ) -> SampleResult:
    """Every rollout worker plays its share of ``episodes`` whole episodes with the weights it
    holds; the driver gets their returns, lengths and env steps. No batch is made: evaluation
    episodes are never trained on. A worker lost meanwhile (survived, under ULFM) is left out."""
    if not len(rollouts):  # every rollout rank lost (survived, under ULFM): nothing to play
        return SampleResult()
    shares = [len(part) for part in np.array_split(np.arange(episodes), len(rollouts))]
    futures = [worker.call_async("evaluate", share, deterministic)
               for worker, share in zip(rollouts, shares, strict=True) if share]
    result = SampleResult()
    for future in futures:
        try:
            metrics = future.result()
        except RankLost:
            continue
        except RemoteError as error:
            raise unwrap_env_failure(error) from None
        result.env_steps += metrics["env_steps"]
        result.env_failures += metrics["env_failures"]
        result.episode_returns += metrics["episode_returns"]
        result.episode_lengths += metrics["episode_lengths"]
    return result


_PROCESS_FAILURE = f"{ProcessFailure.__module__}.{ProcessFailure.__qualname__}"
_CONFIG_ERROR = f"{ConfigError.__module__}.{ConfigError.__qualname__}"
_TASK_TIMEOUT = f"{TaskTimeout.__module__}.{TaskTimeout.__qualname__}"
_BROADCAST_RETRIES = 3


def broadcast_weights(learners: WorkerGroup, rollouts: WorkerGroup) -> None:
    """Copy learner 0's weights to every rollout worker: one ``Bcast`` from learner 0 when the
    rollout workers have ranks of their own, a plain copy for in-process ones."""
    source = learners[0]
    if all(worker.in_process for worker in rollouts):
        weights = source.call("get_weights")
        for worker in rollouts:
            worker.call("set_weights", weights)
        return
    weights_comm_collective(learners, rollouts, "broadcast_weights", "receive_weights",
                            what="the weights")


def weights_comm_collective(learners: WorkerGroup, rollouts: WorkerGroup, send: str,
                            receive: str, *, what: str, first_receive_args: tuple = ()
                            ) -> list[tuple[int, Any]]:
    """One collective over weights_comm (a broadcast, whose root may be learner 0 or a rollout
    worker): learner 0 runs ``send()`` while every rollout worker runs ``receive()``, rollout
    worker 0 with ``first_receive_args``; returns (worker index,
    result) of each rollout worker that answered. Rollout workers must have ranks of their
    own; ``what`` names what is sent, for a timeout's message.

    A rollout rank that dies during the collective breaks it: the members that notice revoke
    the communicator, so all of them fail; it is shrunk to the survivors and the collective runs
    again (``receive`` must therefore give the same result when it gets the same data twice).
    """
    for attempt in range(1 + _BROADCAST_RETRIES):
        discard_lost_rollouts(learners, rollouts)
        # The rollout ranks enter the collective first; a learner in the driver's process runs
        # its part inside call_async, which would otherwise wait for nobody.
        futures = [worker.call_async(receive, *(first_receive_args if i == 0 else ()))
                   for i, worker in enumerate(rollouts)]
        answered, broken = _collective_answers(futures, learners[0].call_async(send), what)
        if not broken:
            return list(answered.items())
        if attempt == _BROADCAST_RETRIES:
            raise broken[0]
        _repair_weights_comm(learners, rollouts)
    raise AssertionError("unreachable")


def _collective_answers(futures: list[Future], source: Future, what: str
                        ) -> tuple[dict[int, Any], list[RemoteError]]:
    """The answers of the rollout workers' ``futures`` to calls that began with a collective over
    weights_comm rooted at ``source``'s worker: {worker index: result} of those that
    answered, and the process failures that broke the collective (empty if none did). A rank
    lost meanwhile is left out; any other error is raised, a timeout naming the rollout ranks
    that had not taken ``what``."""
    answered: dict[int, Any] = {}
    broken: list[RemoteError] = []
    # The source first: a timeout in its half (run already when it is in-process) is then
    # reported at once, not after the rollout ranks' own timeouts.
    for index, future in [(-1, source), *enumerate(futures)]:
        try:
            value = future.result()
        except RankLost:
            continue
        except RemoteError as error:
            if error.cause_type == _TASK_TIMEOUT:
                late = [f"rank {f.rank}" for f in futures if not f.done()]
                raise TaskTimeout(f"{error.cause_message}; rollout ranks that had not taken "
                                  f"{what}: {', '.join(late) or 'none'}") from None
            if error.cause_type != _PROCESS_FAILURE:
                raise
            broken.append(error)
            continue
        if index >= 0:
            answered[index] = value
    return answered, broken


def _repair_weights_comm(learners: WorkerGroup, rollouts: WorkerGroup) -> None:
    """After a broken collective: take out the lost rollout ranks and shrink weights_comm."""
    if not discard_lost_rollouts(learners, rollouts):
        # MPI knows which rank died before the driver may; Shrink leaves it out anyway.
        rebuild_weights_comm(learners, rollouts)


def sample_with_new_weights(rollouts: WorkerGroup, learners: WorkerGroup, steps_per_env: int,
                            obs_filter: RunningMeanStd | None = None,
                            gather: bool | None = None) -> SampleResult:
    """``broadcast_weights`` then ``parallel_rollouts``, in one call to each rollout worker: it
    takes learner 0's weights (the ``Bcast``) and then samples. One message to and one from
    each rollout rank per iteration instead of two of each, which halves the driver's work per
    rollout rank. Use it at the start of an iteration in place of a broadcast at the end of the
    previous one: the rollout workers hold the newest weights whenever they sample.

    A rollout rank that dies during the broadcast breaks it, as in ``weights_comm_collective``:
    weights_comm is shrunk, the broadcast runs again alone, and the workers whose broadcast
    broke (they had not sampled) sample then.

    With ``gather`` (the default unless MPI reports process failures, ULFM, where each answer
    must come on its own to tell the lost ranks apart) the answers come back the other way
    round: learner 0 gathers them over weights_comm after the broadcast and hands them to the
    driver in its own answer. Rank 0 then receives one message per round, not one per rollout
    rank; the result is the same."""
    if all(worker.in_process for worker in rollouts):
        broadcast_weights(learners, rollouts)
        return parallel_rollouts(rollouts, learners, steps_per_env, obs_filter)
    discard_lost_rollouts(learners, rollouts)
    filter_state = obs_filter.state() if obs_filter is not None else None
    targets = [i % len(learners) for i in range(len(rollouts))]
    workers = list(rollouts)
    if gather if gather is not None else gathers_answers(workers):
        return _sample_gathered(workers, learners, targets, steps_per_env, filter_state,
                                obs_filter)
    futures = [worker.call_async("sample", steps_per_env, filter_state,
                                 ToRank(learners[targets[i]].rank), weights=BROADCAST)
               for i, worker in enumerate(workers)]
    try:
        answered, broken = _collective_answers(futures, learners[0].call_async(
            "broadcast_weights"), "the weights")
    except RemoteError as error:
        raise unwrap_env_failure(error) from None
    result = SampleResult()
    for index, metrics in sorted(answered.items()):
        add_sample(result, targets[index], workers[index], metrics, obs_filter)
    if broken:
        _repair_weights_comm(learners, rollouts)
        broadcast_weights(learners, rollouts)
        add_samples(result, [
            (targets[index], worker, worker.call_async("sample", steps_per_env, filter_state,
                                                       ToRank(learners[targets[index]].rank)))
            for index, worker in enumerate(workers)
            if index not in answered and not worker.lost], obs_filter)
    discard_lost_rollouts(learners, rollouts)
    return result


def settle_gathered(workers: list[WorkerHandle], futures: list[Future], parts: list[bytes]
                    ) -> dict[int, Any]:
    """Settle the calls ``futures`` (one per worker) from their answers gathered by learner 0
    (``mpirl.runtime.gathered.gather_answers``); {worker index: result}. A call that raised
    raises its ``RemoteError`` here, from its own answer."""
    index_of = {worker.rank: i for i, worker in enumerate(workers)}
    answered: dict[int, Any] = {}
    for rank, value in decode_answers(parts).items():
        if value is not None:  # else the call raised: its answer says why
            answered[index_of[rank]] = value
            futures[index_of[rank]].settle(value)
    for index, future in enumerate(futures):
        if index not in answered:
            future.result()
            raise AssertionError(f"rank {workers[index].rank} answered outside the gather")
    return answered


def _sample_gathered(workers: list[WorkerHandle], learners: WorkerGroup, targets: list[int],
                     steps_per_env: int, filter_state: tuple | None,
                     obs_filter: RunningMeanStd | None) -> SampleResult:
    """``sample_with_new_weights`` with the answers gathered by learner 0 (``gather``)."""
    # A batch for a learner in the driver's process rides in the gather when it is small: rank
    # 0 then takes no message per rollout rank for it (``gathered.fits_in_gather``).
    one_call = all(worker.index == i for i, worker in enumerate(workers))
    if one_call and rounds_may_stand(workers):
        try:
            answered = _standing_round(workers, learners, steps_per_env, filter_state)
        except RemoteError as error:
            raise unwrap_env_failure(error) from None
        return _sample_result(workers, targets, answered, obs_filter)
    if one_call:
        # Every worker gets the same call, and picks its learner by its role index as
        # ``targets`` does (index i is role index i): rank 0 pickles it once (``submit_many``).
        futures = call_all(
            workers, "sample", steps_per_env, filter_state,
            Gathered(ToLearnerOf(tuple(learner.rank for learner in learners)), rides=True),
            weights=BROADCAST)
    else:
        futures = [worker.call_async("sample", steps_per_env, filter_state,
                                     Gathered(ToRank(learners[targets[i]].rank),
                                              rides=learners[targets[i]].in_process),
                                     weights=BROADCAST)
                   for i, worker in enumerate(workers)]
    try:
        answered = settle_gathered(workers, futures, learners[0].call_async(
            "broadcast_weights", gather_answers=True).result())
    except RemoteError as error:
        raise unwrap_env_failure(error) from None
    return _sample_result(workers, targets, answered, obs_filter)


def _standing_round(workers: list[WorkerHandle], learners: WorkerGroup, steps_per_env: int,
                    filter_state: tuple | None) -> dict[int, Any]:
    """One round of the rollout workers' standing ``sample_rounds`` calls
    (``mpirl.execution.standing_rounds``): {worker index: what its sample() returned}."""
    rounds = StandingRounds.of(workers, learners[0], "sample_rounds",
                               tuple(learner.rank for learner in learners), True)
    parts = rounds.start("broadcast_weights", (steps_per_env, filter_state),
                         gather_answers=True)
    answered = {rounds.index_of[rank]: value for rank, value in decode_answers(parts).items()
                if value is not None}
    if len(answered) < len(workers):
        rounds.failed(sorted(w.rank for i, w in enumerate(workers) if i not in answered))
    return answered


def _sample_result(workers: list[WorkerHandle], targets: list[int], answered: dict[int, Any],
                   obs_filter: RunningMeanStd | None) -> SampleResult:
    result = SampleResult()
    for index, metrics in sorted(answered.items()):
        add_sample(result, targets[index], workers[index], metrics, obs_filter)
    return result


# Replay. Steps go rollout rank -> replay shard rank, minibatches shard -> learner rank, TD errors
# learner -> shard; the driver only tells each rank when. Objects that share the driver's process
# hand their data over in the call instead.


def replay_dest(sender, receiver) -> int | None:
    """Where ``sender`` sends data for ``receiver``: its rank, or None when both are in the
    driver's process (the data then travels in the call's result)."""
    return None if sender.in_process and receiver.in_process else receiver.rank


def store_to_replay(rollouts: WorkerGroup, replay: WorkerGroup, steps_per_env: int,
                    epsilons: list[float]) -> SampleResult:
    """Every rollout worker i steps its envs ``steps_per_env`` times epsilon-greedily with
    ``epsilons[i]`` and sends the steps to replay shard i mod K, which stores them. The driver
    gets counts and episode metrics."""
    result = SampleResult()
    sources: dict[int, list[int]] = {}
    chunks: dict[int, list[dict]] = {}
    futures = []
    for i, worker in enumerate(rollouts):
        shard = i % len(replay)
        futures.append((shard, worker, worker.call_async(
            "sample_transitions", steps_per_env, epsilons[i], replay_dest(worker, replay[shard]))))
    for shard, worker, future in futures:
        try:
            metrics = future.result()
        except RemoteError as error:
            raise unwrap_env_failure(error) from None
        if "chunk" in metrics:
            chunks.setdefault(shard, []).append(metrics["chunk"])
        else:
            sources.setdefault(shard, []).append(worker.rank)
        add_sample_metrics(result, metrics)
    inserts = [replay[k].call_async("insert", sources.get(k, []), chunks.get(k))
               for k in range(len(replay))]
    for future in inserts:
        future.result()
    return result


def add_sample_metrics(result: SampleResult, metrics: dict[str, Any]) -> None:
    """Add the counts, episodes and dumped-episode ids of one sample call to ``result``."""
    result.env_steps += metrics["env_steps"]
    result.env_failures += metrics["env_failures"]
    result.episode_returns += metrics["episode_returns"]
    result.episode_lengths += metrics["episode_lengths"]
    result.custom_metrics += metrics.get("custom_metrics", [])
    if "dumped" in metrics:
        result.dumped.append(metrics["dumped"])


def train_from_replay(learners: WorkerGroup, replay: WorkerGroup, num_steps: int,
                      batch_size: int, beta: float | None = None, lr: float | None = None
                      ) -> dict[str, float]:
    """Every learner takes ``num_steps`` SGD steps on minibatches drawn from the replay shards
    (``batch_size`` rows per step summed over learners, the steps split evenly over shards), at
    learning rate ``lr`` if given; the TD errors go back to the shards as priorities. Returns
    averaged learner statistics."""
    rows = max(1, batch_size // len(learners))
    # Steps split over the shards in proportion to what they hold (a shard may have no feeder).
    sizes = np.array([f.result() for f in replay.call_async("size")], np.float64)
    if not sizes.sum():
        raise ValueError("train_from_replay: every replay shard is empty")
    bounds = np.round(np.cumsum(sizes) / sizes.sum() * num_steps).astype(int)
    shares = np.diff(bounds, prepend=0).tolist()
    trains = []
    for learner in learners:
        sources, messages = [], []
        for shard, count in zip(replay, shares, strict=True):
            if not count:
                continue
            dest = replay_dest(shard, learner)
            sent = shard.call_async("sample", count, rows, dest, beta)
            if dest is None:
                messages.append(sent.result())
            else:
                sources.append(shard.rank)
        dests = {k: replay_dest(learner, shard) for k, shard in enumerate(replay)}
        trains.append(learner.call_async("train_replay", sources, messages, dests, lr=lr))
    results = [f.result() for f in trains]
    # Each shard applies the TD errors of its minibatches before it samples again.
    updates = [[] for _ in replay]
    for result in results:
        for shard, update in result.pop("priorities"):
            updates[shard].append(update)
    expect = [sum(1 for learner in learners if replay_dest(learner, shard) is not None) if count
              else 0 for shard, count in zip(replay, shares, strict=True)]
    for future in [shard.call_async("update_priorities", expect[k], updates[k])
                   for k, shard in enumerate(replay)]:
        future.result()
    stats = learner_stats([r | {"learner_samples": r["sgd_steps"] * rows} for r in results])
    return stats


def count_and_evaluate(trainer: Any, train_stats: dict[str, float]) -> dict[str, float]:
    """Count the dataset rows just trained on as ``timesteps_total``; every
    ``evaluation_interval`` iterations, have the rollout workers play ``evaluation_episodes``
    with the weights they hold, into the episode metrics (``episode_return_mean``). Their env
    steps are counted apart, in ``evaluation_env_steps_total``."""
    config = trainer.config
    trainer.timesteps_total += int(train_stats["learner_samples"])
    if (trainer.iteration + 1) % config.evaluation_interval == 0:
        played = evaluate_policy(trainer.rollouts, config.evaluation_episodes,
                                 config.evaluation_deterministic)
        trainer.evaluation_env_steps_total += played.env_steps
        played.env_steps = 0
        trainer.count(played)
    return {"evaluation_env_steps_total": float(trainer.evaluation_env_steps_total)}
