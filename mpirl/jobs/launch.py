"""``mpirl launch``: run a job command, and run it again after a failure, resuming where it stopped.

``mpirl launch [--max-restarts N] [--restart-delay S] -- COMMAND...`` runs outside MPI (never under
mpiexec or srun) and supervises COMMAND, a whole launcher command line such as
``mpiexec -n 4 ... mpirl train ...`` or ``srun ... mpirl train ...``:

* If COMMAND runs ``mpirl train`` (an argument that is ``mpirl`` or ends in ``/mpirl``, or
  ``-m mpirl``, followed by ``train``), the run directory is read from its ``--run-dir`` (or
  ``--resume``); without either, ``--run-dir runs/ALGO-ENV-TIME`` is added to the first attempt.
  Every later attempt gets ``--resume RUN_DIR``. A COMMAND without ``mpirl train`` is run again
  unchanged.
* Exit 0 ends launch with 0. Exit 2 (bad command line or config) ends it at once: running the same
  input again cannot help. Any other end (1, 70, 75, death by a signal) starts the next attempt
  after ``--restart-delay`` seconds, until ``--max-restarts`` restarts are spent; then launch exits
  with the last attempt's code (128+N for death by signal N).
* COMMAND runs in a session of its own, so Ctrl-C at a terminal reaches launch alone. SIGTERM,
  SIGUSR1, SIGUSR2, SIGINT and SIGHUP sent to launch are forwarded to it, and once launch has
  received one it starts no further attempt: it exits with the command's code, so that a
  scheduler sees 75 ("checkpointed, requeue me"). For ``mpirl train`` the first SIGTERM or SIGINT
  (Ctrl-C) is sent on as SIGUSR2 (below); a second SIGINT kills every process of the command's
  session.

What Open MPI 5.0.11's ``mpiexec`` (the PyPI wheel; it execs ``prterun``, same pid) does, measured
with 2 and 4 ranks that log every signal they get (Python handlers), on one node:

* Each rank runs in a process group of its own, inside prterun's session. So ``killpg`` on
  prterun's group reaches prterun only, and each rank gets exactly one copy of a forwarded signal.
* SIGUSR1 and SIGUSR2 sent to prterun reach every rank within milliseconds, and prterun waits for
  the ranks however long they take (15 s tried). If all ranks then exit 75, prterun exits 75.
* SIGTERM, SIGINT and SIGHUP sent to prterun are not forwarded as such: prterun ends the job. Every
  rank gets SIGCONT at once, SIGTERM 0.25 s later, and is killed (SIGKILL) about 0.25 s after that;
  prterun exits 1 about 0.5 s after the signal, whatever codes the ranks exit with (also when they
  all exit 75 before the SIGTERM). No MCA parameter in ``prte_info --all`` sets that grace. A rank
  cannot write a checkpoint in 0.25 s, so launch turns its first SIGTERM or SIGINT into SIGUSR2
  when COMMAND runs ``mpirl train`` (which treats USR1, USR2 and TERM alike: checkpoint, exit
  75); a second SIGTERM is forwarded as SIGTERM. For other commands both are forwarded unchanged.
* Exit codes: all ranks exit C -> prterun exits C. One rank exits C != 0 (or calls MPI_Abort with
  C) while the others run -> the others get SIGCONT, SIGTERM 0.25 s later, SIGKILL about 0.2 s after
  that, and prterun exits C about 0.55 s after the first exit, after a 7-line note. A rank that
  exits C as the job's last, the others having exited 0 -> prterun exits C with no note (mpirl
  train's ranks end that way: ``mpirl.cli.entry``). A rank killed by SIGKILL -> as for C != 0,
  and prterun exits 137 (128 + 9), not 70. Ranks exiting with different non-zero codes at once ->
  prterun exits with one of them, not reliably the one its message names.
* prterun killed with SIGKILL leaves its ranks running, orphaned. So launch kills whatever is left
  in the command's session after each attempt, before the next one can start, and its second SIGINT
  kills the whole session, not only prterun.
* prterun killed with SIGKILL also leaves its session directory, ``$TMPDIR/ompi.PID`` (``/tmp``
  without TMPDIR). A later prterun that gets the same pid (pids wrap at 32,768 on many systems)
  finds it, fails with "The PMIx server's listener thread failed to start" and exits 213 before
  starting any rank. So launch removes the directory of each attempt's prterun once it has ended.

``srun`` forwards signals to its tasks itself, and its tasks are not in launch's reach (they run
under slurmstepd); the SIGTERM-to-SIGUSR2 rule is harmless there.

An MPMD COMMAND (``mpiexec -n 2 mpirl train ... : -n 4 ./solver``, a solver program beside the
run): launch checks, before starting anything, that every program after a ``:`` is an
executable file (or on PATH), and refuses with exit 2 if one is not, instead of a launcher's
note after the run's ranks have started. The attempts' stderr passes through launch, which
reads Open MPI's note on the process whose end ended the job ("process rank 5 with PID 4321 on
node n1 exited on signal 9"): a world rank of the solver program is then named by its env group
from the run's params.json (``mpirl launch: world rank 5 was solver rank 1 of env group 0
(./solver, pid 4321); resuming from checkpoint 12``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# errors.py imports nothing else from mpirl; launch must stay clear of mpi4py (see __init__.py).
from mpirl.errors import EXIT_FAILURE, EXIT_OK, EXIT_RANK_LOST, EXIT_RESUME, EXIT_USAGE
from mpirl.jobs.run_dir import default_run_dir

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)
#: The signals a scheduler sends for "checkpoint and stop" (mpirl train ends them with 75).
CHECKPOINT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
#: What launch turns into SIGUSR2 the first time, for ``mpirl train``: a scheduler's SIGTERM and
#: Ctrl-C (mpiexec would end the job on either at once).
TO_CHECKPOINT = (signal.SIGTERM, signal.SIGINT)

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_DELAY_S = 3.0

_MEANINGS = {
    EXIT_OK: "finished",
    EXIT_FAILURE: "an exception on some rank",
    EXIT_USAGE: "bad command line or config",
    EXIT_RANK_LOST: "a rank was lost",
    EXIT_RESUME: "stopped on request after a checkpoint",
}


@dataclass(frozen=True)
class TrainCall:
    """Where ``mpirl train`` sits in a command line, and the options launch cares about."""

    train_index: int
    run_dir: str | None
    resume_dir: str | None
    algo: str | None
    env: str | None
    #: "train", or "tune" (a population: its run directory is the tune directory).
    subcommand: str = "train"


def find_train(command: Sequence[str]) -> TrainCall | None:
    """Locate ``mpirl train`` (or ``mpirl tune``) in COMMAND; None if it runs neither."""
    for index, word in enumerate(command):
        if word == "mpirl" or word.endswith("/mpirl"):
            subcommand = index + 1
        elif word == "-m" and command[index + 1:index + 2] in (["mpirl"], ["mpirl.cli"]):
            subcommand = index + 2
        else:
            continue
        if command[subcommand:subcommand + 1] not in (["train"], ["tune"]):
            continue  # e.g. an mpiexec --prefix that ends in /mpirl, or mpirl doctor
        args = list(command[subcommand + 1:])
        if ":" in args:  # mpiexec's MPMD separator: what follows belongs to another program
            args = args[:args.index(":")]
        options = train_args = args
        if command[subcommand] == "tune":  # tune's options, then -- and the trials' train options
            split = args.index("--") if "--" in args else len(args)
            options, train_args = args[:split], args[split + 1:]
        return TrainCall(subcommand, option_value(options, "--run-dir"),
                         option_value(options, "--resume"), option_value(train_args, "--algo"),
                         option_value(train_args, "--env"), command[subcommand])
    return None


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value of the last ``NAME VALUE`` or ``NAME=VALUE`` in args (argparse's rule).

    Exact spelling only, as mpirl's parsers (no abbreviations: ``--run`` is an error there, not
    ``--run-dir``), so the value found here is the one the job uses."""
    value = None
    for index, word in enumerate(args):
        if word == name and index + 1 < len(args):
            value = args[index + 1]
        elif word.startswith(name + "="):
            value = word[len(name) + 1:]
    return value


