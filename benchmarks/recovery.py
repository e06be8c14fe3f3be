"""What checkpoint-restart costs: a replay shard's memory at checkpoint (peak over steady
RSS), checkpoint write/verify/restore times by model size, training throughput with checkpoints
on and off (side by side), and the timeline of a kill -9 and a stop signal (detect, restart,
first iteration again, iterations lost).

    python benchmarks/recovery.py --json benchmarks/recovery.json          # about 4 minutes
    python benchmarks/recovery.py --json /tmp/recovery.json --quick        # about a minute
    # the replay memory alone, this checkout against an older one:
    python benchmarks/recovery.py --only-memory --baseline-src /path/to/old/checkout
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness

from mpirl.runtime.layout import parse_layout_row

SCRIPT = Path(__file__).resolve()
MPIRL = str(Path(sys.executable).parent / "mpirl")


@dataclass(frozen=True)
class Plan:
    hidden_sizes: tuple[tuple[int, ...], ...] = ((64, 64), (1024, 1024), (4096, 4096))
    io_repeats: int = 5
    overhead_iterations: int = 80
    overhead_every: tuple[int, ...] = (0, 10, 1)
    overhead_rounds: int = 2
    ranks: int = 3
    replay_buffer_mb: int = 500

    @staticmethod
    def quick() -> Plan:
        return Plan(hidden_sizes=((64, 64), (1024, 1024)), io_repeats=3, overhead_iterations=40,
                    overhead_rounds=1, replay_buffer_mb=100)


# Measured program: checkpoint I/O of one model size (under mpiexec -n ranks).


def role_checkpoint_io(hidden: tuple[int, ...], repeats: int) -> int:
    import mpirl
    from mpirl.config.parse import build
    from mpirl.execution.contract import load_algorithm
    from mpirl.execution.trainer import Trainer
    from mpirl.jobs.checkpoint import CheckpointStore, verify
    from mpirl.runtime.driver import RuntimeSettings
    from mpirl.runtime.layout import Layout
    from mpirl.workers.env_spec import EnvSpec

    module = load_algorithm("PPO")
    config = build(module.Config, {"hidden_sizes": list(hidden), "num_epochs": 1})

    def body(driver: mpirl.Driver) -> int:
        trainer = Trainer(driver, module, config, EnvSpec("CartPole-v1"))
        trainer.train()
        with tempfile.TemporaryDirectory(dir=os.getcwd()) as run_dir:
            store = CheckpointStore(run_dir, keep=2)
            saves, verifies, restores = [], [], []
            for _ in range(repeats):
                start = time.perf_counter()
                path = trainer.save_checkpoint(store)
                saves.append(time.perf_counter() - start)
                start = time.perf_counter()
                manifest = verify(path)
                verifies.append(time.perf_counter() - start)
                start = time.perf_counter()
                trainer.restore(path, manifest)
                restores.append(time.perf_counter() - start)
                trainer.iteration += 1
            size = sum(entry["bytes"] for entry in manifest["files"].values())
        harness.emit({
            "hidden_sizes": list(hidden), "parameters": int(trainer.learners[0].call(
                "get_weights").size), "checkpoint_bytes": size,
            "save_ms": 1e3 * statistics.median(saves),
            "verify_ms": 1e3 * statistics.median(verifies),
            "restore_ms": 1e3 * statistics.median(restores),
        })
        return 0

    return mpirl.run(body, Layout(), RuntimeSettings(print_layout=False))


# Measured program: a replay shard's memory at checkpoint (under mpiexec -n 4).

REPLAY_LAYOUT = {"num_rollout_workers": 1, "num_replay_shards": 1, "num_learners": 1}


def _memory(pid: int | str, key: str) -> int:
    """VmRSS or VmHWM (peak RSS) of a process on this host, in bytes."""
    with open(f"/proc/{pid}/status") as file:
        line = next(line for line in file if line.startswith(key + ":"))
    return 1024 * int(line.split()[1])


def _reset_peak(pid: int | str) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as file:
        file.write("5")  # VmHWM := VmRSS (Linux 4.0+)


def role_replay_memory(buffer_mb: int) -> int:
    """Fill a replay rank's shard with ``buffer_mb`` MB of CartPole rows (sent by the driver in
    chunks, no sampling), then checkpoint it: its steady RSS, and its peak RSS during the
    checkpoint (VmHWM, reset right before); then the driver's peak RSS while verifying."""
    import numpy as np

    import mpirl
    from mpirl.config.parse import build
    from mpirl.execution.contract import load_algorithm
    from mpirl.execution.trainer import Trainer
    from mpirl.jobs.checkpoint import CheckpointStore, verify
    from mpirl.runtime.driver import RuntimeSettings
    from mpirl.runtime.layout import Layout
    from mpirl.workers.env_spec import EnvSpec

    module = load_algorithm("DQN")
    row_bytes = 4 * 4 + 8 + 4 + 1  # obs (4 float32), action (int64), reward, flags
    config = build(module.Config, {**REPLAY_LAYOUT,
                                   "buffer_size": buffer_mb * 1_000_000 // row_bytes})

    def body(driver: mpirl.Driver) -> int:
        trainer = Trainer(driver, module, config, EnvSpec("CartPole-v1"))
        shard = trainer.plan.replay[0]
        pid = driver.hosts[driver.placement.roles.index("replay")]["pid"]
        streams, steps = config.num_envs_per_worker, 65_536
        rng = np.random.default_rng(0)
        rows, seq = 0, 0
        while rows < config.buffer_size:
            shape = (steps, streams)
            chunk = {"worker": 0, "seq": seq, "obs": rng.standard_normal((*shape, 4), np.float32),
                     "actions": rng.integers(0, 2, shape), "rewards": np.ones(shape, np.float32),
                     "terminated": rng.random(shape) < 0.005, "truncated": np.zeros(shape, bool),
                     "final_obs": np.zeros((0, 4), np.float32), "failed": np.zeros(shape, bool)}
            rows += shard.call("insert", [], [chunk])
            seq += 1
        stored = shard.call("size")
        steady = _memory(pid, "VmRSS")
        _reset_peak(pid)
        with tempfile.TemporaryDirectory(dir=os.getcwd()) as run_dir:
            start = time.perf_counter()
            path = trainer.save_checkpoint(CheckpointStore(run_dir, keep=1))
            save_s = time.perf_counter() - start
            peak = _memory(pid, "VmHWM")
            replay_bytes = (path / "replay_0.pkl").stat().st_size
            driver_steady = _memory("self", "VmRSS")
            _reset_peak("self")
            start = time.perf_counter()
            verify(path)
            verify_s = time.perf_counter() - start
            driver_peak = _memory("self", "VmHWM")
        harness.emit({
            "replay_rows": stored, "replay_file_bytes": replay_bytes,
            "replay_steady_rss_bytes": steady, "replay_checkpoint_peak_rss_bytes": peak,
            "replay_peak_over_steady": peak / steady, "save_s": save_s,
            "driver_verify_extra_rss_bytes": driver_peak - driver_steady, "verify_s": verify_s,
        })
        return 0

    return mpirl.run(body, Layout(**REPLAY_LAYOUT), RuntimeSettings(print_layout=False))


def measure_replay_memory(plan: Plan, baseline_src: Path | None) -> dict[str, Any]:
    """The replay role with this checkout, and with ``baseline_src`` (an older mpirl source
    tree put first on PYTHONPATH) when given."""
    ranks = 1 + sum(REPLAY_LAYOUT.values())
    command = harness.mpiexec_command(ranks, sys.executable, str(SCRIPT), "--role",
                                      "replay_memory", "--buffer-mb", str(plan.replay_buffer_mb))
    report = {"buffer_mb": plan.replay_buffer_mb,
              "current": harness.run_process(command, "replay memory", 600,
                                             want_result=True).result}
    if baseline_src is not None:
        source = Path(baseline_src).resolve()
        found = harness.run_process(command, "replay memory (baseline)", 600,
                                    {"PYTHONPATH": str(source)}, want_result=True).result
        report["baseline"] = {"source": str(source), "commit": _commit(source), **found}
    return report


def _commit(source: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    return proc.stdout.strip() or None


def _describe_memory(r: dict[str, Any]) -> str:
    parts = []
    for name in ("baseline", "current"):
        if name in r:
            m = r[name]
            parts.append(f"{name}: replay rank peak/steady RSS {m['replay_peak_over_steady']:.2f} "
                         f"({m['replay_steady_rss_bytes'] / 1e6:.0f} MB steady, "
                         f"{m['replay_checkpoint_peak_rss_bytes'] / 1e6:.0f} MB peak), driver "
                         f"+{m['driver_verify_extra_rss_bytes'] / 1e6:.0f} MB verifying")
    return "; ".join(parts)


# Orchestrator.


def train_command(plan: Plan, run_dir: Path, *extra: str) -> list[str]:
    return harness.mpiexec_command(plan.ranks, MPIRL, "train", *extra, "--run-dir", str(run_dir))


def measure_overhead(plan: Plan, workdir: Path) -> dict[str, Any]:
    """Env steps/s over the same PPO run with checkpoint_every = each of the plan's values,
    alternated over rounds (ABC CBA ...)."""
    rates: dict[int, list[float]] = {every: [] for every in plan.overhead_every}
    order = list(plan.overhead_every)
    for round_index in range(plan.overhead_rounds):
        for every in order if round_index % 2 == 0 else order[::-1]:
            run_dir = workdir / f"overhead-{every}-{round_index}"
            config = json.dumps({"checkpoint_every": every, "checkpoint_at_end": False,
                                 "print_layout": False})
            harness.run_process(
                train_command(plan, run_dir, "--algo", "PPO", "--env", "CartPole-v1", "--config",
                              config, "--stop",
                              json.dumps({"training_iteration": plan.overhead_iterations})),
                f"train checkpoint_every={every}", 300)
            row = json.loads((run_dir / "result.json").read_text())
            rates[every].append(row["timesteps_total"] / row["time_total_s"])
    base = statistics.median(rates[0])
    return {
        "env_steps_per_s": {str(k): statistics.median(v) for k, v in rates.items()},
        "throughput_ratio": {str(k): statistics.median(v) / base for k, v in rates.items()},
    }


def _last_iteration(run_dir: Path) -> int:
    try:
        with open(run_dir / "progress.csv") as file:
            rows = list(csv.DictReader(file))
        return int(rows[-1]["iteration"]) if rows else 0
    except (FileNotFoundError, KeyError, ValueError):
        return 0


def _latest_checkpoint(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().split("_")[1]) if latest.is_file() else 0


def _wait(condition, timeout: float, what: str, proc: subprocess.Popen) -> float:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None and not condition():
            raise harness.BenchError(f"{what}: the job exited with {proc.returncode} first")
        if time.monotonic() > deadline:
            harness.end_session(proc)
            raise harness.BenchError(f"{what}: not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic()


def _start(command: list[str]) -> subprocess.Popen:
    env = {**os.environ, **harness.MPI_ENV, **harness.THREAD_ENV}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)


def _rank_pids(proc: subprocess.Popen, ranks: int) -> dict[int, int]:
    pids = {}
    while len(pids) < ranks:
        line = proc.stdout.readline()
        if not line:
            raise harness.BenchError("the job ended before printing its layout")
        if row := parse_layout_row(line):
            pids[row["rank"]] = row["pid"]
    return pids


def measure_timeline(plan: Plan, workdir: Path) -> dict[str, Any]:
    """kill -9 of a rollout rank mid-run, then --resume, then SIGUSR2 on the resumed job."""
    run_dir = workdir / "timeline"
    every = 10
    config = json.dumps({"checkpoint_every": every})
    proc = _start(train_command(plan, run_dir, "--algo", "PPO", "--env", "CartPole-v1",
                                "--config", config, "--stop", '{"training_iteration": 100000}'))
    pids = _rank_pids(proc, plan.ranks)
    # Kill halfway between two checkpoints: the iterations since the last one are redone.
    _wait(lambda: _last_iteration(run_dir) >= 2 * every + every // 2, 120, "iteration 25", proc)
    killed = time.monotonic()
    os.kill(pids[plan.ranks - 1], signal.SIGKILL)
    proc.wait(timeout=60)
    ended = time.monotonic()
    done_at_kill = _last_iteration(run_dir)
    checkpoint = _latest_checkpoint(run_dir)
    harness.end_session(proc)

    started = time.monotonic()
    resumed = _start(train_command(plan, run_dir, "--resume", str(run_dir), "--stop",
                                   '{"training_iteration": 100000}'))
    pids = _rank_pids(resumed, plan.ranks)
    first = _wait(lambda: _last_iteration(run_dir) > checkpoint, 120, "first resumed iteration",
                  resumed)
    time.sleep(1.0)
    signalled = time.monotonic()
    os.kill(pids[1], signal.SIGUSR2)
    code = resumed.wait(timeout=60)
    exited = time.monotonic()
    harness.end_session(resumed)
    return {
        "kill_to_job_end_s": ended - killed,
        "iterations_done_at_kill": done_at_kill, "checkpoint_resumed_from": checkpoint,
        "iterations_redone": done_at_kill - checkpoint, "checkpoint_every": every,
        "resume_command_to_first_iteration_s": first - started,
        "sigusr2_to_exit_s": exited - signalled, "sigusr2_exit_code": code,
    }


def orchestrate(plan: Plan, quick: bool, json_path: Path | None,
                baseline_src: Path | None = None) -> int:
    report: dict[str, Any] = {"meta": harness.run_metadata(quick, plan, ["mpi4py", "torch"])}
    report["replay_checkpoint_memory"] = harness.attempt(
        "replay shard memory at checkpoint", lambda: measure_replay_memory(plan, baseline_src),
        _describe_memory)
    io = []
    for hidden in plan.hidden_sizes:
        args = ["--hidden", ",".join(map(str, hidden)), "--repeats", str(plan.io_repeats)]
        io.append(harness.attempt(
            f"checkpoint I/O, hidden {hidden}",
            lambda a=args: harness.run_role(SCRIPT, "checkpoint_io", False, a,
                                            ranks=plan.ranks).result,
            lambda r: (f"{r['parameters']:,} parameters, {r['checkpoint_bytes'] / 1e6:.1f} MB: "
                       f"save {r['save_ms']:.1f} ms, verify {r['verify_ms']:.1f} ms, restore "
                       f"{r['restore_ms']:.1f} ms")))
    report["checkpoint_io"] = io
    with tempfile.TemporaryDirectory() as tmp:
        report["overhead"] = harness.attempt(
            "training throughput by checkpoint_every", lambda: measure_overhead(plan, Path(tmp)),
            lambda r: ", ".join(f"every {k}: {v:.3f}" for k, v in r["throughput_ratio"].items()))
        report["timeline"] = harness.attempt(
            "kill -9, resume, SIGUSR2", lambda: measure_timeline(plan, Path(tmp)),
            lambda r: json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                  for k, v in r.items()}))
    harness.write_report(report, json_path)
    failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    failed += ["checkpoint_io" for entry in io if "error" in entry]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--baseline-src", type=Path, metavar="DIR",
                        help="also measure replay memory with the mpirl source tree in DIR (an "
                             "older checkout) first on PYTHONPATH")
    parser.add_argument("--only-memory", action="store_true",
                        help="measure only the replay shard's memory at checkpoint, replacing "
                             "that section of an existing --json report")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--buffer-mb", type=int, default=500, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "checkpoint_io":
        return role_checkpoint_io(tuple(int(h) for h in args.hidden.split(",")), args.repeats)
    if args.role == "replay_memory":
        return role_replay_memory(args.buffer_mb)
    plan = Plan.quick() if args.quick else Plan()
    if args.only_memory:
        # Replaces this one section of an existing report, keeping the others and their meta.
        report = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
        memory = harness.attempt("replay shard memory at checkpoint",
                                 lambda: measure_replay_memory(plan, args.baseline_src),
                                 _describe_memory)
        report["replay_checkpoint_memory"] = {
            "meta": harness.run_metadata(args.quick, plan, ["mpi4py", "torch"]), **memory}
        harness.write_report(report, args.json)
        return 1 if "error" in memory else 0
    return orchestrate(plan, args.quick, args.json, args.baseline_src)


if __name__ == "__main__":
    sys.exit(main())
