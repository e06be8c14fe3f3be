"""ES and ARS: time and env steps to solve CartPole-v1, what crosses ranks per generation, and
what the shared noise table costs in memory.

    python benchmarks/evolution.py [--seeds 5] [--json PATH] [--quick]

* Learning: ``mpiexec -n 3 mpirl train --algo ES|ARS --env CartPole-v1`` with the defaults, until
  the 20-episode mean of the unperturbed policy's return reaches 475 (budgets: ES 3M env steps,
  ARS 1M); whole process, launch to exit, per seed. (``--quick``: to 100, under ``-n 2``.)
* Bytes: ``bytes_per_rank_per_generation`` (results, update message and answer, between the
  driver and one rollout rank) for a 226-weight policy and a 1,008,002-weight one (two hidden
  layers of 1000), 2 generations each under ``-n 3`` (``--quick``: the large one alone, read
  from the memory's runs below, which play it).
* Memory: the summed proportional set size (PSS) of 3 rollout ranks with a 4 MB and a 381 MB
  noise table (``--quick``: 2 rollout ranks, the large policy, and 8 MB and 95 MB); one copy per
  node grows it by about one table, one per rank would by three (two).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    BenchError,
    attempt,
    mpiexec_command,
    print_table,
    run_main,
    run_metadata,
    run_process,
    write_report,
)

MPIRL = str(Path(sys.executable).parent / "mpirl")
BUDGETS = {"ES": 3_000_000, "ARS": 1_000_000}
TARGET = 475.0


@dataclass
class Plan:
    seeds: int


def train(ranks: int, algo: str, config: dict[str, Any], stop: dict[str, Any], seed: int = 0
          ) -> tuple[float, list[dict[str, str]]]:
    """One whole run: its wall time and its progress rows."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        finished = run_process(
            mpiexec_command(ranks, MPIRL, "train", "--algo", algo, "--env", "CartPole-v1",
                            "--run-dir", str(run_dir), "--progress", "off", "--seed", str(seed),
                            "--config", json.dumps(config), "--stop", json.dumps(stop)),
            f"{algo} seed {seed}", 1800)
        with open(run_dir / "progress.csv") as file:
            rows = list(csv.DictReader(file))
    if not rows:
        raise BenchError(f"{algo}: no progress rows")
    return finished.wall_s, rows


def learning(seeds: int, quick: bool) -> dict[str, Any]:
    report = {}
    for algo, budget in BUDGETS.items():
        runs = []
        for seed in range(seeds):
            def measure(seed: int = seed, algo: str = algo, budget: int = budget) -> dict:
                target = 100.0 if quick else TARGET
                # Quick: 1 rollout rank, which plays each generation's episodes alone.
                wall, rows = train(2 if quick else 3, algo, {},
                                   {"episode_return_mean": target, "timesteps_total": budget},
                                   seed)
                last = rows[-1]
                return {"wall_s": wall, "env_steps": int(last["timesteps_total"]),
                        "return": float(last["episode_return_mean"]),
                        "reached": float(last["episode_return_mean"]) >= target,
                        "env_steps_per_s": int(last["timesteps_total"])
                        / float(last["time_total_s"])}
            runs.append(attempt(f"{algo} seed {seed}", measure,
                                lambda r: f"{r['wall_s']:.1f} s, {r['env_steps']} env steps, "
                                          f"return {r['return']:.1f}"))
        ok = [r for r in runs if "error" not in r]
        report[algo] = {"runs": runs, "reached": sum(r["reached"] for r in ok),
                        "wall_s_median": statistics.median(r["wall_s"] for r in ok) if ok
                        else None,
                        "env_steps_median": statistics.median(r["env_steps"] for r in ok) if ok
                        else None,
                        "env_steps_per_s_median": statistics.median(
                            r["env_steps_per_s"] for r in ok) if ok else None}
    return report


#: The policies whose bytes per generation are measured, and how their runs play.
NETS = (("226_weights", [32]), ("1008002_weights", [1000, 1000]))
BYTES_CONFIG = {"episodes_per_batch": 8, "train_batch_size": 0, "num_envs_per_worker": 2,
                "eval_prob": 0.0}


def message_bytes(quick: bool) -> dict[str, Any]:
    """Bytes per generation of the small and the large policy (quick: none here; the large
    one's comes from ``noise_memory``'s runs)."""
    sent = {}
    for name, hidden in () if quick else NETS:
        _, rows = train(3, "ES", {"hidden_sizes": hidden, **BYTES_CONFIG,
                                  "noise_size": 20_000_000}, {"training_iteration": 2})
        sent[name] = float(rows[-1]["bytes_per_rank_per_generation"])
    sent["weights_bytes_1008002"] = 4 * 1_008_002
    return sent


def noise_memory(quick: bool) -> dict[str, Any]:
    """The rollout ranks' PSS with a small and a large table (25M numbers instead of 100M if
    quick: 95 MB, still far above what else differs between the two runs; and 2 rollout ranks,
    not 3: a copy per rank would still double the growth). Quick: both runs play
    ``message_bytes``'s large policy (a table of 2M numbers, not 1M, holds its 1M weights), and
    the large table's run gives its bytes per generation (``bytes_1008002_weights``): two runs
    instead of three."""
    small, large = (2_000_000, 25_000_000) if quick else (1_000_000, 100_000_000)
    config = {"hidden_sizes": NETS[1][1], **BYTES_CONFIG} if quick else {}
    totals, sent = {}, None
    for size in (small, large):
        _, rows = train(3 if quick else 4, "ES", {**config, "noise_size": size},
                        {"training_iteration": 2})
        totals[size] = (float(rows[-1]["rollout_pss_mb_total"]),
                        float(rows[-1]["noise_table_mb"]))
        sent = float(rows[-1]["bytes_per_rank_per_generation"])
    growth = totals[large][0] - totals[small][0]
    table = totals[large][1]
    return {"pss_mb_small_table": totals[small][0], "pss_mb_large_table":
            totals[large][0], "table_mb": table, "growth_mb": growth,
            "growth_over_table": growth / table,
            **({"bytes_1008002_weights": sent} if quick else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    seeds = 1 if args.quick else args.seeds
    report = {"meta": run_metadata(args.quick, Plan(seeds), ["torch", "numpy"])}
    report["learning"] = learning(seeds, args.quick)
    report["bytes"] = attempt("bytes per generation, 226 vs 1M weights",
                              lambda: message_bytes(args.quick))
    report["memory"] = attempt(f"noise table memory, {2 if args.quick else 3} rollout ranks",
                               lambda: noise_memory(args.quick))
    if args.quick and "bytes_1008002_weights" in report["memory"]:
        report["bytes"]["1008002_weights"] = report["memory"].pop("bytes_1008002_weights")
    rows = [["what", "ES", "ARS"]]
    for key, label in (("reached", "reached"), ("wall_s_median", "wall s (median)"),
                       ("env_steps_median", "env steps (median)"),
                       ("env_steps_per_s_median", "env steps/s (median)")):
        rows.append([label, *(f"{report['learning'][a][key]}" for a in BUDGETS)])
    print_table(rows)
    print(json.dumps({"bytes": report["bytes"], "memory": report["memory"]}, indent=1))
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
