"""The core interfaces: a worker object, and what it knows about the rank it lives on.

The driver creates workers and calls them; it never touches their state directly::

    # Rank 0 (driver)
    rollouts = driver.spawn("rollout", Sampler, env_id="CartPole-v1")   # one Sampler per rank
    futures = rollouts.call_async("sample", 1000)                      # returns at once
    ready, _ = mpirl.wait(futures, num_returns=1, timeout=60)          # first to finish
    batch_stats = ready[0].result()

    # Every rollout rank: serves calls, in order, until the driver shuts the job down.
    class Sampler(Worker):
        MESSAGES = ("sample",)
        def __init__(self, context, env_id): ...
        def sample(self, n): ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from mpi4py import MPI

    from mpirl.runtime.layout import Placement
    from mpirl.runtime.transport import Channel


@dataclass(frozen=True)
class RankContext:
    """Where a worker object runs. Passed as the first argument to every ``Worker``.

    ``data_channel`` spans the whole world and carries worker-to-worker data (sample batches);
    ``role_comm`` spans the ranks of this role only (learners allreduce over it);
    ``weights_comm`` holds the weight source (learner 0, or the driver when it holds the learner)
    as its rank 0 plus every rollout rank, for one ``Bcast`` of the weights, and is None on other
    ranks. In local mode ``role_comm`` is ``COMM_SELF``, the others are None, and ``role_index``
    is 0. ``collective_timeout_s`` bounds the wait for the other members of a collective (the
    weight broadcast) before the rank gives up with ``TaskTimeout``: the runtime's
    ``task_timeout_s``; ``collective_backoff`` how that wait polls.
    """

    rank: int
    role: str
    role_index: int
    role_size: int
    placement: Placement
    data_channel: Channel | None
    role_comm: MPI.Comm
    weights_comm: MPI.Comm | None
    host: str
    device: str
    collective_timeout_s: float = 3600.0
    #: (max_sleep_s, sleep_share) of the waits for the other members of a collective: the run's
    #: poll_max_sleep_s and poll_sleep_share; None: ``Backoff``'s defaults
    collective_backoff: tuple[float, float] | None = None
    #: An env rank's env group: its k members (``mpirl.runtime.layout.EnvGroup``); else None
    group_comm: MPI.Comm | None = None
    #: Where rollout ranks and their env groups talk (``mpirl.runtime.sim_link``): a duplicate
    #: of the run's communicator for env ranks in the world, the MPMD intercommunicator for a
    #: solver program's; None in a run without env groups
    sim_link: MPI.Comm | None = None

    @property
    def local(self) -> bool:
        """True in the embedded local mode (world size 1, every role in-process)."""
        return self.placement.local


#: The key of a learner's ``get_state`` that holds its flat float32 weights (the vector
#: ``get_weights`` returns): what ``mpirl evaluate``, ``export`` and ``play`` read from a
#: checkpoint's learner_0.pkl (``mpirl.execution.contract.LearnerClass``).
WEIGHTS_KEY = "weights"


class Worker:
    """A stateful object hosted on a worker rank and driven by rank 0.

    Subclasses list the methods the driver may call in ``MESSAGES``; calling any other name is an
    error raised on the driver before anything is sent. Arguments and results cross ranks pickled
    (protocol 5, NumPy buffers raw), so they must be picklable. An exception raised by a method
    reaches the driver as ``RemoteError``; the worker keeps serving.
    """

    MESSAGES: ClassVar[tuple[str, ...]] = ()
    #: Whether this worker can serve one policy of a multi-agent run among others: a rollout
    #: worker that takes its policy's steps from the rank's shared sampling core, a learner
    #: placed on a policy's slice of the learner ranks (its ``Settings`` have ``for_policy``).
    #: An algorithm whose rollout worker and learner both can drives a policy.
    SERVES_A_POLICY: ClassVar[bool] = False

    def __init__(self, context: RankContext) -> None:
        self.context = context

    # Checkpointing: a worker that has state lists "save_state" and "load_state" in MESSAGES and
    # implements get_state/set_state. The file is written and read on the worker's own rank.

    def get_state(self) -> Any:
        """Everything this worker needs to continue identically (picklable)."""
        raise NotImplementedError(f"{type(self).__name__} does not support checkpoints")

    def set_state(self, state: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support checkpoints")

    def save_state(self, directory: str, name: str) -> dict[str, Any]:
        """Write ``get_state()`` to ``directory/name``; return its checksum entry."""
        from mpirl.runtime.state_files import write_state_file

        return write_state_file(Path(directory) / name, self.get_state())

    def load_state(self, path: str, entry: dict[str, Any]) -> Any:
        """Read ``path``, check it against its manifest ``entry``, and ``set_state`` it; return
        what ``set_state`` returns (the driver reports a False: state that was not restored)."""
        from mpirl.runtime.state_files import read_state_file

        return self.set_state(read_state_file(path, entry))


def shrink_weights_comm(context: RankContext, objects: Iterable[Any]) -> RankContext:
    """Replace ``context.weights_comm`` by a copy without its failed members; collective over
    every live member. The weight source stays rank 0 (``Shrink`` keeps the order of ranks).

    Returns the new context, and points each of ``objects`` whose ``context`` is ``context`` at
    the new one, so their next ``Bcast`` uses the shrunk communicator.
    """
    old = context.weights_comm
    if old is None:
        return context
    # Blocking: ``Ishrink`` failed here (Open MPI 5.0.11: MPI_ERR_INTERN, "NBC_Progress: an
    # error 75") and a barrier cannot go first on a communicator with a failed member. A live
    # member that never joins is a stuck rank, which the heartbeat reports.
    new_context = dataclasses.replace(context, weights_comm=old.Shrink())
    for obj in objects:
        if getattr(obj, "context", None) is context:
            obj.context = new_context
    # The old communicator is not freed: freeing one with failed members is not defined to be
    # safe, and one handle per lost rank is a small leak.
    return new_context
