"""A time limit on ``MPI_Init`` under ULFM: past it, the rank says so and exits with 70.

Under ULFM (``mpiexec --with-ft ulfm``) Open MPI's launcher does not end a job when one of its
ranks dies, so a rank lost while the job starts leaves every other rank in ``MPI_Init`` for
ever, waiting for it (seen with Open MPI 5: kill -9 of one rank in its first second). No mpirl
code runs there, and ``MPI_Init`` holds the GIL, so neither a Python thread nor a signal handler
could end the rank. Two things that need no Python do, started just before ``MPI_Init``:

- a timer of the C library (``timer_create`` with ``SIGEV_THREAD``) whose thread calls
  ``_exit(70)``: a lost rank's code. A rank killed by a signal would not do: under ULFM the
  launcher then exits 0, as if the job had succeeded;
- a small watcher process that writes the one line first. It waits on a pipe that this rank
  closes once ``MPI_Init`` returns (or that closes when the rank dies), and kills the rank
  itself where the timer could not be made (a C library without ``timer_create``).

``done`` disarms both. Without ULFM the launcher ends the job on a lost rank: nothing starts.
Nothing here talks to other ranks.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

from mpirl.errors import EXIT_RANK_LOST

#: The watcher (argv: limit s, rank pid, seconds to the kill, the line): wait for the pipe on
#: stdin to close; past the limit, write the line, and kill the rank if it is still there
#: later. Run with ``python -I -S`` and no environment, so that it starts fast and is never
#: taken for one of the job's ranks.
_WATCHER = """\
import os, select, signal, sys
if not select.select([0], [], [], float(sys.argv[1]))[0]:
    os.write(2, sys.argv[4].encode())
    if not select.select([0], [], [], float(sys.argv[3]))[0]:
        os.kill(int(sys.argv[2]), signal.SIGKILL)
"""

#: How long after the line the timer ends the rank, and the watcher after that if it could not.
_LINE_FIRST_S = 1.0
_KILL_AFTER_S = 10.0

#: Where launchers put a rank's number before MPI_Init can be asked (Open MPI, PMIx, Slurm).
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


class _Sigevent(ctypes.Structure):
    # struct sigevent (64 bytes on Linux): the value the function is called with, the signal
    # (unused), SIGEV_THREAD, the function and its thread attributes (none), and padding.
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p),
                ("padding", ctypes.c_byte * 32)]


class _Timespec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


_SIGEV_THREAD = 2
_CLOCK_MONOTONIC = 1


class InitWatchdog:
    """Ends this rank (one line on stderr, exit code 70) unless ``done`` is called within the
    limit given to ``start``."""

    def __init__(self, watcher: subprocess.Popen, timer: ctypes.c_void_p | None) -> None:
        self._watcher, self._timer = watcher, timer

    def done(self) -> None:
        """MPI_Init returned: disarm the timer and let the watcher go without a word."""
        if self._timer is not None:
            _libc().timer_delete(self._timer)
            self._timer = None
        if self._watcher.stdin is not None:
            self._watcher.stdin.close()
        self._watcher.wait()


def under_ulfm() -> bool:
    """Whether Open MPI was asked for ULFM, read from the environment (MPI is not initialized
    yet, so ``mpirl.runtime.ulfm.fault_tolerant`` cannot be asked)."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on")


def start(timeout_s: float) -> InitWatchdog | None:
    """Arm the limit for this rank under ULFM (else None): call just before ``MPI_Init``."""
    if not under_ulfm():
        return None
    rank = next((os.environ[v] for v in _RANK_VARIABLES if v in os.environ), "?")
    message = (f"mpirl: rank {rank} did not finish MPI_Init within {timeout_s:g} s "
               f"(startup_timeout_s): under ULFM a rank lost while the job starts leaves the "
               f"others waiting there for ever. Ending this rank (exit code "
               f"{EXIT_RANK_LOST}); start the job again.\n")
    watcher = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _WATCHER, repr(float(timeout_s)), str(os.getpid()),
         repr(_LINE_FIRST_S + _KILL_AFTER_S), message],
        stdin=subprocess.PIPE, env={}, close_fds=True)
    return InitWatchdog(watcher, exit_timer(timeout_s + _LINE_FIRST_S, EXIT_RANK_LOST))


def exit_timer(after_s: float, code: int) -> ctypes.c_void_p | None:
    """A C-library timer whose own thread calls ``_exit(code)`` after ``after_s`` seconds,
    GIL or not; None where the C library has no ``timer_create``. ``timer_delete`` disarms it."""
    try:
        libc = _libc()
        create, arm = libc.timer_create, libc.timer_settime
        end = ctypes.CDLL(None)._exit
    except (OSError, AttributeError):
        return None
    event = _Sigevent(value=code, notify=_SIGEV_THREAD,
                      function=ctypes.cast(end, ctypes.c_void_p))
    timer = ctypes.c_void_p()
    if create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        return None
    seconds = int(after_s)
    when = _Itimerspec(value=_Timespec(seconds, int((after_s - seconds) * 1e9)))
    if arm(timer, 0, ctypes.byref(when), None) != 0:
        libc.timer_delete(timer)
        return None
    return timer


def _libc() -> ctypes.CDLL:
    """The C library's timer calls: in the process's own symbols (glibc 2.34 and later), else
    in librt (older glibc)."""
    own = ctypes.CDLL(None)
    if hasattr(own, "timer_create"):
        return own
    return ctypes.CDLL("librt.so.1")
