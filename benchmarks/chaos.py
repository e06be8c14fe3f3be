"""Chaos: training under a seeded schedule of real faults, then checks from the files alone.

    python benchmarks/chaos.py --minutes 60 [--algos PPO,APEX,...] [--seed 0] [--json FILE]
    python benchmarks/chaos.py --quick --json /tmp/chaos.json    # 2-3 minutes, PPO and DQN

Each algorithm trains under ``mpirl launch`` (restarts without limit, 1 s apart) for the set time,
on its layout from ``soak.py`` (docs/algorithms.md's commands), with checkpoints every 3
iterations, trajectory dumps where the algorithm samples, and a run directory on a tmpfs of its
own (so that the disk can be filled on purpose; without the right to mount, the full-disk faults
are left out and the report says why). A schedule drawn from ``--seed`` injects, one at a time and
each once training is under way again:

* ``kill_rank``: kill -9 of a random rank (driver, rollout, replay, learner);
* ``stop_signal``: SIGUSR1 or SIGTERM to the job (through launch, as a scheduler sends it); the
  job must checkpoint and exit 75, and is started again with ``--resume``;
* ``kill_in_checkpoint``: kill -9 of a random rank while a checkpoint is being written (its
  temporary directory exists);
* ``kill_in_resume``: kill -9, then kill -9 again while the next attempt restores;
* ``second_kill``: kill -9, then again within seconds of training having started again;
* ``full_disk``: the run's file system filled for 3-10 s (checkpoints, progress rows and HDF5
  dumps all fail to write), then freed;
* ``env_raises`` and ``env_hangs``: an env step raises, or sleeps past ``stuck_task_timeout_s``
  (``mpirl.testing.TriggeredFaultEnv``).

Afterwards it sends SIGUSR1, checks that the job exits 75, resumes the run once more for one
iteration, and checks from the files:

* every iteration in progress.csv appears exactly once, in order, across all restarts;
* ``timesteps_total`` always grows, and no iteration adds more than twice the median and more
  than every iteration away from a resume did (a step counted twice after a resume would);
* every checkpoint that ``latest`` named while the job ran verified, and the final one resumed;
* every HDF5 dump file opens and every episode of the dump's index reads;
* no process of the job is left (each carries the run's tag in its environment), and no live
  holder keeps ``run.lock``;
* no fault left the job without training for longer than the limit: heartbeat timeout (plus
  ``stuck_task_timeout_s`` for a hung env) to notice, then restart and start-up;
* with ``--baselines K``, the final return lies within the spread of K uninterrupted runs
  (seeds 1..K; the chaos run has seed 0), trained alongside the job for the same time under the
  same load: every return their rows reached over the last tenth of the job's env steps.

Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import errno
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from harness import (
    MPI_ENV,
    THREAD_ENV,
    end_session,
    mpiexec_command,
    print_table,
    run_metadata,
    write_report,
)
from soak import PLANS, Plan

from mpirl.errors import EXIT_RESUME
from mpirl.execution.contract import ALGORITHMS
from mpirl.jobs.checkpoint import CheckpointError, verify
from mpirl.jobs.launch import remove_dead_launchers_session_dirs
from mpirl.runtime.layout import parse_layout_row
from mpirl.testing import FaultTrigger, tagged_processes, tagged_ranks

MPIRL = str(Path(sys.executable).parent / "mpirl")
KINDS = ("kill_rank", "stop_signal", "kill_in_checkpoint", "kill_in_resume", "second_kill",
         "full_disk", "env_raises", "env_hangs")
#: What every chaos run adds to its plan's config: frequent checkpoints, and short timeouts so
#: that a lost or stuck rank is noticed within seconds rather than minutes.
CHAOS_CONFIG = {"checkpoint_every": 3, "heartbeat_timeout_s": 10.0, "stuck_task_timeout_s": 10.0,
                "keep_checkpoints": 3}
RESTART_DELAY_S = 1.0
#: How long a stop signal may take to end the job, beyond the iteration in progress.
STOP_ALLOWANCE_S = 120.0
#: The longest a disk stays full: the job must notice and a restart must fail on it by then.
FULL_DISK_MAX_S = 60.0
#: How long after a fault a row still says nothing about recovery in place: kills are seen by
#: the launcher at once or by the heartbeat; a hung env by the stuck-task check.
SETTLE_S = {
    "kill_rank": CHAOS_CONFIG["heartbeat_timeout_s"] + 2.0,
    "kill_in_checkpoint": CHAOS_CONFIG["heartbeat_timeout_s"] + 2.0,
    "kill_in_resume": CHAOS_CONFIG["heartbeat_timeout_s"] + 2.0,
    "second_kill": CHAOS_CONFIG["heartbeat_timeout_s"] + 2.0,
    "env_hangs": CHAOS_CONFIG["stuck_task_timeout_s"] + 3.0,
    "env_raises": 0.5,
}
#: Start-up and restore after a restart, on a loaded 2-core machine.
START_ALLOWANCE_S = 60.0
#: Algorithms that sample from a gymnasium env (the env faults apply, dumps are written).
SAMPLING = {"PPO", "A2C", "IMPALA", "A3C", "DQN", "APEX", "SAC", "ES", "ARS", "PETS", "MBPO"}
#: Algorithms whose runs write trajectory dumps here.
DUMPING = {"PPO", "A2C", "IMPALA", "A3C", "DQN", "APEX", "SAC"}
QUICK_ALGOS = ("PPO", "DQN")
#: The default: one algorithm of each kind the issue names (policy gradient, async, distributed
#: replay, off-policy actor-critic, evolution, self-play, model-based, multi-agent, population).
DEFAULT_ALGOS = ("PPO", "IMPALA", "APEX", "SAC", "ES", "ALPHAZERO", "PETS", "MULTIAGENT", "PBT")
#: Plans of chaos's own, for algorithms soak.py runs on its default (3 ranks, CartPole-v1): PETS
#: on Pendulum as its docs, but one env a rank, 100 steps an iteration (its 5 envs a rank take 10
#: iterations to end an episode, longer than the gaps between faults: no return to compare).
CHAOS_PLANS = {"PETS": Plan(3, "Pendulum-v1", {"num_envs_per_worker": 1,
                                              "rollout_fragment_length": 100}, algo="PETS")}
#: ``PBT`` is a population under ``mpirl tune`` (docs/tune.md's command, smaller): 2 PPO members
#: of 2 ranks each and the controller, a decision every 4 iterations.
TUNE_NAME = "PBT"
TUNE_PLAN = Plan(5, "CartPole-v1", algo="PPO")
TUNE_OPTIONS = ("--scheduler", "pbt", "--population", "2", "--ranks-per-trial", "2",
                "--perturbation-interval", "4", "--mutations",
                json.dumps({"lr": [1e-4, 3e-4, 1e-3, 3e-3]}), "--metric",
                "episode_return_mean", "--mode", "max")


def now() -> float:
    return time.monotonic()


@dataclass
class Schedule:
    """What a chaos run was asked to do (recorded in the report)."""

    minutes: float
    algos: list[str]
    kinds: list[str]
    seed: int
    gap_s: list[float]
    baselines: int
    fs_mb: int
    ulfm: bool


@dataclass
class Fault:
    kind: str
    at_s: float  # since the run's start
    detail: str = ""
    restarted: bool = False
    #: From the fault to the job's noticing it (the attempt's end), where it ended one.
    detect_s: float | None = None
    #: From the fault to the first progress row written after it (by the next attempt).
    to_training_s: float | None = None
    hang: bool = False
    note: str = ""


@dataclass
class RowEvent:
    t: float
    iteration: int
    timesteps: int
    ranks_lost: int = 0  # rollout_ranks_lost: ranks the run goes on without (ULFM)
    run: str = ""  # the trial's directory name under tune


@dataclass
class ChaosRun:
    """One algorithm's job under chaos: its processes, what it wrote, the faults it got."""

    name: str
    plan: Plan
    workdir: Path
    minutes: float
    rng: random.Random
    kinds: tuple[str, ...]
    gap_s: tuple[float, float]
    fs_mb: int
    #: Inject each kind this many times (in a shuffled order), then stop; 0: until time is up.
    per_kind: int = 0
    #: Launch with Open MPI's ULFM (``--with-ft ulfm``): a lost rollout rank is survived in place.
    ulfm: bool = False
    #: Uninterrupted runs (seeds 1..K) trained alongside, under the same load, to compare with.
    baselines: int = 0
    baseline_jobs: list[tuple[Path, subprocess.Popen]] = field(default_factory=list)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    mounted: bool = False
    mount_note: str = ""
    launch: subprocess.Popen | None = None
    launches: int = 0
    launch_started: float = 0.0
    launch_codes: list[int] = field(default_factory=list)
    #: Set from --start-allowance for every run.
    start_allowance_s: ClassVar[float] = START_ALLOWANCE_S
    attempts: list[float] = field(default_factory=list)  # when launch began each restart
    survived: list[float] = field(default_factory=list)  # when the job said it went on (ULFM)
    #: When a new launch or the final resume began (the job resumed, as at an attempt).
    relaunched: list[float] = field(default_factory=list)
    rows: list[RowEvent] = field(default_factory=list)
    latest_seen: dict[str, str] = field(default_factory=dict)  # checkpoint -> "ok" or error
    swapped_reads: int = 0  # reads that a commit of the same name swapped, done again
    faults: list[Fault] = field(default_factory=list)
    started: float = 0.0
    problems: list[str] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop_monitor: threading.Event = field(default_factory=threading.Event)

    # --- where things are --------------------------------------------------------------------
    @property
    def fs(self) -> Path:
        return self.workdir / "fs"

    @property
    def run_dir(self) -> Path:
        return self.fs / "run"

    @property
    def dump_dir(self) -> Path:
        return self.fs / "dumps"

    @property
    def trigger_dir(self) -> Path:
        return self.workdir / "triggers"

    @property
    def algo(self) -> str:
        return self.plan.algo or self.name

    @property
    def tune(self) -> bool:
        return self.name == TUNE_NAME

    def run_dirs(self) -> list[Path]:
        """The run directories to check: the run's, or each trial's under tune."""
        if self.tune:
            return sorted(p for p in self.run_dir.glob("trial_*") if p.is_dir())
        return [self.run_dir]

    def mpiexec(self, *command: str) -> list[str]:
        words = mpiexec_command(self.plan.ranks, MPIRL, *command)
        return [words[0], "--with-ft", "ulfm", *words[1:]] if self.ulfm else words

    @property
    def multiagent(self) -> bool:
        return bool(self.plan.config.get("multiagent"))

    @property
    def samples_env(self) -> bool:
        """True where the job's envs can be told to fail (``FaultTrigger``): the sampling
        algorithms' and multi-agent compositions' (not AlphaZero's games)."""
        return self.algo.upper() in SAMPLING or self.multiagent

    def elapsed(self) -> float:
        return now() - self.started

    # --- the job -----------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        config = {**self.plan.config, **CHAOS_CONFIG}
        if (self.algo.upper() in DUMPING and not self.plan.config.get("multiagent")
                and not self.tune):
            config["dump_trajectories"] = str(self.dump_dir)
        return config

    def env_args(self) -> list[str]:
        if not self.samples_env:
            return ["--env", self.plan.env]
        if self.multiagent:
            return ["--env", "mpirl.testing:TriggeredFaultMultiAgentEnv"]
        return ["--env", "mpirl.testing:TriggeredFaultEnv"]

    def train_args(self, seed: int, run_dir: Path, triggers: Path) -> list[str]:
        config = self.config()
        if self.samples_env:
            inner = {"env": self.plan.env} if self.multiagent else {"env_id": self.plan.env}
            config["env_config"] = {**config.get("env_config", {}), **inner,
                                    "trigger_dir": str(triggers)}
        return ["train", "--algo", self.algo, *self.env_args(), "--config", json.dumps(config),
                "--seed", str(seed), "--run-dir", str(run_dir), "--progress", "off"]

    def environment(self) -> dict[str, str]:
        return {**os.environ, **MPI_ENV, **THREAD_ENV, "MPIRL_CHAOS_TAG": self.tag}

    def first_job(self, seed: int, run_dir: Path, triggers: Path) -> list[str]:
        """The job's first command after ``mpirl``: training until stopped."""
        forever = ["--stop", json.dumps({"timesteps_total": 10**12})]
        train = self.train_args(seed, run_dir, triggers)
        if not self.tune:
            return [*train, *forever]
        del train[train.index("--run-dir"):train.index("--run-dir") + 2]
        job = ["tune", *TUNE_OPTIONS, "--run-dir", str(run_dir), "--", *train[1:], *forever]
        del job[job.index("--progress"):job.index("--progress") + 2]
        return job

    def start_baselines(self) -> None:
        """The uninterrupted runs, seeds 1..K, each as the job's first command without dumps
        or faults (the env wrapper stays, never triggered); untagged, so not the job's own."""
        for seed in range(1, self.baselines + 1):
            directory = self.workdir / f"baseline-{seed}"
            job = self.first_job(seed, directory, self.workdir / "no-triggers")
            config = json.loads(job[job.index("--config") + 1])
            config.pop("dump_trajectories", None)
            job[job.index("--config") + 1] = json.dumps(config)
            log = open(self.workdir / f"baseline-{seed}.log", "w")  # noqa: SIM115
            self.baseline_jobs.append((directory, subprocess.Popen(
                mpiexec_command(self.plan.ranks, MPIRL, *job), stdout=log,
                stderr=subprocess.STDOUT, env={**os.environ, **MPI_ENV, **THREAD_ENV},
                start_new_session=True)))

    def stop_baselines(self) -> None:
        for _, proc in self.baseline_jobs:
            if proc.poll() is None:
                end_session(proc)
            else:
                self.problems.append(f"an uninterrupted run ended by itself with "
                                     f"{proc.returncode}")

    def baseline_returns(self, steps: float) -> dict[str, Any]:
        """From the uninterrupted runs' files: each run's return at ``steps`` env steps (a
        trial's, under tune), and every return their rows reached over the last
        ``BASELINE_STRETCH`` of those steps (of their own, where one fell short of them)."""
        finals: list[float | None] = []
        stretch: list[float] = []
        reached: list[int] = []
        for directory, _ in self.baseline_jobs:
            dirs = sorted(directory.glob("trial_*")) if self.tune else [directory]
            for run_dir in dirs:
                _, timesteps, values = read_progress(run_dir / "progress.csv")
                rows = [(t, v) for t, v in zip(timesteps, values, strict=True) if t <= steps]
                reached.append(max(timesteps, default=0))
                top = rows[-1][0] if rows else 0
                stretch += [v for t, v in rows
                            if t >= (1 - BASELINE_STRETCH) * top and math.isfinite(v)]
                finals.append(last_finite([v for _, v in rows]))
        return {"finals": finals, "stretch": stretch, "steps_reached": reached}

    def start_launch(self) -> None:
        if self.launches and self.tune:
            job = ["tune", "--resume", str(self.run_dir)]
        elif self.launches:
            job = ["train", "--resume", str(self.run_dir), "--progress", "off"]
        else:
            job = self.first_job(0, self.run_dir, self.trigger_dir)
        command = [MPIRL, "launch", "--max-restarts", "100000", "--restart-delay",
                   str(RESTART_DELAY_S), "--", *self.mpiexec(*job)]
        log = open(self.workdir / f"launch{self.launches}.log", "w")  # noqa: SIM115
        self.launch = subprocess.Popen(command, stdout=log, stderr=subprocess.PIPE, text=True,
                                       env=self.environment(), start_new_session=True)
        if self.launches:
            self.relaunched.append(now())
        self.launches += 1
        self.launch_started = now()
        threading.Thread(target=self._read_launch, args=(self.launch, log), daemon=True).start()

    def _read_launch(self, proc: subprocess.Popen, log: Any) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.write(f"[{self.elapsed():8.2f}] {line}")
            log.flush()
            # Not startswith: the launcher's last note may leave the line unfinished.
            if "mpirl launch: attempt " in line and " previous attempt " in line:
                with self._lock:
                    self.attempts.append(now())
            elif "(survive_rollout_loss)" in line:
                with self._lock:
                    self.survived.append(now())
        log.close()

    def stop_allowance_s(self) -> float:
        """How long a stop signal may take to end the job: it checkpoints when the iteration in
        progress ends, so ``STOP_ALLOWANCE_S`` plus the longest iteration seen."""
        return STOP_ALLOWANCE_S + self.longest_iteration_s()

    def longest_iteration_s(self) -> float:
        """The longest time between two consecutive rows of one run (PETS's iterations took
        2-4 minutes at load 25): a fault's limits allow for one more."""
        longest = 0.0
        with self._lock:
            by_run: dict[str, list[RowEvent]] = {}
            for row in self.rows:
                by_run.setdefault(row.run, []).append(row)
        for rows in by_run.values():
            longest = max([longest, *(b.t - a.t for a, b in itertools.pairwise(rows)
                                      if b.iteration == a.iteration + 1)])
        return longest

    def wait_launch(self, timeout_s: float) -> int | None:
        assert self.launch is not None
        try:
            code = self.launch.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self.launch_codes.append(code)
        return code

    # --- watching ----------------------------------------------------------------------------
    def monitor(self) -> None:
        """Every 0.1 s: each run directory's last progress row, and the checkpoint its
        ``latest`` names (verified)."""
        last_lines: dict[str, str] = {}
        while not self._stop_monitor.wait(0.1):
            for run_dir in self.run_dirs():
                line = last_complete_row(run_dir / "progress.csv")
                if line and line[1] != last_lines.get(run_dir.name):
                    last_lines[run_dir.name] = line[1]
                    with self._lock:
                        self.rows.append(RowEvent(now(), *line[0], run=run_dir.name))
                self.check_latest(run_dir)

    def check_latest(self, run_dir: Path) -> None:
        try:
            name = (run_dir / "checkpoints" / "latest").read_text().strip()
        except OSError:
            return
        key = f"{run_dir.name}/{name}" if self.tune else name
        if not name or key in self.latest_seen:
            return
        path = run_dir / "checkpoints" / name
        try:
            before = path.stat().st_ino
            verify(path)
            self.latest_seen[key] = "ok"
        except CheckpointError as error:
            # A checkpoint of the same name committed meanwhile (PBT's exploit puts the
            # winner's copy in place of the loser's own at the same iteration) swaps the
            # directory by a rename while it is read: the old manifest against new files.
            # That one is checked afresh next time; a damaged one stays the same directory.
            with contextlib.suppress(OSError):
                if path.stat().st_ino == before:
                    self.latest_seen[key] = f"failed to verify: {error}"
                else:
                    self.swapped_reads += 1
        except OSError:
            pass  # pruned while being read; its successor is checked next time

    def rows_after(self, t: float) -> list[RowEvent]:
        with self._lock:
            return [row for row in self.rows if row.t > t]

    def attempts_after(self, t: float) -> list[float]:
        with self._lock:
            return [a for a in self.attempts if a > t]

    def current_pids(self) -> dict[int, tuple[int, str]]:
        """rank -> (pid, role) of the running attempt, once its start-up table is printed
        (under tune, once all its ranks run: the controller and the trials' ranks)."""
        if self.tune:
            ranks = self.tagged_ranks()
            if len(ranks) < self.plan.ranks:
                return {}
            return {rank: (pid, "controller" if rank == 0 else "trial")
                    for rank, pid in ranks.items()}
        log = self.run_dir / "output.log"
        try:
            text = log.read_text(errors="replace")
        except OSError:
            return {}
        rows = [row for line in text.rsplit("\n--- ", 1)[-1].splitlines()
                if (row := parse_layout_row(line))]
        return {row["rank"]: (row["pid"], row["role"]) for row in rows if self.is_ours(row["pid"])}

    def tagged_processes(self) -> list[tuple[int, bytes, list[str]]]:
        """(pid, environment, stat fields) of every live process that carries this run's tag."""
        return tagged_processes("MPIRL_CHAOS_TAG", self.tag)

    def tagged_ranks(self) -> dict[int, int]:
        """world rank -> pid of the job's live ranks, from their environments."""
        return tagged_ranks("MPIRL_CHAOS_TAG", self.tag)

    def is_ours(self, pid: int) -> bool:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False
        return f"MPIRL_CHAOS_TAG={self.tag}".encode() in environ

    def leftover_processes(self) -> list[int]:
        return [pid for pid, _, _ in self.tagged_processes()]

    # --- waiting ----------------------------------------------------------------------------
    def wait_for(self, condition, timeout_s: float, poll_s: float = 0.05) -> bool:
        deadline = now() + timeout_s
        while now() < deadline:
            if condition():
                return True
            if self.launch is not None and self.launch.poll() is not None:
                return bool(condition())
            time.sleep(poll_s)
        return False

    def wait_training(self, fault: Fault, t0: float, limit_s: float) -> None:
        """Fill in ``fault``'s detection and recovery times; mark it a hang past ``limit_s``.

        A fault that ends the attempt counts as recovered at the next attempt's first row. One
        that the job survives in place (an env that raised; a rank lost under ULFM) counts at
        the first row after it has had time to end the attempt (``settle_s``), since a row
        already under way when the fault struck says nothing."""
        deadline = t0 + limit_s
        settle = t0 + SETTLE_S.get(fault.kind, 0.0)
        with self._lock:
            lost_before = max((row.ranks_lost for row in self.rows), default=0)
        while now() < deadline:
            attempts = self.attempts_after(t0)
            if attempts:
                fault.restarted = True
                fault.detect_s = round(attempts[0] - t0, 2)
                rows = self.rows_after(attempts[0])
            else:
                # A rank lost and survived in place (ULFM) shows in the row's count at once.
                rows = [row for row in self.rows_after(t0) if row.ranks_lost > lost_before]
                if rows:
                    # Noticed when the job said so; its row may come an iteration later.
                    fault.note = "survived in place"
                    with self._lock:
                        said = [t for t in self.survived if t > t0]
                    fault.detect_s = round((said[0] if said else rows[0].t) - t0, 2)
                elif now() > settle:
                    rows = self.rows_after(settle)
            if rows:
                fault.to_training_s = round(rows[0].t - t0, 2)
                return
            if self.launch is not None and self.launch.poll() is not None:
                code = self.launch.returncode
                if code != EXIT_RESUME or fault.kind != "stop_signal":
                    fault.note = f"launch exited {code}"
                    return
            time.sleep(0.05)
        fault.hang = True
        fault.note = f"no progress row within {limit_s:.0f} s of the fault"

    # --- faults -----------------------------------------------------------------------------
    def kill_random_rank(self, roles: set[str] | None = None) -> str:
        pids = self.current_pids()
        choices = [(rank, pid, role) for rank, (pid, role) in sorted(pids.items())
                   if roles is None or role in roles]
        if not choices:
            return ""
        # A role first, then one of its ranks: the one driver is struck as often as any role.
        role = self.rng.choice(sorted({role for _, _, role in choices}))
        rank, pid, role = self.rng.choice([c for c in choices if c[2] == role])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return ""
        return f"rank {rank} ({role}, pid {pid})"

    def wait_pids(self, since: float, timeout_s: float) -> bool:
        """Wait for an attempt started after ``since`` to print its start-up table."""
        def ready() -> bool:
            # current_pids keeps only live, tagged pids: the killed attempt's table yields none.
            return bool(self.attempts_after(since)) and bool(self.current_pids())
        return self.wait_for(ready, timeout_s)

    def wait_steady(self, timeout_s: float) -> bool:
        """Wait until the running attempt has printed its ranks and written a row."""
        def steady() -> bool:
            attempts = self.attempts_after(0.0)
            since = max([self.launch_started, *attempts])
            return bool(self.current_pids()) and bool(self.rows_after(since))
        return self.wait_for(steady, timeout_s)

    def inject(self, kind: str, limit_s: float) -> Fault:
        fault = Fault(kind, round(self.elapsed(), 2))
        t0 = now()
        if kind == "kill_rank":
            fault.detail = self.kill_random_rank()
            t0 = now()
        elif kind == "stop_signal":
            sig = self.rng.choice([signal.SIGUSR1, signal.SIGTERM])
            assert self.launch is not None
            if self.tune:  # during a PBT decision: right after its line is written
                decisions = self.run_dir / "pbt.jsonl"
                before = file_lines(decisions)
                self.wait_for(lambda: file_lines(decisions) > before, 120.0, poll_s=0.005)
                fault.detail = "after a PBT decision, "
                fault.at_s = round(self.elapsed(), 2)
            os.kill(self.launch.pid, sig)
            allowance = self.stop_allowance_s()
            code = self.wait_launch(allowance)
            fault.detail += f"{sig.name} to launch: exit {code}"
            if code is None:
                # Never start a job on top of one still running: the second only finds the
                # run directory in use.
                fault.hang = True
                fault.note = f"the job did not stop within {allowance:.0f} s of {sig.name}"
                return fault
            if code != EXIT_RESUME:
                fault.note = f"exit {code}, not {EXIT_RESUME}"
            t0 = now()
            self.start_launch()
            fault.restarted = True
            fault.detect_s = 0.0
            self.wait_training(fault, t0, limit_s)
            fault.to_training_s = None if fault.to_training_s is None else round(
                fault.to_training_s + (t0 - (self.started + fault.at_s)), 2)
            return fault
        elif kind == "kill_in_checkpoint":
            fault.detail = self.kill_in_checkpoint()
            fault.at_s = round(self.elapsed(), 2)
            t0 = now()
        elif kind in ("kill_in_resume", "second_kill"):
            first = self.kill_random_rank()
            t_first = now()
            if kind == "kill_in_resume":
                if self.wait_pids(t_first, limit_s):
                    time.sleep(self.rng.uniform(0.0, 0.5))
                    second = self.kill_random_rank()
                    fault.detail = f"{first}, then {second} while it restored"
                    if self.rows_after(self.attempts_after(t_first)[0]):
                        fault.note = "the second kill came after the first row"
                else:
                    fault.detail = f"{first}; no restart to kill"
            else:
                probe = Fault(kind, fault.at_s)
                self.wait_training(probe, t_first, limit_s)
                time.sleep(self.rng.uniform(0.5, 3.0))
                fault.detail = f"{first}, then {self.kill_random_rank()} " \
                               f"{probe.to_training_s} s later"
            t0 = now()
        elif kind == "full_disk":
            # Full until the attempt that notices has ended and the restart has failed on the
            # full disk too (as on a cluster, where nobody frees the space in seconds), then a
            # little longer.
            t_fill = now()
            filled = fill_disk(self.fs)
            self.wait_for(lambda: len(self.attempts_after(t_fill)) >= 2, FULL_DISK_MAX_S)
            time.sleep(self.rng.uniform(0.0, 3.0))
            failed = len(self.attempts_after(t_fill))
            filled.unlink()
            fault.detail = f"full for {now() - t_fill:.1f} s; {failed} attempt(s) ended on it"
            if failed < 2:
                fault.note = f"only {failed} attempt(s) ended on the full disk"
            t0 = now()  # recovery is counted from the moment the disk has room again
        elif kind in ("env_raises", "env_hangs"):
            what = "raise" if kind == "env_raises" else "hang"
            trigger = self.trigger_dir / FaultTrigger.NAME
            tmp = self.trigger_dir / f"{FaultTrigger.NAME}.tmp"
            tmp.write_text(what)
            os.replace(tmp, trigger)
            # The fault begins when an env claims the trigger at its next step, which load can
            # delay by seconds: the time to notice counts from then.
            claimed = self.wait_for(lambda: not trigger.exists(), 60.0, poll_s=0.01)
            fault.detail = what if claimed else f"{what} (no env claimed it within 60 s)"
            t0 = now()
        self.wait_training(fault, t0, limit_s)
        return fault

    def kill_in_checkpoint(self) -> str:
        """Kill -9 a random rank while a checkpoint's temporary directory exists."""
        roots = [d / "checkpoints" for d in self.run_dirs()]
        deadline = now() + 60.0
        while now() < deadline:
            if any(checkpoint_being_written(root) for root in roots):
                return self.kill_random_rank() + " while a checkpoint was written"
            time.sleep(0.0005)
        return self.kill_random_rank() + " (no checkpoint write seen within 60 s)"

    # --- the run ----------------------------------------------------------------------------
    def run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.trigger_dir.mkdir(exist_ok=True)
        self.fs.mkdir(exist_ok=True)
        self.mounted, self.mount_note = mount_tmpfs(self.fs, self.fs_mb)
        kinds = [k for k in self.kinds if k != "full_disk" or self.mounted]
        if not self.samples_env:
            kinds = [k for k in kinds if not k.startswith("env_")]
        limit_s = CHAOS_CONFIG["heartbeat_timeout_s"] + CHAOS_CONFIG["stuck_task_timeout_s"] + \
            RESTART_DELAY_S + self.start_allowance_s
        self.started = now()
        monitor = threading.Thread(target=self.monitor, daemon=True)
        monitor.start()
        try:
            self.start_launch()
            self.start_baselines()
            if not self.wait_for(lambda: bool(self.rows), self.start_allowance_s * 2):
                self.problems.append("no first progress row")
                return
            end = self.started + self.minutes * 60
            if self.per_kind:
                order = iter(self.rng.sample(kinds * self.per_kind, len(kinds) * self.per_kind))
            else:
                order = itertools.cycle(self.rng.sample(kinds, len(kinds)))
            for kind in order:
                gap = self.rng.uniform(*self.gap_s)
                if now() + gap >= end:
                    if self.per_kind:
                        self.problems.append("time ran out before every fault was injected")
                    break
                time.sleep(gap)
                if self.launch is not None and self.launch.poll() is not None:
                    self.problems.append(f"launch ended by itself with {self.launch.returncode}")
                    break
                allowed_s = limit_s + self.longest_iteration_s()
                if not self.wait_steady(allowed_s):
                    self.problems.append(f"not training {allowed_s:.0f} s after the last fault")
                    break
                fault = self.inject(kind, allowed_s)
                self.faults.append(fault)
                if fault.hang or (fault.note and fault.note.startswith("launch exited")):
                    break
            self.stop_baselines()
            self.stop_and_resume()
        finally:
            if self.launch is not None and self.launch.poll() is None:
                end_session(self.launch)
            for _, proc in self.baseline_jobs:
                if proc.poll() is None:
                    end_session(proc)
            self._stop_monitor.set()
            monitor.join()

    def stop_and_resume(self) -> None:
        """SIGUSR1 to launch (exit 75 expected), then one more iteration with ``--resume``."""
        assert self.launch is not None
        if self.launch.poll() is not None:  # ended already: a problem found before says why
            self.final["stop_exit"] = None
            self.problems.append(f"the job had ended with {self.launch.returncode} before the "
                                 f"final SIGUSR1")
        else:
            os.kill(self.launch.pid, signal.SIGUSR1)
            code = self.final["stop_exit"] = self.wait_launch(self.stop_allowance_s())
            if code != EXIT_RESUME:
                self.problems.append(f"the final SIGUSR1 ended the job with {code}, not "
                                     f"{EXIT_RESUME}")
        iteration = max((row[0][0] for d in self.run_dirs()
                         if (row := last_complete_row(d / "progress.csv"))), default=0)
        # One more iteration of every trial (MPIRL_MAX_ITERATIONS ends a run there, whatever
        # its --stop says, and tune counts such a trial as finished).
        job = ("tune", "--resume", str(self.run_dir)) if self.tune else (
            "train", "--resume", str(self.run_dir), "--progress", "off")
        self.relaunched.append(now())
        proc = subprocess.run(self.mpiexec(*job), capture_output=True, text=True, timeout=300,
                              env={**self.environment(),
                                   "MPIRL_MAX_ITERATIONS": str(iteration + 1)})
        self.final["resume_exit"] = proc.returncode
        if proc.returncode != 0:
            self.problems.append(f"the final resume exited {proc.returncode}: "
                                 f"{proc.stderr.strip()[-500:]}")

    # --- the checks, from the files alone ---------------------------------------------------
    def check(self) -> dict[str, Any]:
        report: dict[str, Any] = {"algo": self.algo, "ranks": self.plan.ranks,
                                  "env": self.plan.env, "minutes": self.minutes,
                                  "ulfm": self.ulfm, "iterations": 0, "iterations_lost": 0,
                                  "iterations_repeated": 0, "timesteps_total": 0}
        finals = []
        for run_dir in self.run_dirs() or [self.run_dir]:
            final = self.check_progress(run_dir, report)
            if final is not None:
                finals.append(final)
        report["final_return"] = round(statistics.mean(finals), 2) if finals else None
        bad = {name: why for name, why in self.latest_seen.items() if why != "ok"}
        report["checkpoints_seen"] = len(self.latest_seen)
        report["checkpoints_read_again"] = self.swapped_reads
        unreadable = [f"checkpoint {name}: {why}" for name, why in bad.items()]
        if self.dump_dir.exists():
            dump = check_dump(self.dump_dir)
            report["dump"] = dump
            unreadable += dump["unreadable"]
        report["unreadable_files"] = len(unreadable)
        if unreadable:
            self.problems.extend(unreadable[:10])
        left = self.leftover_processes()
        report["processes_left"] = len(left)
        if left:
            self.problems.append(f"processes left running: {left}")
        lock = next((held for d in [self.run_dir, *self.run_dirs()]
                     if (held := lock_holder(d))), None)
        report["lock_left"] = lock
        if lock:
            self.problems.append(f"run.lock still held: {lock}")
        faults = [vars(f) for f in self.faults]
        report["faults"] = faults
        report["faults_injected"] = len(faults)
        report["recoveries"] = sum(1 for f in self.faults if f.to_training_s is not None)
        report["hangs"] = sum(1 for f in self.faults if f.hang)
        times = [f.to_training_s for f in self.faults if f.to_training_s is not None]
        report["longest_to_training_s"] = max(times, default=None)
        detects = [f.detect_s for f in self.faults if f.detect_s is not None]
        report["longest_detect_s"] = max(detects, default=None)
        for f in self.faults:
            if f.detect_s is not None and f.kind in SETTLE_S and f.detect_s > SETTLE_S[f.kind]:
                f.hang = True
                f.note = f"the job took {f.detect_s} s to notice (limit {SETTLE_S[f.kind]} s)"
            if f.to_training_s is None and not f.hang:
                self.problems.append(f"{f.kind} at {f.at_s} s: training did not start again "
                                     f"({f.note})")
            elif f.hang:
                self.problems.append(f"{f.kind} at {f.at_s} s: {f.note}")
        tracebacks = [log.name for log in sorted(self.workdir.glob("launch*.log"))
                      if "Traceback (most recent call last)" in log.read_text(errors="replace")]
        if tracebacks:
            self.problems.append(f"a traceback reached the job's output: {tracebacks}")
        report["full_disk"] = "on" if self.mounted else f"left out: {self.mount_note}"
        report["launch_exits"] = self.launch_codes
        report["final"] = self.final
        return report

    def check_progress(self, run_dir: Path, report: dict[str, Any]) -> float | None:
        """Check one progress.csv, adding to ``report``'s counts; returns the last return."""
        iterations, timesteps, returns = read_progress(run_dir / "progress.csv")
        where = f"{run_dir.name}/progress.csv" if self.tune else "progress.csv"
        report["iterations"] += len(iterations)
        lost = sorted(set(range(1, max(iterations, default=0) + 1)) - set(iterations))
        repeated = sorted({i for i in iterations if iterations.count(i) > 1})
        report["iterations_lost"] += len(lost)
        report["iterations_repeated"] += len(repeated)
        if iterations != list(range(1, len(iterations) + 1)):
            self.problems.append(f"{where}'s iterations are not 1..N once each: lost "
                                 f"{lost[:10]}, repeated {repeated[:10]}")
        steps = [b - a for a, b in itertools.pairwise(timesteps)]
        report["timesteps_total"] += timesteps[-1] if timesteps else 0
        if any(d <= 0 for d in steps):
            self.problems.append(f"{where}: timesteps_total went backwards or stood still")
        if steps:
            # A step counted twice shows in an iteration just after a resume: one that adds
            # over twice the median, and more than any iteration away from a resume did (some
            # algorithms' iterations vary that much: IMPALA's take every finished fragment).
            near = self.near_resume(run_dir.name)
            usual = [d for i, d in zip(iterations[1:], steps, strict=True) if i not in near]
            median, worst = statistics.median(steps), max(steps)
            if median > 0:  # steps that stood still are flagged above
                report["max_step_ratio"] = max(report.get("max_step_ratio") or 0,
                                               round(worst / median, 2))
                if worst > max(2 * median, max(usual, default=0)):
                    self.problems.append(f"{where}: an iteration added {worst} steps, over "
                                         f"twice the median {median} and more than any "
                                         f"iteration away from a resume: counted twice?")
        return last_finite(returns)

    def near_resume(self, run: str) -> set[int]:
        """The iterations a resume may have touched in ``run``: for each restart, the first
        row seen after it and the checkpoint interval before (the monitor may miss a row)."""
        with self._lock:
            rows = [row for row in self.rows if row.run == run]
            starts = [*self.attempts, *self.relaunched]
        near: set[int] = set()
        reach = CHAOS_CONFIG["checkpoint_every"] + 1
        for start in starts:
            first = next((row.iteration for row in rows if row.t > start), None)
            if first is not None:
                near.update(range(first - reach, first + 1))
        return near

    def cleanup(self) -> None:
        if self.mounted:
            keep = self.workdir / "run-copy"
            subprocess.run(["cp", "-a", str(self.run_dir), str(keep)], check=False)
            subprocess.run(["umount", "-l", str(self.fs)], check=False)