def first_command(command: Sequence[str]) -> tuple[list[str], str | None]:
    """COMMAND for the first attempt, with --run-dir added if needed, and the run directory."""
    call = find_train(command)
    if call is None:
        return list(command), None
    if call.run_dir or call.resume_dir:
        return list(command), call.run_dir or call.resume_dir
    if not (call.algo and call.env):
        return list(command), None  # mpirl train itself will say what is missing (exit 2)
    run_dir = default_run_dir(call.algo, call.env, prefix="tune-" if call.subcommand == "tune"
                              else "")
    return _insert_after_train(command, call, "--run-dir", run_dir), run_dir


def restart_command(command: Sequence[str]) -> list[str]:
    """The first attempt's COMMAND with ``--resume RUN_DIR`` added (unless it has one)."""
    call = find_train(command)
    if call is None or call.resume_dir or not call.run_dir:
        return list(command)
    return _insert_after_train(command, call, "--resume", call.run_dir)


def _insert_after_train(command: Sequence[str], call: TrainCall, *words: str) -> list[str]:
    # Right after "train", not at the end: the end may belong to another program (MPMD ":").
    at = call.train_index + 1
    return [*command[:at], *words, *command[at:]]


#: The options of mpiexec (Open MPI, MPICH) and srun that take a value, in a part of an MPMD
#: command line before its program; ``--opt=value`` needs no entry. ``--mca`` takes two.
_VALUE_OPTIONS = frozenset({
    "-n", "-np", "--n", "--np", "-c", "-N", "--npernode", "-H", "--host", "-host",
    "--hostfile", "-hostfile", "--machinefile", "-machinefile", "-f", "-x", "--x", "-env",
    "-genv", "--wdir", "-wdir", "--wd", "-wd", "--chdir", "-D", "--map-by", "--rank-by",
    "--bind-to", "--path", "--prefix", "--preload-files", "--app", "--ntasks", "--nodes",
    "--cpus-per-task", "--ntasks-per-node", "-G", "--gpus", "--mem", "--partition", "-p",
    "--nodelist", "-w", "--distribution", "-m", "--export", "--cpu-bind", "--label-every",
})
_TWO_VALUE_OPTIONS = frozenset({"--mca", "-mca", "--gmca", "-gmca", "--prtemca", "--pmixmca"})
_COUNT_OPTIONS = frozenset({"-n", "-np", "--n", "--np", "--ntasks"})
_WORKING_DIR_OPTIONS = ("--wdir", "-wdir", "--wd", "-wd", "--chdir", "-D")


