"""mpirl's cost as the rank count grows, emulated on one machine: rank 0's CPU, messages and bytes
per iteration, the sampling rate per rollout rank, memory per role and start-up.

    python benchmarks/scale.py --json benchmarks/scale.json            # 8, 16, 32, 64 ranks
    python benchmarks/scale.py --quick --json /tmp/scale.json          # 4 and 8 ranks, PPO, IMPALA

Each point is one ``mpiexec -n N mpirl train`` on ``mpirl.testing:SleepEnv``, whose step sleeps a
fixed time (``--step-ms``) instead of using a core, with one env per rollout rank and a policy of
one 8-unit layer: rollout ranks then spend their time waiting, as they would on nodes of their
own, so that what grows with N is the runtime's own cost, not the competition for this machine's
cores. Work per rollout rank is fixed (weak scaling): a PPO batch, an IMPALA iteration, an Ape-X
iteration and an ES generation all grow with the number of rollout ranks.

From each run's ``progress.csv`` (the rows after the first ``WARMUP_ITERATIONS``, medians):
``iteration_s``; ``driver_cpu_ms_per_iter`` (rank 0's process, the learner it hosts included) and
that divided by the rollout ranks; its parts (``Driver.perf_report``): ``driver_hosted_cpu_ms``
(worker objects in rank 0's process: PPO's and IMPALA's learner), ``driver_idle_cpu_ms`` (polls
that found nothing), ``driver_threads_cpu_ms`` (heartbeat, writers) and ``driver_own_cpu_ms``,
the driving itself (dispatching calls, taking answers, merging metrics, logging), with
``driver_own_cpu_us_per_worker_iteration`` that divided by the rollout ranks;
``driver_msgs_per_iter`` and ``driver_bytes_per_iter``
(through rank 0); ``steps_per_s_per_worker`` and the weak-scaling efficiency against the smallest
rank count run; the largest RSS per role; and from ``startup.json`` the time from launch to the
first iteration. ``growth`` fits each quantity through rank 0 to ``c * workers^k`` over the rank
counts: k > 1 would be faster than linear; ``driver_cpu_us_per_added_worker`` is the slope of rank
0's CPU per iteration against the rollout ranks, the part of its cost that each rank adds, and
``driver_own_cpu_us_per_added_worker`` the same for the driving alone.

The driver's counters see only its control channel. With ``--mpi-traffic`` each point also gets
``mpi_sent_bytes_per_iter`` and ``mpi_received_bytes_per_iter``: every byte rank 0 sent and
received, collectives included (a weight or update broadcast from rank 0, say), from Open MPI's
pml monitoring over two runs of different lengths (``mpi_traffic``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    BenchError,
    attempt,
    fmt,
    mpiexec_command,
    print_problems,
    print_table,
    run_metadata,
    run_process,
    tail,
    write_report,
)

MPIRL = Path(sys.executable).parent / "mpirl"
ENV_ID = "mpirl.testing:SleepEnv"
ALGOS = ("PPO", "IMPALA", "APEX", "ES")
WARMUP_ITERATIONS = 2
FRAGMENT = 50
"""Steps per rollout rank per PPO or IMPALA iteration, and per Ape-X fragment."""
ES_EPISODE_LEN = 20
APEX_SGD_STEPS_PER_ENV_STEP = 0.1
IMPALA_FRAGMENTS_PER_CALL = 8
"""IMPALA streams its fragments to the learner, 8 per call (``fragments_per_call``), as a run of
many rollout ranks should; ``--impala-fragments-per-call 0`` measures the driver-routed path."""
APEX_FRAGMENTS_PER_CALL = 8
"""Ape-X streams too: its calls run from checkpoint to checkpoint and the learner reports each
iteration (``fragments_per_call`` > 0; 8 sets only how far a throttled rank may run ahead, and
the scale config does not throttle); ``--apex-fragments-per-call 0`` measures the driver-driven
path."""
CPU_PARTS = ("hosted", "idle", "threads", "own")
"""The parts of rank 0's CPU per iteration that ``progress.csv`` reports (``perf/driver_*``)."""
RANK_MB = 100
"""A rank's memory here, rounded up: every rollout rank acts in NumPy on SleepEnv (about 70 MB)."""
TRAFFIC_ITERATIONS = (4, 12)
"""The two runs whose difference gives the MPI traffic of one iteration (``--mpi-traffic``)."""
MONITORING_FLAGS = ("--mca", "pml_monitoring_enable", "2", "--mca", "pml_monitoring_enable_output",
                    "3", "--mca", "osc", "sm,rdma")