# --- helpers ----------------------------------------------------------------------------------
def mount_tmpfs(path: Path, size_mb: int) -> tuple[bool, str]:
    """Mount a tmpfs of ``size_mb`` at ``path`` (needs root and the right to mount)."""
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return False, (proc.stderr.strip() or f"mount exited {proc.returncode}")[:200]
    return True, ""


def fill_disk(root: Path) -> Path:
    """Fill the file system of ``root`` to the last byte; returns the file to delete."""
    filler = root / ".chaos-filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as out:
        for size in (1 << 20, 1 << 12, 1):
            piece = chunk[:size]
            while True:
                try:
                    out.write(piece)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
    return filler


def checkpoint_being_written(root: Path) -> bool:
    """Whether a checkpoint's temporary directory exists under ``root``."""
    try:
        return any(e.name.startswith(".tmp-checkpoint_") for e in os.scandir(root))
    except OSError:
        return False


def file_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def last_complete_row(progress: Path) -> tuple[tuple[int, int, int], str] | None:
    """((iteration, timesteps_total, rollout_ranks_lost), line) of progress.csv's last
    complete row."""
    try:
        with open(progress, "rb") as file:
            header = file.readline().decode().strip().split(",")
            size = os.path.getsize(progress)
            file.seek(max(0, size - 8192))
            tail = file.read().decode(errors="replace")
    except OSError:
        return None
    if not tail.endswith("\n"):
        tail = tail.rsplit("\n", 1)[0]
    for line in reversed(tail.splitlines()):
        cells = line.split(",")
        if len(cells) == len(header) and cells[0].isdigit():
            try:
                lost = (int(float(cells[header.index("rollout_ranks_lost")] or 0))
                        if "rollout_ranks_lost" in header else 0)
                return ((int(cells[header.index("iteration")]),
                         int(float(cells[header.index("timesteps_total")])), lost), line)
            except ValueError:
                return None
    return None


