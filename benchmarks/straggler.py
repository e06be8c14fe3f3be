"""IMPALA with a straggler: one rollout rank slowed about 10x, against the healthy ranks alone.

    python benchmarks/straggler.py --json /tmp/straggler.json [--quick]

Every run is ``mpirl train --algo IMPALA`` under mpiexec on ``MpirlStragglerCartPole-v0``
(``mpirl.testing``): CartPole-v1 whose steps sleep ``BASE_DELAY_S`` on every rank and
``DELAY_S`` more on one chosen rank (``MPIRL_STRAGGLER_RANK``; -1 slows none), so every run
steps the same environment code. The base delay keeps the 2 cores of a small machine from
saturating, as ranks on nodes of their own would be: the ratio then measures whether the driver
waits for the slow rank, not how the kernel shares 2 cores among 3 or 4 busy processes.

1. Calibration: one rollout rank, healthy and then slowed; the ratio of their sampling rates is
   the slow-down factor actually reached on this machine.
2. Throughput, in alternating pairs: 2 healthy rollout ranks, then the same 2 plus a slowed third
   (rank 1). A run's rate is the median over its iterations (the first left out) of
   ``env_steps_per_s``; ``throughput_ratio`` is the median over pairs of slowed / healthy, which
   should stay at or above 0.8: asynchronous sampling never waits for the slow rank.
3. Convergence: the last pair's run with the straggler trains on to a mean return of ``target``.
"""

from __future__ import annotations

import argparse
import csv
import json
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
    print_table,
    run_metadata,
    run_process,
    tail,
    write_report,
)

MPIRL = Path(sys.executable).parent / "mpirl"
ENV = ["--env-module", "mpirl.testing", "--env", "MpirlStragglerCartPole-v0"]
BASE_DELAY_S = 1.5e-4
"""Sleep per environment step on every rank, more than a step's CPU cost here (56-100 us with
its share of inference), so that no run saturates the 2 cores."""
DELAY_S = 4e-3
"""Further sleep per environment step on the slow rank: about 10x a healthy rank's step."""
CONFIG = {"min_steps_per_iteration": 2000, "metrics_window": 20}
CALIBRATION_CONFIG = CONFIG | {"min_steps_per_iteration": 400, "train_batch_size": 400}
"""Iterations of one fragment, so that the slowed rank alone soon gives several rates to take
the median of."""


@dataclass(frozen=True)
class Plan:
    """How much the run does; ``--quick`` scales it down."""

    calibration_steps: int
    throughput_steps: int
    pairs: int
    target: float
    max_steps: int
    timeout_s: float


FULL = Plan(calibration_steps=8_000, throughput_steps=40_000, pairs=3, target=450.0,
            max_steps=800_000, timeout_s=600.0)
QUICK = Plan(calibration_steps=1_600, throughput_steps=16_000, pairs=2, target=100.0,
             max_steps=120_000, timeout_s=240.0)


def train(rollouts: int, slow_rank: int, stop: dict[str, float], plan: Plan,
          config: dict[str, Any] = CONFIG, seed: int = 0) -> dict[str, Any]:
    """One IMPALA run with ``rollouts`` rollout ranks, ``slow_rank`` slowed (-1: none)."""
    with tempfile.TemporaryDirectory(prefix="mpirl-straggler-") as tmp:
        run_dir = Path(tmp) / "run"
        command = mpiexec_command(
            rollouts + 1, str(MPIRL), "train", "--algo", "IMPALA", *ENV,
            "--config", json.dumps(config), "--stop", json.dumps(stop),
            "--run-dir", str(run_dir), "--seed", str(seed))
        name = f"IMPALA {rollouts} rollout ranks, slow rank {slow_rank}"
        wall, out, err, _ = run_process(command, name, plan.timeout_s, {
            "CI": "true", "MPIRL_STRAGGLER_RANK": str(slow_rank),
            "MPIRL_STRAGGLER_DELAY_S": str(DELAY_S),
            "MPIRL_STEP_DELAY_S": str(BASE_DELAY_S)})
        try:
            result = json.loads((run_dir / "result.json").read_text())
            with open(run_dir / "progress.csv") as file:
                rows = list(csv.DictReader(file))
        except (OSError, ValueError) as error:
            raise BenchError(f"{name}: no result ({error}):\n{tail(err) or tail(out)}") from None
    rates = [float(r["env_steps_per_s"]) for r in rows[1:]] or [
        float(rows[0]["env_steps_per_s"])]
    return {
        "rollouts": rollouts, "slow_rank": slow_rank, "wall_s": wall,
        "env_steps": int(result["timesteps_total"]), "train_s": float(result["time_total_s"]),
        "steps_per_s": statistics.median(rates),
        "episode_return_mean": float(result["episode_return_mean"]),
        "policy_lag_mean": statistics.fmean(float(r["policy_lag_mean"]) for r in rows),
        "policy_lag_max": max(float(r["policy_lag_max"]) for r in rows),
    }


