"""What one poll costs rank 0 on this machine, and how much of it the emulation adds: the CPU of
an empty ``Improbe`` and of unpickling a typical answer, taken right after a short sleep (as the
driver takes them between answers), with N - 1 neighbouring ranks either asleep or doing what a
rollout rank of ``benchmarks/scale.py`` does (a short burst of CPU every env step).

    python benchmarks/poll_cost.py --json benchmarks/poll_cost.json     # 8, 16, 32, 64 ranks
    python benchmarks/poll_cost.py --quick --json /tmp/poll_cost.json   # 2 and 4 ranks

``scale.py`` runs 64 ranks on 2 cores, so rank 0 shares its core and caches with ranks that
work. On a cluster rank 0 has a core of its own. The ratio ``busy / idle`` at each N is the
factor by which sharing inflates rank 0's CPU per operation, which ``scale.py`` cannot tell
apart from the runtime's own cost; ``warm`` is the same probe in a tight loop (no sleep), the
floor on a core that nothing else uses.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    attempt,
    emit,
    fmt,
    print_problems,
    print_table,
    run_main,
    run_metadata,
    run_role,
    write_report,
)

SCRIPT = Path(__file__)
FULL_RANKS = (8, 16, 32, 64)
QUICK_RANKS = (2, 4)
NEIGHBOURS = ("idle", "busy")
STEP_S = 0.02
"""A neighbour's env step, as in scale.py's full plan (SleepEnv sleeping 20 ms)."""
BURST_S = 3e-4
"""A busy neighbour's CPU per step: 63 of them keep about one of this machine's 2 cores busy,
about what scale.py's 64-rank PPO run does (its sampling efficiency is 0.94)."""
SLEEP_S = 5e-4
"""Rank 0's sleep before each measured probe: the driver's back-off sleeps 0.05-1 ms."""
SAMPLES, QUICK_SAMPLES = 2000, 300
ANSWER = (17, True, {"env_steps": 50, "env_failures": 0, "episode_returns": [21.0, 35.0],
                     "episode_lengths": [21, 35], "filter_delta": None,
                     "weights_version": 1234})
"""A typical small answer: (call id, ok, a rollout rank's metrics)."""


@dataclass(frozen=True)
class Plan:
    ranks: tuple[int, ...]
    samples: int
    step_s: float = STEP_S
    burst_s: float = BURST_S
    sleep_s: float = SLEEP_S


def probe(neighbours: str, samples: int) -> None:
    """Under mpiexec: rank 0 measures, the others sleep or work until it is done."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.rank != 0:
        done = comm.irecv(source=0, tag=1)
        block = np.random.default_rng(comm.rank).random((32, 32))
        while not done.Test():
            time.sleep(STEP_S)
            if neighbours == "busy":
                start = time.thread_time()
                while time.thread_time() - start < BURST_S:
                    block = block @ block
                    block /= np.abs(block).max() or 1.0
        return
    status, payload = MPI.Status(), pickle.dumps(ANSWER, protocol=5)

    def improbe() -> None:
        comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)

    def unpickle() -> None:
        pickle.loads(payload)

    costs: dict[str, list[float]] = {"improbe": [], "unpickle": []}
    warm: dict[str, float] = {}
    for name, operation in (("improbe", improbe), ("unpickle", unpickle)):
        start = time.thread_time()
        for _ in range(samples):
            operation()
        warm[name] = (time.thread_time() - start) / samples * 1e6
    for _ in range(samples):
        for name, operation in (("improbe", improbe), ("unpickle", unpickle)):
            time.sleep(SLEEP_S)
            start = time.thread_time()
            operation()
            costs[name].append((time.thread_time() - start) * 1e6)
    for rank in range(1, comm.size):
        comm.send(None, rank, tag=1)
    emit({"ranks": comm.size, "neighbours": neighbours,
          **{f"{name}_us": statistics.mean(values) for name, values in costs.items()},
          **{f"{name}_warm_us": value for name, value in warm.items()}})


def measure(ranks: int, neighbours: str, quick: bool) -> dict[str, Any]:
    return run_role(SCRIPT, "probe", quick, ["--neighbours", neighbours], ranks=ranks,
                    name=f"poll cost, {ranks} ranks, {neighbours} neighbours").result


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, fewer samples")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--role", choices=["probe"], help=argparse.SUPPRESS)
    parser.add_argument("--neighbours", choices=NEIGHBOURS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "probe":
        probe(args.neighbours, QUICK_SAMPLES if args.quick else SAMPLES)
        return 0
    ranks = QUICK_RANKS if args.quick else FULL_RANKS
    by_ranks: dict[str, dict[str, Any]] = {}
    for n in ranks:
        point: dict[str, Any] = {}
        for neighbours in NEIGHBOURS:
            point[neighbours] = attempt(
                f"{n} ranks, {neighbours} neighbours",
                lambda n=n, neighbours=neighbours: measure(n, neighbours, args.quick),
                lambda r: f"improbe {r['improbe_us']:.1f} us, unpickle {r['unpickle_us']:.1f} us"
                          f" after a sleep")
        idle, busy = point["idle"], point["busy"]
        if "error" not in idle and "error" not in busy:
            point["busy_over_idle"] = {op: busy[f"{op}_us"] / idle[f"{op}_us"]
                                       for op in ("improbe", "unpickle")}
        by_ranks[str(n)] = point
    print_problems({f"{n} ranks, {k}": v for n, p in by_ranks.items() for k, v in p.items()
                    if k in NEIGHBOURS})
    rows = [("ranks", "improbe warm", "idle", "busy", "busy/idle", "unpickle warm", "idle",
             "busy", "busy/idle")]
    for n, point in by_ranks.items():
        idle, busy, ratio = point["idle"], point["busy"], point.get("busy_over_idle", {})
        cells = [n]
        for op in ("improbe", "unpickle"):
            cells += [fmt(idle.get(f"{op}_warm_us"), 1), fmt(idle.get(f"{op}_us"), 1),
                      fmt(busy.get(f"{op}_us"), 1), fmt(ratio.get(op), 1)]
        rows.append(tuple(cells))
    print("rank 0's CPU per operation, us (after a 0.5 ms sleep unless warm):")
    print_table(rows)
    plan = Plan(ranks, QUICK_SAMPLES if args.quick else SAMPLES)
    write_report({**run_metadata(args.quick, plan, ("mpi4py", "numpy")), "by_ranks": by_ranks},
                 args.json)
    failed = any("error" in p[k] for p in by_ranks.values() for k in NEIGHBOURS)
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
