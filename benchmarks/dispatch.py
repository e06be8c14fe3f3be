"""Call overhead of mpirl against Ray and mpi4py.futures, and what idle workers cost the driver.

    python benchmarks/dispatch.py --json benchmarks/dispatch.json [--quick] [--peers mpirl,ray]

The same file is the orchestrator and every measured program. The orchestrator starts it again
with ``--role ROLE``: under ``mpiexec`` for mpirl and mpi4py.futures, under plain Python for Ray
(which starts its own cluster). The programs run one after another, so no two measurements share
the cores, and each prints one line of JSON (``harness.emit``) that the orchestrator parses. A
peer that fails (Ray will not start, say) is recorded as an error string; a failure of the mpirl
part makes the script exit non-zero. ``--peers`` picks which peers run besides mpirl; the others
are recorded as skipped.

Every peer is measured by the same code (``measure_peer``) on the same three workloads:

* sync: one ``ping()`` at a time, median round trip in microseconds;
* async: ``IN_FLIGHT`` ``echo(small int)`` calls kept outstanding on one worker for a fixed
  time, a new one submitted as each completes; calls completed per second;
* 1 MiB: ``echo`` of a 1 MiB uint8 array, one at a time, median round trip in microseconds.

The idle measurement times a fixed CPU-bound job on the driver in an mpirl run of world size 1
and in one of world size 6 whose 5 Echo workers sit idle, alternating the two.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    add_peers_option,
    attempt_role,
    emit,
    fmt,
    not_installed,
    print_problems,
    print_table,
    ratio,
    run_metadata,
    skipped,
    write_report,
)

SCRIPT = Path(__file__).resolve()
IN_FLIGHT = 8
PAYLOAD_BYTES = 1 << 20
IDLE_WORKERS = 5
IDLE_TARGET = 0.10
# Ray starts worker processes in the background at init; on 2 cores their imports would still be
# competing with the first measurement (seen as 1.5k instead of 2.5k calls/s in flight).
RAY_SETTLE_S = 3.0
PEERS = ("mpirl", "ray", "mpi4py_futures")


@dataclass(frozen=True)
class Plan:
    """How much each measurement does; ``--quick`` scales everything down."""

    warmup: int
    sync_calls: int
    async_s: float
    """How long the in-flight loop runs: a fixed time, since the peers differ 50-fold in rate."""
    mb_calls: int
    max_loop_s: float
    """Cap on any one timed loop, so a slow peer cannot stall the whole run."""
    idle_rounds: int
    idle_reps: int
    idle_units: int
    """Size of the driver's job; one unit is about 20 us of CPU on the reference machine."""
    idle_workers: int = IDLE_WORKERS
    """Idle workers beside the driver in the ``with_idle`` runs (``--quick``: 2, the same code
    with 3 processes fewer)."""


FULL = Plan(warmup=200, sync_calls=20_000, async_s=10.0, mb_calls=2_000, max_loop_s=30.0,
            idle_rounds=3, idle_reps=5, idle_units=75_000)
QUICK = Plan(warmup=200, sync_calls=2_000, async_s=1.0, mb_calls=200, max_loop_s=5.0,
             idle_rounds=1, idle_reps=3, idle_units=20_000, idle_workers=2)


# Measurement, shared by every peer.


