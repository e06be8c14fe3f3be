"""The seeds' Atari table, scaled to this machine: IMPALA and A2C on Breakout for one hour each.

    python benchmarks/atari_hour.py --json benchmarks/atari_hour.json [--minutes 60]

Each algorithm is one ``mpiexec -n 3 mpirl train`` (the driver and learner, and 2 rollout ranks
of 8 envs), run alone, one after the other, for ``--minutes`` of training time
(``--stop '{"time_total_s": ...}'``), with its tuned config from ``examples/tuned/``
(``--config @examples/tuned/impala_breakout.json``). Atari preprocessing is mpirl's default: no-op
starts, frame skip 4 with max-pooling, 84x84 grayscale, a stack of 4, rewards clipped for
training only. The score is ``episode_return_mean``: the game score of whole games (all five
lives), the mean of the last 100 games. The seeds' figures (RLlib with 32 IMPALA workers or 5 A2C
workers, one hour) are printed beside it; their machines had many more cores than this one.

The run directories are kept (``--runs-dir``), so the learning curves can be read or plotted
(``mpirl plot``) afterwards.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
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
ROOT = Path(__file__).resolve().parent.parent
ENV_ID = "ALE/Breakout-v5"
FRAME_SKIP = 4
RANKS = 3
SEED = 0
TUNED = {"IMPALA": ROOT / "examples" / "tuned" / "impala_breakout.json",
         "A2C": ROOT / "examples" / "tuned" / "a2c_breakout.json"}
SEEDS_SCORE = {"IMPALA": (538, "RLlib IMPALA, 32 workers, 1 hour"),
               "A2C": (268, "RLlib A2C, 5 workers, 1 hour")}
CHECKPOINTS_MIN = (10, 20, 30, 40, 50, 60)
"""Training minutes at which the curve is sampled into the report."""


@dataclass(frozen=True)
class Plan:
    minutes: float
    """Training time of each algorithm."""


def score_at(rows: list[dict[str, str]], seconds: float) -> float | None:
    """``episode_return_mean`` of the last row at or before ``seconds`` of training."""
    before = [r for r in rows if float(r["time_total_s"]) <= seconds and r["episode_return_mean"]]
    return float(before[-1]["episode_return_mean"]) if before else None


def run_algo(algo: str, minutes: float, runs_dir: Path) -> dict[str, Any]:
    """One ``mpirl train`` of ``algo`` for ``minutes`` of training; its score and rates."""
    run_dir = runs_dir / algo.lower()
    if run_dir.exists():
        raise BenchError(f"{run_dir} exists: give another --runs-dir, or remove it")
    train_s = minutes * 60.0
    command = mpiexec_command(
        RANKS, str(MPIRL), "train", "--algo", algo, "--env", ENV_ID,
        "--config", f"@{TUNED[algo]}", "--stop", json.dumps({"time_total_s": train_s}),
        "--run-dir", str(run_dir), "--seed", str(SEED))
    # Start-up and the last iteration come on top of the training time.
    finished = run_process(command, f"mpirl {algo}", train_s + 600.0, {"CI": "true"})
    try:
        with (run_dir / "progress.csv").open() as file:
            rows = list(csv.DictReader(file))
    except OSError as error:
        raise BenchError(f"mpirl {algo}: no progress.csv ({error}):\n"
                         f"{tail(finished.stderr) or tail(finished.stdout)}") from None
    if not rows:
        raise BenchError(f"mpirl {algo}: progress.csv has no rows")
    last = rows[-1]
    # Rows before the first whole game hold NaN, which max() would return.
    scores = [v for r in rows if math.isfinite(v := float(r["episode_return_mean"] or "nan"))]
    steps, seconds = int(last["timesteps_total"]), float(last["time_total_s"])
    return {
        "score": float(last["episode_return_mean"]),
        "best_score": max(scores) if scores else None,
        "frames": steps * FRAME_SKIP, "agent_steps": steps, "train_s": seconds,
        "frames_per_s": steps * FRAME_SKIP / seconds, "wall_s": finished.wall_s,
        "episodes": int(float(last.get("episodes_total") or 0)),
        "curve": {f"{m}min": score_at(rows, m * 60.0) for m in CHECKPOINTS_MIN
                  if m * 60.0 <= seconds + 1.0},
        "config": json.loads(TUNED[algo].read_text()), "run_dir": str(run_dir),
        "seeds_score": SEEDS_SCORE[algo][0], "seeds_setup": SEEDS_SCORE[algo][1],
    }


def describe(result: dict[str, Any]) -> str:
    return (f"score {result['score']:.1f} after {result['train_s'] / 60:.0f} min, "
            f"{result['frames']:,} frames, {result['frames_per_s']:,.0f} frames/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--minutes", type=float, default=60.0,
                        help="training minutes per algorithm (default 60)")
    parser.add_argument("--algos", default="IMPALA,A2C", help="IMPALA, A2C or both (default)")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "atari_hour",
                        help="where the run directories are kept")
    args = parser.parse_args(argv)
    algos = [a.strip().upper() for a in args.algos.split(",") if a.strip()]
    unknown = [a for a in algos if a not in TUNED]
    if unknown:
        parser.error(f"--algos: {', '.join(unknown)} not one of {', '.join(TUNED)}")
    started = time.perf_counter()
    report: dict[str, Any] = {"meta": {
        **run_metadata(False, Plan(args.minutes), ("mpirl", "torch", "ale-py")),
        "env": ENV_ID, "ranks": RANKS, "minutes": args.minutes, "seed": SEED}}
    for algo in algos:
        report[algo] = attempt(f"mpirl {algo}", lambda a=algo: run_algo(
            a, args.minutes, args.runs_dir), describe)
    report["meta"]["wall_s"] = time.perf_counter() - started
    write_report(report, args.json)
    rows = [("ALE/Breakout-v5", "score", "seeds' score", "frames", "frames/s")]
    for algo in algos:
        entry = report[algo]
        rows.append((f"mpirl {algo}, {args.minutes:g} min", fmt(entry.get("score"), 1),
                     f"{SEEDS_SCORE[algo][0]} ({SEEDS_SCORE[algo][1]})",
                     fmt(entry.get("frames"), 0), fmt(entry.get("frames_per_s"), 0)))
    print_table(rows)
    print_problems({algo: report[algo] for algo in algos})
    return 1 if any("error" in report[a] for a in algos) else 0


if __name__ == "__main__":
    sys.exit(main())