def read_progress(progress: Path) -> tuple[list[int], list[int], list[float]]:
    iterations, timesteps, returns = [], [], []
    try:
        with open(progress) as file:
            for row in csv.DictReader(file):
                iterations.append(int(row["iteration"]))
                timesteps.append(int(float(row["timesteps_total"])))
                value = row.get("episode_return_mean") or "nan"
                returns.append(float(value))
    except (OSError, KeyError, ValueError):
        pass
    return iterations, timesteps, returns


def last_finite(values: list[float]) -> float | None:
    """The newest return that is a number: a row before any episode has ended since a restart
    (PETS's 200-step episodes span iterations) has none."""
    return next((v for v in reversed(values) if math.isfinite(v)), None)


def check_dump(directory: Path) -> dict[str, Any]:
    """Open every HDF5 file of a dump, and read every episode its index lists."""
    import h5py

    from mpirl.data.reader import open_dataset

    unreadable = []
    files = sorted(directory.rglob("*.hdf5"))
    for path in files:
        try:
            with h5py.File(path, "r"):
                pass
        except OSError as error:
            unreadable.append(f"{path.name}: {error}")
    episodes = 0
    try:
        with open_dataset(directory) as dataset:
            for i in range(dataset.num_episodes):
                try:
                    episode = dataset.episode(i)
                    for value in vars(episode).values() if hasattr(episode, "__dict__") else ():
                        _ = getattr(value, "shape", None)
                    episodes += 1
                except Exception as error:  # noqa: BLE001 - any failure to read is the finding
                    unreadable.append(f"episode {i}: {type(error).__name__}: {error}")
    except Exception as error:  # noqa: BLE001
        unreadable.append(f"the dump does not open: {type(error).__name__}: {error}")
    return {"files": len(files), "episodes": episodes, "unreadable": unreadable}


