"""Same seed, same layout, same progress.csv: the check a refactor owes (issue 48).

Runs each algorithm's short training under ``mpiexec -n 3`` with seed 0 and writes every
progress row, without the columns that measure time or memory, to a JSON file:

    python benchmarks/same_progress.py --json before.json            # on the old code
    python benchmarks/same_progress.py --json after.json             # on the new code
    python benchmarks/same_progress.py --compare before.json after.json

``--compare`` prints, per algorithm, whether the rows are identical, differ only by float noise
(relative 1e-6), or differ, naming the first column that does.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
#: Columns that a run measures rather than computes (perf/: CPU time and bytes through the
#: driver, which grow with the length of a worker class's module path): left out.
MEASURED = re.compile(r"^perf/|time|_per_s|per_second|mem|_mb$|timestamp|date|hostname|pid|lag|"
                      r"wait|_s$|throughput|utilization|_mb_|rss|pss")
#: Each algorithm: its env, its config (small: a few seconds of training) and its iterations.
RUNS = {
    "PPO": ("CartPole-v1", {}, 3),
    "IMPALA": ("CartPole-v1", {}, 3),
    "DQN": ("CartPole-v1", {"learning_starts": 200}, 3),
    "SAC": ("Pendulum-v1", {"learning_starts": 100, "hidden_sizes": [32, 32]}, 3),
    "ES": ("CartPole-v1", {"noise_size": 1_000_000}, 3),
    "AlphaZero": ("openspiel/tic_tac_toe", {"games_per_worker": 8, "sgd_steps_per_iteration": 8,
                                            "train_batch_size": 32, "simulations": 8}, 3),
    "PETS": ("Pendulum-v1", {"num_envs_per_worker": 2, "rollout_fragment_length": 10,
                             "initial_random_steps": 40, "cem_population": 20, "cem_elites": 4,
                             "cem_iterations": 2, "planning_horizon": 4, "particles": 2,
                             "model_max_epochs": 3, "hidden_sizes": [32, 32],
                             "evaluation_interval": 2, "evaluation_episodes": 2}, 4),
    "MBPO": ("Pendulum-v1", {"rollout_fragment_length": 10, "initial_random_steps": 40,
                             "model_train_freq": 40, "rollout_batch_size": 20,
                             "rollout_schedule": [0, 2, 1, 3], "epoch_length": 40,
                             "sgd_steps_per_env_step": 1, "train_batch_size": 32,
                             "hidden_sizes": [32, 32], "ensemble_size": 3, "elites": 2,
                             "model_hidden_sizes": [16, 16], "model_batch_size": 32,
                             "model_max_epochs": 3, "evaluation_interval": 2,
                             "evaluation_episodes": 2}, 4),
}


def run(algo: str, directory: Path) -> list[dict[str, str]]:
    """The progress rows of ``algo``'s short run, without the measured columns."""
    env, config, iterations = RUNS[algo]
    run_dir = directory / algo
    command = [str(BIN / "mpiexec"), "-n", "3", str(BIN / "mpirl"), "train", "--algo", algo,
               "--env", env, "--seed", "0", "--config", json.dumps(config), "--stop",
               json.dumps({"training_iteration": iterations}), "--run-dir", str(run_dir),
               "--progress", "off"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "CI": "true"})
    if proc.returncode != 0:
        raise SystemExit(f"{algo}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    with open(run_dir / "progress.csv") as file:
        return [{k: v for k, v in row.items() if not MEASURED.search(k)}
                for row in csv.DictReader(file)]


def same(a: str, b: str) -> str:
    """"same", "noise" (floats within 1e-6 relative) or "differs"."""
    if a == b:
        return "same"
    try:
        x, y = float(a), float(b)
    except ValueError:
        return "differs"
    if math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(x) and math.isnan(y)):
        return "noise"
    return "differs"


def compare(before: dict, after: dict) -> int:
    failed = 0
    for algo in sorted(set(before) | set(after)):
        old, new = before.get(algo), after.get(algo)
        if old is None or new is None:
            print(f"{algo}: only in {'after' if old is None else 'before'}")
            failed += 1
            continue
        verdict, where = "same", ""
        if len(old) != len(new):
            verdict, where = "differs", f"{len(old)} rows before, {len(new)} after"
        for i, (row_a, row_b) in enumerate(zip(old, new, strict=False)):
            for key in sorted(k for k in set(row_a) | set(row_b) if not MEASURED.search(k)):
                v = same(row_a.get(key, "<none>"), row_b.get(key, "<none>"))
                if v == "differs" or (v == "noise" and verdict == "same"):
                    verdict = v
                    where = (f"row {i + 1} {key}: {row_a.get(key, '<none>')} -> "
                             f"{row_b.get(key, '<none>')}")
                if verdict == "differs":
                    break
            if verdict == "differs":
                break
        failed += verdict == "differs"
        print(f"{algo}: {verdict} ({len(new)} rows){' - ' + where if where else ''}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--algos", default=",".join(RUNS), help="comma-separated (all)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(before, after)
    rows = {}
    with tempfile.TemporaryDirectory() as directory:
        for algo in args.algos.split(","):
            rows[algo] = run(algo, Path(directory))
            print(f"{algo}: {len(rows[algo])} rows", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
