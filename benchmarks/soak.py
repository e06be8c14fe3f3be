"""Soak: every algorithm trained for a long time on its layout in docs/algorithms.md, every rank
watched.

    python benchmarks/soak.py --minutes 60 [--algos PPO,IMPALA:4] [--parallel 9]
        [--warmup-minutes 5] [--target 0.5] [--signal-halfway] [--json FILE]

Each algorithm (``ALGO``, or ``ALGO:N`` for another world size) runs ``mpirl train`` under
``mpiexec`` until ``time_total_s`` reaches the soak's length. Every ``--interval-s`` seconds the
orchestrator reads each rank's resident memory and open file descriptors from ``/proc`` (the
ranks' pids come from the run's start-up table) and the run's latest ``timesteps_total``. It
reports, per algorithm and role, the slope of the largest rank's RSS after warm-up (a least-squares
fit, MB/min), the RSS and open fds at the end of warm-up and at the end, and whether
``progress.csv`` has every iteration exactly once. Warm-up lasts ``--warmup-minutes`` and, for
replay algorithms, until the replay buffer has filled (``timesteps_total`` >= ``buffer_size``;
a buffer's pages become resident as it fills), or half the part if it fills later.

With ``--signal-halfway`` each run gets SIGUSR1 halfway through its training time: it
checkpoints and exits with 75 (requeue), and is resumed with ``--resume``. Each part then has
its own warm-up and slope, and the largest RSS of each role at the end must be no higher than
before the signal (within 5 MB).

Exit status 1 when any slope exceeds ``--target`` (0.5 MB/min), an fd count grows, an
iteration is missing or repeated, a run fails, or memory after a resume is higher than before.
Runs are local (``/proc`` of this node); ``--parallel`` runs several at once, which also loads
the machine: the table says how many iterations each run got.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    MPI_ENV,
    THREAD_ENV,
    end_session,
    fmt,
    mpiexec_command,
    print_table,
    run_metadata,
    write_report,
)

from mpirl.errors import EXIT_RESUME
from mpirl.execution.contract import ALGORITHMS
from mpirl.runtime.layout import parse_layout_row
from mpirl.runtime.memory import MIB, open_fd_count, process_rss_bytes

MPIRL = Path(sys.executable).parent / "mpirl"


@dataclass(frozen=True)
class Plan:
    """How one algorithm runs in docs/algorithms.md: world size, environment, config."""

    ranks: int
    env: str = "CartPole-v1"
    config: dict[str, Any] = field(default_factory=dict)
    offline: bool = False
    """Learns from a dump (made first, by a short PPO run) rather than by sampling."""
    algo: str = ""
    """The ``--algo`` of a plan named otherwise (MULTIAGENT runs PPO with a DQN policy)."""


#: docs/algorithms.md's command for each algorithm. An algorithm not listed runs on 3 ranks on
#: CartPole-v1 with its defaults, so each new one is soaked as soon as it exists.
PLANS = {
    "PPO": Plan(3), "A2C": Plan(3), "IMPALA": Plan(3), "A3C": Plan(3), "DQN": Plan(2),
    "APEX": Plan(7), "SAC": Plan(2, "Pendulum-v1"), "BC": Plan(3, offline=True),
    "MARWIL": Plan(3, offline=True),
    "ALPHAZERO": Plan(3, "openspiel/tic_tac_toe", algo="AlphaZero"),
    # docs/multiagent.md's composed run: PPO and DQN policies, each on a learner rank.
    "MULTIAGENT": Plan(4, "mpirl.envs.examples:FourAgentCartPole", {
        "num_learners": 2, "multiagent": {
            "policies": {"ppo": {"num_learners": 1}, "dqn": {"algo": "DQN", "num_learners": 1}},
            "policy_mapping": {"cart_[02]": "ppo", "cart_[13]": "dqn"}}}, algo="PPO"),
}
#: The slack allowed: fds at the end over those at the end of warm-up, and RSS (MB) after a
#: resume over RSS before the signal.
FD_SLACK = 2
RESUME_SLACK_MB = 5.0


@dataclass
class Sample:
    t: float  # seconds since the soak's start of this run
    rss_mb: dict[int, float]  # rank -> RSS
    fds: dict[int, int]
    timesteps: int | None
    time_total_s: float | None = None  # the run's training time, at its latest row


@dataclass
class Soak:
    """One algorithm's run (and its resumed part): its processes and its samples."""

    name: str
    algo: str
    plan: Plan
    run_dir: Path
    minutes: float
    signal_halfway: bool
    proc: subprocess.Popen | None = None
    started: float = 0.0
    parts: list[dict[str, Any]] = field(default_factory=list)  # one per process: start, pids
    samples: list[list[Sample]] = field(default_factory=list)
    signalled_at: float | None = None
    exit_codes: list[int] = field(default_factory=list)
    error: str | None = None

    def command(self, dump: Path | None) -> list[str]:
        if self.parts:  # the resumed part
            return mpiexec_command(self.plan.ranks, str(MPIRL), "train", "--resume",
                                   str(self.run_dir), "--progress", "off")
        config = dict(self.plan.config)
        if self.plan.offline:
            config["input"] = str(dump)
        return mpiexec_command(
            self.plan.ranks, str(MPIRL), "train", "--algo", self.algo, "--env", self.plan.env,
            "--config", json.dumps(config), "--run-dir", str(self.run_dir), "--progress", "off",
            "--stop", json.dumps({"time_total_s": self.minutes * 60}))

    def launch(self, dump: Path | None) -> None:
        part = len(self.parts)
        log = self.run_dir.parent / f"{self.name}.part{part}.log"
        if not self.parts:
            self.started = time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(self.command(dump), stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **MPI_ENV, **THREAD_ENV},
                                         start_new_session=True)
        self.parts.append({"start": self.elapsed(), "log": str(log), "pids": {}})
        self.samples.append([])

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def pids(self) -> dict[int, tuple[int, str]]:
        """rank -> (pid, role), from the start-up table of the current part (once printed)."""
        part = self.parts[-1]
        if not part["pids"]:
            part["pids"] = read_layout(Path(part["log"]))
        return part["pids"]

    def sample(self) -> None:
        pids = self.pids()
        if not pids:
            return
        rss, fds = {}, {}
        for rank, (pid, _) in pids.items():
            value = process_rss_bytes(pid)
            count = open_fd_count(pid)
            if value is not None and count is not None:
                rss[rank], fds[rank] = value / MIB, count
        if len(rss) == len(pids):
            self.samples[-1].append(Sample(self.elapsed(), rss, fds,
                                           *latest_progress(self.run_dir / "progress.csv")))


