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

Ctrl-C at a terminal goes to the terminal's foreground process group. Under Open MPI's mpiexec
that group is mpiexec's alone (each rank runs in a group of its own), and mpiexec ends the job
on it: SIGCONT to every rank, SIGTERM 0.25 s later, SIGKILL 0.25 s after that, exit code 1,
whatever the ranks do; too soon for a checkpoint under load. So ``holding_terminal`` makes
rank 0's group the terminal's foreground group for the run: Ctrl-C then reaches rank 0 as a
SIGINT and nothing else, rank 0 stops every rank after a checkpoint, and the job exits 130.
``from_launcher`` tells a SIGTERM of mpiexec's ending of the job (after its SIGCONT) from one
sent to the rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import termios
import time
from collections.abc import Callable, Iterator
from types import FrameType

from mpirl.errors import EXIT_INTERRUPTED, EXIT_RESUME

#: The signals that request a checkpoint and a resumable exit.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
#: Ctrl-C: a checkpoint and an exit too, with its own code (``exit_code``).
INTERRUPT = signal.SIGINT

_received: int | None = None
#: When (time.monotonic) the first stop signal came, and the latest SIGCONT before it.
_received_at: float | None = None
_continued_at: float | None = None
#: How long after a SIGCONT a SIGTERM counts as the launcher's ending of the job (mpiexec
#: sends SIGTERM 0.25 s after its SIGCONT; a busy machine may delay the handlers).
LAUNCHER_TERM_WINDOW_S = 2.0
#: While rank 0 holds the terminal: how to give it back (see ``holding_terminal``).
_give_back_terminal: Callable[[], None] | None = None
#: What to do before a second signal ends the process at once (``before_quitting``).
_last_words: list[Callable[[], None]] = []
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
    signal.signal(signal.SIGCONT, _on_continue)


def exit_code(signum: int) -> int:
    """The exit code of a run that ``signum`` stopped: 130 for SIGINT, else 75."""
    return EXIT_INTERRUPTED if signum == INTERRUPT else EXIT_RESUME


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _received, _received_at
    if _received == signum:
        # Asked twice: do what the signal would have done without us. The terminal goes back
        # to the launcher first, so that a shell without job control gets it back too.
        for last_words in reversed(_last_words):
            with contextlib.suppress(Exception):
                last_words()
        if _give_back_terminal is not None:
            _give_back_terminal()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _received is None:
        _received, _received_at = signum, time.monotonic()


def _on_continue(signum: int, frame: FrameType | None) -> None:
    global _continued_at
    _continued_at = time.monotonic()


def from_launcher() -> bool:
    """Whether the stop signal is Open MPI's mpiexec ending the job: a SIGTERM that came soon
    after a SIGCONT. mpiexec then kills every rank and exits 1, whatever code the ranks exit
    with."""
    return (_received == signal.SIGTERM and _received_at is not None
            and _continued_at is not None
            and 0 <= _received_at - _continued_at < LAUNCHER_TERM_WINDOW_S)


@contextlib.contextmanager
def before_quitting(callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` (from the signal handler) if a second signal ends the process at once
    while this context lasts: e.g. end a partial line on the terminal, which the shell's prompt
    would otherwise follow on the same line."""
    _last_words.append(callback)
    try:
        yield
    finally:
        _last_words.remove(callback)


@contextlib.contextmanager
def holding_terminal(launcher_pid: int | None) -> Iterator[bool]:
    """Make this process's group the foreground process group of its terminal for the
    duration, if ``launcher_pid`` (the mpiexec that started this rank) is the terminal's
    foreground job; yields whether it did. Ctrl-C then sends SIGINT to this process alone,
    not to mpiexec (see the module docstring). Ctrl-Z is ignored meanwhile: stopping one rank
    of a job stops nothing else (its peers would declare it lost). The terminal goes back to
    the launcher's group at the end, or before a second Ctrl-C ends the process; if the process
    is killed meanwhile, a shell takes it back once mpiexec exits.

    Not taken when there is no terminal, the launcher is not its foreground job (a job in the
    background, a batch job, ``mpirl launch``'s own session), or ``stty tostop`` is set (the
    launcher, no longer in the foreground, would be stopped as it writes the ranks' output).
    """
    global _give_back_terminal
    taken = _take_terminal(launcher_pid) if launcher_pid is not None else None
    if taken is None:
        yield False
        return
    terminal, launcher_group = taken
    tstp_before = signal.signal(signal.SIGTSTP, signal.SIG_IGN)

    def give_back() -> None:
        global _give_back_terminal
        _give_back_terminal = None
        with contextlib.suppress(OSError):
            if os.tcgetpgrp(terminal) == os.getpgrp():
                _set_foreground(terminal, launcher_group)

    _give_back_terminal = give_back
    try:
        yield True
    finally:
        give_back()
        signal.signal(signal.SIGTSTP, tstp_before)
        os.close(terminal)


def _take_terminal(launcher_pid: int) -> tuple[int, int] | None:
    """(the terminal's fd, the launcher's process group) once this process's group holds the
    terminal; None, and nothing changed, where it should not or cannot."""
    try:
        terminal = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None  # no controlling terminal
    try:
        launcher_group = os.getpgid(launcher_pid)
        own_group = os.getpgrp()
        if (os.tcgetpgrp(terminal) != launcher_group or own_group == launcher_group
                or os.getsid(0) != os.getsid(launcher_pid)
                or termios.tcgetattr(terminal)[3] & termios.TOSTOP):
            os.close(terminal)
            return None
        _set_foreground(terminal, own_group)
    except (OSError, termios.error):
        os.close(terminal)
        return None
    return terminal, launcher_group


def _set_foreground(terminal: int, group: int) -> None:
    # A process outside the foreground group that sets it gets SIGTTOU (which would stop it)
    # unless it ignores that signal.
    before = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(terminal, group)
    finally:
        signal.signal(signal.SIGTTOU, before)


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
    signal.signal(signal.SIGCONT, signal.SIG_DFL)  # only a run's stop needs it timed
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
    global _received, _received_at
    _received = _received_at = None


def request_stop(signum: int = signal.SIGUSR2) -> None:
    """Act as if this process had received ``signum`` (a stop passed on by another rank, such as
    ``mpirl tune``'s controller asking a trial's driver to checkpoint and stop)."""
    global _received, _received_at
    if _received is None:
        _received, _received_at = signum, time.monotonic()
