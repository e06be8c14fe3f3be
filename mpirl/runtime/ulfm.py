"""Process failures under ULFM (Open MPI's ``mpiexec --with-ft ulfm``): telling them apart,
naming the failed ranks, and the communicator repairs that let a job go on without them.

Without fault tolerance a dead rank ends the whole MPI job, and none of this is reached. With it,
MPI calls that involve a dead rank raise ``ERR_PROC_FAILED`` (``ERR_PROC_FAILED_PENDING`` for a
pending receive from any source, ``ERR_REVOKED`` once a member has revoked the communicator), and
the survivors may shrink a communicator to its live members. Measured with the PyPI Open MPI 5.0
wheel: MPI knew of a kill -9 within 10 ms; a blocking ``Recv`` or ``Bcast`` involving the dead rank
then raised (no hang); ``Shrink`` gave a working communicator with the order of ranks kept.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpirl.errors import EXIT_RANK_LOST, ProcessFailure
from mpirl.runtime.waiting import wait_for_all
from mpirl.runtime.world import run_comm

__all__ = ["bcast_bytes", "bcast_weights", "flush_to_survivors", "isend_to_survivors",
           "poll_any_source"]

if TYPE_CHECKING:
    pass

_FAILURE_CLASS_NAMES = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")


def fault_tolerant() -> bool:
    """True when this MPI reports process failures instead of ending the job (ULFM).

    Open MPI sets ``OMPI_MCA_mpi_ft_enable`` for ``mpiexec --with-ft ulfm`` (or
    ``--mca mpi_ft_enable 1``); MPI offers no portable query, so other MPIs count as not
    fault tolerant.
    """
    if not all(hasattr(MPI.Comm, name) for name in ("Revoke", "Shrink", "Get_failed",
                                                     "Ack_failed")):
        return False
    if "Open MPI" not in MPI.Get_library_version():
        return False
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on")


def is_process_failure(error: BaseException) -> bool:
    """True for the errors an MPI with fault tolerance (ULFM) raises when a peer has died."""
    if not isinstance(error, MPI.Exception):
        return False
    classes = {getattr(MPI, name, None) for name in _FAILURE_CLASS_NAMES} - {None}
    return error.Get_error_class() in classes


def is_collective_failure(comm: MPI.Comm, error: BaseException) -> bool:
    """``is_process_failure``, or the vaguer error a nonblocking collective may give for the same
    death: Open MPI's libnbc prints ``NBC_Progress: an error 75 was found during schedule`` and
    has been seen to complete the request with ``ERR_OTHER`` (CI, in an ``Ibarrier`` of
    ``wait_for_all``) or ``ERR_INTERN`` (``Ishrink``) instead of ``ERR_PROC_FAILED``. Those count
    as a failure only when MPI knows a member of ``comm`` has failed."""
    if is_process_failure(error):
        return True
    if not isinstance(error, MPI.Exception) or not fault_tolerant():
        return False
    return error.Get_error_class() in (MPI.ERR_OTHER, MPI.ERR_INTERN) and bool(
        failed_world_ranks(comm))


def failed_world_ranks(comm: MPI.Comm | None = None) -> list[int]:
    """Ranks of the run's world (``mpirl.runtime.world.run_comm()``: COMM_WORLD, or the
    sub-communicator of a nested run) that MPI knows have failed in ``comm`` (default: that
    world). ULFM only; else empty."""
    try:
        world = run_comm()
        failed = (comm or world).Get_failed()
        group = world.Get_group()
        ranks = failed.Translate_ranks(list(range(failed.Get_size())), group)
        group.Free()
        failed.Free()
        return sorted(r for r in ranks if r != MPI.UNDEFINED)
    except (MPI.Exception, NotImplementedError, AttributeError):
        return []


def end_rank_on_process_failure(error: BaseException, when: str) -> None:
    """End this rank if ``error`` is MPI's report of a lost rank that nothing handled (one
    raised ``when`` the job starts, before any heartbeat watches): one line, a revoke of
    COMM_WORLD so that every rank's pending call on it returns, and exit code
    ``EXIT_RANK_LOST``. Returns for any other error.

    Each rank that meets the failure says so: the launcher ends the job on the first rank's
    exit, and a rank that has not met it yet (importing torch, say) would never speak."""
    if not is_process_failure(error):
        return
    world = MPI.COMM_WORLD
    failed = failed_world_ranks(world)
    names = f"rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))}" if failed else "a rank"
    print(f"mpirl: lost {names} {when}: MPI reported a process failure, seen from rank "
          f"{world.Get_rank()}. It was probably killed, ran out of memory, or its node failed. "
          f"Ending the job (exit code {EXIT_RANK_LOST}); start it again, or resume it from its "
          f"last checkpoint.", file=sys.stderr, flush=True)
    with contextlib.suppress(MPI.Exception, NotImplementedError, AttributeError):
        world.Revoke()
    os._exit(EXIT_RANK_LOST)  # MPI_Finalize would wait for the lost rank


def acknowledge_failures(comm: MPI.Comm) -> None:
    """Acknowledge the failures MPI knows of in ``comm``: receives and probes from any source
    on it work again (they raise until then). Acknowledgements are per communicator."""
    with contextlib.suppress(MPI.Exception, NotImplementedError, AttributeError):
        comm.Ack_failed()


def poll_any_source(channel: Any, tag: int) -> tuple[Any, int] | None:
    """One message of ``tag`` from any rank of ``channel`` (``(obj, source)``), or None. Under
    ULFM a probe from any source raises once a rank has failed, until the failure is
    acknowledged: that is done here and None returned (the driver learns of the loss from its
    calls); any other error is raised."""
    try:
        return channel.poll(MPI.ANY_SOURCE, tag)
    except MPI.Exception as error:
        if not is_process_failure(error):
            raise
        acknowledge_failures(channel.comm)
        return None


def isend_to_survivors(channel: Any, obj: Any, ranks: list[int], tag: int,
                       failed: set[int]) -> None:
    """Start sending ``obj`` to ``ranks`` less those in ``failed``. Under ULFM the sends to
    ranks MPI reports failed are dropped (they can never complete) and the ranks added to
    ``failed``; any other error is raised."""
    ranks = [rank for rank in ranks if rank not in failed]
    if not ranks:
        return
    try:
        channel.isend_many(obj, ranks, tag)
    except MPI.Exception as error:
        _drop_sends_to_failed(channel, error, failed)


def flush_to_survivors(channel: Any, failed: set[int]) -> None:
    """``channel.flush()``; under ULFM the sends to ranks MPI reports failed (they fail the
    test of every send) are dropped and the ranks added to ``failed``."""
    try:
        channel.flush()
    except MPI.Exception as error:
        _drop_sends_to_failed(channel, error, failed)


def _drop_sends_to_failed(channel: Any, error: MPI.Exception, failed: set[int]) -> None:
    lost = failed_world_ranks(channel.comm)
    if not (lost or is_process_failure(error)):
        raise error
    for rank in lost:
        channel.forget(rank)
    failed.update(lost)
    acknowledge_failures(channel.comm)


@contextlib.contextmanager
def revoke_on_failure(comm: MPI.Comm, what: str) -> Iterator[None]:
    """Run a collective on ``comm``; if a member's death breaks it, revoke ``comm`` and raise
    ``ProcessFailure``.

    MPI reports a failure inside a collective only to some members; the others may wait for the
    member that gave up. Revoking makes every pending and later operation on ``comm`` raise on
    every member, so none waits. The communicator must then be shrunk before it is used again.
    """
    try:
        yield
    except MPI.Exception as error:
        if not is_collective_failure(comm, error):
            raise
        with contextlib.suppress(MPI.Exception):
            comm.Revoke()
        failed = failed_world_ranks(comm)
        raise ProcessFailure(
            f"{what} failed: {MPI.Get_error_string(error.Get_error_class())} (MPI reports "
            f"ranks {failed or 'none yet'} as failed); the communicator was revoked"
        ) from None


def bcast_weights(comm: MPI.Comm, buffer: np.ndarray, timeout_s: float) -> None:
    """The weight broadcast: ``buffer`` from rank 0 of ``comm`` (the weights communicator) to
    every member, once all have arrived within ``timeout_s``; a member's death revokes ``comm``
    and raises ``ProcessFailure`` (see ``revoke_on_failure``). Called by the source and by
    every receiver, each with its own buffer."""
    with revoke_on_failure(comm, "the weight broadcast"):
        wait_for_all(comm, timeout_s, "the weight broadcast")
        comm.Bcast(buffer, root=0)


def bcast_round(comm: MPI.Comm, header: bytes | None, weights: np.ndarray,
                timeout_s: float) -> bytes:
    """The start of a standing round (``mpirl.execution.standing_rounds``): ``header``, given on
    member 0 of ``comm`` (None on the others), to every member, then ``weights`` as in
    ``bcast_weights`` unless the header is empty, which ends the rounds. Returns the header.
    Collective over ``comm``: a length, the header and the weights, rooted at member 0."""
    what = "the round's broadcast"
    with revoke_on_failure(comm, what):
        wait_for_all(comm, timeout_s, what)
        size = np.array([-1 if header is None else len(header)], np.int64)
        comm.Bcast(size, root=0)
        if not size[0]:
            return b""
        buffer = np.frombuffer(header, np.uint8) if header is not None else np.empty(
            int(size[0]), np.uint8)
        comm.Bcast(buffer, root=0)
        comm.Bcast(weights, root=0)
    return header if header is not None else buffer.tobytes()


def bcast_bytes(comm: MPI.Comm, payload: bytes | None, timeout_s: float, what: str) -> bytes:
    """``payload``, given on one member of ``comm`` (None on the others), to every member, once
    all have arrived within ``timeout_s``: an allreduce tells them who holds it and its length,
    then a ``Bcast`` from there. A member's death revokes ``comm`` and raises
    ``ProcessFailure``, as in ``bcast_weights``. Collective over ``comm``."""
    with revoke_on_failure(comm, what):
        wait_for_all(comm, timeout_s, what)
        held = payload is not None
        mine = np.array([comm.Get_rank() if held else -1, len(payload) if held else -1],
                        np.int64)
        found = np.empty(2, np.int64)
        comm.Allreduce(mine, found, op=MPI.MAX)
        buffer = np.frombuffer(payload, np.uint8) if held else np.empty(int(found[1]), np.uint8)
        comm.Bcast(buffer, root=int(found[0]))
    return payload if held else buffer.tobytes()


def allreduce_max(comm: MPI.Comm, values: np.ndarray, timeout_s: float, what: str,
                  backoff: tuple[float, float] | None = None,
                  expected_s: float = 0.0) -> np.ndarray:
    """The elementwise maximum of every member's ``values`` (int64, one length on all), on every
    member, once all have arrived within ``timeout_s``. A member's death revokes ``comm`` and
    raises ``ProcessFailure``, as in ``bcast_weights``. Collective over ``comm``; ``backoff`` and
    ``expected_s`` as in ``wait_for_all``."""
    found = np.empty_like(values)
    with revoke_on_failure(comm, what):
        wait_for_all(comm, timeout_s, what, backoff, expected_s)
        comm.Allreduce(values, found, op=MPI.MAX)
    return found


def gather_bytes(comm: MPI.Comm, payload: bytes, timeout_s: float, what: str,
                 backoff: tuple[float, float] | None = None,
                 expected_s: float = 0.0, root: int = 0) -> list[bytes] | None:
    """Every member's ``payload``, in the order of their ranks in ``comm``, on its rank
    ``root`` (None on the others), once all have arrived within ``timeout_s``: a ``Gather`` of
    the lengths, then a ``Gatherv`` of the bytes. The root handles one collective, not a
    message per member. A member's death revokes ``comm`` and raises ``ProcessFailure``, as in
    ``bcast_weights``. Collective over ``comm``; ``backoff`` and ``expected_s`` as in
    ``wait_for_all``."""
    with revoke_on_failure(comm, what):
        wait_for_all(comm, timeout_s, what, backoff, expected_s)
        is_root = comm.Get_rank() == root
        sizes = np.empty(comm.Get_size(), np.int64) if is_root else None
        comm.Gather(np.array([len(payload)], np.int64), sizes, root=root)
        data = np.frombuffer(payload, np.uint8)
        if not is_root:
            comm.Gatherv(data, None, root=root)
            return None
        offsets = np.zeros_like(sizes)
        np.cumsum(sizes[:-1], out=offsets[1:])
        buffer = np.empty(int(sizes.sum()), np.uint8)
        comm.Gatherv(data, [buffer, sizes, offsets, MPI.BYTE], root=root)
    return [buffer[start:start + size].tobytes()
            for start, size in zip(offsets, sizes, strict=True)]