def read_layout(log: Path) -> dict[int, tuple[int, str]]:
    """rank -> (pid, role) from the ``rank role index host pid device rss MB`` table."""
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return {}
    rows = [row for line in lines if (row := parse_layout_row(line))]
    return {row["rank"]: (row["pid"], row["role"]) for row in rows}


def latest_progress(progress: Path) -> tuple[int | None, float | None]:
    """``timesteps_total`` and ``time_total_s`` of progress.csv's last complete row (None,
    None before the first)."""
    try:
        with open(progress, "rb") as file:
            header = file.readline().decode().strip().split(",")
            file.seek(max(0, os.path.getsize(progress) - 4096))
            tail = file.read().decode(errors="replace").splitlines()
    except OSError:
        return None, None
    for line in reversed(tail[1:] if len(tail) > 1 else []):
        cells = line.split(",")
        if len(cells) == len(header):
            try:
                return (int(float(cells[header.index("timesteps_total")])),
                        float(cells[header.index("time_total_s")]))
            except ValueError:
                return None, None
    return None, None


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute; None below 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def progress_iterations(run_dir: Path) -> list[int] | None:
    """The ``iteration`` column of the run's progress.csv, or None if it cannot be read."""
    try:
        with open(run_dir / "progress.csv") as file:
            return [int(row["iteration"]) for row in csv.DictReader(file)]
    except (OSError, KeyError, ValueError):
        return None


def iterations_once(iterations: list[int] | None) -> bool:
    """Whether ``iterations`` are 1..N, each exactly once."""
    return bool(iterations) and iterations == list(range(1, len(iterations) + 1))


