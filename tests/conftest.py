"""Launching MPI programs from tests: always a subprocess, always a timeout."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirl.jobs.launch import remove_dead_launchers_session_dirs
from mpirl.runtime.layout import parse_layout_row

BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
PROGRAMS = Path(__file__).parent / "programs"
SCENARIOS = PROGRAMS / "scenarios.py"
#: The example solvers (C, Fortran) of the MPMD tests; built_solvers makes them.
SOLVERS = Path(__file__).parent.parent / "examples" / "solvers"


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def mpiexec_command(n: int, *args: str, ulfm: bool = False) -> list[str]:
    """``mpiexec -n n ARGS`` with the flags local runs need (Open MPI's wheel). Clears what dead
    launchers left first (tests kill mpiexec with SIGKILL, and pids wrap at 32,768 here), so
    that the launch cannot fail on it."""
    remove_dead_launchers_session_dirs()
    ft = ["--with-ft", "ulfm"] if ulfm else []
    return [str(MPIEXEC), *ft, "-n", str(n), "--oversubscribe", "--bind-to", "none", *args]


#: Open MPI's launcher failing before it starts any rank: its PMIx server could not open its
#: listener (once in about 270 launches of a CI run). None of the test ran, so it runs again.
#: The cause found: a session directory left by a killed launcher with the same pid, which
#: mpiexec_command now removes first; the retry stays for causes not yet seen.
LAUNCHER_FAILURES = ("PMIx server's listener thread failed to start",)


def run_mpi(n: int, *args: str, timeout: float = 120, ulfm: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n ARGS`` to completion; a hang fails the test at ``timeout``. A launch
    that failed before any rank started (LAUNCHER_FAILURES) is tried up to twice more."""
    for attempt in range(3):
        try:
            proc = subprocess.run(mpiexec_command(n, *args, ulfm=ulfm), capture_output=True,
                                  text=True, timeout=timeout, env=mpi_env(env))
        except subprocess.TimeoutExpired as error:
            pytest.fail(f"mpiexec -n {n} {' '.join(args)} hung for {timeout} s:\n"
                        f"{error.stdout}\n{error.stderr}")
        if proc.returncode == 0 or attempt == 2 or not any(
                failure in proc.stderr for failure in LAUNCHER_FAILURES):
            return proc
        print(f"mpiexec failed to launch (attempt {attempt + 1}), trying again:\n{proc.stderr}")
    raise AssertionError("unreachable")


def run_scenario(n: int, name: str, *args: str, timeout: float = 120,
                 ulfm: bool = False) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run one driver scenario of programs/scenarios.py; return the process and its RESULT."""
    if n == 1:
        # World size 1 without any launcher: the embedded local mode.
        proc = subprocess.run([sys.executable, str(SCENARIOS), name, *args], capture_output=True,
                              text=True, timeout=timeout, env=mpi_env())
    else:
        proc = run_mpi(n, sys.executable, str(SCENARIOS), name, *args, timeout=timeout,
                       ulfm=ulfm)
    return proc, parse_result(proc.stdout)


def latest_checkpoint_iteration(run_dir: Path) -> int:
    """The iteration of the run's newest checkpoint (its ``latest`` pointer); 0 if none."""
    latest = run_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return 0
    return int(latest.read_text().strip().rsplit("_", 1)[1])


def rewound_copy(run_dir: Path, to: Path, iteration: int) -> Path:
    """A copy of the finished run ``run_dir`` at ``to`` as if it had stopped at its checkpoint
    of ``iteration``: the later checkpoints and its result removed, ``latest`` pointing there.
    A resume test's interrupted run without a launch of its own."""
    shutil.copytree(run_dir, to)
    for checkpoint in (to / "checkpoints").glob("checkpoint_*"):
        if int(checkpoint.name.rsplit("_", 1)[1]) > iteration:
            shutil.rmtree(checkpoint)
    (to / "checkpoints" / "latest").write_text(f"checkpoint_{iteration:06d}")
    (to / "result.json").unlink()
    return to


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size_mb: int):
    """A tmpfs of ``size_mb`` mounted at ``path`` (created) for the block; root can mount one,
    elsewhere the test is skipped."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs could be mounted here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs of its own, to be filled on purpose."""
    with mounted_tmpfs(tmp_path / "fs", 2) as disk:
        yield disk


