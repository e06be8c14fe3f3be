"""``mpirl doctor``: check that every rank starts, answers, and moves data, and how fast.

Run it the way you will run training (``mpiexec -n 8 mpirl doctor`` or ``srun mpirl doctor``) to
see the layout and a round-trip time per rank before spending an allocation on a real job.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from mpirl.runtime.core import Worker
from mpirl.runtime.dispatch import wait
from mpirl.runtime.driver import Driver
from mpirl.runtime.heartbeat import thread_level_name
from mpirl.runtime.layout import WORKER_ROLES, format_table


class Probe(Worker):
    """Answers pings and echoes payloads; reports what its rank runs."""

    MESSAGES = ("ping", "echo", "versions")

    def ping(self) -> None:
        return None

    def echo(self, payload):
        return payload

    def versions(self) -> dict[str, str]:
        return {
            "python": sys.version.split()[0],
            "mpi": MPI.Get_library_version().splitlines()[0].split(",")[0].strip(),
            "mpi4py": __import__("mpi4py").__version__,
            "MPI thread level": thread_level_name(),
        }


def round_trip_us(handle, pings: int) -> float:
    """Median microseconds of one call at a time on ``handle``."""
    handle.call("ping")
    times = []
    for _ in range(pings):
        start = time.perf_counter()
        handle.call("ping")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run_doctor(driver: Driver, pings: int = 200, payload_mib: int = 1) -> int:
    """Ping every worker, echo a payload through it, and print a table; 1 if any answer is wrong."""
    payload = np.random.default_rng(0).integers(0, 255, payload_mib << 20, dtype=np.uint8)
    rows, failures = [], 0
    groups = [driver.spawn(role, Probe) for role in WORKER_ROLES if driver.placement.count(role)]
    for group in groups:
        for handle in group:
            rtt = round_trip_us(handle, pings)
            intact = bool(np.array_equal(handle.call("echo", payload), payload))  # also warms up
            echo_times = []
            for _ in range(5):
                start = time.perf_counter()
                intact &= bool(np.array_equal(handle.call("echo", payload), payload))
                echo_times.append(time.perf_counter() - start)
            echo_ms = statistics.median(echo_times) * 1e3
            failures += not intact
            rows.append((handle.rank, group.role, handle.index, f"{rtt:.1f}",
                         f"{echo_ms:.2f}", "ok" if intact else "CORRUPTED"))
    futures = [f for group in groups for f in group.call_async("versions")]
    ready, _ = wait(futures, num_returns=len(futures), timeout=60)
    versions = {tuple(sorted(f.result().items())) for f in ready}
    print(format_table(("rank", "role", "index", "round trip us", f"{payload_mib} MiB echo ms",
                        "payload"), rows))
    for v in versions:
        print("workers run: " + ", ".join(f"{k} {val}" for k, val in v))
    if len(versions) > 1:
        print("warning: ranks run different versions (see above)")
    answered = len(ready) if driver.dispatcher else sum(len(g) for g in groups)
    print(f"doctor: {answered} worker(s) answered, {failures} payload error(s)", flush=True)
    return 1 if failures else 0