def buffer_rows(run_dir: Path) -> int | None:
    """The run's ``buffer_size`` (replay algorithms), from params.json."""
    try:
        config = json.loads((run_dir / "params.json").read_text())["config"]
    except (OSError, KeyError, ValueError):
        return None
    return config.get("buffer_size")


def analyse_part(soak: Soak, index: int, warmup_s: float, target: float) -> dict[str, Any]:
    """Per role: slope after warm-up, RSS and fds at warm-up's end and at the end."""
    samples = soak.samples[index]
    pids = soak.parts[index]["pids"]
    if not samples:
        return {"error": "no samples (the run never printed its start-up table)"}
    # Warm-up counts from the part's first new progress row: start-up (imports, spawning,
    # a restore) is not steady state, and on a loaded machine it takes a while.
    before = soak.samples[index - 1][-1].timesteps if index and soak.samples[index - 1] else None
    start = next((s.t for s in samples if s.timesteps is not None
                  and (before is None or s.timesteps > before)), samples[-1].t)
    warm = start + warmup_s
    rows = buffer_rows(soak.run_dir) if index == 0 else None
    filled_at = None
    if rows:
        # A buffer still filling by half the part is measured from there on: its pages add to
        # the slope, so the slope is an upper bound (and the report says it never filled).
        filled_at = next((s.t for s in samples if (s.timesteps or 0) >= rows), None)
        half = start + (samples[-1].t - start) / 2
        warm = max(warm, min(filled_at if filled_at is not None else half, half))
    measured = [s for s in samples if s.t >= warm]
    roles: dict[str, dict[str, Any]] = {}
    for role in dict.fromkeys(role for _, role in pids.values()):
        ranks = [r for r, (_, rl) in pids.items() if rl == role]
        slopes = [slope_mb_per_min([(s.t, s.rss_mb[r]) for s in measured]) for r in ranks]
        known = [s for s in slopes if s is not None]
        first, last = (measured[0], measured[-1]) if measured else (None, None)
        roles[role] = {
            "ranks": len(ranks),
            "slope_mb_per_min": max(known) if known else None,
            "rss_mb_after_warmup": max(first.rss_mb[r] for r in ranks) if first else None,
            "rss_mb_end": max(last.rss_mb[r] for r in ranks) if last else None,
            "fds_after_warmup": max(first.fds[r] for r in ranks) if first else None,
            "fds_end": max(last.fds[r] for r in ranks) if last else None,
        }
    problems = []
    for role, entry in roles.items():
        if entry["slope_mb_per_min"] is None:
            problems.append(f"{role}: too few samples after warm-up to fit a slope")
        elif entry["slope_mb_per_min"] > target:
            problems.append(f"{role}: RSS grows {entry['slope_mb_per_min']:.2f} MB/min "
                            f"(target {target:g})")
        if entry["fds_end"] is not None and entry["fds_end"] > entry["fds_after_warmup"] + FD_SLACK:
            problems.append(f"{role}: open fds grew {entry['fds_after_warmup']} -> "
                            f"{entry['fds_end']}")
    return {"warmup_end_s": round(warm - start, 1), "measured_s": round(
        (measured[-1].t - measured[0].t) if len(measured) > 1 else 0.0, 1),
        "buffer_filled_at_s": None if filled_at is None else round(filled_at - start, 1),
        "samples": len(samples), "roles": roles, "problems": problems}


