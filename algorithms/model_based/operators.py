"""The model-based plans' own operators (PETS, MBPO): real transitions go rollout rank ->
learner 0, which keeps them (and, with several learner ranks, passes them on over the learners'
communicator); a call made on every learner at once.
"""

from __future__ import annotations

from typing import Any

from mpirl.errors import RankLost, RemoteError
from mpirl.execution.operators import (
    SampleResult,
    add_sample_metrics,
    discard_lost_rollouts,
    replay_dest,
)
from mpirl.runtime.dispatch import WorkerGroup


def transitions_to_learner(rollouts: WorkerGroup, learners: WorkerGroup, steps_per_env: int,
                           epsilon: float) -> SampleResult:
    """Every rollout worker steps its envs ``steps_per_env`` times (``sample_steps``;
    ``epsilon`` 1: random actions) and sends its transitions straight to learner 0, which keeps
    them (``add``) and, with several learner ranks, broadcasts them to the others: one send
    per rollout rank whatever their number. A rank lost meanwhile (survived, under ULFM) is
    left out, and the weight broadcast shrinks to the ranks left."""
    learner = learners[0]
    discard_lost_rollouts(learners, rollouts)
    futures = [(worker, worker.call_async("sample_steps", steps_per_env, epsilon,
                                          replay_dest(worker, learner)))
               for worker in rollouts]
    result, sources, batches = SampleResult(), [], []
    for worker, future in futures:
        try:
            metrics = future.result()
        except RankLost:  # its transitions are not waited for
            continue
        if "transitions" in metrics:
            batches.append(metrics.pop("transitions"))
        else:
            sources.append(worker.rank)
        add_sample_metrics(result, metrics)
    on_every_learner(learners, "add", lambda i: (sources, batches) if i == 0 else ([], None))
    discard_lost_rollouts(learners, rollouts)
    return result


def on_every_learner(learners: WorkerGroup, method: str, args: Any = lambda i: ()) -> Any:
    """``method(*args(i))`` on every learner i at once (a collective over them with several);
    learner 0's answer. When some raise, learner 0's error (they raise alike) is raised after
    every answer is in, so no call is left running."""
    futures = [learner.call_async(method, *args(i)) for i, learner in enumerate(learners)]
    answers, errors = [], []
    for future in futures:
        try:
            answers.append(future.result())
        except RemoteError as error:
            errors.append(error)
    if errors:
        raise errors[0]
    return answers[0]
