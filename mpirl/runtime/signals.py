"""Stop requests by signal: SIGUSR1, SIGUSR2 or SIGTERM on any rank asks the run to checkpoint at
the next iteration boundary and exit with ``EXIT_RESUME`` (75); SIGINT (Ctrl-C) does the same
but exits with ``EXIT_INTERRUPTED`` (130): the user stopped it, no scheduler is to requeue it.

Open MPI's mpiexec does not pass a SIGINT on: it ends the job itself (SIGTERM to every rank,
SIGKILL 0.25 s later, exit code 1; see ``mpirl.jobs.launch``). A rank sees a SIGINT when it is
sent to the ranks themselves: a run without a launcher (local mode), ``srun``'s Ctrl-C, or
``kill -INT`` of a rank.

Slurm may signal the batch shell, the launcher or every task, so any rank may be the one that
hears it. A worker rank reports its signal to the driver over the control channel (tag
``SIGNAL``) as soon as its serve loop is between tasks, or a call that runs across iterations
is between steps (``report_received``); the driver checks for reports, and for its own signals,
once per iteration. A second signal of the same kind ends the process at once, the
way it would have without mpirl (a second Ctrl-C quits without waiting for the checkpoint).

Only programs that check for stop requests install the handlers (``mpirl train`` does), so a
plain ``mpirl.run`` program still dies on SIGTERM as usual.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from types import FrameType

from mpirl.errors import EXIT_INTERRUPTED, EXIT_RESUME

#: The signals that request a checkpoint and a resumable exit.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
#: Ctrl-C: a checkpoint and an exit too, with its own code (``exit_code``).
INTERRUPT = signal.SIGINT

_received: int | None = None
#: SIGINT's handler before ``install`` (Python's KeyboardInterrupt), given back by ``settle``.
_interrupt_before: object = None
#: How this worker rank tells the driver of a signal (set by its host), and whether it did.
_reporter: Callable[[int], None] | None = None
_reported = False


def install() -> None:
    """Route the stop signals and SIGINT to a flag. Call from the main thread of every rank."""
    global _interrupt_before
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)
    before = signal.signal(INTERRUPT, _on_signal)
    if before is not _on_signal:
        _interrupt_before = before


def exit_code(signum: int) -> int:
    """The exit code of a run that ``signum`` stopped: 130 for SIGINT, else 75."""
    return EXIT_INTERRUPTED if signum == INTERRUPT else EXIT_RESUME


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _received
    if _received == signum:
        # Asked twice: do what the signal would have done without us.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _received is None:
        _received = signum


def settle() -> None:
    """Ignore SIGUSR1 and SIGUSR2 from now on: the run's outcome is decided.

    At interpreter exit Python gives back the default action (terminate) to every signal it
    handled, so a scheduler's warning that lands while a finished run shuts down would turn a
    finished job into a killed one (exit 140 instead of 0). SIGTERM still ends the process,
    and SIGINT gets its handler of before ``install`` back (Ctrl-C interrupts a script that
    called ``mpirl.train`` as it would have).
    """
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    if _interrupt_before is not None and signal.getsignal(INTERRUPT) is _on_signal:
        signal.signal(INTERRUPT, _interrupt_before)


def received() -> int | None:
    """The first stop signal this process received, or None."""
    return _received


def report_with(reporter: Callable[[int], None] | None) -> None:
    """On a worker rank: ``reporter(signum)`` tells the driver of a stop signal (its host's
    send on the control channel); None on rank 0 and once the host is done."""
    global _reporter, _reported
    _reporter, _reported = reporter, False


def report_received() -> None:
    """Tell the driver of this rank's stop signal, once, if one came. Called by the host's
    serve loop between tasks, and by a call that stands across iterations between its steps
    (a standing round), which would otherwise keep the signal from the driver until it ends."""
    global _reported
    if not _reported and _reporter is not None and _received is not None:
        _reported = True
        _reporter(_received)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def reset() -> None:
    """Forget a received signal (tests, and a process that runs several jobs)."""
    global _received
    _received = None


def request_stop(signum: int = signal.SIGUSR2) -> None:
    """Act as if this process had received ``signum`` (a stop passed on by another rank, such as
    ``mpirl tune``'s controller asking a trial's driver to checkpoint and stop)."""
    global _received
    if _received is None:
        _received = signum
