"""Errors a user can act on, and the exit codes the process ends with.

Every error here carries a message written for the person who launched the job. The CLI prints
that message alone (no traceback) and exits with the error's ``exit_code``.
"""

from __future__ import annotations

__all__ = ["MissingPackage", "CheckpointError", "ModelDivergedError", "NonFiniteDataError"]

#: The run finished: a stop criterion was met, or the driver's program returned normally.
EXIT_OK = 0
#: Something failed during the run (an uncaught exception on some rank).
EXIT_FAILURE = 1
#: The command line, config or layout is wrong; nothing ran.
EXIT_USAGE = 2
#: A rank stopped answering (killed, out of memory, node lost); the whole job was ended.
EXIT_RANK_LOST = 70
#: The run stopped on request (SIGUSR1, SIGUSR2 or SIGTERM) after writing a checkpoint; run it
#: again with ``--resume`` to continue. 75 is EX_TEMPFAIL of sysexits.h: "try again later".
EXIT_RESUME = 75
#: The run stopped on Ctrl-C (SIGINT) after writing a checkpoint; ``--resume`` continues it.
#: 130 is what a shell reports for a command that SIGINT ended (128 + 2), so nothing that
#: requeues on 75 runs it again.
EXIT_INTERRUPTED = 130


class MpirlError(Exception):
    """Base class of the errors that mpirl reports to users by message alone."""

    exit_code: int = EXIT_FAILURE


class ConfigError(MpirlError, ValueError):
    """A config key or value is wrong. Raised identically on every rank, before any MPI traffic."""

    exit_code = EXIT_USAGE


class MissingPackage(ConfigError):
    """What was asked for needs an optional package that is not installed; the message starts
    with what needs which package and the line that installs it, and callers pass it on as is
    rather than behind a message of their own."""


class LayoutError(ConfigError):
    """The MPI world size does not fit the requested layout of roles."""


class LaunchError(LayoutError):
    """The MPI world does not match the Slurm step that started this process: a PMI setting that
    does not fit the MPI library starts every task as a singleton. Raised on every task;
    ``speaker`` is True on the one task (Slurm's task 0) that reports it."""

    def __init__(self, message: str, speaker: bool = True) -> None:
        super().__init__(message)
        self.speaker = speaker

    def __reduce__(self):
        return (LaunchError, (str(self), self.speaker))


class ThreadLevelError(MpirlError):
    """MPI gives less than ``MPI_THREAD_MULTIPLE``, which the heartbeat thread needs. Raised on
    every rank before any communication."""

    exit_code = EXIT_USAGE


class RemoteError(MpirlError, RuntimeError):
    """A method called on a worker raised there. The worker keeps serving.

    Attributes:
        rank: the world rank the method ran on (0 in local mode).
        role: the role of that rank, such as ``"rollout"``.
        method: the method name.
        cause_type: the qualified name of the remote exception's class.
        remote_traceback: the traceback text as formatted on the remote rank.
    """

    def __init__(
        self, rank: int, role: str, method: str, cause_type: str, cause_message: str,
        remote_traceback: str,
    ) -> None:
        self.rank = rank
        self.role = role
        self.method = method
        self.cause_type = cause_type
        self.cause_message = cause_message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"{role} worker on rank {rank} raised in {method}(): {cause_type}: {cause_message}\n"
            f"Remote traceback (rank {rank}):\n{remote_traceback.rstrip()}"
        )

    def __reduce__(self):  # keep it picklable with its fields
        return (
            RemoteError,
            (self.rank, self.role, self.method, self.cause_type, self.cause_message,
             self.remote_traceback),
        )


class CallbackError(MpirlError):
    """A user's callback raised; the message names the hook and the rank it ran on."""


class TaskTimeout(MpirlError, TimeoutError):
    """A call on a worker did not complete within its timeout."""


class EnvFailureError(MpirlError):
    """An environment kept raising: ``max_env_failures`` failures in a row on one sub-env.

    Raised on the rollout rank; the driver re-raises it under this type (see
    ``mpirl.workers.env_guard.unwrap_env_failure``) so the user reads its message alone.
    """


