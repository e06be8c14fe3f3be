"""What the extension points cost: the engine's import alone vs all of mpirl's, and PPO's
throughput with callbacks (a custom metric per episode) or TensorBoard histograms on, beside the
same run with neither. Measured side by side, alternating, one process at a time.

    python benchmarks/extensions.py [--rounds 3] [--iterations 40] [--json PATH] [--quick]
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

from harness import attempt, print_table, run_main, run_metadata, run_process, write_report

import mpirl

HERE = Path(__file__).resolve().parent
MPIRL = str(Path(sys.executable).parent / "mpirl")

ENGINE = "import mpirl.runtime.driver, mpirl.runtime.doctor, mpirl.runtime.host"
EVERYTHING = "import mpirl.commands.train, mpirl.api"
PEAK_RSS = ("import resource, sys; print('BENCH_RESULT {\"rss_mb\": %f, \"torch\": %s}' % ("
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "
            "str('torch' in sys.modules).lower()))")


class EpisodeMetric(mpirl.Callbacks):
    """One custom metric per episode, as a user's callbacks would set."""

    def on_episode_end(self, *, episode, worker):
        episode.custom_metrics["long"] = float(episode.length >= 200)


@dataclass
class Plan:
    rounds: int
    iterations: int
    warmup_iterations: int = 5
    import_rounds: int = 3
    """Rounds of the two imports (at least ``rounds``); one with ``--quick``."""
    ranks: int = 3
    """Ranks of each PPO run; 2 (one rollout rank) with ``--quick``."""


VARIANTS = {
    "plain": {"tensorboard_histograms_every": 0},
    "callbacks": {"tensorboard_histograms_every": 0, "callbacks": "extensions:EpisodeMetric"},
    "histograms": {"tensorboard_histograms_every": 10},  # the default
    "histograms_every_iteration": {"tensorboard_histograms_every": 1},
}


def measure_import(code: str) -> dict[str, float]:
    run = run_process([sys.executable, "-c", f"{code}; {PEAK_RSS}"], "import", 120,
                      want_result=True)
    return {"wall_s": run.wall_s, **run.result}


def measure_ppo(variant: str, plan: Plan) -> float:
    """Mean env steps/s over the iterations after the warm-up, PPO on CartPole, ``plan.ranks``
    ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        config = {**VARIANTS[variant], "checkpoint_every": 0}
        run_process(
            [str(Path(sys.executable).parent / "mpiexec"), "-n", str(plan.ranks), "--oversubscribe",
             "--bind-to", "none", MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1",
             "--run-dir", str(run_dir), "--progress", "off", "--config", json.dumps(config),
             "--stop", json.dumps({"training_iteration": plan.iterations})],
            f"PPO {variant}", 600, extra_env={"PYTHONPATH": str(HERE)})
        with open(run_dir / "progress.csv") as file:
            rows = list(csv.DictReader(file))[plan.warmup_iterations:]
        return statistics.mean(float(row["env_steps_per_s"]) for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 3 iterations (1 measured) on 2 ranks, the imports once")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # Quick: the default histograms (every 10 iterations) write none in 3; every iteration does.
    plan = (Plan(1, 3, warmup_iterations=2, import_rounds=1, ranks=2) if args.quick
            else Plan(args.rounds, args.iterations))
    report = {"meta": run_metadata(args.quick, plan, ["torch", "tensorboardX"])}

    imports: dict[str, list[dict]] = {"engine": [], "everything": []}
    throughput: dict[str, list[float]] = {name: [] for name in VARIANTS}

    def measure() -> dict:
        # Alternating, so drift hits both alike.
        for _ in range(max(plan.rounds, plan.import_rounds)):
            imports["engine"].append(measure_import(ENGINE))
            imports["everything"].append(measure_import(EVERYTHING))
        for _ in range(plan.rounds):
            for name in VARIANTS:
                throughput[name].append(measure_ppo(name, plan))
        return {"imports": imports, "throughput": throughput}

    result = attempt("imports and PPO throughput", measure)
    if "error" in result:
        write_report({**report, **result}, args.json)
        return 1
    summary = {
        "engine_import_s": statistics.median(r["wall_s"] for r in imports["engine"]),
        "engine_rss_mb": statistics.median(r["rss_mb"] for r in imports["engine"]),
        "engine_loads_torch": any(r["torch"] for r in imports["engine"]),
        "everything_import_s": statistics.median(r["wall_s"] for r in imports["everything"]),
        "everything_rss_mb": statistics.median(r["rss_mb"] for r in imports["everything"]),
        **{f"{name}_steps_per_s": statistics.median(values)
           for name, values in throughput.items()},
    }
    for name in ("callbacks", "histograms", "histograms_every_iteration"):
        summary[f"{name}_vs_plain"] = (statistics.median(
            a / b for a, b in zip(throughput[name], throughput["plain"], strict=True)))
    report.update(result, summary=summary)
    write_report(report, args.json)
    print_table([
        ["what", "value"],
        ["import mpirl.runtime (engine): s / peak MB / torch", f"{summary['engine_import_s']:.2f}"
         f" / {summary['engine_rss_mb']:.0f} / {summary['engine_loads_torch']}"],
        ["import mpirl.commands.train + api: s / peak MB",
         f"{summary['everything_import_s']:.2f} / {summary['everything_rss_mb']:.0f}"],
        ["PPO steps/s: plain / callbacks / histograms every 10 / every 1",
         f"{summary['plain_steps_per_s']:,.0f} / {summary['callbacks_steps_per_s']:,.0f} / "
         f"{summary['histograms_steps_per_s']:,.0f} / "
         f"{summary['histograms_every_iteration_steps_per_s']:,.0f}"],
        ["callbacks vs plain (median of paired ratios)", f"{summary['callbacks_vs_plain']:.3f}"],
        ["histograms every 10 (default) vs plain", f"{summary['histograms_vs_plain']:.3f}"],
        ["histograms every iteration vs plain",
         f"{summary['histograms_every_iteration_vs_plain']:.3f}"],
    ])
    return 0


if __name__ == "__main__":
    run_main(main)
