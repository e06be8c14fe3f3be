"""Driver programs for tests/test_mpi_threads.py: a stuck worker, a failing heartbeat thread, a
weight broadcast that one rank never joins.

``python threads_scenarios.py NAME [options]`` runs on every rank; rank 0 prints ``RESULT {json}``.
Its own file, so that its options do not crowd the shared scenarios.py.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import threading
import time

from scenarios import SCENARIOS, report, scenario  # the shared registry and RESULT line

import mpirl
from mpirl.runtime.core import Worker
from mpirl.runtime.heartbeat import Heartbeat


class Blocker(Worker):
    """Blocks its rank's main thread for ever, sleeps, or breaks its rank's heartbeat thread."""

    MESSAGES = ("ping", "block_forever", "sleep", "compute", "break_heartbeat")

    def ping(self) -> None:
        return None

    def block_forever(self) -> None:
        threading.Event().wait()  # a deadlock: no CPU, no return

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def compute(self, seconds: float) -> int:
        """Busy for ``seconds`` in one task: a long computation, not a stuck one."""
        deadline, n = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            n += sum(range(1000))
        return n

    def break_heartbeat(self) -> None:
        break_heartbeat()


def break_heartbeat() -> None:
    """Make this rank's heartbeat thread raise at its next send: a bug in the thread itself."""

    def send(self, sends):
        raise RuntimeError("injected heartbeat failure")

    Heartbeat._send = send


@scenario
def stuck_worker(driver, args):
    """A rollout worker computes in one task for longer than the stuck bound (progress, not
    stuck); then another blocks for ever in a task while the driver waits on it with no timeout
    of its own."""
    blockers = driver.spawn("rollout", Blocker)
    computed = blockers[0].call("compute", args.compute_s)
    report(computed=computed > 0, blocked_at=time.time())
    blockers[-1].call("block_forever")
    report(stuck_returned=True)


@scenario
def heartbeat_fails(driver, args):
    """The heartbeat thread of rank ``--rank`` raises; the driver goes on calling workers."""
    blockers = driver.spawn("rollout", Blocker)
    if args.rank == 0:
        break_heartbeat()
    else:
        blockers[args.rank - 1].call("break_heartbeat")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for handle in blockers:
            if handle.rank != args.rank:
                handle.call("sleep", 0.01)
    report(survived=True)


@scenario
def broadcast_while_busy(driver, args):
    """With the learner in the driver (num_learners 0), broadcast weights while the only rollout
    rank is busy in another task for longer than task_timeout_s."""
    import gymnasium as gym
    import numpy as np
    from mpirl.algorithms import ppo

    from mpirl.execution.operators import broadcast_weights
    from mpirl.models.policy import PolicySpec
    from mpirl.workers.env_spec import EnvSpec
    from mpirl.workers.learner import Learner, LearnerSettings
    from mpirl.workers.rollout import RolloutSettings, RolloutWorker

    # Large enough (about 1 MiB) that MPI cannot send it eagerly: the root waits for receivers.
    spec = PolicySpec(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2),
                      hidden_sizes=(512, 512))
    learners = driver.spawn("learner", Learner, LearnerSettings(
        policy=spec, loss=ppo.loss, loss_config=ppo.Config(), lr=1e-2, grad_clip=0.5, seed=0,
        backend="mpi"), local_if_empty=True)
    rollouts = driver.spawn("rollout", RolloutWorker, RolloutSettings(
        env=EnvSpec("CartPole-v1"), policy=spec, num_envs=1, seed=0, gamma=0.99, lam=0.95))
    busy = driver.spawn("rollout", Blocker)
    broadcast_weights(learners, rollouts)  # works while the rank is free
    busy[0].call_async("compute", args.compute_s)
    start = time.monotonic()
    try:
        broadcast_weights(learners, rollouts)
        error = None
    except mpirl.MpirlError as caught:
        error = f"{type(caught).__name__}: {caught}"
    report(error=error, elapsed_s=time.monotonic() - start)


@scenario
def ping_all(driver, args):
    blockers = driver.spawn("rollout", Blocker)
    report(answers=len(blockers.call("ping")))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=sorted(SCENARIOS))
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--compute-s", type=float, default=5.0)
    parser.add_argument("--layout", default="{}")
    parser.add_argument("--settings", default="{}", help="RuntimeSettings fields, as JSON")
    parser.add_argument("--late-rank", type=int, default=-1,
                        help="this rank sleeps --late-s before it calls mpirl.run")
    parser.add_argument("--late-s", type=float, default=0.0)
    args = parser.parse_args()
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == args.late_rank:
        time.sleep(args.late_s)
    if args.name == "broadcast_while_busy":
        # Imported on every rank before the run, so that spawning takes less than the short
        # task_timeout_s the scenario runs with.
        for module in ("mpirl.workers.learner", "mpirl.workers.rollout"):
            importlib.import_module(module)
    settings = mpirl.RuntimeSettings(**{"print_layout": False, **json.loads(args.settings)})
    layout = mpirl.Layout(**json.loads(args.layout))
    return mpirl.run(lambda driver: SCENARIOS[args.name](driver, args), layout, settings)


if __name__ == "__main__":
    sys.exit(main())