def describe(result: dict[str, Any]) -> str:
    return (f"{result['steps_per_s']:,.0f} steps/s, {result['env_steps']:,} steps, "
            f"return {result['episode_return_mean']:.1f}, policy lag mean "
            f"{result['policy_lag_mean']:.2f} (max {result['policy_lag_max']:g})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--quick", action="store_true",
                        help="shorter runs, a low return target (about 2 minutes)")
    parser.add_argument("--min-ratio", type=float, metavar="R",
                        help="exit 1 unless the throughput ratio is at least R and the run with "
                             "the straggler converged (make bench: 0.8)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    meta = run_metadata(args.quick, plan, ("mpirl", "mpi4py", "torch", "gymnasium"))
    meta.update(base_delay_s=BASE_DELAY_S, delay_s=DELAY_S, config=CONFIG)
    report: dict[str, Any] = {"meta": meta}

    steps = {"timesteps_total": plan.calibration_steps}
    healthy_one = attempt("calibration: 1 healthy rollout rank",
                          lambda: train(1, -1, steps, plan, CALIBRATION_CONFIG),
                          describe)
    slow_one = attempt("calibration: 1 slowed rollout rank",
                       lambda: train(1, 1, steps, plan, CALIBRATION_CONFIG),
                       describe)
    report["calibration"] = {"healthy": healthy_one, "slowed": slow_one}
    if "error" not in healthy_one and "error" not in slow_one:
        report["slowdown_factor"] = healthy_one["steps_per_s"] / slow_one["steps_per_s"]

    # The last pair's straggler run trains on to the target: it is both a throughput sample
    # (rates are medians over iterations) and the convergence check, one launch fewer.
    pairs = []
    steps = {"timesteps_total": plan.throughput_steps}
    converge = {"episode_return_mean": plan.target, "timesteps_total": plan.max_steps}
    for index in range(plan.pairs):
        last = index == plan.pairs - 1
        stop = converge if last else steps
        healthy = attempt("2 healthy rollout ranks", lambda: train(2, -1, steps, plan), describe)
        straggler = attempt(
            "2 healthy + 1 slowed rollout ranks" + (
                f", on to return {plan.target:g}" if last else ""),
            lambda stop=stop: train(3, 1, stop, plan), describe)
        pairs.append({"healthy": healthy, "straggler": straggler})
    ratios = [p["straggler"]["steps_per_s"] / p["healthy"]["steps_per_s"] for p in pairs
              if "error" not in p["healthy"] and "error" not in p["straggler"]]
    report["pairs"] = pairs
    report["throughput_ratio_per_pair"] = ratios
    report["throughput_ratio"] = statistics.median(ratios) if ratios else None

    convergence = dict(pairs[-1]["straggler"])
    if "error" not in convergence:
        convergence["reached"] = convergence["episode_return_mean"] >= plan.target
    report["convergence"] = convergence
    meta["wall_s"] = time.perf_counter() - started
    write_report(report, args.json)

    print(f"\nIMPALA straggler benchmark ({'quick' if args.quick else 'full'}) on "
          f"{meta['hostname']}, {meta['cpu_count']} CPUs, {meta['wall_s']:.0f} s in all")
    print_table([
        ("", "value"),
        ("slow-down factor of the slowed rank", fmt(report.get("slowdown_factor"), 1)),
        ("throughput ratio, straggler / healthy (median)", fmt(report["throughput_ratio"], 2)),
        (f"converged to {plan.target:g} with the straggler",
         fmt(convergence.get("reached"), 0)),
        ("  env steps", fmt(convergence.get("env_steps"), 0)),
        ("  wall time, s", fmt(convergence.get("wall_s"), 1)),
    ])
    if args.json is not None:
        print(f"wrote {args.json}")
    failed = any("error" in r for r in (healthy_one, slow_one, convergence)) or not ratios
    if args.min_ratio is not None and not failed and (
            report["throughput_ratio"] < args.min_ratio or not convergence["reached"]):
        print(f"below the bar: throughput ratio {report['throughput_ratio']:.2f} (at least "
              f"{args.min_ratio:g}), converged {convergence['reached']}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
