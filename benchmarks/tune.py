"""PBT against fixed hyperparameters: a PPO population that starts at a learning rate too small
to learn CartPole in the budget, with and without PBT.

    python benchmarks/tune.py [--seeds 5] [--first-seed 0] [--arms pbt,fixed]
        [--run-env KEY=VALUE] [--budget STEPS] [--json PATH] [--quick]

Both arms are one ``mpiexec -n 5 mpirl tune`` job of 4 members, one rank each (local mode), all
starting at ``lr`` 1e-5, each member stopping at a 100-episode mean return of 450 or at 200k env
steps:

* PBT: ``--scheduler pbt --perturbation-interval 10 --mutations '{"lr": [1e-5, 1e-4, 3e-4,
  1e-3]}'`` (Ray Tune's defaults otherwise: quantile 0.25, resample probability 0.25);
* fixed: ``--search random --num-samples 4`` over an empty space (4 seeds of the same config);
* the peer (``--peers mpirl,rllib``, ``--rllib-seeds``): Ray Tune's ``PopulationBasedTraining`` of
  4 RLlib PPO trials (RLlib's CartPole example settings, no env runners, Ray told 4 CPUs so that
  all 4 run at once), the same lr start and mutations, quantile and resample probability, the
  same stop; its interval is 4000 env steps (``time_attr`` env steps sampled): a decision after
  every RLlib iteration, the nearest Ray can come to mpirl's 5120.

Per seed (``--seed`` of the train options, which also seeds PBT's decisions): whether the best
member reached 450, its env steps, the whole job's wall time, and PBT's decisions.

A job is deterministic on one machine, but its walk follows the last bits of every matrix product:
another CPU's kernels give each seed another walk. ``--run-env MKL_CBWR=COMPATIBLE`` runs the
same seeds on MKL's compatible kernels (as ``make bench`` does for DQN), ``--first-seed`` and
``--arms pbt`` measure a rate over more seeds without the fixed arm. ``--budget`` lets slow seeds
show where they finish (a job follows the same walk whatever its budget, so one run to 350k also
says whether it reached 450 within 200k).
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
    add_peers_option,
    attempt,
    emit,
    mpiexec_command,
    not_installed,
    print_table,
    run_main,
    run_metadata,
    run_process,
    run_role,
    skipped,
    write_report,
)

MPIRL = str(Path(sys.executable).parent / "mpirl")
TARGET = 450.0
BUDGET = 200_000
LEVELS = (150, 200, 250, 300, 350, 400, 450)
MUTATIONS = {"lr": [1e-5, 1e-4, 3e-4, 1e-3]}
#: PBT's interval in PPO iterations of 512 env steps. With 5 the decisions came before a new rate
#: could show in the 100-episode mean: 3 of 5 seeds reached 450 in 200k steps; with 10, 5 of 5
#: (17 of seeds 0-19; all 20 within 264k) on one machine, about four in five of seeds 0-9 on an
#: AVX-512 EPYC, with its default kernels and with MKL_CBWR=COMPATIBLE (RESULTS.md, issue 47).
PBT_INTERVAL_ITERATIONS = 10
#: RLlib's own CartPole PPO example settings (as benchmarks/learning.py runs them).
RLLIB_TRAINING = {"num_epochs": 6, "vf_loss_coeff": 0.01}
RLLIB_MODEL = {"fcnet_hiddens": [32], "fcnet_activation": "linear", "vf_share_layers": True}
#: One RLlib iteration (4000 env steps): Ray's PBT decides after each, the nearest it can come to
#: mpirl's interval of 5120 steps (with 5120 it would decide every second iteration).
RLLIB_INTERVAL_STEPS = 4000


@dataclass
class Plan:
    seeds: int
    target: float
    budget: int


def population(arm: str, seed: int, plan: Plan,
               run_env: dict[str, str] | None = None) -> dict[str, Any]:
    """One tune job; what its best member reached. ``run_env``: more environment variables."""
    options = (["--scheduler", "pbt", "--population", "4", "--perturbation-interval",
                str(PBT_INTERVAL_ITERATIONS),
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
            f"{arm} seed {seed}", 3600, run_env)
        result = json.loads((tune_dir / "result.json").read_text())
        rows = [row for trial in sorted(tune_dir.glob("trial_*"))
                for row in csv.DictReader((trial / "progress.csv").open())]
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
            # When any member's 100-episode mean first reached each level: what a test's
            # threshold below 450 can be sized from.
            "steps_to_level": {level: min((int(row["timesteps_total"]) for row in rows
                                           if float(row["episode_return_mean"] or 0) >= level),
                                          default=None)
                               for level in LEVELS},
            "decisions": len(decisions),
            "exploits_moving_lr": sum(d["exploited"] and d["new_config"]["lr"] != 1e-5
                                      for d in decisions)}


def _flat(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def role_rllib(seed: int, plan: Plan) -> int:
    """Ray Tune's PBT of 4 RLlib PPO trials, the same start, space and stop as mpirl's arm."""
    started = time.perf_counter()
    try:
        import ray
        from ray import tune
        from ray.rllib.algorithms.ppo import PPOConfig
        from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
        from ray.tune.schedulers import PopulationBasedTraining
    except ImportError as error:
        return not_installed("Ray Tune", error)

    # Told 4 CPUs, Ray runs the 4 trials at once on the 2 cores, as mpirl's 4 members run.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        metric = "env_runners/episode_return_mean"
        steps_key = "num_env_steps_sampled_lifetime"
        config = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
                  .training(**{**RLLIB_TRAINING, "lr": 1e-5})
                  .rl_module(model_config=DefaultModelConfig(**RLLIB_MODEL))
                  .debugging(seed=seed))
        scheduler = PopulationBasedTraining(
            time_attr=steps_key, perturbation_interval=RLLIB_INTERVAL_STEPS,
            hyperparam_mutations=MUTATIONS, quantile_fraction=0.25, resample_probability=0.25)
        with tempfile.TemporaryDirectory() as tmp:
            tuner = tune.Tuner(
                "PPO", param_space=config,
                tune_config=tune.TuneConfig(metric=metric, mode="max", scheduler=scheduler,
                                            num_samples=4),
                run_config=tune.RunConfig(stop={metric: plan.target, steps_key: plan.budget},
                                          storage_path=tmp, verbose=0))
            results = tuner.fit()
        # Ray reports nested dicts ({"env_runners": {"episode_return_mean": ...}}).
        finals = [_flat(r.metrics) for r in results if r.metrics]
        reached = [m for m in finals if m.get(metric, 0) >= plan.target]
        best = max(finals, key=lambda m: m.get(metric, -math.inf))
        emit({"wall_s": time.perf_counter() - started, "best_return": best.get(metric),
              "best_env_steps": best.get(steps_key), "reached": bool(reached),
              "members_reached": len(reached),
              "steps_to_target": min((m[steps_key] for m in reached), default=None),
              "best_lr": best.get("config/lr")})
    finally:
        ray.shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--arms", default="pbt,fixed",
                        help="pbt, fixed or both (pbt,fixed)")
    parser.add_argument("--budget", type=int, default=BUDGET,
                        help=f"env steps per member at most ({BUDGET:,})")
    parser.add_argument("--run-env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in every job's environment, e.g. MKL_CBWR=COMPATIBLE (other "
                             "floating-point kernels: another walk per seed)")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, a target of 100 and 40k steps (about a minute)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rllib-seeds", type=int, default=1,
                        help="seeds of Ray Tune's PBT of RLlib PPO (1; it takes minutes each)")
    parser.add_argument("--role", choices=["rllib"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add_peers_option(parser, ("mpirl", "rllib"))
    args = parser.parse_args()
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    if not arms or set(arms) - {"pbt", "fixed"}:
        parser.error(f"--arms takes pbt, fixed or pbt,fixed, got {args.arms!r}")
    bad = [item for item in args.run_env if "=" not in item]
    if bad:
        parser.error(f"--run-env takes KEY=VALUE, got {bad[0]!r}")
    run_env = dict(item.split("=", 1) for item in args.run_env)
    plan = (Plan(1, 100.0, 40_000) if args.quick else Plan(args.seeds, TARGET, args.budget))
    if args.role == "rllib":
        return role_rllib(args.seed, plan)
    seeds = range(args.first_seed, args.first_seed + plan.seeds)
    report: dict[str, Any] = {"meta": run_metadata(args.quick, plan, ["torch", "numpy", "ray"])}
    report["meta"].update(run_env=run_env, seeds=list(seeds))
    for arm in arms:
        runs = [attempt(f"{arm} seed {seed}",
                        lambda s=seed, a=arm: {"seed": s, **population(a, s, plan, run_env)},
                        lambda r: f"best {r['best_return']:.1f} after {r['best_env_steps']:,} "
                                  f"steps, {r['wall_s']:.0f} s")
                for seed in seeds]
        ok = [r for r in runs if "error" not in r]
        steps = [r["steps_to_target"] for r in ok if r["steps_to_target"] is not None]
        report[arm] = {"runs": runs, "reached": sum(r["reached"] for r in ok), "seeds": len(runs),
                       "best_return_median": statistics.median(r["best_return"] for r in ok)
                       if ok else None,
                       "steps_to_target_median": statistics.median(steps) if steps else None,
                       "wall_s_median": statistics.median(r["wall_s"] for r in ok) if ok
                       else None}
    if "rllib" in args.peers:
        runs = [attempt(f"Ray Tune PBT of RLlib PPO, seed {seed}",
                        lambda s=seed: run_role(Path(__file__), "rllib", args.quick,
                                                ["--seed", str(s)], timeout_s=3600).result,
                        lambda r: f"best {r['best_return']:.1f} after {r['best_env_steps']:,} "
                                  f"steps, {r['wall_s']:.0f} s")
                for seed in range(min(args.rllib_seeds, plan.seeds))]
        ok = [r for r in runs if "error" not in r]
        report["rllib_pbt"] = {"runs": runs, "reached": sum(r["reached"] for r in ok),
                               "seeds": len(runs),
                               "wall_s_median": statistics.median(r["wall_s"] for r in ok)
                               if ok else None}
        mpirl_first = [r for r in report.get("pbt", {}).get("runs", [])[:len(runs)]
                       if "error" not in r]
        if ok and mpirl_first:
            report["rllib_pbt"]["wall_s_over_mpirl_same_seeds"] = (
                statistics.median(r["wall_s"] for r in ok)
                / statistics.median(r["wall_s"] for r in mpirl_first))
    else:
        report["rllib_pbt"] = skipped()
    print_table([["", *("PBT from lr 1e-5" if arm == "pbt" else "fixed lr 1e-5" for arm in arms)],
                 *([label, *(str(report[arm][key]) for arm in arms)]
                   for key, label in (("reached", f"seeds reaching {plan.target:g}"),
                                      ("best_return_median", "best member's return (median)"),
                                      ("steps_to_target_median", "env steps to target (median)"),
                                      ("wall_s_median", "wall s (median)")))])
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