def time_each(call: Callable[[], Any], count: int, warmup: int, max_s: float) -> dict[str, Any]:
    """Run ``call`` ``warmup`` times untimed, then time up to ``count`` calls one by one."""
    for _ in range(warmup):
        call()
    clock = time.perf_counter_ns
    deadline = clock() + int(max_s * 1e9)
    samples: list[int] = []
    for _ in range(count):
        start = clock()
        call()
        end = clock()
        samples.append(end - start)
        if end > deadline:
            break
    samples.sort()
    return {
        "median_us": statistics.median(samples) / 1e3,
        "p10_us": samples[len(samples) // 10] / 1e3,
        "p90_us": samples[len(samples) * 9 // 10] / 1e3,
        "calls": len(samples),
    }


def closed_loop(submit: Callable[[], Any], wait_some: Callable[[list], tuple[list, list]],
                seconds: float, warmup: int, depth: int = IN_FLIGHT) -> dict[str, Any]:
    """After ``warmup`` calls, keep ``depth`` calls outstanding for ``seconds``; calls per second.

    ``wait_some(pending)`` blocks until at least one call is done, takes its result, and returns
    ``(finished, still_pending)``.
    """

    def drive(total: int, deadline: float) -> int:
        pending = [submit() for _ in range(min(depth, total))]
        submitted, completed = len(pending), 0
        while pending:
            finished, pending = wait_some(pending)
            pending = list(pending)
            completed += len(finished)
            # Past the deadline, stop refilling and let the outstanding calls drain.
            if time.perf_counter() < deadline:
                refill = min(len(finished), total - submitted)
                pending.extend(submit() for _ in range(refill))
                submitted += refill
        return completed

    drive(warmup, float("inf"))
    start = time.perf_counter()
    completed = drive(sys.maxsize, start + seconds)
    elapsed = time.perf_counter() - start
    return {"calls_per_s": completed / elapsed, "calls": completed, "seconds": elapsed}


def measure_peer(ping: Callable[[], Any], echo: Callable[[Any], Any],
                 submit_echo: Callable[[Any], Any],
                 wait_some: Callable[[list], tuple[list, list]], plan: Plan) -> dict[str, Any]:
    """The three workloads on one worker, reached through the peer's own calls."""
    import numpy as np

    payload = np.random.default_rng(0).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8)
    # A benchmark of calls that silently return the wrong thing would be worthless.
    if echo(12345) != 12345 or not np.array_equal(echo(payload), payload):
        raise RuntimeError("echo did not return its argument")
    sync = time_each(ping, plan.sync_calls, plan.warmup, plan.max_loop_s)
    flow = closed_loop(lambda: submit_echo(1), wait_some, plan.async_s, plan.warmup)
    big = time_each(lambda: echo(payload), plan.mb_calls, plan.warmup, plan.max_loop_s)
    return {
        "sync_roundtrip_us": sync["median_us"],
        "async_calls_per_s": flow["calls_per_s"],
        "mb_roundtrip_us": big["median_us"],
        "sync_roundtrip_p90_us": sync["p90_us"],
        "mb_roundtrip_p90_us": big["p90_us"],
        "mb_throughput_gib_per_s": 2 * PAYLOAD_BYTES / (big["median_us"] * 1e-6) / (1 << 30),
        "calls_timed": {"sync": sync["calls"], "async": flow["calls"], "mb": big["calls"]},
    }


# The measured programs, one per --role.


def role_mpirl(plan: Plan) -> int:
    """mpirl under ``mpiexec -n 2``: the driver calls one Echo worker on rank 1."""
    from mpi4py import MPI

    import mpirl
    from mpirl.testing import Echo

    def body(driver: mpirl.Driver) -> int:
        if driver.placement.world_size != 2:
            raise RuntimeError(f"needs 2 ranks, got {driver.placement.world_size}")
        worker = driver.spawn("rollout", Echo)[0]

        def wait_some(pending: list) -> tuple[list, list]:
            ready, rest = mpirl.wait(pending, num_returns=1)
            for future in ready:
                future.result()
            return ready, rest

        result = measure_peer(lambda: worker.call("ping"), lambda v: worker.call("echo", v),
                              lambda v: worker.call_async("echo", v), wait_some, plan)
        result["mpi_library"] = MPI.Get_library_version().strip("\0 \n").splitlines()[0]
        emit(result)
        return 0

    settings = mpirl.RuntimeSettings(print_layout=False)
    return mpirl.run(body, mpirl.Layout(num_rollout_workers=-1), settings)


def _remote_echo(value: Any) -> Any:
    return value


def _remote_ping() -> None:
    return None


def role_mpi4py_futures(plan: Plan) -> int:
    """``mpi4py.futures.MPICommExecutor`` under ``mpiexec -n 2``: rank 1 serves rank 0."""
    import concurrent.futures as cf

    from mpi4py import MPI
    from mpi4py.futures import MPICommExecutor

    with MPICommExecutor(MPI.COMM_WORLD, root=0) as executor:
        if executor is not None:
            def wait_some(pending: list) -> tuple[list, list]:
                done, rest = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for future in done:
                    future.result()
                return list(done), list(rest)

            emit(measure_peer(
                lambda: executor.submit(_remote_ping).result(),
                lambda v: executor.submit(_remote_echo, v).result(),
                lambda v: executor.submit(_remote_echo, v), wait_some, plan,
            ))
    return 0


class EchoActor:
    """The Ray twin of ``mpirl.testing.Echo``'s ``echo`` and ``ping``."""

    def echo(self, value: Any) -> Any:
        return value

    def ping(self) -> None:
        return None


def role_ray(plan: Plan) -> int:
    """One Ray actor on a local Ray cluster; start-up is timed apart and not counted."""
    try:
        import ray
    except ImportError as error:
        return not_installed("Ray", error)

    started = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(EchoActor).remote()
        ray.get(actor.ping.remote())
        startup_s = time.perf_counter() - started
        time.sleep(RAY_SETTLE_S)

        def wait_some(pending: list) -> tuple[list, list]:
            ready, rest = ray.wait(pending, num_returns=1)
            ray.get(ready)
            return ready, rest

        result = measure_peer(lambda: ray.get(actor.ping.remote()),
                              lambda v: ray.get(actor.echo.remote(v)),
                              lambda v: actor.echo.remote(v), wait_some, plan)
        result["startup_s"] = startup_s
        result["settle_s"] = RAY_SETTLE_S
        emit(result)
    finally:
        ray.shutdown()
    return 0


def driver_work(units: int) -> float:
    """A fixed CPU-bound job for the driver: pure-Python arithmetic and small NumPy calls."""
    import numpy as np

    rng = np.random.default_rng(1)
    acc = 0.0
    for i in range(units):
        acc += float(np.sort(rng.standard_normal(512))[256])
        for k in range(300):
            acc += (i ^ k) * 1e-9
    return acc


def _cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU time of ``pids`` from /proc; None where /proc cannot tell."""
    total = 0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as stat:
                # The command name may hold spaces; the numeric fields follow its ')'.
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None
    return total / os.sysconf("SC_CLK_TCK")


def role_idle(plan: Plan) -> int:
    """Time ``driver_work`` on the driver while every other rank hosts an idle Echo worker."""
    import mpirl
    from mpirl.testing import Echo

    def body(driver: mpirl.Driver) -> int:
        group = driver.spawn("rollout", Echo)
        group.call("ping")
        # Let the workers fall from their post-call spin into the idle sleep they would sit in.
        time.sleep(0.5)
        driver_work(plan.idle_units // 4)
        here = socket.gethostname()
        pids = [h["pid"] for h in driver.hosts[1:] if h["host"] == here]
        cpu_before, wall_before = _cpu_seconds(pids), time.perf_counter()
        work_s, work_cpu_s = [], []
        for _ in range(plan.idle_reps):
            wall, cpu = time.perf_counter(), time.thread_time()
            driver_work(plan.idle_units)
            work_s.append(time.perf_counter() - wall)
            work_cpu_s.append(time.thread_time() - cpu)
        cpu_after, wall_after = _cpu_seconds(pids), time.perf_counter()
        workers_cpu = None
        if pids and cpu_before is not None and cpu_after is not None:
            workers_cpu = (cpu_after - cpu_before) / (wall_after - wall_before)
        emit({"world_size": driver.placement.world_size, "workers": len(group),
              "work_s": work_s, "work_cpu_s": work_cpu_s,
              "idle_workers_cpu_cores": workers_cpu})
        return 0

    settings = mpirl.RuntimeSettings(print_layout=False)
    return mpirl.run(body, mpirl.Layout(num_rollout_workers=-1), settings)


ROLES: dict[str, Callable[[Plan], int]] = {
    "mpirl": role_mpirl,
    "mpi4py-futures": role_mpi4py_futures,
    "ray": role_ray,
    "idle": role_idle,
}


# The orchestrator.


def measure_idle(plan: Plan, quick: bool) -> dict[str, Any]:
    """Alone vs with idle workers, alternating (ABBA) so that drift in load hits both alike."""
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "with_idle": []}
    ranks = {"alone": 1, "with_idle": 1 + plan.idle_workers}
    errors = []
    for round_index in range(plan.idle_rounds):
        order = ("alone", "with_idle") if round_index % 2 == 0 else ("with_idle", "alone")
        for config in order:
            result = attempt_role(SCRIPT, "idle", ranks[config], quick)
            if "error" in result:
                errors.append(result["error"])
            else:
                runs[config].append(result)
    summary: dict[str, Any] = {"units": plan.idle_units, "workers": plan.idle_workers,
                               "rounds": plan.idle_rounds,
                               "reps_per_run": plan.idle_reps, "runs": runs}
    if errors:
        summary["errors"] = errors
    if not runs["alone"] or not runs["with_idle"]:
        summary["error"] = "idle measurement incomplete: " + " | ".join(errors)
        return summary
    for config, results in runs.items():
        times = [t for r in results for t in r["work_s"]]
        summary[f"{config}_median_s"] = statistics.median(times)
        summary[f"{config}_min_s"] = min(times)
        summary[f"{config}_cpu_median_s"] = statistics.median(
            t for r in results for t in r["work_cpu_s"])
    shares = [r["idle_workers_cpu_cores"] for r in runs["with_idle"]
              if r["idle_workers_cpu_cores"] is not None]
    summary["idle_workers_cpu_cores"] = statistics.median(shares) if shares else None
    summary["slowdown"] = summary["with_idle_median_s"] / summary["alone_median_s"] - 1
    summary["slowdown_of_min"] = summary["with_idle_min_s"] / summary["alone_min_s"] - 1
    return summary


def orchestrate(plan: Plan, quick: bool, json_path: Path | None,
                peers: tuple[str, ...] = PEERS) -> int:
    """Run every measured program of ``peers`` in turn, write the JSON report, print a table."""
    started = time.perf_counter()
    meta = {
        **run_metadata(quick, plan, ("mpi4py", "ray", "numpy", "mpirl")),
        "in_flight": IN_FLIGHT,
        "payload_bytes": PAYLOAD_BYTES,
    }
    report: dict[str, Any] = {"meta": meta}
    # MPI programs first and Ray last, so that no Ray daemon lingering after shutdown can eat
    # into an MPI measurement.
    report["mpirl"] = attempt_role(SCRIPT, "mpirl", 2, quick)
    report["mpi4py_futures"] = (attempt_role(SCRIPT, "mpi4py-futures", 2, quick)
                                if "mpi4py_futures" in peers else skipped())
    idle = measure_idle(plan, quick)
    report["ray"] = attempt_role(SCRIPT, "ray", None, quick) if "ray" in peers else skipped()
    meta["mpi_library"] = report["mpirl"].pop("mpi_library", None)

    mpirl_result, ray_result = report["mpirl"], report["ray"]
    # Any failed idle run is an mpirl failure, even when the others gave a result.
    idle_error = idle.get("error") or " | ".join(idle.get("errors", []))
    if idle_error:
        mpirl_result["idle_error"] = idle_error
    if "error" not in idle:
        mpirl_result["idle_driver_work_s_alone"] = idle["alone_median_s"]
        mpirl_result[f"idle_driver_work_s_with_{plan.idle_workers}_idle"] = idle[
            "with_idle_median_s"]
    report["speedup_vs_ray_sync"] = ratio(ray_result.get("sync_roundtrip_us"),
                                          mpirl_result.get("sync_roundtrip_us"))
    report["speedup_vs_ray_async"] = ratio(mpirl_result.get("async_calls_per_s"),
                                           ray_result.get("async_calls_per_s"))
    futures_result = report["mpi4py_futures"]
    report["speedup_vs_mpi4py_futures_sync"] = ratio(futures_result.get("sync_roundtrip_us"),
                                                     mpirl_result.get("sync_roundtrip_us"))
    report["speedup_vs_mpi4py_futures_async"] = ratio(mpirl_result.get("async_calls_per_s"),
                                                      futures_result.get("async_calls_per_s"))
    report["idle_slowdown"] = idle.get("slowdown")
    report["idle_slowdown_target"] = IDLE_TARGET
    report["idle_slowdown_ok"] = (None if idle.get("slowdown") is None
                                  else idle["slowdown"] <= IDLE_TARGET)
    report["idle"] = idle
    meta["wall_s"] = time.perf_counter() - started

    write_report(report, json_path)
    print_summary(report)
    if json_path is not None:
        print(f"wrote {json_path}")
    failed = "error" in mpirl_result or "idle_error" in mpirl_result
    return 1 if failed else 0


def print_summary(report: dict[str, Any]) -> None:
    """A small table for people; the JSON holds everything."""
    meta = report["meta"]
    rows = [("", *PEERS)]
    for label, key, digits in (
        ("sync round trip, us (median)", "sync_roundtrip_us", 1),
        (f"async calls/s ({IN_FLIGHT} in flight)", "async_calls_per_s", 0),
        ("1 MiB echo round trip, us (median)", "mb_roundtrip_us", 1),
    ):
        rows.append((label, *(fmt(report[p].get(key), digits) for p in PEERS)))
    mode = "quick" if meta["quick"] else "full"
    print(f"\ndispatch benchmark ({mode}) on {meta['hostname']}, {meta['cpu_count']} CPUs, "
          f"{meta['wall_s']:.0f} s")
    print_table(rows)
    print_problems({peer: report[peer] for peer in PEERS})
    print(f"mpirl vs ray: sync {fmt(report['speedup_vs_ray_sync'], 1)}x, "
          f"async {fmt(report['speedup_vs_ray_async'], 1)}x")
    idle = report["idle"]
    if "error" in idle:
        print(f"idle workers: error: {idle['error']}")
    else:
        verdict = "ok" if report["idle_slowdown_ok"] else "OVER TARGET"
        print(f"driver job alone {idle['alone_median_s']:.3f} s, with {idle['workers']} idle "
              f"workers {idle['with_idle_median_s']:.3f} s: slowdown {idle['slowdown']:+.1%} "
              f"(target <= {IDLE_TARGET:.0%}, {verdict})")


def main(argv: list[str] | None = None) -> int:
    """Entry point for the orchestrator and for every measured program."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--quick", action="store_true", help="short run (under a minute)")
    add_peers_option(parser, PEERS)
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.role is not None:
        return ROLES[args.role](plan)
    return orchestrate(plan, args.quick, args.json, args.peers)


if __name__ == "__main__":
    sys.exit(main())