"""Open MPI's pml monitoring, writing each rank's per-peer totals at MPI_Finalize. Its one-sided
component breaks shared-memory windows (ES's noise table), so ``osc`` leaves it out."""


def fits_in_memory(algo: str, ranks: int) -> str | None:
    """Why ``ranks`` ranks of ``algo`` would not fit in this machine's memory, or None."""
    try:
        with open("/proc/meminfo") as file:
            available_mb = next(int(line.split()[1]) // 1024 for line in file
                                if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    need_mb = ranks * RANK_MB + 1000
    if need_mb > 0.8 * available_mb:
        return (f"{ranks} ranks of {algo} need about {need_mb:,} MB ({RANK_MB} MB per rank) "
                f"and {available_mb:,} MB are available")
    return None


@dataclass(frozen=True)
class Plan:
    ranks: tuple[int, ...]
    algos: tuple[str, ...]
    train_s: float
    """Training time of each run (after its start-up)."""
    step_ms: float
    """What each env step sleeps."""
    impala_fragments_per_call: int = IMPALA_FRAGMENTS_PER_CALL
    apex_fragments_per_call: int = APEX_FRAGMENTS_PER_CALL


QUICK = Plan(ranks=(4, 8), algos=("PPO", "IMPALA"), train_s=6.0, step_ms=10.0)
FULL = Plan(ranks=(8, 16, 32, 64), algos=ALGOS, train_s=20.0, step_ms=20.0)


def rollout_ranks(algo: str, ranks: int) -> tuple[int, dict[str, Any]]:
    """The rollout ranks of ``ranks`` for ``algo``, and the layout keys that give them."""
    if algo == "APEX":
        # One replay shard per 16 ranks; the learner on a rank of its own.
        shards = max(1, ranks // 16)
        return ranks - 2 - shards, {"num_replay_shards": shards, "num_learners": 1}
    return ranks - 1, {}


def config_for(algo: str, workers: int, step_ms: float,
               impala_fragments_per_call: int = IMPALA_FRAGMENTS_PER_CALL,
               apex_fragments_per_call: int = APEX_FRAGMENTS_PER_CALL) -> dict[str, Any]:
    """Weak scaling: each rollout rank's work per iteration stays the same as ranks grow."""
    common = {"num_envs_per_worker": 1, "hidden_sizes": [8],
              "env_config": {"step_s": step_ms / 1e3}}
    if algo == "PPO":
        return {**common, "rollout_fragment_length": FRAGMENT, "num_epochs": 1,
                "minibatch_size": FRAGMENT * workers}
    if algo == "IMPALA":
        return {**common, "rollout_fragment_length": FRAGMENT, "train_batch_size": FRAGMENT,
                "min_steps_per_iteration": FRAGMENT * workers,
                "fragments_per_call": impala_fragments_per_call}
    if algo == "APEX":
        return {**common, "rollout_fragment_length": FRAGMENT,
                "min_env_steps_per_iteration": FRAGMENT * workers, "learning_starts": 200,
                "throttle_sampling": False, "fragments_per_call": apex_fragments_per_call,
                # What one CPU learner keeps up with here (about 17 rounds of 16 minibatches
                # per iteration at 64 ranks), so that a learner training flat out does not
                # take the rollout ranks' share of the 2 cores.
                "sgd_steps_per_env_step": APEX_SGD_STEPS_PER_ENV_STEP}
    if algo == "ES":
        # Two episodes (one antithetic pair) per rollout rank per generation.
        return {"hidden_sizes": [8], "episodes_per_batch": 2 * workers,
                "train_batch_size": 2 * ES_EPISODE_LEN * workers,
                "env_config": {"step_s": step_ms / 1e3, "episode_len": ES_EPISODE_LEN}}
    raise ValueError(algo)


def _median(rows: list[dict[str, str]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "", "nan")]
    values = [v for v in values if math.isfinite(v)]
    return statistics.median(values) if values else None


def measure(algo: str, ranks: int, plan: Plan, runs_dir: Path) -> dict[str, Any]:
    """One ``mpirl train`` of ``algo`` on ``ranks`` ranks; its costs per iteration."""
    workers, _ = rollout_ranks(algo, ranks)
    run_dir = runs_dir / f"{algo.lower()}-{ranks}"
    command = mpiexec_command(ranks, str(MPIRL), *_train_command(
        algo, ranks, plan, run_dir, {"time_total_s": plan.train_s}))
    # Start-up of 64 ranks on 2 cores takes 15-20 s here; more on a loaded machine.
    finished = run_process(command, f"mpirl {algo} -n {ranks}", plan.train_s + 60 + 3.0 * ranks,
                           {"CI": "true"})
    try:
        with (run_dir / "progress.csv").open() as file:
            rows = list(csv.DictReader(file))
        startup = json.loads((run_dir / "startup.json").read_text())
    except (OSError, ValueError) as error:
        raise BenchError(f"mpirl {algo} -n {ranks}: no progress.csv or startup.json ({error}):\n"
                         f"{tail(finished.stderr) or tail(finished.stdout)}") from None
    steady = rows[WARMUP_ITERATIONS:]
    if len(steady) < 2:
        raise BenchError(f"mpirl {algo} -n {ranks}: {len(rows)} iterations in {plan.train_s:g} s;"
                         f" too few to measure (give a longer training time)")
    seen_workers = int(float(steady[-1]["num_rollout_workers"]))
    if seen_workers != workers:
        raise BenchError(f"mpirl {algo} -n {ranks}: ran {seen_workers} rollout ranks, "
                         f"expected {workers}")
    cpu_ms = _median(steady, "perf/driver_cpu_ms_per_iter")
    parts = {f"driver_{part}_cpu_ms_per_iter": _median(steady,
                                                       f"perf/driver_{part}_cpu_ms_per_iter")
             for part in CPU_PARTS}
    own_ms = parts["driver_own_cpu_ms_per_iter"]
    rate = _median(steady, "env_steps_per_s")
    last = rows[-1]
    rss = {role: float(last[f"perf/max_{role}_rss_mb"])
           for role in ("rollout", "replay", "learner") if last.get(f"perf/max_{role}_rss_mb")}
    return {
        "ranks": ranks, "rollout_ranks": workers, "iterations": len(rows),
        "iteration_s": _median(steady, "time_this_iter_s"),
        "driver_cpu_ms_per_iter": cpu_ms,
        "driver_cpu_us_per_worker_iteration": cpu_ms * 1e3 / workers if cpu_ms else None,
        **parts,
        "driver_own_cpu_us_per_worker_iteration": (own_ms * 1e3 / workers
                                                   if own_ms is not None else None),
        "driver_msgs_per_iter": _median(steady, "perf/driver_msgs_per_iter"),
        "driver_bytes_per_iter": _median(steady, "perf/driver_bytes_per_iter"),
        "steps_per_s": rate,
        "steps_per_s_per_worker": rate / workers if rate else None,
        "ideal_steps_per_s_per_worker": 1e3 / plan.step_ms,
        "driver_rss_mb": float(last["perf/driver_rss_mb"]),
        "rss_mb_by_role": rss,
        "startup_s": startup.get("launch_to_first_iteration_s"),
        "startup_phases_s": startup.get("driver_phases_s"),
        "wall_s": finished.wall_s,
    }


def _train_command(algo: str, ranks: int, plan: Plan, run_dir: Path, stop: dict[str, Any]
                   ) -> list[str]:
    workers, layout = rollout_ranks(algo, ranks)
    if workers < 1:
        raise BenchError(f"{algo} needs more than {ranks} ranks")
    config = {**layout, **config_for(algo, workers, plan.step_ms,
                                     plan.impala_fragments_per_call,
                                     plan.apex_fragments_per_call)}
    return ["train", "--algo", algo, "--env", ENV_ID, "--config", json.dumps(config),
            "--stop", json.dumps(stop), "--run-dir", str(run_dir), "--progress", "plain",
            "--seed", "0"]


def read_rank0_traffic(prefix: Path, ranks: int) -> dict[str, float]:
    """Bytes and messages rank 0 sent and received over a whole run, from the files Open MPI's
    pml monitoring wrote (``PREFIX.RANK.prof``): point to point (``E`` lines) and the
    point-to-point messages that collectives are made of (``I`` lines), by world rank."""
    totals = {"sent_bytes": 0.0, "sent_msgs": 0.0, "received_bytes": 0.0, "received_msgs": 0.0}
    for rank in range(ranks):
        path = Path(f"{prefix}.{rank}.prof")
        if not path.exists():
            raise BenchError(f"Open MPI's monitoring wrote no {path.name}")
        for line in path.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) < 5 or fields[0] not in ("E", "I"):
                continue
            source, dest = int(fields[1]), int(fields[2])
            size, count = float(fields[3].split()[0]), float(fields[4].split()[0])
            if source == 0:
                totals["sent_bytes"] += size
                totals["sent_msgs"] += count
            elif dest == 0:
                totals["received_bytes"] += size
                totals["received_msgs"] += count
    return totals


def mpi_traffic(algo: str, ranks: int, plan: Plan, runs_dir: Path) -> dict[str, float]:
    """All the MPI traffic through rank 0 per iteration, collectives included (the driver's own
    counters see only its control channel): two runs of ``TRAFFIC_ITERATIONS`` under Open MPI's
    pml monitoring; their difference, over the difference in iterations. Start-up cancels.
    Persistent sends are off in these runs (``MPIRL_PERSISTENT_SENDS=0``): the monitoring does
    not count them, and a group call sends the same bytes to the same ranks either way."""
    totals = []
    for iterations in TRAFFIC_ITERATIONS:
        run_dir = runs_dir / f"{algo.lower()}-{ranks}-traffic-{iterations}"
        prefix = runs_dir / f"{algo.lower()}-{ranks}-traffic-{iterations}-mon"
        command = mpiexec_command(
            ranks, *MONITORING_FLAGS, "--mca", "pml_monitoring_filename", str(prefix), str(MPIRL),
            *_train_command(algo, ranks, plan, run_dir, {"training_iteration": iterations}))
        run_process(command, f"mpirl {algo} -n {ranks} (monitored)", 120 + 3.0 * ranks,
                    {"CI": "true", "MPIRL_PERSISTENT_SENDS": "0"})
        totals.append(read_rank0_traffic(prefix, ranks))
    span = TRAFFIC_ITERATIONS[1] - TRAFFIC_ITERATIONS[0]
    return {f"mpi_{key}_per_iter": (totals[1][key] - totals[0][key]) / span
            for key in totals[0]}


def marginal_cost(points: list[tuple[float, float]]) -> float | None:
    """The slope of the least-squares line through ``(workers, cost)``: what one more rollout
    rank adds (rank 0's idle polling, paid once per iteration whatever N is, falls out)."""
    points = [(x, y) for x, y in points if y is not None]
    if len(points) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None


def growth_exponent(points: list[tuple[float, float]]) -> float | None:
    """k of the least-squares fit of ``y = c * x^k``: the slope on log-log axes; None with
    fewer than 2 points."""
    return marginal_cost([(math.log(x), math.log(y)) for x, y in points
                          if x > 0 and y and y > 0])


def summarize(by_algo: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Efficiency against each algorithm's smallest run, growth exponents, and per rank count
    the worst over the algorithms of each quantity the issue names."""
    growth: dict[str, dict[str, float | None]] = {}
    for algo, runs in by_algo.items():
        ok = {n: r for n, r in runs.items() if "error" not in r and "skipped" not in r}
        if not ok:
            continue
        base = ok[min(ok)]
        for r in ok.values():
            per = r["steps_per_s_per_worker"]
            base_per = base["steps_per_s_per_worker"]
            r["sampling_weak_scaling_efficiency"] = per / base_per if per and base_per else None
        growth[algo] = {key: growth_exponent([(r["rollout_ranks"], r.get(key))
                                               for r in ok.values()])
                        for key in ("driver_cpu_ms_per_iter", "driver_msgs_per_iter",
                                    "driver_bytes_per_iter", "mpi_sent_bytes_per_iter",
                                    "mpi_received_bytes_per_iter", "mpi_sent_msgs_per_iter")
                        if any(r.get(key) is not None for r in ok.values())}
        for key, out in (("driver_cpu_ms_per_iter", "driver_cpu_us_per_added_worker"),
                         ("driver_own_cpu_ms_per_iter", "driver_own_cpu_us_per_added_worker")):
            slope_ms = marginal_cost([(r["rollout_ranks"], r.get(key)) for r in ok.values()])
            growth[algo][out] = slope_ms * 1e3 if slope_ms is not None else None
    by_ranks: dict[int, dict[str, Any]] = {}
    all_ranks = sorted({n for runs in by_algo.values() for n in runs})
    for n in all_ranks:
        runs = [runs[n] for runs in by_algo.values()
                if n in runs and "error" not in runs[n] and "skipped" not in runs[n]]
        if not runs:
            continue

        def worst(key: str, pick: Any, runs: list[dict[str, Any]] = runs) -> float | None:
            values = [r[key] for r in runs if r.get(key) is not None]
            return pick(values) if values else None

        by_ranks[n] = {
            "driver_cpu_us_per_worker_iteration": worst("driver_cpu_us_per_worker_iteration",
                                                        max),
            "driver_own_cpu_us_per_worker_iteration": worst(
                "driver_own_cpu_us_per_worker_iteration", max),
            "sampling_weak_scaling_efficiency": worst("sampling_weak_scaling_efficiency", min),
            "rollout_rank_rss_mb": max((r["rss_mb_by_role"].get("rollout", 0.0) for r in runs),
                                       default=None),
            "startup_s": worst("startup_s", max),
        }
    top = by_ranks[max(by_ranks)] if by_ranks else {}
    return {"max_ranks": max(by_ranks) if by_ranks else None, **top,
            "by_ranks": {str(n): v for n, v in by_ranks.items()}, "growth_exponents": growth}


def describe(result: dict[str, Any]) -> str:
    return (f"{result['iterations']} iterations of {fmt(result['iteration_s'], 2)} s; rank 0 "
            f"{fmt(result['driver_cpu_us_per_worker_iteration'], 0)} us CPU per worker per "
            f"iteration ({fmt(result['driver_own_cpu_us_per_worker_iteration'], 0)} of them "
            f"driving), {fmt(result['driver_msgs_per_iter'], 0)} msgs; "
            f"{fmt(result['steps_per_s_per_worker'], 1)} steps/s per rollout rank; start-up "
            f"{fmt(result['startup_s'], 1)} s")


def describe_traffic(result: dict[str, float]) -> str:
    return (f"rank 0 sends {fmt(result['mpi_sent_bytes_per_iter'] / 1e3, 1)} kB and receives "
            f"{fmt(result['mpi_received_bytes_per_iter'] / 1e3, 1)} kB per iteration, all MPI")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 and 8 ranks, PPO and IMPALA, 6 s each (about a minute)")
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--ranks", help="comma-separated rank counts (default 8,16,32,64)")
    parser.add_argument("--algos", help=f"comma-separated, of {','.join(ALGOS)}")
    parser.add_argument("--train-s", type=float, help="training seconds per run")
    parser.add_argument("--step-ms", type=float, help="what each env step sleeps, in ms")
    parser.add_argument("--mpi-traffic", action="store_true",
                        help="also measure all MPI traffic through rank 0 per iteration, "
                             "collectives included, with Open MPI's monitoring (two more runs "
                             "per point)")
    parser.add_argument("--runs-dir", type=Path,
                        help="keep the run directories here (default: a temporary directory)")
    parser.add_argument("--impala-fragments-per-call", type=int,
                        default=IMPALA_FRAGMENTS_PER_CALL,
                        help=f"IMPALA's fragments_per_call (default "
                             f"{IMPALA_FRAGMENTS_PER_CALL}; 0: the driver-routed path)")
    parser.add_argument("--apex-fragments-per-call", type=int, default=APEX_FRAGMENTS_PER_CALL,
                        help=f"Ape-X's fragments_per_call (default {APEX_FRAGMENTS_PER_CALL}; "
                             f"0: the driver-driven path)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    try:
        ranks = (tuple(int(n) for n in args.ranks.split(",")) if args.ranks else plan.ranks)
    except ValueError:
        parser.error(f"--ranks: comma-separated integers, got {args.ranks!r}")
    algos = tuple(a.strip().upper() for a in args.algos.split(",")) if args.algos else plan.algos
    if unknown := [a for a in algos if a not in ALGOS]:
        parser.error(f"--algos: {', '.join(unknown)} not one of {', '.join(ALGOS)}")
    if any(n < 3 for n in ranks):
        parser.error(f"--ranks: every count must be at least 3, got {args.ranks}")
    plan = Plan(ranks=ranks, algos=algos, train_s=args.train_s or plan.train_s,
                step_ms=args.step_ms or plan.step_ms,
                impala_fragments_per_call=args.impala_fragments_per_call,
                apex_fragments_per_call=args.apex_fragments_per_call)
    started = time.perf_counter()
    by_algo: dict[str, dict[int, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="mpirl-scale-") as tmp:
        runs_dir = args.runs_dir or Path(tmp)
        for algo in plan.algos:
            by_algo[algo] = {}
            for n in plan.ranks:
                if (reason := fits_in_memory(algo, n)) is not None:
                    print(f"skipping mpirl {algo}, {n} ranks: {reason}", flush=True)
                    by_algo[algo][n] = {"skipped": reason}
                    continue
                by_algo[algo][n] = attempt(f"mpirl {algo}, {n} ranks", lambda a=algo, n=n: measure(
                    a, n, plan, runs_dir), describe)
                if args.mpi_traffic and "error" not in by_algo[algo][n]:
                    traffic = attempt(f"mpirl {algo}, {n} ranks, MPI traffic",
                                      lambda a=algo, n=n: mpi_traffic(a, n, plan, runs_dir),
                                      describe_traffic)
                    by_algo[algo][n].update(traffic if "error" not in traffic
                                            else {"mpi_traffic_error": traffic["error"]})
    report = {"meta": {**run_metadata(args.quick, plan, ("mpirl", "torch", "mpi4py")),
                       "env": ENV_ID, "wall_s": time.perf_counter() - started},
              **summarize(by_algo),
              "by_algo": {a: {str(n): r for n, r in runs.items()} for a, runs in by_algo.items()}}
    write_report(report, args.json)
    rows = [("algo, ranks", "iter s", "rank0 us/worker/iter", "own", "msgs/iter", "kB/iter",
             "MPI kB out/in", "steps/s/worker", "efficiency", "rollout MB", "start-up s")]
    for algo, runs in by_algo.items():
        for n, r in runs.items():
            rows.append((f"{algo} {n}", fmt(r.get("iteration_s"), 2),
                         fmt(r.get("driver_cpu_us_per_worker_iteration"), 0),
                         fmt(r.get("driver_own_cpu_us_per_worker_iteration"), 0),
                         fmt(r.get("driver_msgs_per_iter"), 0),
                         fmt((r.get("driver_bytes_per_iter") or 0) / 1e3, 1),
                         (f"{fmt((r.get('mpi_sent_bytes_per_iter') or 0) / 1e3, 1)}/"
                          f"{fmt((r.get('mpi_received_bytes_per_iter') or 0) / 1e3, 1)}"
                          if "mpi_sent_bytes_per_iter" in r else "-"),
                         fmt(r.get("steps_per_s_per_worker"), 1),
                         fmt(r.get("sampling_weak_scaling_efficiency"), 2),
                         fmt(r.get("rss_mb_by_role", {}).get("rollout"), 0),
                         fmt(r.get("startup_s"), 1)))
    print_table(rows)
    print(f"growth exponents through rank 0 (1 = linear in rollout ranks): "
          f"{json.dumps(report['growth_exponents'])}")
    problems = {f"{a} {n}": r for a, runs in by_algo.items() for n, r in runs.items()}
    print_problems(problems)
    return 1 if any("error" in r for r in problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
