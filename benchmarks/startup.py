"""Start-up, phase by phase: a one-iteration PPO CartPole run under ``mpiexec -n 3``, timed from
the outside (whole process) and from the inside (each run's ``startup.json``).

    python benchmarks/startup.py --json benchmarks/startup.json [--repeats 5] [--ranks 3]

Each variant is run ``--repeats`` times, alternating, and the medians are reported:

- ``default``: mpirl as it is;
- ``with_ofi``: Open MPI's libfabric BTL left in (``OMPI_MCA_btl=""``), as before mpirl left it
  out on one node;
- with ``--baseline REF``, also ``REF``: the mpirl of git commit REF (a worktree of it first on
  ``PYTHONPATH``), same interpreter and packages, for a before/after in one run.

Phases (rank 0's, and the slowest rank's for those every rank passes): ``mpirl_imported`` (the
interpreter), ``mpi_ready`` (``MPI_Init``), ``imports_done`` (torch, gymnasium and the rest),
``run_start`` (the request's checks), ``ranks_connected``, ``workers_built`` (envs, models),
``first_iteration``. ``launcher_and_exit_s`` is the whole process less launch to the first
iteration: mpiexec starting the ranks, and all after the iteration (checkpoint, shutdown, exit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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
    write_report,
)

MPIRL = Path(sys.executable).parent / "mpirl"
VARIANTS = {"default": {}, "with_ofi": {"OMPI_MCA_btl": ""}}


@dataclass(frozen=True)
class Plan:
    ranks: int
    repeats: int


def one_run(ranks: int, env: dict[str, str], run_dir: Path) -> dict[str, Any]:
    """One ``mpirl train`` of one PPO iteration; its whole-process time and startup.json."""
    command = mpiexec_command(
        ranks, str(MPIRL), "train", "--algo", "PPO", "--env", "CartPole-v1", "--stop",
        '{"training_iteration": 1}', "--run-dir", str(run_dir), "--progress", "plain")
    finished = run_process(command, f"mpirl train -n {ranks}", 300.0, {"CI": "true", **env})
    try:
        startup = json.loads((run_dir / "startup.json").read_text())
        row = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError) as error:
        raise BenchError(f"no startup.json or result.json in {run_dir}: {error}") from None
    first = startup["launch_to_first_iteration_s"]
    return {"whole_process_s": finished.wall_s, "launch_to_first_iteration_s": first,
            "first_iteration_train_s": float(row["time_this_iter_s"]),
            "launcher_and_exit_s": finished.wall_s - first,
            "driver_phases_s": startup["driver_phases_s"],
            "slowest_rank_phases_s": {k: v["seconds"]
                                      for k, v in startup["slowest_rank_phases_s"].items()}}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every number over ``runs``, nested dicts too."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = medians([r[key] for r in runs])
        else:
            out[key] = round(statistics.median(r[key] for r in runs), 3)
    return out


def baseline_tree(ref: str, into: Path) -> Path:
    """A worktree of the repository at ``ref`` under ``into``; its root goes on PYTHONPATH."""
    repo = Path(__file__).resolve().parent.parent
    tree = into / "baseline"
    made = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), ref],
                          capture_output=True, text=True)
    if made.returncode:
        raise BenchError(f"git worktree add {ref}: {made.stderr.strip()}")
    # The built-in algorithms are mpirl.algorithms, which the editable install maps to this
    # checkout's algorithms/; inside the package they come from the worktree's own.
    (tree / "mpirl" / "algorithms").symlink_to(tree / "algorithms", target_is_directory=True)
    return tree


def measure(plan: Plan, baseline: str | None) -> dict[str, Any]:
    variants = dict(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="mpirl-startup-") as tmp:
        tree = None
        if baseline:
            tree = baseline_tree(baseline, Path(tmp))
            variants[baseline] = {"PYTHONPATH": str(tree)}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        try:
            for i in range(plan.repeats):
                for name, env in variants.items():  # alternating: load drifts hit all alike
                    runs[name].append(one_run(plan.ranks, env, Path(tmp) / f"{name}-{i}"))
        finally:
            if tree is not None:
                subprocess.run(["git", "-C", str(tree), "worktree", "remove", "--force",
                                str(tree)], capture_output=True)
    return {name: {"median": medians(r), "runs": r} for name, r in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--ranks", type=int, default=3, help="ranks of each run (default 3)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant (default 5)")
    parser.add_argument("--baseline", metavar="REF",
                        help="also run the mpirl of this git commit, for a before/after")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.repeats < 1:
        parser.error("--ranks and --repeats must be at least 1")
    plan = Plan(args.ranks, args.repeats)
    started = time.perf_counter()
    result = attempt(f"PPO CartPole, one iteration, -n {plan.ranks}, {plan.repeats} x "
                     f"{len(VARIANTS) + bool(args.baseline)} variants",
                     lambda: measure(plan, args.baseline))
    report = {"meta": {**run_metadata(False, plan, ("mpirl", "torch", "mpi4py")),
                       "wall_s": time.perf_counter() - started}, **result}
    write_report(report, args.json)
    if "error" in result:
        print_problems({"startup": result})
        return 1
    phases = list(result["default"]["median"]["driver_phases_s"])
    variants = list(result)
    rows = [("median seconds", *variants)]
    for key in ("whole_process_s", "launch_to_first_iteration_s", "launcher_and_exit_s"):
        rows.append((key, *(fmt(result[v]["median"][key], 2) for v in variants)))
    for phase in phases:
        rows.append((f"  {phase}", *(fmt(result[v]["median"]["driver_phases_s"].get(phase), 2)
                                     for v in variants)))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