def analyse(soak: Soak, warmup_s: float, target: float) -> dict[str, Any]:
    parts = [analyse_part(soak, i, warmup_s, target) for i in range(len(soak.parts))]
    problems = [p for part in parts for p in part.get("problems", [])]
    problems += [part["error"] for part in parts if "error" in part]
    if soak.error:
        problems.append(soak.error)
    iterations = progress_iterations(soak.run_dir)
    once = iterations_once(iterations)
    if not once:
        problems.append("progress.csv does not hold every iteration exactly once")
    entry: dict[str, Any] = {"algo": soak.algo, "ranks": soak.plan.ranks, "env": soak.plan.env,
                             "exit_codes": soak.exit_codes, "parts": parts,
                             "iterations_once": once,
                             "iterations": None if iterations is None else len(iterations)}
    if soak.signal_halfway and len(parts) == 2 and soak.samples[0]:
        before_samples = soak.samples[0][-3:]
        pids = soak.parts[0]["pids"]
        resume = {}
        for role in parts[1].get("roles", {}):
            before = max(s.rss_mb[r] for s in before_samples for r, (_, rl) in pids.items()
                         if rl == role)
            after = parts[1]["roles"][role]["rss_mb_end"]
            resume[role] = {"rss_mb_before_signal": round(before, 1),
                            "rss_mb_end_after_resume": None if after is None else round(after, 1)}
            if after is None or after > before + RESUME_SLACK_MB:
                problems.append(f"{role}: RSS after the resume ({fmt(after, 1)} MB) is higher "
                                f"than before the signal ({before:.1f} MB)")
        entry["resume"] = resume
    elif soak.signal_halfway:
        problems.append("the run was not signalled and resumed")
    entry["problems"] = problems
    entry["ok"] = not problems
    # The raw samples, to plot or fit again: per part, the ranks' roles and one row per sample
    # (seconds, timesteps_total, time_total_s, RSS MB per rank, open fds per rank).
    entry["series"] = [
        {"roles": {rank: role for rank, (_, role) in part["pids"].items()},
         "samples": [[round(s.t, 1), s.timesteps, s.time_total_s,
                      {r: round(v, 1) for r, v in s.rss_mb.items()}, s.fds] for s in samples]}
        for part, samples in zip(soak.parts, soak.samples, strict=True)]
    return entry


def make_dump(directory: Path) -> Path:
    """A trajectory dump of CartPole-v1 for the offline algorithms (a short PPO run)."""
    dump = directory / "dump"
    command = mpiexec_command(3, str(MPIRL), "train", "--algo", "PPO", "--env", "CartPole-v1",
                              "--config", json.dumps({"dump_trajectories": str(dump)}),
                              "--stop", '{"timesteps_total": 50000}', "--run-dir",
                              str(directory / "dump-run"), "--progress", "off")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **MPI_ENV, **THREAD_ENV})
    if proc.returncode != 0:
        raise SystemExit(f"soak: making the dump for BC/MARWIL failed:\n{proc.stderr[-2000:]}")
    return dump


def parse_algos(text: str | None) -> list[tuple[str, str, Plan]]:
    """``ALGO`` or ``ALGO:N`` entries -> (name, algo, plan); default: every algorithm."""
    builtin = [name.upper() for name in ALGORITHMS]
    known = [*builtin, *(name for name in PLANS if name not in builtin)]
    entries = text.split(",") if text else known
    parsed = []
    for entry in entries:
        name, _, ranks = entry.strip().upper().partition(":")
        if name not in known:
            raise SystemExit(f"soak: unknown algorithm {name!r}; known: {', '.join(known)}")
        plan = PLANS.get(name, Plan(3))
        if ranks:
            plan = Plan(int(ranks), plan.env, plan.config, plan.offline, plan.algo)
        parsed.append((f"{name}-n{plan.ranks}", plan.algo or name, plan))
    return parsed


def run_soaks(soaks: list[Soak], parallel: int, interval_s: float, dump: Path | None) -> None:
    """Run the soaks, ``parallel`` at a time, sampling every ``interval_s``; signal and resume
    where asked."""
    waiting, running = list(soaks), []
    while waiting or running:
        while waiting and len(running) < parallel:
            soak = waiting.pop(0)
            soak.launch(dump)
            running.append(soak)
            print(f"soak: started {soak.name}", flush=True)
        tick = time.monotonic()
        for soak in list(running):
            soak.sample()
            # Halfway through the run's training time (its stop), not through the wall time:
            # start-up on a loaded machine can take a while.
            if (soak.signal_halfway and soak.signalled_at is None and len(soak.parts) == 1
                    and soak.samples[0]
                    and (soak.samples[0][-1].time_total_s or 0) >= soak.minutes * 30):
                driver_pid = soak.pids().get(0, (None,))[0]
                if driver_pid is not None:
                    os.kill(driver_pid, signal.SIGUSR1)
                    soak.signalled_at = soak.elapsed()
                    print(f"soak: SIGUSR1 to {soak.name}'s driver at {soak.signalled_at:.0f} s",
                          flush=True)
            code = soak.proc.poll()
            if code is None:
                if soak.elapsed() > soak.minutes * 60 + 900:
                    end_session(soak.proc)
                    soak.error = "still running 15 minutes past its length: killed"
                    running.remove(soak)
                continue
            soak.exit_codes.append(code)
            if code == EXIT_RESUME and soak.signalled_at is not None and len(soak.parts) == 1:
                soak.launch(dump)
                print(f"soak: resumed {soak.name}", flush=True)
                continue
            if code != 0:
                soak.error = f"exit code {code} (see {soak.parts[-1]['log']})"
            running.remove(soak)
            print(f"soak: {soak.name} ended (exit {code})", flush=True)
        time.sleep(max(0.0, interval_s - (time.monotonic() - tick)))