@dataclass(frozen=True)
class MpmdProgram:
    """A program after a ``:`` of an MPMD command line, with its process count if given."""

    program: str
    count: int | None


def mpmd_programs(command: Sequence[str]) -> list[MpmdProgram]:
    """The program of each part after a ``:`` in COMMAND (mpiexec's MPMD form, srun's
    heterogeneous steps), in order, each with its ``-n``; empty for a command without one."""
    parts: list[list[str]] = [[]]
    for word in command:
        if word == ":":
            parts.append([])
        else:
            parts[-1].append(word)
    programs = []
    for part in parts[1:]:
        count, index = None, 0
        while index < len(part):
            word = part[index]
            if word in _TWO_VALUE_OPTIONS:
                index += 3
                continue
            if word in _VALUE_OPTIONS:
                if word in _COUNT_OPTIONS and part[index + 1:index + 2] and \
                        part[index + 1].isdigit():
                    count = int(part[index + 1])
                index += 2
                continue
            if word.startswith("-"):
                name, _, value = word.partition("=")
                if name in _COUNT_OPTIONS and value.isdigit():
                    count = int(value)
                index += 1
                continue
            programs.append(MpmdProgram(word, count))
            break
    return programs


def check_mpmd_programs(command: Sequence[str]) -> list[str]:
    """What is wrong with the programs after COMMAND's ``:`` (each one line): a path that is
    not an executable file, a name not on PATH. Relative paths are not judged when COMMAND
    sets a working directory for its processes."""
    elsewhere = any(word in _WORKING_DIR_OPTIONS or word.split("=", 1)[0] in _WORKING_DIR_OPTIONS
                    for word in command)
    problems = []
    for entry in mpmd_programs(command):
        program = entry.program
        if "/" in program:
            if elsewhere and not os.path.isabs(program):
                continue
            if not (os.path.isfile(program) and os.access(program, os.X_OK)):
                problems.append(f"{program} (after ':') is not an executable file")
        elif shutil.which(program) is None:
            problems.append(f"{program} (after ':') is not on PATH; give its path, e.g. "
                            f"./{program}")
    return problems