def fill_disk(disk: Path) -> Path:
    """Fill ``disk``'s file system to the last byte; returns the file to delete to free it."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as file, pytest.raises(OSError):
        while True:
            file.write(b"\0" * 4096)
    return filler


def parse_result(stdout: str) -> dict | None:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None


#: MPIRL_TEST_COSTS=FILE: a line of JSON per test (wall s, CPU s of pytest and of the processes
#: it waited for), appended as each test ends. The suite is CPU-bound on CI's 2 cores, so CPU
#: seconds say what a test costs there even when this machine is busy.
_COSTS = os.environ.get("MPIRL_TEST_COSTS")


def _cpu_s(now, before) -> float:
    return round(now.ru_utime + now.ru_stime - before.ru_utime - before.ru_stime, 3)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _COSTS:
        return (yield)
    before = (time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF),
              resource.getrusage(resource.RUSAGE_CHILDREN))
    try:
        return (yield)
    finally:
        wall, own, children = before
        own_now = resource.getrusage(resource.RUSAGE_SELF)
        children_now = resource.getrusage(resource.RUSAGE_CHILDREN)
        cost = {"test": item.nodeid, "wall_s": round(time.perf_counter() - wall, 3),
                "cpu_s": _cpu_s(own_now, own), "children_cpu_s": _cpu_s(children_now, children),
                # Which pytest-xdist worker ran it ("" when serial), and when it ended: the
                # workers' timelines, to see whether one waited on the other at the end.
                "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                "ended": round(time.time(), 1)}
        with open(_COSTS, "a") as file:
            file.write(json.dumps(cost) + "\n")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> None:
    """The tests that train in pytest's own process do it on one torch thread, as mpirl's ranks
    do (``torch_threads`` 1): with torch's default of one per core, each small convolution
    waited on the second thread, and on a busy 2-core machine AlphaZero's Connect Four
    self-play tests took 7-11 CPU-s each, against 0.4 with one."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def open_mpi_is_the_launcher() -> None:
    out = subprocess.run([str(MPIEXEC), "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in out:
        pytest.exit(f"{MPIEXEC} is not Open MPI's mpiexec (mpich wheel installed too?):\n{out}",
                    returncode=3)


class LiveRun:
    """An ``mpirl train`` job running in the background under mpiexec, for fault tests: its
    output is collected as it arrives, and its ranks' pids come from the layout table."""

    def __init__(self, n: int, *args: str, ulfm: bool = False,
                 command: list[str] | None = None) -> None:
        if command is None:
            command = mpiexec_command(n, str(BIN / "mpirl"), "train", *args, ulfm=ulfm)
        self._command = command
        self._relaunches = 0
        self._start()

    def _start(self) -> None:
        import threading

        self.proc = subprocess.Popen(self._command, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=mpi_env(),
                                     start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.out),
                                               (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    def _launch_failed(self) -> bool:
        """The launcher ended before starting any rank (LAUNCHER_FAILURES): nothing ran."""
        for reader in self._readers:
            reader.join(timeout=10)
        return not self.pids() and any(failure in self.stderr for failure in LAUNCHER_FAILURES)

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait_until(self, condition, what: str, timeout: float = 90) -> None:
        import time

        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                if self._relaunches < 2 and self._launch_failed():
                    print(f"mpiexec failed to launch, trying again:\n{self.stderr}")
                    self._relaunches += 1
                    self._start()
                    continue
                self.finish()
                pytest.fail(f"the job ended (exit {self.proc.returncode}) before {what}:\n"
                            f"{self.stdout}\n{self.stderr}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {what} within {timeout} s:\n{self.stdout}\n{self.stderr}")
            time.sleep(0.05)

    def kill_rollout_rank(self, run_dir: Path, rank: int = 2, rows: int = 2) -> float:
        """kill -9 of rollout rank ``rank`` once progress.csv has ``rows`` rows; the
        ``time.monotonic()`` of the kill."""
        import csv
        import signal
        import time

        def written() -> int:
            if not (run_dir / "progress.csv").exists():
                return 0
            with open(run_dir / "progress.csv") as file:
                return len(list(csv.DictReader(file)))

        self.wait_until(lambda: written() >= rows, f"{rows} iterations")
        pids = self.pids()
        assert pids[rank][0] == "rollout", pids
        os.kill(pids[rank][1], signal.SIGKILL)
        return time.monotonic()

    def pids(self) -> dict[int, tuple[str, int]]:
        """rank -> (role, pid), from the newest layout table rank 0 printed at start-up."""
        rows = [row for line in list(self.out) if (row := parse_layout_row(line))]
        return {row["rank"]: (row["role"], row["pid"]) for row in rows}

    def finish(self, timeout: float = 90) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job hung for {timeout} s:\n{self.stdout}\n{self.stderr}")
        for reader in self._readers:
            reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        import signal

        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def assert_every_rank_ended(pids, within_s: float = 10.0) -> None:
    """mpiexec exiting is not enough: under ULFM it can exit while ranks run on, holding the
    allocation. Every rank's process (an iterable of pids) must be gone."""
    import time

    deadline = time.monotonic() + within_s
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"ranks still running {within_s} s after the job ended: {alive}"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_9_after_checkpoint(n: int, run_dir: Path, role: str, iteration: int,
                            *train_args: str) -> None:
    """Start ``mpirl train TRAIN_ARGS --run-dir RUN_DIR`` on ``n`` ranks with no end in sight,
    kill -9 its first ``role`` rank once a checkpoint at ``iteration`` or later is on disk, and
    check that the job failed."""
    import os
    import signal

    run = LiveRun(n, *train_args, "--run-dir", str(run_dir),
                  "--stop", '{"training_iteration": 100000}')
    run.wait_until(lambda: latest_checkpoint_iteration(run_dir) >= iteration,
                   f"a checkpoint at iteration {iteration}")
    victim = next(pid for rank_role, pid in run.pids().values() if rank_role == role)
    os.kill(victim, signal.SIGKILL)
    assert run.finish() != 0


def resume_then_stop_a_rollout_rank(n: int, run_dir: Path, killed_at: int, total: int) -> int:
    """Resume the run in ``run_dir``, killed after checkpoint ``killed_at``, on ``n`` ranks with
    no end in sight and no periodic checkpoints; once it has trained an iteration, send SIGUSR1
    to its first rollout rank and check that it exited 75 (resume me) naming the rank, before
    iteration ``total``, with a checkpoint where it stopped and every row up to it. The
    iteration it stopped at."""
    import json
    import os
    import signal

    from mpirl.errors import EXIT_RESUME

    progress = run_dir / "progress.csv"
    run = LiveRun(n, "--resume", str(run_dir), "--config", '{"checkpoint_every": 0}',
                  "--stop", '{"training_iteration": 100000}')
    run.wait_until(lambda: len(progress.read_text().splitlines()) - 1 > killed_at,
                   "an iteration after the resume")
    rank, pid = next((rank, pid) for rank, (role, pid) in run.pids().items() if role == "rollout")
    os.kill(pid, signal.SIGUSR1)
    assert run.finish() == EXIT_RESUME, run.stderr
    assert f"SIGUSR1 on rank {rank} (rollout" in run.stderr
    stopped_at = json.loads((run_dir / "result.json").read_text())["iteration"]
    assert killed_at < stopped_at < total, "the stop came too late"
    assert latest_checkpoint_iteration(run_dir) == stopped_at  # checkpointed where it stopped
    iterations = [int(line.split(",")[0]) for line in progress.read_text().splitlines()[1:]]
    assert iterations == list(range(1, stopped_at + 1))
    return stopped_at


def stop_signal_on_a_rollout_rank(n: int, run_dir: Path, *train_args: str) -> int:
    """Start ``mpirl train TRAIN_ARGS --run-dir RUN_DIR`` on ``n`` ranks with no end in sight
    (its config must print the layout), send SIGUSR1 to its first rollout rank after the first
    iteration, and check that the run checkpointed where it stopped and exited 75 (resume me),
    naming the rank; then resume it for 2 more iterations. The iteration it stopped at."""
    import signal

    from mpirl.errors import EXIT_RESUME

    run = LiveRun(n, *train_args, "--run-dir", str(run_dir),
                  "--stop", '{"training_iteration": 100000}')
    run.wait_until(lambda: (run_dir / "result.json").exists(), "a first iteration")
    rank, pid = next((rank, pid) for rank, (role, pid) in run.pids().items() if role == "rollout")
    os.kill(pid, signal.SIGUSR1)
    assert run.finish() == EXIT_RESUME, run.stderr
    assert f"SIGUSR1 on rank {rank} (rollout" in run.stderr
    stopped_at = json.loads((run_dir / "result.json").read_text())["iteration"]
    assert latest_checkpoint_iteration(run_dir) == stopped_at
    proc = run_mpi(n, str(BIN / "mpirl"), "train", "--resume", str(run_dir), "--stop",
                   json.dumps({"training_iteration": stopped_at + 2}), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return stopped_at


def hook_log(directory: Path) -> list[dict]:
    """What tests/programs/callbacks_probe.py's Probe logged into ``directory`` on every rank."""
    return [json.loads(line) for path in directory.glob("*.jsonl")
            for line in path.read_text().splitlines()]


def hook_ranks(log: list[dict]) -> dict[str, set[int]]:
    """Each hook of ``hook_log``'s entries, and the ranks it ran on."""
    ranks: dict[str, set[int]] = {}
    for entry in log:
        ranks.setdefault(entry["hook"], set()).add(entry["rank"])
    return ranks


def local_train(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``mpirl train ARGS --run-dir TMP_PATH/run`` in local mode (one process, no mpiexec)."""
    return subprocess.run([str(BIN / "mpirl"), "train", *args, "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=timeout, env=mpi_env())


def train_refused(tmp_path: Path, *args: str) -> str:
    """Check that ``mpirl train ARGS`` (local mode) refuses its input: exit 2, one line on
    stderr, no traceback. That line."""
    proc = local_train(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def cli_in_process(capsys, *argv: str) -> tuple[int, str]:
    """``mpirl ARGV`` by the CLI's main in pytest's process (the console script's code path,
    without an interpreter's start-up per case): its exit code and stderr."""
    from mpirl.cli import main

    try:
        code = main(list(argv))
    except SystemExit as error:  # argparse's own refusals
        code = error.code
    return code, capsys.readouterr().err


def train_refused_in_process(tmp_path: Path, capsys, *args: str) -> str:
    """``train_refused`` in pytest's process: ``mpirl train ARGS --run-dir TMP_PATH/run`` is
    refused by rank 0's checks before anything starts, with exit 2, one line on stderr and no
    traceback. That line. Each file keeps one case end to end through ``train_refused``."""
    code, stderr = cli_in_process(capsys, "train", *args, "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    return stderr


def doctor_learner_rows(stdout: str) -> list[list[str]]:
    """The rows of the doctor's learner table (rank, host, device, gpu, backend, torch, cuda,
    nccl). Cells are split on runs of two or more spaces: a GPU's name has single spaces."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.split()[:3] == ["rank", "host", "device"])
    rows = []
    for line in lines[start + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != 8:
            break
        rows.append(cells)
    return rows


#: Board games by their --env ids, from both sources (tests/test_games.py and the search tests).
PZ_TTT = "pettingzoo.classic.tictactoe_v3"
PZ_C4 = "pettingzoo.classic.connect_four_v3"
OS_TTT = "openspiel/tic_tac_toe"
OS_C4 = "openspiel/connect_four"


class BuiltSolvers:
    """examples/solvers/build/, made for this session: each solver's path, or ``skip_fortran``
    (why the Fortran one is missing) where gfortran is not installed outside CI."""

    def __init__(self, build: Path, skip_fortran: str | None) -> None:
        self.build = build
        self.skip_fortran = skip_fortran

    def path(self, name: str) -> str:
        return str(self.build / name)

    def fortran(self, name: str) -> str:
        """The Fortran solver's path; skips saying why without gfortran (fails on CI)."""
        if self.skip_fortran:
            if os.environ.get("CI") == "true":
                pytest.fail(f"{self.skip_fortran} (CI=true: make test installs it)")
            pytest.skip(self.skip_fortran)
        return self.path(name)


@pytest.fixture(scope="session")
def built_solvers() -> BuiltSolvers:
    """``make -C examples/solvers`` with the venv's mpicc (and the Fortran targets where
    gfortran is), as ``make test`` does first; a bare pytest gets them here. A lock keeps
    pytest-xdist's workers from building at once."""
    import fcntl
    import shutil

    fortran = shutil.which("gfortran") is not None
    skip_fortran = None if fortran else "gfortran is not installed (make fortran installs it)"
    (SOLVERS / "build").mkdir(exist_ok=True)
    with open(SOLVERS / "build" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(["make", "--no-print-directory", "-C", str(SOLVERS),
                               f"MPICC={BIN / 'mpicc'}", "all", *(["fortran"] if fortran else [])],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return BuiltSolvers(SOLVERS / "build", skip_fortran)
