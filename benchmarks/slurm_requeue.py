"""Preemption on a real Slurm: from SIGUSR2 to the requeued job's first new iteration.

Starts the local test cluster (slurm/local-cluster.sh, in a directory and on ports of its own),
submits PPO on CartPole with ``mpirl slurm --submit`` (3 ranks), and after a few iterations sends
``scancel --batch --signal=USR2``: what ``--signal=B:USR2@LEAD`` does before the time limit. From
the scancel it times: the new checkpoint appearing, the job leaving RUNNING (step exited 75,
``scontrol requeue`` accepted), the job RUNNING again, and its first new progress.csv row.

    python benchmarks/slurm_requeue.py --json benchmarks/slurm_requeue.json   # about 2 minutes
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "slurm" / "local-cluster.sh"
MPIRL = str(Path(sys.executable).parent / "mpirl")
PHASES = ("checkpoint_written_s", "job_left_running_s", "running_again_s", "first_new_row_s")


@dataclass(frozen=True)
class Plan:
    rounds: int = 3
    launcher: str = "srun-pmix"
    signal_after_iterations: int = 5


def _rows(run_dir: Path) -> int:
    try:
        with open(run_dir / "progress.csv") as file:
            return sum(1 for _ in csv.DictReader(file))
    except FileNotFoundError:
        return 0


def _latest(run_dir: Path) -> str:
    try:
        return (run_dir / "checkpoints" / "latest").read_text().strip()
    except FileNotFoundError:
        return ""


def _job(env: dict[str, str], job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                         env=env, timeout=30).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def _wait(condition, what: str, timeout_s: float = 180.0) -> float:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise harness.BenchError(f"no {what} within {timeout_s:g} s")
        time.sleep(0.02)
    return time.monotonic()


def one_round(env: dict[str, str], plan: Plan, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / "run"
    proc = subprocess.run(
        [MPIRL, "slurm", "--submit", "--nodes", "1", "--ntasks-per-node", "3", "--time", "30",
         "--launcher", plan.launcher, "--run-dir", str(run_dir), "--", "train", "--algo", "PPO",
         "--env", "CartPole-v1", "--stop", '{"training_iteration": 100000}',
         "--config", '{"checkpoint_every": 0}'],
        capture_output=True, text=True, env=env, cwd=workdir, timeout=60)
    if proc.returncode != 0:
        raise harness.BenchError(f"mpirl slurm --submit failed: {proc.stderr}")
    job = proc.stdout.strip()
    try:
        _wait(lambda: _rows(run_dir) >= plan.signal_after_iterations, "first iterations")
        sent = time.monotonic()
        subprocess.run(["scancel", "--batch", "--signal=USR2", job], env=env, check=True,
                       timeout=30)
        stopped_at = None

        def checkpointed() -> bool:
            nonlocal stopped_at
            name = _latest(run_dir)
            if name:
                stopped_at = int(name.rsplit("_", 1)[1])
            return bool(name)

        written = _wait(checkpointed, "checkpoint")
        left = _wait(lambda: _job(env, job).get("JobState") != "RUNNING", "requeue")
        again = _wait(lambda: (info := _job(env, job)).get("JobState") == "RUNNING"
                      and info.get("Restarts") == "1", "restart")
        first = _wait(lambda: _rows(run_dir) > stopped_at, "first new iteration")
    finally:
        subprocess.run(["scancel", job], env=env, timeout=30)
    return {"job": job, "stopped_at_iteration": stopped_at,
            "checkpoint_written_s": written - sent, "job_left_running_s": left - sent,
            "running_again_s": again - sent, "first_new_row_s": first - sent}


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--rounds", type=int, default=Plan.rounds)
    parser.add_argument("--launcher", default=Plan.launcher,
                        choices=("srun-pmix", "srun-pmi2", "mpiexec"))
    args = parser.parse_args()
    plan = Plan(rounds=args.rounds, launcher=args.launcher)
    directory = Path("/tmp/mpirl-slurm-bench")
    env = {**os.environ, **harness.MPI_ENV, "MPIRL_SLURM_DIR": str(directory),
           "MPIRL_SLURM_PORT": "7017", "SLURM_CONF": str(directory / "slurm.conf")}
    subprocess.run(["bash", str(CLUSTER), "start"], env=env, check=True, timeout=120)
    report: dict[str, Any] = {"metadata": harness.run_metadata(False, plan, ["mpirl", "torch"])}
    version = subprocess.run(["sinfo", "-V"], capture_output=True, text=True, env=env)
    report["metadata"]["slurm"] = version.stdout.strip()
    rounds = []
    try:
        for _ in range(plan.rounds):
            with tempfile.TemporaryDirectory() as workdir:
                rounds.append(harness.attempt("round", lambda w=workdir: one_round(
                    env, plan, Path(w))))
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop"], env=env, timeout=120)
    good = [r for r in rounds if "error" not in r]
    report["rounds"] = rounds
    report["median"] = {phase: statistics.median(r[phase] for r in good) for phase in PHASES} \
        if good else {}
    for phase in PHASES:
        print(f"{phase:22s} " + "  ".join(f"{r[phase]:6.2f}" for r in good)
              + (f"   median {report['median'][phase]:.2f} s" if good else ""))
    harness.print_problems({f"round {i}": r for i, r in enumerate(rounds)})
    harness.write_report(report, args.json)
    return 0 if len(good) == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