def lock_holder(run_dir: Path) -> str | None:
    """The live holder of ``run.lock``, or None."""
    lock = run_dir / "run.lock"
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    pid = holder.get("pid")
    if isinstance(pid, int) and Path(f"/proc/{pid}").exists():
        return f"pid {pid}"
    return None


#: The stretch of an uninterrupted run whose returns make up the spread: its last tenth of the
#: chaos run's env steps (one row per run would make a spread of K points, which an unharmed
#: run falls outside of half the time with K = 3).
BASELINE_STRETCH = 0.1


def compare_with_baselines(run: ChaosRun, report: dict[str, Any],
                           baselines: dict[str, Any]) -> None:
    """The final return against the uninterrupted runs' spread, into ``report``; a problem
    for ``run`` where it lies outside."""
    report["baseline_returns"] = baselines["finals"]
    report["baseline_steps_reached"] = baselines.get("steps_reached")
    spread, final = baselines["stretch"], report["final_return"]
    if final is None:
        return
    if not spread:
        run.problems.append("no uninterrupted run reached a return to compare with")
        return
    report["baseline_spread"] = [round(min(spread), 2), round(max(spread), 2)]
    report["within_spread"] = min(spread) <= final <= max(spread)
    if not report["within_spread"]:
        run.problems.append(f"final return {final:.1f} is outside the uninterrupted runs' "
                            f"{min(spread):.1f}..{max(spread):.1f} over their last "
                            f"{BASELINE_STRETCH:.0%} of the steps")


