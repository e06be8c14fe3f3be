"""What the benchmark scripts share: running measured programs one at a time, and the report.

Each script is its own orchestrator and its own measured programs: the orchestrator starts the file
again with ``--role ROLE`` (under ``mpiexec`` or plain Python), or another command such as ``mpirl
train``, always one process at a time and each in a session of its own. A program hands back its
result as one line on stdout (``emit``); a program that fails, hangs or gives no result raises
``BenchError`` in the orchestrator, and ``attempt`` turns that into ``{"error": ...}`` in the
report.

The scripts run as ``python benchmarks/NAME.py``, which puts this directory on ``sys.path``; that
is how they import this module (``benchmarks`` is not a package).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

from mpirl.jobs.launch import remove_dead_launchers_session_dirs

RESULT_PREFIX = "BENCH_RESULT "
MPIEXEC = Path(sys.executable).parent / "mpiexec"
# Open MPI refuses root without these; the machine has fewer cores than ranks, and pinning every
# rank to one core would measure the pinning, not the runtime.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPIEXEC_FLAGS = ("--oversubscribe", "--bind-to", "none")
# Single-threaded numerics everywhere, so the only competition for the cores is the runtime's.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SUBPROCESS_TIMEOUT_S = 300.0
NOT_REQUESTED = "not requested (--peers)"


class BenchError(Exception):
    """A measured program failed or gave no result."""


class Finished(NamedTuple):
    """A measured program that exited with code 0."""

    wall_s: float
    """From launch to exit, interpreter start and shutdown included."""
    stdout: str
    stderr: str
    result: dict[str, Any] | None
    """What the program ``emit``ted; None where no result was asked for."""


# In the measured programs.


def emit(result: dict[str, Any]) -> None:
    """Hand the result to the orchestrator: one line on stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def not_installed(peer: str, error: ImportError) -> int:
    """Say how to install a missing peer; the measured program's exit code."""
    print(f"{peer} is not installed ({error}); install the peers with: "
          f"pip install -e '.[bench]'  (or: make bench)", file=sys.stderr)
    return 1


def local_context(role: str, device: str = "cpu") -> Any:
    """A ``RankContext`` for a worker of ``role`` built in this process, alone in a world of
    one (COMM_SELF), as the measured programs build rollout workers and learners directly."""
    from mpi4py import MPI

    from mpirl.runtime.core import RankContext
    from mpirl.runtime.layout import Layout

    return RankContext(0, role, 0, 1, Layout().resolve(1), None, MPI.COMM_SELF, None,
                       socket.gethostname(), device)


# In the orchestrator: running the programs.


