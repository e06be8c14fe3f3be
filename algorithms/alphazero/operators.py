"""AlphaZero's operator: self-play's positions straight from the rollout ranks to the learners."""

from __future__ import annotations

from typing import Any

from mpirl.execution.operators import (
    SampleResult,
    add_samples,
    discard_lost_rollouts,
    learner_stats,
)
from mpirl.runtime.dispatch import WorkerGroup
from mpirl.workers.delivery import IN_ANSWER, ToLearnerOf


def rollouts_to_learners(rollouts: WorkerGroup, learners: WorkerGroup, method: str,
                         *args: Any) -> SampleResult:
    """Every rollout worker runs ``method(*args, deliver=...)``, which collects a batch and
    delivers it as told (``mpirl.workers.delivery``): rollout worker i's to learner i mod L over
    the data channel (``ToLearnerOf``: one call, pickled once for all ranks), or in its answer
    where the worker or the one learner is in the driver's process. The driver gets the counts
    and episodes (``add_samples``) and where each learner's batches are (``sources``,
    ``batches``), for ``train_on_positions``. For workers whose collecting is not ``sample``'s
    (AlphaZero's self-play, ``play``)."""
    discard_lost_rollouts(learners, rollouts)
    if len(learners) == 1 and learners[0].in_process or all(w.in_process for w in rollouts):
        deliver: Any = IN_ANSWER
    else:
        deliver = ToLearnerOf(tuple(learner.rank for learner in learners))
    futures = rollouts.call_async(method, *args, deliver=deliver)
    result = SampleResult()
    add_samples(result, [(worker.index % len(learners), worker, future)
                         for worker, future in zip(rollouts, futures, strict=True)], None)
    discard_lost_rollouts(learners, rollouts)
    return result


def train_on_positions(learners: WorkerGroup, samples: SampleResult, sgd_steps: int,
                       batch_size: int, min_replay: int) -> dict[str, float]:
    """Every learner adds its share of ``samples`` to its replay shard and, once the shards
    hold ``min_replay`` positions together, takes ``sgd_steps`` steps on ``batch_size`` of its
    own (``AlphaZeroLearner.train``). Statistics averaged over learners."""
    futures = [
        learner.call_async("train", samples.sources.get(i, []), samples.batches.get(i),
                           sgd_steps=sgd_steps, batch_size=batch_size, min_replay=min_replay)
        for i, learner in enumerate(learners)
    ]
    return learner_stats([f.result() for f in futures])
