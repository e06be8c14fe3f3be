"""PBT against fixed hyperparameters: a PPO population that starts at a learning rate too small
to learn CartPole in the budget, with and without PBT.

    python benchmarks/tune.py [--seeds 5] [--json PATH] [--quick]

Both arms are one ``mpiexec -n 5 mpirl tune`` job of 4 members, one rank each (local mode), all
starting at ``lr`` 1e-5, each member stopping at a 100-episode mean return of 450 or at 200k env
steps:

* PBT: ``--scheduler pbt --perturbation-interval 5 --mutations '{"lr": [1e-5, 1e-4, 3e-4,
  1e-3]}'`` (Ray Tune's defaults otherwise: quantile 0.25, resample probability 0.25);
* fixed: ``--search random --num-samples 4`` over an empty space (4 seeds of the same config).

Per seed (``--seed`` of the train options, which also seeds PBT's decisions): whether the best
member reached 450, its env steps, the whole job's wall time, and PBT's decisions.
"""

from __future__ import annotations

import argparse
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
    run_metadata,
    run_process,
    write_report,
)

MPIRL = str(Path(sys.executable).parent / "mpirl")
TARGET = 450.0
BUDGET = 200_000
MUTATIONS = {"lr": [1e-5, 1e-4, 3e-4, 1e-3]}


@dataclass
class Plan:
    seeds: int
    target: float
    budget: int


def population(arm: str, seed: int, plan: Plan) -> dict[str, Any]:
    """One tune job; what its best member reached."""
    options = (["--scheduler", "pbt", "--population", "4", "--perturbation-interval", "5",
                "--mutations", json.dumps(MUTATIONS)] if arm == "pbt" else
               ["--search", "random", "--num-samples", "4", "--space", "{}"])
    with tempfile.TemporaryDirectory() as tmp:
        tune_dir = Path(tmp) / "tune"
        finished = run_process(
            mpiexec_command(5, MPIRL, "tune", *options, "--ranks-per-trial", "1", "--run-dir",
                            str(tune_dir), "--", "--algo", "PPO", "--env", "CartPole-v1",
                            "--seed", str(seed), "--config", '{"lr": 1e-5}', "--stop",
                            json.dumps({"episode_return_mean": plan.target,
                                        "timesteps_total": plan.budget})),
            f"{arm} seed {seed}", 1200)
        result = json.loads((tune_dir / "result.json").read_text())
        decisions = []
        if (tune_dir / "pbt.jsonl").exists():
            decisions = [json.loads(line) for line in
                         (tune_dir / "pbt.jsonl").read_text().splitlines()]
    best = result["best_result"]
    reached = [t for t in result["trials"]
               if (t["last"] or {}).get("episode_return_mean", 0) >= plan.target]
    return {"wall_s": finished.wall_s, "best_return": best["episode_return_mean"],
            "best_env_steps": best["timesteps_total"], "reached": bool(reached),
            "members_reached": len(reached),
            "steps_to_target": min((t["last"]["timesteps_total"] for t in reached), default=None),
            "best_lr": result["best_config"].get("lr", 1e-5),
            "decisions": len(decisions),
            "exploits_moving_lr": sum(d["exploited"] and d["new_config"]["lr"] != 1e-5
                                      for d in decisions)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="one seed, a target of 100 and 40k steps (about a minute)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    plan = (Plan(1, 100.0, 40_000) if args.quick else Plan(args.seeds, TARGET, BUDGET))
    report: dict[str, Any] = {"meta": run_metadata(args.quick, plan, ["torch", "numpy"])}
    for arm in ("pbt", "fixed"):
        runs = [attempt(f"{arm} seed {seed}", lambda s=seed, a=arm: population(a, s, plan),
                        lambda r: f"best {r['best_return']:.1f} after {r['best_env_steps']:,} "
                                  f"steps, {r['wall_s']:.0f} s")
                for seed in range(plan.seeds)]
        ok = [r for r in runs if "error" not in r]
        steps = [r["steps_to_target"] for r in ok if r["steps_to_target"] is not None]
        report[arm] = {"runs": runs, "reached": sum(r["reached"] for r in ok), "seeds": len(runs),
                       "best_return_median": statistics.median(r["best_return"] for r in ok)
                       if ok else None,
                       "steps_to_target_median": statistics.median(steps) if steps else None,
                       "wall_s_median": statistics.median(r["wall_s"] for r in ok) if ok
                       else None}
    print_table([["", "PBT from lr 1e-5", "fixed lr 1e-5"],
                 *([label, *(str(report[arm][key]) for arm in ("pbt", "fixed"))]
                   for key, label in (("reached", f"seeds reaching {plan.target:g}"),
                                      ("best_return_median", "best member's return (median)"),
                                      ("steps_to_target_median", "env steps to target (median)"),
                                      ("wall_s_median", "wall s (median)")))])
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as error:
        print(error, file=sys.stderr)
        sys.exit(1)