#: Open MPI 5's notes on the process whose end ended the job: killed by a signal, or the first
#: to exit with a non-zero code ("[prterun-HOST-PID@JOB,RANK]"). Their lines wrap anywhere.
_SIGNAL_NOTE = re.compile(r"process rank (\d+) with PID (\d+) on node (\S+) exited on\s+signal "
                          r"(\d+)")
_EXIT_NOTE = re.compile(r"Process name:\s*\[[^\]@]*@\d+,(\d+)\]\s*Exit code:\s*(\d+)")


def lost_solver_rank(launcher_output: str, run_dir: str | None,
                     command: Sequence[str]) -> str | None:
    """``world rank 5 was solver rank 1 of env group 0 (./solver, pid 4321)`` when the
    launcher's note in ``launcher_output`` names a world rank of the solver program beside the
    run (the run's params.json gives its world size and env groups); else None."""
    found = _SIGNAL_NOTE.search(launcher_output)
    if found:
        world_rank, what = int(found[1]), f"pid {found[2]}"
    elif (found := _EXIT_NOTE.search(launcher_output)):
        world_rank, what = int(found[1]), f"exit code {found[2]}"
    else:
        return None
    if run_dir is None:
        return None
    try:
        layout = json.loads((Path(run_dir) / "params.json").read_text())["layout"]
        mpirl_ranks = int(layout["world_size"])
        groups = [g for g in layout.get("env_groups", ()) if g.get("external")]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    solver_rank = world_rank - mpirl_ranks
    group = next((g for g in groups if world_rank in g.get("world_ranks", ())), None) or \
        next((g for g in groups if solver_rank in g.get("ranks", ())), None)
    if solver_rank < 0 or group is None:
        return None
    program = group.get("program")  # the solver's argv[0], as it introduced itself
    first = mpirl_ranks
    for entry in mpmd_programs(command) if not program else ():
        # Else the program of the part of the command line that holds that world rank.
        if entry.count is None or world_rank < first + entry.count:
            program = entry.program
            break
        first += entry.count
    where = ", ".join(part for part in (program, what) if part)
    return (f"world rank {world_rank} was solver rank {solver_rank} of env group "
            f"{group['group']} ({where})")


def latest_checkpoint(run_dir: str | None) -> int | None:
    """The iteration of the run's newest checkpoint (its ``latest`` pointer), or None."""
    if run_dir is None:
        return None
    try:
        name = (Path(run_dir) / "checkpoints" / "latest").read_text().strip()
        return int(name.rsplit("_", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def describe(returncode: int) -> str:
    """``exited with 70 (a rank was lost)``, ``was killed by SIGKILL``, ..."""
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)}"
    meaning = _MEANINGS.get(returncode)
    if meaning is None and returncode > 128 and _is_signal(returncode - 128):
        # Only a real signal number: Open MPI's launcher exits with codes such as 213 of its own.
        meaning = f"a process was killed by {_signal_name(returncode - 128)}"
    return f"exited with {returncode}" + (f" ({meaning})" if meaning else "")


def exit_code(returncode: int) -> int:
    """A process exit code for a child's return code (the shell's 128+N for death by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def _is_signal(number: int) -> bool:
    return number in set(signal.valid_signals())


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}" if number > 0 else ""


def session_processes(session: int) -> list[int]:
    """Pids of the live processes of a session, read from /proc (empty where there is none)."""
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        # Fields after "(comm)": state ppid pgrp session ...; comm may hold spaces and ")".
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == session and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def kill_session(session: int, spare_leader: bool = True) -> list[int]:
    """SIGKILL the processes of a session that launch created; returns their pids.

    Once the leader (pid == session) has been reaped, a process with its pid would be an unrelated
    newcomer, so it is spared unless ``spare_leader`` is False.
    """
    killed = []
    for pid in session_processes(session):
        if pid == session and spare_leader:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def launcher_session_dir(pid: int) -> Path:
    """Where Open MPI 5's prterun with this pid keeps its session files (PMIx rendezvous)."""
    return Path(tempfile.gettempdir()) / f"ompi.{pid}"


def remove_launcher_session_dir(pid: int) -> bool:
    """Remove the session directory of a prterun that has ended (True if there was one). Call it
    only once ``pid`` has been reaped: a live prterun needs it, and a newcomer's is its own."""
    directory = launcher_session_dir(pid)
    if not directory.is_dir():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


