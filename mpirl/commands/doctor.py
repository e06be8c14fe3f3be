"""``mpirl doctor``: the runtime's checks (every rank answers, moves data, how fast), then the
learners': each learner's device and the versions behind it, and the speed of the gradient
allreduce over the learner communicator, the collective every SGD step makes.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpirl.errors import ConfigError, RemoteError, unwrap_remote
from mpirl.runtime.doctor import run_doctor
from mpirl.runtime.driver import Driver
from mpirl.runtime.layout import format_table

ALLREDUCE_SIZES_MIB = (1, 64)
ALLREDUCE_REPEATS = 5


@dataclass
class LearnerCheck:
    """The ``--config`` keys of ``mpirl doctor`` besides the layout and runtime ones: the
    learners' allreduce backend as training would use it."""

    learner_backend: str = "auto"
    """auto (NCCL where each learner has a GPU of its own, else MPI), mpi, gloo or nccl."""
    learner_master_addr: str = ""
    """Where learner 0 opens the torch process group's store (gloo, nccl)."""


def doctor(driver: Driver, pings: int, learners: LearnerCheck) -> int:
    """Rank 0: the runtime's checks, then the learners' (where the layout has learner ranks)."""
    if driver.placement.count("learner"):
        from mpirl.workers.learner import check_backend  # before the pings, not after

        check_backend(learners.learner_backend)
    code = run_doctor(driver, pings=pings)
    if driver.placement.count("learner"):
        check_learners(driver, learners)
    return code


def check_learners(driver: Driver, learners: LearnerCheck) -> None:
    """Print each learner's device and versions, and the allreduce time and bandwidth at
    ``ALLREDUCE_SIZES_MIB``. Bus bandwidth is NCCL's convention, ``alg * 2 (n - 1) / n``: what
    each link carries in a ring allreduce."""
    from mpirl.workers.learner import AllreduceProbe  # torch: only where learners are checked

    try:
        group = driver.spawn("learner", AllreduceProbe, learners.learner_backend,
                             learners.learner_master_addr)
    except RemoteError as error:  # nccl without CUDA, a store that cannot open: say which
        raise unwrap_remote(error, ConfigError) from None
    described = [f.result() for f in group.call_async("describe")]
    rows = [(d["rank"], d["host"], d["device"], d["gpu"] or "-", d["backend"], d["torch"],
             d["cuda"] or "-", d["nccl"] or "-") for d in described]
    print(format_table(("rank", "host", "device", "gpu", "backend", "torch", "cuda", "nccl"),
                       rows))
    n = len(described)
    if n < 2:
        print("learners: one learner rank, so no gradient allreduce to time")
        return
    for mib in ALLREDUCE_SIZES_MIB:
        futures = group.call_async("time_allreduce", mib << 20, ALLREDUCE_REPEATS)
        # The collective ends when its slowest member does.
        seconds = max(f.result(timeout=300) for f in futures)
        alg = (mib << 20) / seconds / 1e9
        print(f"learner allreduce ({described[0]['backend']}, {n} learners), {mib} MiB: "
              f"{seconds * 1e3:.2f} ms, {alg:.2f} GB/s alg, {alg * 2 * (n - 1) / n:.2f} GB/s bus",
              flush=True)