def run_main(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s code; a ``BenchError`` that escapes it is one line and exit 1."""
    try:
        sys.exit(main())
    except BenchError as error:
        print(error, file=sys.stderr)
        sys.exit(1)


def tail(text: str, lines: int = 15) -> str:
    """The last ``lines`` lines of ``text``, where a failing program usually says why."""
    return "\n".join(text.strip().splitlines()[-lines:])


def mpiexec_command(ranks: int, *command: str) -> list[str]:
    """``command`` under ``mpiexec -n ranks`` with the flags a small shared machine needs. Clears
    the session directories of killed launchers first: one with a reused pid would fail."""
    remove_dead_launchers_session_dirs()
    return [str(MPIEXEC), "-n", str(ranks), *MPIEXEC_FLAGS, *command]


def end_session(proc: subprocess.Popen) -> None:
    """TERM, then KILL, whatever is left of the process's session."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; give daemons it left in the group a moment to follow the TERM.
        time.sleep(1.0)


PROGRESS_PREFIX = "progress: "
"""Lines a measured program writes to stderr as it goes; a timeout's error quotes the last."""


def session_cpu_s(session: int) -> float:
    """CPU seconds (user + system) of the live processes of ``session`` (a launched program,
    its ranks, its spawned actors), from /proc."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def run_process(command: Sequence[str], name: str, timeout_s: float,
                extra_env: Mapping[str, str] | None = None,
                want_result: bool = False) -> Finished:
    """Run ``command`` to completion and time it; BenchError on a timeout, a non-zero exit or,
    with ``want_result``, no ``emit``ted result."""
    env = {**os.environ, **MPI_ENV, **THREAD_ENV, **(extra_env or {})}
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the machine may have no way out
    start = time.perf_counter()
    # A session of its own, so that a timeout can end mpiexec, its ranks or Ray's daemons at once.
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_session(proc)
        out, err = proc.communicate()
        progress = [line for line in err.splitlines() if line.startswith(PROGRESS_PREFIX)]
        last = f"; last progress: {progress[-1]}" if progress else ""
        raise BenchError(f"{name}: no result within {timeout_s:g} s; killed{last}") from None
    wall = time.perf_counter() - start
    # Nothing it started may outlive it and eat into the next measurement.
    end_session(proc)
    results = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    missing = want_result and not results
    if proc.returncode != 0 or missing:
        what = " without a result" if missing else ""
        detail = tail(err) or tail(out) or "(no output)"
        raise BenchError(f"{name}: exited with code {proc.returncode}{what}:\n{detail}")
    result = json.loads(results[-1][len(RESULT_PREFIX):]) if want_result else None
    return Finished(wall, out, err, result)


def run_role(script: Path, role: str, quick: bool, args: Sequence[str] = (), *,
             ranks: int | None = None, name: str | None = None,
             timeout_s: float = SUBPROCESS_TIMEOUT_S) -> Finished:
    """Run ``script --role ROLE ARGS [--quick]``, under ``mpiexec -n ranks`` unless None."""
    command = [sys.executable, str(script), "--role", role, *args, *(["--quick"] if quick else [])]
    if ranks is not None:
        command = mpiexec_command(ranks, *command)
    return run_process(command, name or role, timeout_s, want_result=True)


def attempt(name: str, measure: Callable[[], dict[str, Any]],
            describe: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Any]:
    """``measure()``, with a failure turned into ``{"error": ...}``; progress on the console."""
    print(f"running {name}", flush=True)
    try:
        result = measure()
    except BenchError as error:
        print(f"  failed: {error}", file=sys.stderr, flush=True)
        return {"error": str(error)}
    if describe is not None:
        print(f"  {describe(result)}", flush=True)
    return result


def attempt_role(script: Path, role: str, ranks: int | None, quick: bool,
                 describe: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Any]:
    """``attempt`` of ``run_role``: the result the role emitted, or ``{"error": ...}``."""
    label = role + (f" (mpiexec -n {ranks})" if ranks else "")
    return attempt(label, lambda: run_role(script, role, quick, ranks=ranks).result, describe)


# In the orchestrator: choosing peers.


def add_peers_option(parser: argparse.ArgumentParser, peers: Sequence[str]) -> None:
    """``--peers a,b``: the peers to measure, as a tuple in ``peers``' order; mpirl always."""

    def parse(text: str) -> tuple[str, ...]:
        chosen = {name.strip() for name in text.split(",") if name.strip()}
        unknown = sorted(chosen - set(peers))
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown peer(s) {', '.join(unknown)}; choose from {','.join(peers)}")
        if "mpirl" not in chosen:
            # Every other peer is only there to be compared with mpirl.
            raise argparse.ArgumentTypeError("mpirl is always measured; include it")
        return tuple(peer for peer in peers if peer in chosen)

    parser.add_argument("--peers", type=parse, default=tuple(peers), metavar="LIST",
                        help=f"comma-separated peers to measure, of {','.join(peers)} "
                             "(default all; mpirl is required)")


def skipped() -> dict[str, Any]:
    """The report entry of a peer that ``--peers`` left out."""
    return {"skipped": NOT_REQUESTED}


# In the orchestrator: the report.


def version(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run_metadata(quick: bool, plan: Any, packages: Iterable[str]) -> dict[str, Any]:
    """Where, when and with what the benchmark ran; ``plan`` is the script's Plan dataclass."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg(),
        "python": platform.python_version(),
        **{name: version(name) for name in packages},
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "quick": quick,
        "plan": asdict(plan),
    }


def write_report(report: dict[str, Any], json_path: Path | None) -> None:
    """Write ``report`` as indented JSON, unless no path was given."""
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")


def ratio(numerator: Any, denominator: Any) -> float | None:
    """``numerator / denominator``, or None where either is missing (a failed or skipped peer)."""
    if isinstance(numerator, int | float) and isinstance(denominator, int | float) and denominator:
        return numerator / denominator
    return None


def fmt(value: Any, digits: int) -> str:
    """A table cell: a number with thousands separators, yes/no, or "-" for anything else."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:,.{digits}f}" if isinstance(value, int | float) else "-"


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Rows of cells; the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                           strict=True)]
        print("  ".join(cells))


def print_problems(entries: Mapping[str, dict[str, Any]]) -> None:
    """One line per error in the entries (``error`` and ``errors``), one for skipped peers."""
    for name, entry in entries.items():
        errors = [entry["error"]] if "error" in entry else []
        for error in errors + entry.get("errors", []):
            # The first line says which program failed, the last usually why.
            lines = error.splitlines()
            print(f"{name}: error: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else ""))
    left_out = [name for name, entry in entries.items() if "skipped" in entry]
    if left_out:
        print(f"not measured (--peers): {', '.join(left_out)}")


def timed_rates(step_block: Callable[[], int], warmup_s: float, block_s: float,
                reps: int) -> list[float]:
    """Call ``step_block`` (which returns the steps it did) for ``warmup_s`` untimed, then in
    ``reps`` timed blocks of at least ``block_s`` each; the steps per second of each block."""
    deadline = time.perf_counter() + warmup_s
    while time.perf_counter() < deadline:
        step_block()
    rates = []
    for _ in range(reps):
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < block_s:
            steps += step_block()
        rates.append(steps / elapsed)
    return rates