def remove_dead_launchers_session_dirs() -> list[int]:
    """Remove every session directory whose prterun is no longer running (``ompi.PID`` with no
    process PID); return those PIDs. For harnesses that kill mpiexec with SIGKILL and launch
    many more (tests, benchmarks): a later prterun given such a PID would fail to start."""
    removed = []
    for directory in Path(tempfile.gettempdir()).glob("ompi.*"):
        pid = directory.name.removeprefix("ompi.")
        if not pid.isdigit():
            continue  # ompi.HOST.UID: the ranks' shared session, not one launcher's
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            if remove_launcher_session_dir(int(pid)):
                removed.append(int(pid))
        except PermissionError:
            pass  # another user's live process
    return removed


class Supervisor:
    """Runs the attempts of one ``mpirl launch`` and owns its signal handlers."""

    def __init__(self, command: Sequence[str], max_restarts: int, restart_delay_s: float) -> None:
        self.command, self.run_dir = first_command(command)
        self.is_train = find_train(self.command) is not None
        self.max_attempts = max_restarts + 1
        self.restart_delay_s = restart_delay_s
        self.child: subprocess.Popen | None = None
        self.received: list[int] = []  # every forwarded signal launch got, in order
        self.unsent: list[int] = []  # received while no child was running yet
        #: An MPMD command: its stderr passes through launch, which reads the launcher's note.
        self.mpmd = bool(mpmd_programs(self.command))
        self.stderr_tail = ""

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED_SIGNALS}
        try:
            return self._attempts()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _attempts(self) -> int:
        command = self.command
        code = EXIT_OK
        for attempt in range(1, self.max_attempts + 1):
            if attempt == 1:
                if self.run_dir:
                    _say(f"attempt 1 of {self.max_attempts}; run directory {self.run_dir}")
            else:
                command = restart_command(self.command)
                lost = lost_solver_rank(self.stderr_tail, self.run_dir, self.command)
                if lost:
                    checkpoint = latest_checkpoint(self.run_dir)
                    _say(f"{lost}; " + (f"resuming from checkpoint {checkpoint}"
                                        if checkpoint is not None and self.is_train else
                                        "starting it again"))
                target = f"resuming from {self.run_dir}" if self.run_dir else "running it again"
                _say(f"attempt {attempt} of {self.max_attempts}: previous attempt {describe(code)};"
                     f" {target}")
                self._sleep(self.restart_delay_s)
                if self.received:
                    return self._stopped_between_attempts(code)
            try:
                code = self._run_once(command)
            except OSError as error:
                _say(f"error: cannot run {command[0]!r}: {error.strerror or error}. COMMAND must "
                     f"be a program on PATH or a path to one, e.g. -- mpiexec -n 4 mpirl train ...")
                return EXIT_USAGE
            if code == EXIT_OK:
                return EXIT_OK
            if self.received:
                _say(f"the command {describe(code)} after launch got "
                     f"{_signal_name(self.received[-1])}; not restarting")
                return exit_code(code)
            if code == EXIT_USAGE:
                _say("the command exited with 2 (bad command line or config); not restarting")
                return EXIT_USAGE
        lost = lost_solver_rank(self.stderr_tail, self.run_dir, self.command)
        if lost:
            _say(lost)
        _say(f"giving up after {self.max_attempts} attempts: the last {describe(code)}")
        return exit_code(code)

    def _run_once(self, command: list[str]) -> int:
        self.child = subprocess.Popen(command, start_new_session=True,
                                      stderr=subprocess.PIPE if self.mpmd else None)
        tee = None
        if self.mpmd:
            self.stderr_tail = ""
            tee = threading.Thread(target=self._pass_stderr, args=(self.child.stderr,),
                                   daemon=True)
            tee.start()
        unsent, self.unsent = self.unsent, []
        for sig in unsent:
            self._forward(sig)
        try:
            returncode = self.child.wait()
        finally:
            session = self.child.pid
            self.child = None
        leftovers = kill_session(session)
        if tee is not None:
            tee.join(timeout=10)  # the pipe closes once the command's last process has gone
        if leftovers:
            _say(f"killed {len(leftovers)} process(es) the command left running: "
                 f"{' '.join(map(str, leftovers))}")
        # The command's own pid is the session's (prterun execs in place of mpiexec); a prterun
        # that exited cleanly has removed it already.
        remove_launcher_session_dir(session)
        return returncode

    def _pass_stderr(self, stream: Any) -> None:
        """Copy the command's stderr to launch's as it comes; keep its end for the launcher's
        note on who ended the job."""
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stderr.write(chunk.decode(errors="replace"))
            self.stderr_tail = (self.stderr_tail + chunk.decode(errors="replace"))[-65536:]
        stream.close()

    def _stopped_between_attempts(self, last_code: int) -> int:
        sig = self.received[-1]
        if self.is_train and sig in CHECKPOINT_SIGNALS:
            # Nothing runs now and --resume continues from the newest checkpoint (or from the
            # start if there is none yet), so "requeue me" is the truthful answer.
            _say(f"got {_signal_name(sig)} between attempts; exiting with {EXIT_RESUME} "
                 f"(resume from {self.run_dir})")
            return EXIT_RESUME
        _say(f"got {_signal_name(sig)} between attempts; not restarting")
        return exit_code(last_code)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.received and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if self.child is None:
            self.unsent.append(signum)
        else:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        child = self.child
        assert child is not None
        count = self.received.count(signum)
        if signum == signal.SIGINT and count >= 2:
            # Not only the child: ranks outlive a SIGKILLed prterun (see the module docstring).
            killed = kill_session(child.pid, spare_leader=False)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)  # where /proc is missing
            _say_now(f"second SIGINT: killed the command's {len(killed)} process(es)")
        elif signum in TO_CHECKPOINT and count == 1 and self.is_train:
            # Open MPI's mpiexec would kill every rank 0.25 s after a SIGTERM or SIGINT (see the
            # module docstring); SIGUSR2 asks mpirl train for a checkpoint and exit 75, and
            # mpiexec waits for that.
            self._signal_group(child.pid, signal.SIGUSR2)
            then = ("a second Ctrl-C kills it at once" if signum == signal.SIGINT
                    else "a second SIGTERM is forwarded as is")
            _say_now(f"got {_signal_name(signum)}: sent SIGUSR2 to the command (checkpoint, then "
                     f"exit 75); {then}")
        else:
            self._signal_group(child.pid, signum)

    @staticmethod
    def _signal_group(group: int, signum: int) -> None:
        # The child leads its own session and process group, so its pid is the group's id.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signum)