class SimulationError(MpirlError):
    """An env group failed: its simulation raised, did not answer within env_step_timeout_s, or
    sent a reply of the wrong size. Raised on the rollout rank, unwrapped on the driver as
    ``EnvFailureError`` is; the message names the group and the step."""

    exit_code = EXIT_USAGE


class SimulationStuck(SimulationError):
    """An env group did not answer within env_step_timeout_s. Its ranks may never return: they
    take no stop and never reach MPI_Finalize, where every process of the job waits for all, so
    the driver ends the job with MPI_Abort after the one line that names the group."""


def unwrap_remote(error: RemoteError, *kinds: type[MpirlError]) -> MpirlError:
    """The error a worker raised, as one of this process when its class is one of ``kinds`` (so
    the user reads its message alone, not a remote traceback); any other remote error as is."""
    for kind in kinds:
        if error.cause_type == f"{kind.__module__}.{kind.__qualname__}":
            return kind(error.cause_message)
    return error


class RankLost(MpirlError):
    """A rank was lost: it stopped sending heartbeats or MPI reported it failed.

    Raised by the futures of calls on a rollout rank that the driver lost and survived (under
    ULFM); uncaught, it ends the run with ``EXIT_RANK_LOST``. ``rank`` is the lost world rank.
    """

    exit_code = EXIT_RANK_LOST

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (RankLost, (str(self), self.rank))


class ProcessFailure(MpirlError):
    """An MPI operation failed because a rank it involved died (under ULFM only)."""

    exit_code = EXIT_RANK_LOST


class CheckpointError(MpirlError):
    """A checkpoint cannot be used: missing, corrupt, or of another run."""

    exit_code = 2


class ModelDivergedError(MpirlError):
    """A learned model's loss or prediction became NaN or infinite (a dynamics ensemble member
    in model-based RL). The message names the member and the epoch or iteration; the run stops
    and the last good checkpoint is kept. ``member`` is the member's index (None when unknown)."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, member: int | None = None) -> None:
        super().__init__(message)
        self.member = member

    def __reduce__(self):
        return (ModelDivergedError, (str(self), self.member))


class NonFiniteDataError(MpirlError):
    """Data a learner was given holds NaN or infinite values (an environment's observations or
    rewards): the run stops before a model learns from them, like ``ModelDivergedError``."""

    exit_code = EXIT_USAGE


#: The errors a learner raises that stop a run cleanly: the driver names the training iteration
#: and exits with the error's code, writing no checkpoint of the state that failed.
LEARNER_STOPS: tuple[type[MpirlError], ...] = (ModelDivergedError, NonFiniteDataError)


#: errno values that mean "the file system has no room": ENOSPC, and EDQUOT (a quota).
_NO_ROOM = {28: "No space left on device", 122: "Disk quota exceeded"}
NO_ROOM_ERRNOS = frozenset(_NO_ROOM)


class DiskFull(MpirlError):
    """A write failed for want of room (ENOSPC or EDQUOT): the run ends with ``EXIT_FAILURE``,
    which ``mpirl launch`` and a requeue answer with a resume, and what was written before the
    newest checkpoint is intact (checkpoints are written aside and renamed into place)."""

    def __init__(self, run_dir: object, detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"the file system holding {run_dir} is full ({detail}). The newest checkpoint and "
            f"everything before it are intact: free some space, then continue with --resume "
            f"{run_dir} (mpirl launch does so by itself)")


def no_room_cause(error: BaseException | None) -> str | None:
    """What says "no room" in ``error``, its causes and contexts, or in a worker's error that
    reached the driver (a ``RemoteError`` of an ``OSError``), or a ``DiskFull`` already made of
    it; None when nothing does."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DiskFull):
            return error.detail
        if isinstance(error, OSError) and error.errno in _NO_ROOM:
            where = f": {error.filename}" if error.filename else ""
            return f"{_NO_ROOM[error.errno]}{where}"
        if isinstance(error, RemoteError):
            for number, text in _NO_ROOM.items():
                if f"[Errno {number}]" in error.cause_message or (
                        f"[Errno {number}]" in error.remote_traceback):
                    return f"{text}, on rank {error.rank} ({error.role})"
        error = error.__cause__ or error.__context__
    return None