def print_report(entries: list[dict[str, Any]], target: float) -> None:
    rows = [("run", "part", "role", "iters", "measured min", "MB/min", "RSS MB warm->end",
             "fds warm->end", "ok")]
    for entry in entries:
        for index, part in enumerate(entry["parts"]):
            for role, r in part.get("roles", {}).items():
                rss = f"{fmt(r['rss_mb_after_warmup'], 0)}->{fmt(r['rss_mb_end'], 0)}"
                fds = f"{fmt(r['fds_after_warmup'], 0)}->{fmt(r['fds_end'], 0)}"
                rows.append((f"{entry['algo']} -n {entry['ranks']}", str(index + 1), role,
                             fmt(entry["iterations"], 0), fmt(part["measured_s"] / 60, 1),
                             fmt(r["slope_mb_per_min"], 2), rss, fds,
                             "yes" if entry["ok"] else "NO"))
    print_table(rows)
    print(f"target: no rank's RSS grows faster than {target:g} MB/min after warm-up; fds flat; "
          f"every iteration exactly once")
    for entry in entries:
        for problem in entry["problems"]:
            print(f"{entry['algo']} -n {entry['ranks']}: {problem}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--minutes", type=float, required=True, help="length of each run")
    parser.add_argument("--algos", help="ALGO or ALGO:N, comma-separated (default: all)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="warm-up before the slope is fitted (default: a quarter of the "
                             "run, at most 5; replay runs also wait for a full buffer)")
    parser.add_argument("--interval-s", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--target", type=float, default=0.5, help="largest slope, MB/min")
    parser.add_argument("--signal-halfway", action="store_true",
                        help="SIGUSR1 halfway through, then resume")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args()
    if args.minutes <= 0 or args.parallel < 1 or args.interval_s <= 0:
        parser.error("--minutes, --parallel and --interval-s must be positive")
    warmup_min = args.warmup_minutes
    if warmup_min is None:
        warmup_min = min(5.0, args.minutes / 4)
    parts_length = args.minutes / 2 if args.signal_halfway else args.minutes
    if warmup_min >= parts_length:
        parser.error(f"--warmup-minutes {warmup_min:g} leaves nothing to measure in a part of "
                     f"{parts_length:g} minutes")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="mpirl-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    plans = parse_algos(args.algos)
    dump = make_dump(work) if any(plan.offline for _, _, plan in plans) else None
    soaks = [Soak(name, algo, plan, work / name, args.minutes, args.signal_halfway)
             for name, algo, plan in plans]
    print(f"soak: {len(soaks)} run(s) of {args.minutes:g} min, {args.parallel} at a time, in "
          f"{work}", flush=True)
    run_soaks(soaks, args.parallel, args.interval_s, dump)
    entries = [analyse(soak, warmup_min * 60, args.target) for soak in soaks]
    print_report(entries, args.target)
    meta = soak_metadata(args)
    write_report({"meta": meta, "runs": entries}, args.json)
    return 0 if all(entry["ok"] for entry in entries) else 1


def soak_metadata(args: argparse.Namespace) -> dict[str, Any]:
    @dataclass
    class Settings:
        minutes: float
        algos: str | None
        parallel: int
        warmup_minutes: float | None
        interval_s: float
        target: float
        signal_halfway: bool

    return run_metadata(False, Settings(args.minutes, args.algos, args.parallel,
                                        args.warmup_minutes, args.interval_s, args.target,
                                        args.signal_halfway), ["mpirl", "torch", "mpi4py"])


if __name__ == "__main__":
    sys.exit(main())