def known_plans() -> dict[str, Plan]:
    """Every algorithm that trains online, by name: soak.py's plans (docs/algorithms.md's
    commands), ``CHAOS_PLANS``, 3 ranks on CartPole-v1 for the rest, and ``PBT``."""
    plans = {name.upper(): Plan(3, algo=name) for name in ALGORITHMS}
    plans.update(PLANS)
    plans.update(CHAOS_PLANS)
    plans = {name: plan for name, plan in plans.items() if not plan.offline}
    return {**plans, TUNE_NAME: TUNE_PLAN}


def parse_algos(text: str | None, quick: bool) -> list[tuple[str, Plan]]:
    plans = known_plans()
    names = (text.split(",") if text else list(QUICK_ALGOS) if quick
             else list(DEFAULT_ALGOS))
    chosen = []
    for name in names:
        key = name.strip().upper()
        if key not in plans:
            raise SystemExit(f"chaos: unknown or offline algorithm {name!r}; choose from "
                             f"{', '.join(plans)}")
        chosen.append((key, plans[key]))
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0,
                        help="how long each algorithm trains under faults (60)")
    parser.add_argument("--algos", help="comma-separated (default: "
                        f"{','.join(DEFAULT_ALGOS)}; any online algorithm, MULTIAGENT or PBT)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"the faults to inject (default: all of {', '.join(KINDS)})")
    parser.add_argument("--seed", type=int, default=0,
                        help="draws the schedule, the ranks struck and the run's seed (0)")
    parser.add_argument("--gap", default="20,60", help="seconds between faults, MIN,MAX")
    parser.add_argument("--baselines", type=int, default=2,
                        help="uninterrupted runs trained alongside each job, under the same "
                        "load, to compare its final return with at the same env steps (2)")
    parser.add_argument("--fs-mb", type=int, default=1024,
                        help="size of each run's tmpfs (MB)")
    parser.add_argument("--workdir", type=Path,
                        help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--parallel", type=int, default=0,
                        help="runs at once (default: all); each algorithm runs --minutes")
    parser.add_argument("--start-allowance", type=float, default=START_ALLOWANCE_S,
                        help="seconds a restart may take to train again (start-up and restore) "
                        "before the fault counts as a hang; raise it on a crowded machine")
    parser.add_argument("--ulfm", action="store_true",
                        help="launch with Open MPI's ULFM (--with-ft ulfm)")
    parser.add_argument("--per-kind", type=int, default=0,
                        help="inject each kind N times, then stop (0: until --minutes is up)")
    parser.add_argument("--quick", action="store_true",
                        help="PPO and DQN side by side, each kind of fault once, 1-3 s apart")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.minutes = min(args.minutes, 5.0)
        args.per_kind = args.per_kind or 1
        args.gap = "1,3"
        args.baselines = 0
        args.fs_mb = min(args.fs_mb, 256)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    ChaosRun.start_allowance_s = args.start_allowance
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"chaos: unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    gap = tuple(float(x) for x in args.gap.split(","))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mpirl-chaos-"))
    runs = [ChaosRun(name, plan, workdir / name, args.minutes,
                     random.Random(f"{args.seed}-{name}"), kinds, gap, args.fs_mb, args.per_kind,
                     args.ulfm, args.baselines)
            for name, plan in parse_algos(args.algos, args.quick)]
    pending = list(runs)
    running: list[threading.Thread] = []
    while pending or running:
        running = [t for t in running if t.is_alive()]
        while pending and len(running) < (args.parallel or len(runs)):
            run = pending.pop(0)
            running.append(threading.Thread(target=run.run, name=run.name))
            running[-1].start()
        time.sleep(0.5)
    reports = {}
    for run in runs:
        report = run.check()
        if run.baseline_jobs:
            # Under tune each trial's steps: the members train in step with each other.
            steps = report["timesteps_total"] / max(1, len(run.run_dirs()))
            compare_with_baselines(run, report, run.baseline_returns(steps))
        report["problems"] = run.problems
        reports[run.name] = report
        run.cleanup()
    remove_dead_launchers_session_dirs()
    rows = [["algo", "faults", "recovered", "it. lost", "it. repeated", "unreadable", "hangs",
             "longest to training (s)", "final return", "problems"]]
    for name, r in reports.items():
        rows.append([name, str(r["faults_injected"]), str(r["recoveries"]),
                     str(r["iterations_lost"]), str(r["iterations_repeated"]),
                     str(r["unreadable_files"]), str(r["hangs"]),
                     str(r["longest_to_training_s"]), f"{r['final_return']}",
                     str(len(r["problems"]))])
    print_table(rows)
    for name, r in reports.items():
        for problem in r["problems"]:
            print(f"{name}: {problem}")
    schedule = Schedule(args.minutes, [r.name for r in runs], list(kinds), args.seed, list(gap),
                        args.baselines, args.fs_mb, args.ulfm)
    report = {"meta": {**run_metadata(args.quick, schedule, ("torch", "mpi4py")),
                       "workdir": str(workdir)}, "runs": reports}
    write_report(report, args.json)
    return 1 if any(r["problems"] for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