def _say(message: str) -> None:
    print(f"mpirl launch: {message}", file=sys.stderr, flush=True)


def _say_now(message: str) -> None:
    # From a signal handler: os.write, because print may be interrupted inside its own buffer.
    os.write(2, f"mpirl launch: {message}\n".encode())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpirl launch`` (cli.py calls this on its subparser)."""
    parser.add_argument(
        "--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS, metavar="N",
        help=f"run COMMAND at most N+1 times in all (default {DEFAULT_MAX_RESTARTS})",
    )
    parser.add_argument(
        "--restart-delay", type=float, default=DEFAULT_RESTART_DELAY_S, metavar="SECONDS",
        help=f"wait this long before each restart (default {DEFAULT_RESTART_DELAY_S:g})",
    )
    parser.add_argument(
        "job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND...",
        help="the whole job command line, e.g. -- mpiexec -n 4 mpirl train --algo PPO ...",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``mpirl launch`` with parsed arguments; returns the exit code."""
    command = list(args.job_command)
    if command[:1] == ["--"]:
        command = command[1:]  # argparse keeps the "--" before a REMAINDER on Python 3.11
    problems = []
    if not command:
        problems.append("no COMMAND given: put the job command after --, e.g. "
                        "mpirl launch --max-restarts 3 -- mpiexec -n 4 mpirl train --algo PPO ...")
    if args.max_restarts < 0:
        problems.append(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if not 0 <= args.restart_delay < math.inf:  # also rejects nan
        problems.append(f"--restart-delay must be 0 or more seconds, got {args.restart_delay:g}")
    problems.extend(check_mpmd_programs(command))
    if problems:
        for problem in problems:
            _say(f"error: {problem}")
        return EXIT_USAGE
    return Supervisor(command, args.max_restarts, args.restart_delay).run()
