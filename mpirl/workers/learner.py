"""Learners: data-parallel SGD over the learner ranks, with one gradient allreduce per step.

Every learner holds the same policy and optimizer. Each receives its share of the sample batches
straight from rollout ranks, and every SGD step averages the flattened gradients of all learners
in one allreduce, weighted by the rows behind each, so that the step is the gradient of all rows
together however unevenly they were shared, and after every update all learners hold identical
weights. Offline algorithms
(BC, MARWIL) have no sampling: each learner reads its own shard of a trajectory dump instead
(``train_offline``), with the same allreduce per step.

The allreduce backend: NCCL through ``torch.distributed`` on GPUs, MPI (``Allreduce`` on the
learner communicator) on CPUs, or Gloo on request. A torch process group is bootstrapped over the
learner communicator: learner 0 opens a ``TCPStore`` and broadcasts its address, so the driver and
the rollout ranks never join it. Its address is chosen by ``bootstrap_address``; gloo's own
connections use the interface on the route to it unless ``GLOO_SOCKET_IFNAME`` says otherwise.
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import os
import re
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from mpi4py import MPI

from mpirl.config.fields import CommonConfig
from mpirl.data.batches import concat_batches, standardize_fields
from mpirl.data.offline import EpisodeShard, OfflineInput, load_shard, rows_per_learner
from mpirl.data.tags import DataTags
from mpirl.errors import ConfigError
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime import gathered
from mpirl.runtime.core import WEIGHTS_KEY, RankContext, Worker
from mpirl.runtime.dispatch import DRIVER_SPIN_S
from mpirl.runtime.ulfm import (
    bcast_weights,
    flush_to_survivors,
    isend_to_survivors,
    poll_any_source,
)
from mpirl.runtime.waiting import DRIVER_CPU, Backoff
from mpirl.workers.batch_transfer import BatchTransfer
from mpirl.workers.callbacks import invoke, make_callbacks
from mpirl.workers.optimizer import Adam

__all__ = ["LossFn", "StatefulLoss", "LearnerSettings", "Learner", "GradientAllreduce",
           "share_gradient"]

BACKENDS = ("auto", "mpi", "gloo", "nccl")


def check_backend(backend: str) -> None:
    """ConfigError unless ``backend`` is one of ``BACKENDS``."""
    if backend not in BACKENDS:
        raise ConfigError(f"learner_backend must be one of {', '.join(BACKENDS)}, "
                          f"got {backend!r}")


class GradientAllreduce:
    """Averages flat gradients over the learner ranks, weighted by the rows behind each."""

    def __init__(self, context: RankContext, backend: str, master_addr: str = "") -> None:
        check_backend(backend)
        self.comm = context.role_comm
        self.size = self.comm.Get_size()
        gpu = gpu_identity(context.device) if context.device.startswith("cuda") else ""
        places = [(context.host, gpu)]
        if self.size > 1 and backend in ("auto", "nccl"):
            # Every learner decides from the same list, so all take the same backend or raise
            # the same error: none is left waiting in a group the others never join.
            places = self.comm.allgather(places[0])
        backend = resolve_backend(backend, places, context.device)
        self.backend = backend
        self.group = None
        if self.size > 1 and backend in ("gloo", "nccl"):
            self.group = _init_process_group(self.comm, backend, master_addr)

    def __call__(self, flat: torch.Tensor, rows: float) -> tuple[torch.Tensor, float]:
        """``flat`` is this learner's gradient of a mean over ``rows`` rows (0 rows: ignored).
        Every learner gets ``sum(rows_i * flat_i) / sum(rows_i)`` and ``sum(rows_i)`` over all
        learners: one allreduce of the gradient with its row count appended. Plain averaging
        would make a row of a learner with fewer rows weigh more, and an empty share shrink
        the step."""
        if self.size == 1:
            return flat, rows
        packed = torch.cat([flat * rows, flat.new_tensor([rows])])
        if self.group is not None:
            torch.distributed.all_reduce(packed, group=self.group)
        else:
            host = packed.cpu().numpy()  # a view of packed on the CPU, a copy from a GPU
            self.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
            packed = torch.from_numpy(host).to(flat.device)
        total = float(packed[-1])
        return packed[:-1].div_(total if total else 1.0), total


def gpu_identity(device: str) -> str:
    """What tells ``device`` apart from every other GPU: its UUID (``cuda:0`` is a different
    GPU in each task that ``CUDA_VISIBLE_DEVICES`` gives its own)."""
    uuid = getattr(torch.cuda.get_device_properties(torch.device(device)), "uuid", None)
    return str(uuid) if uuid is not None else device


def resolve_backend(backend: str, places: list[tuple[str, str]], device: str = "cpu") -> str:
    """The allreduce backend that ``learner_backend`` comes to for learners at ``places``: each
    one's (host, GPU identity, or "" on the CPU), gathered over the learner communicator (only
    this learner's own where that was not needed). ``auto`` takes NCCL where every learner has a
    GPU of its own, else MPI (which stages through host memory, so learners may share a GPU or
    mix GPUs and CPUs). ConfigError where ``nccl`` cannot work; ``device`` is this learner's."""
    if backend == "nccl":
        on_cpu = [i for i, (_, gpu) in enumerate(places) if not gpu]
        if on_cpu:
            who = (f"this learner runs on {device}" if len(places) == 1
                   else f"learner {on_cpu[0]} runs on the CPU")
            raise ConfigError(f"learner_backend 'nccl' needs CUDA learners; {who}. Use 'mpi' "
                              f"or 'gloo' on CPUs.")
        shared = first_shared_gpu(places)
        if shared is not None:
            first, second = shared
            raise ConfigError(
                f"learner_backend 'nccl' needs a GPU of its own for each learner, but learners "
                f"{first} and {second} share one GPU on host {places[first][0]}. Give each "
                f"learner rank its own GPU (no more learner ranks on a node than it has "
                f"GPUs), or set learner_backend to 'mpi' or 'gloo', which average the "
                f"gradients through host memory.")
    if backend != "auto":
        return backend
    on_own_gpus = all(gpu for _, gpu in places) and first_shared_gpu(places) is None
    return "nccl" if on_own_gpus else "mpi"


def first_shared_gpu(places: list[tuple[str, str]]) -> tuple[int, int] | None:
    """The first two learners at ``places`` (host, GPU identity) on the same GPU, or None."""
    first: dict[tuple[str, str], int] = {}
    for index, place in enumerate(places):
        if place[1] and place in first:
            return first[place], index
        first.setdefault(place, index)
    return None


class AllreduceProbe(Worker):
    """On each learner rank, for ``mpirl doctor``: what the learner runs on, and how fast its
    gradient allreduce is over the learner communicator (every learner must be asked at once)."""

    MESSAGES = ("describe", "time_allreduce")

    def __init__(self, context: RankContext, backend: str = "auto",
                 master_addr: str = "") -> None:
        super().__init__(context)
        self.allreduce = GradientAllreduce(context, backend, master_addr)
        self.device = torch.device(context.device)

    def describe(self) -> dict[str, Any]:
        """Device, backend and the versions behind them, as this rank sees them."""
        cuda = self.device.type == "cuda"
        return {
            "rank": self.context.rank, "host": self.context.host, "device": str(self.device),
            "gpu": torch.cuda.get_device_name(self.device) if cuda else "",
            "backend": self.allreduce.backend, "learners": self.allreduce.size,
            "torch": torch.__version__, "cuda": torch.version.cuda or "",
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "",
        }

    def time_allreduce(self, nbytes: int, repeats: int) -> float:
        """Median seconds of one gradient allreduce of ``nbytes`` of float32 (after one warm-up
        call), as training makes it; collective over the learners."""
        flat = torch.ones(max(1, nbytes // 4) - 1, dtype=torch.float32, device=self.device)
        self.allreduce(flat, 1.0)
        times = []
        for _ in range(repeats):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.allreduce.comm.Barrier()  # start together: time the collective, not arrival
            start = time.perf_counter()
            self.allreduce(flat, 1.0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        return float(np.median(times))


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _init_process_group(comm: MPI.Comm, backend: str, master_addr: str = ""):
    import torch.distributed as dist

    if dist.is_initialized():  # a second learner in this process (tests): the group exists
        return dist.group.WORLD
    address = failure = None
    if comm.Get_rank() == 0:
        try:
            host = bootstrap_address(master_addr)
            store = dist.TCPStore(host, 0, comm.Get_size(), is_master=True,
                                  wait_for_workers=False)
            address = (host, store.port)
        except (ConfigError, RuntimeError, OSError) as error:
            failure = error
    # The other learners wait in this bcast: learner 0 reaches it whatever happened.
    address = comm.bcast(address if failure is None else str(failure), root=0)
    if failure is not None:
        raise failure
    if isinstance(address, str):
        raise ConfigError(f"learner 0 could not start the {backend} group: {address}")
    if comm.Get_rank() != 0:
        store = dist.TCPStore(address[0], address[1], comm.Get_size(), is_master=False)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Gloo's own connections start from what this host's name resolves to, often loopback:
        # take the interface on the route to learner 0, which the store just reached.
        local = _route_to(address[0])
        if local is not None and (interface := _interface_with(local)) is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    # Gloo's worker threads release tensors after a collective returns; one still doing so when
    # the interpreter finalizes takes the GIL from a dying thread and aborts the process. Shut
    # the group down while the interpreter is whole. (NCCL's is left to the driver's exit: with
    # a peer lost, its shutdown may wait on it.)
    if backend == "gloo":
        atexit.register(_destroy_process_group)
    return dist.group.WORLD


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


#: Environment variables that name the host the MPI launcher runs on, most reliable first:
#: Slurm's srun sets the first two in every task; Open MPI 4's mpirun gives its ranks its own
#: URI; a PMIx server's URI (Open MPI 5) names a non-loopback address only when the server
#: listens on one. What each holds is an address other nodes reach this job's launcher on.
LAUNCHER_ADDRESS_VARIABLES = ("SLURM_LAUNCH_NODE_IPADDR", "SLURM_SRUN_COMM_HOST",
                              "OMPI_MCA_orte_hnp_uri", "PMIX_SERVER_URI41", "PMIX_SERVER_URI4",
                              "PMIX_SERVER_URI3", "PMIX_SERVER_URI21", "PMIX_SERVER_URI2")
#: Where a route is looked up when nothing names the launcher: a TEST-NET address (RFC 5737);
#: connecting a UDP socket sends nothing, it only picks the interface of the default route.
_DEFAULT_ROUTE_PROBE = "192.0.2.1"


def bootstrap_address(configured: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The address learner 0 opens the ``TCPStore`` on, which every other learner must reach.

    In order: ``configured`` (the ``learner_master_addr`` key); ``MASTER_ADDR``; this host's
    address on the route to the MPI launcher's host (``LAUNCHER_ADDRESS_VARIABLES``: the network
    the launcher itself reached every node over); a non-loopback address this host's name
    resolves to; the address of the default route; ``gethostbyname(gethostname())``, which is
    often 127.0.1.1 and then works on one node only. Runs on learner 0 only: a given address
    that is not one of this host's is a ConfigError (the other learners would wait for it)."""
    environ = os.environ if environ is None else environ
    hostname = socket.gethostname()
    for given, source in ((configured, "config key learner_master_addr"),
                          (environ.get("MASTER_ADDR", ""), "MASTER_ADDR")):
        if not given:
            continue
        if not _is_local(given):
            raise ConfigError(
                f"{source} is {given!r}, which is no address of {hostname}, where learner 0 "
                f"runs and listens: give an address of learner 0's own host, or leave it unset "
                f"to let mpirl choose")
        return given
    for name in LAUNCHER_ADDRESS_VARIABLES:
        for launcher in _addresses_in(environ.get(name, "")):
            if (local := _route_to(launcher)) is not None:
                return local
    try:
        resolved = [info[4][0] for info in socket.getaddrinfo(hostname, None, socket.AF_INET)]
    except OSError:
        resolved = []
    for address in resolved:
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return _route_to(_DEFAULT_ROUTE_PROBE) or socket.gethostbyname(hostname)


def _addresses_in(value: str) -> list[str]:
    """The non-loopback IPv4 addresses an environment variable names: a bare address or host
    name (Slurm), or URIs such as ``jobid.0;tcp://10.0.0.1,10.0.1.1:5000`` (Open MPI 4) and
    ``ns@0.0;tcp4://10.0.0.1:5000`` (PMIx)."""
    if "://" in value:
        hosts = [host for uri in re.findall(r"tcp4?://([^;/\s]+)", value)
                 for host in uri.rsplit(":", 1)[0].split(",")]
    else:
        hosts = [value.strip()] if value.strip() else []
    found = []
    for host in hosts:
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, UnicodeError, ValueError):
            continue
        if not address.is_loopback and not address.is_unspecified:
            found.append(str(address))
    return found


def _is_local(host: str) -> bool:
    """True if ``host`` (an address or a name) is an address of this host: one can bind to."""
    try:
        candidates = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, sockaddr in candidates:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(sockaddr)
            return True
        except OSError:
            continue
    return False


def _interface_with(address: str) -> str | None:
    """The name of this host's network interface that has IPv4 ``address`` (Linux); None if
    none has it or interfaces cannot be queried here."""
    try:
        import fcntl

        interfaces = socket.if_nameindex()
    except (ImportError, OSError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in interfaces:
            try:  # SIOCGIFADDR: the interface's address, bytes 20-24 of its ifreq
                request = struct.pack("256s", name.encode()[:15])
                found = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24])
            except OSError:
                continue
            if found == address:
                return name
    return None


def _route_to(address: str) -> str | None:
    """This host's source address for packets to ``address`` (nothing is sent); None without
    a route, or when it is a loopback address."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(local).is_loopback else local


def policy_context(context: RankContext, members: list[int]) -> RankContext:
    """``context`` with ``role_comm`` narrowed to the learner indices ``members``: a policy's
    learners average their gradients over those members only."""
    if len(members) == context.role_comm.Get_size():
        return context
    comm = context.role_comm.Create_group(context.role_comm.Get_group().Incl(members))
    return dataclasses.replace(context, role_comm=comm,
                               role_index=members.index(context.role_index),
                               role_size=len(members))


def minibatch_rows(minibatch: dict[str, torch.Tensor]) -> float:
    """What a loss averages over: the steps a ``mask`` keeps, else the rows."""
    if "mask" in minibatch:
        return float(minibatch["mask"].sum())
    return float(len(next(iter(minibatch.values()))))


def share_gradient(params: list[torch.nn.Parameter], allreduce: GradientAllreduce,
                   rows: float) -> torch.Tensor | None:
    """Replace the gradients of ``params`` (this learner's, of a mean over ``rows`` rows) by
    the gradient of all learners' rows: one ``allreduce`` of the flat gradient and its row
    count over the learner ranks. The flat shared gradient, or None when no learner had rows
    (the gradients are then left as they were)."""
    for p in params:
        # A loss may leave a part unused (BC: the critic; SAC: the value head of a custom
        # actor-critic module): zeros, so that the flat gradient keeps its layout.
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    flat, total = allreduce(flat, rows)
    if not total:
        return None
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n
    return flat


LossFn = Callable[[Any, dict[str, torch.Tensor], Any], tuple[torch.Tensor, dict[str, float]]]


class StatefulLoss:
    """A loss that keeps state of its own between calls (MARWIL's moving average): subclass it
    and override the hooks it needs; a plain ``loss(policy, batch, config)`` function needs
    none of them. Its state lives on each learner rank: nothing crosses ranks but what
    ``share_statistics`` sends, and ``get_state`` goes into that learner's checkpoint."""

    def __call__(self, *args: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of a minibatch, called as the learner calls a loss function."""
        raise NotImplementedError

    def share_statistics(self, comm: MPI.Comm) -> None:
        """Once, on every learner as it starts: ``comm`` joins the learners, over which the
        loss may average its statistics from now on (a collective in every call then)."""

    def get_state(self) -> dict[str, Any] | None:
        """What a resumed run needs of the loss, saved in the learner's checkpoint; None
        saves nothing."""
        return None

    def set_state(self, state: dict[str, Any]) -> None:
        """Take back ``get_state``'s values from a checkpoint."""


@dataclass(frozen=True)
class _FunctionLoss(StatefulLoss):
    """A plain loss function as a ``StatefulLoss`` with no state."""

    function: Callable[..., tuple[torch.Tensor, dict[str, float]]]

    def __call__(self, *args: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return self.function(*args)


def as_stateful_loss(loss: Any) -> StatefulLoss:
    """``loss`` with the hooks of ``StatefulLoss``: itself if it subclasses it, else a plain
    function wrapped in no-op hooks."""
    return loss if isinstance(loss, StatefulLoss) else _FunctionLoss(loss)


@dataclass(frozen=True, kw_only=True)
class LearnerSettings:
    """What a learner (``Learner``, ``QLearner``) is built from; it crosses to each learner rank
    once, when the learner is spawned."""

    policy: Any
    """The spec of the model it trains (``PolicySpec``, ``QSpec``, ...)."""
    loss: LossFn
    loss_config: CommonConfig
    """The algorithm's config, which the loss reads (and the Q learners their target update)."""
    lr: float
    grad_clip: float | None
    """Global gradient-norm clip; 0 or None turns it off."""
    seed: int
    backend: str = "auto"
    """The gradient allreduce: auto, mpi, gloo or nccl."""
    torch_threads: int = 1
    master_addr: str = ""
    """The address learner 0's TCPStore listens on (gloo, nccl); empty picks one."""
    # A multi-agent run's policy: its learners are a slice of the learner ranks, and several
    # policies' workers may share a rank.
    members: tuple[int, ...] | None = None
    """The learner indices of the policy's slice of the learner ranks (None: all of them)."""
    policy_index: int | None = None
    """The policy's place among the run's policies: its messages' tags (None: a single-agent
    run's)."""
    weights_to: tuple[int, ...] = ()
    """The rollout ranks ``broadcast_weights`` sends the weights to by message, where they
    share their ranks with other policies' workers (a multi-agent run); empty: the broadcast
    over the weights communicator."""

    def for_policy(self, *, members: list[int], policy_index: int,
                   weights_to: list[int]) -> LearnerSettings:
        """These settings for one policy of a multi-agent run (``members``, its learner
        indices; ``weights_to``, the rollout ranks)."""
        return dataclasses.replace(self, members=tuple(members), policy_index=policy_index,
                                   weights_to=tuple(weights_to))

    @classmethod
    def from_config(cls, config: CommonConfig, *, policy: Any, loss: LossFn
                    ) -> LearnerSettings:
        """The settings of a run with ``config``. A3C's learner makes no allreduce, and its config
        has neither allreduce key."""
        backend, master_addr = config.allreduce_options()
        return cls(policy=policy, loss=loss, loss_config=config, lr=config.lr,
                   grad_clip=config.grad_clip, seed=config.seed, backend=backend,
                   torch_threads=config.torch_threads, master_addr=master_addr)


class Learner(Worker):
    """One data-parallel learner: receives batches, runs minibatch SGD, shares weights.

    A loss is a mean over its minibatch's rows, or over the steps its ``mask`` keeps where the
    minibatch has one (V-trace fragments); that count weighs the learner's gradient in the
    allreduce (``minibatch_rows``)."""

    MESSAGES = ("train", "train_offline", "get_weights", "set_weights", "broadcast_weights",
                "save_state", "load_state", "apply_gradients", "histograms", "train_streamed",
                "pushes_sent", "end_rounds")
    #: The data-channel tags of its messages (a multi-agent policy's learner has its own).
    tags = DataTags()
    #: On a policy's slice of the learner ranks (``LearnerSettings.for_policy``).
    SERVES_A_POLICY = True

    Settings: ClassVar[type[LearnerSettings]] = LearnerSettings

    def __init__(self, context: RankContext, settings: LearnerSettings) -> None:
        if settings.members is not None:
            context = policy_context(context, list(settings.members))
        super().__init__(context)
        self.tags = DataTags.of_policy(settings.policy_index)
        self.weights_to = settings.weights_to
        loss, lr, seed = settings.loss, settings.lr, settings.seed
        torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(seed)
        self.device = torch.device(context.device)
        self.policy = build_torch_model(settings.policy, context.device)
        #: How batches reach the device (``BatchTransfer``: pageable unless measured otherwise).
        self.transfer = BatchTransfer(self.device)
        self.loss, self.loss_config = as_stateful_loss(loss), settings.loss_config
        self.callbacks = make_callbacks(self.loss_config.callbacks)
        self.allreduce = GradientAllreduce(context, settings.backend, settings.master_addr)
        self.loss.share_statistics(context.role_comm)
        self.params = list(self.policy.parameters())
        # Learners start from learner 0's initial weights, whatever their seeds did.
        flat = self.policy.get_flat_weights()
        context.role_comm.Bcast(flat, root=0)
        self.policy.set_flat_weights(flat)
        self.optimizer = Adam(self.params, lr=lr, eps=1e-5)
        self.lr = lr
        self.grad_clip = settings.grad_clip
        self.rng = np.random.default_rng(seed + 7919 * context.role_index)
        #: The (shared, unclipped) gradient norm of each SGD step since ``histograms()`` last ran.
        self.grad_norms: deque[float] = deque(maxlen=100_000)
        # Streamed fragments: the weights version trained so far, and the pushes of new
        # weights sent to each rollout rank.
        self.stream_version = 0
        self.pushes: dict[int, int] = {}
        self.failed_ranks: set[int] = set()  # rollout ranks MPI reported failed (ULFM)
        #: How long the gathers of the sampling rounds it roots took (``gathered.RoundWaits``).
        self.sample_round_waits = gathered.RoundWaits()
        # Offline algorithms only: this learner's shard of a dump, read on the first call.
        self.offline_shard: EpisodeShard | None = None

    def train(self, sources: list[int], batches: list[dict] | None, num_epochs: int,
              num_minibatches: int, lr: float | None = None,
              standardize: tuple[str, ...] = ("advantages",)) -> dict[str, float]:
        """Receive the batches of rollout ranks ``sources`` (or take ``batches`` given in the
        call, unpacking those that came packed in a gather), then run ``num_epochs`` passes of
        ``num_minibatches`` SGD steps. Every learner must run the same number of steps: each
        step is an allreduce.

        Batches may be short (rows dropped after env failures) or missing (a source rank lost
        before its batch came whole, survived under ULFM), so learners exchange their row counts
        first: with fewer rows than minibatches anywhere, every learner takes fewer steps alike,
        and with no rows at all none is taken. A learner whose share of a step is empty adds
        no rows to it: each step's gradient is that of the rows all learners had."""
        parts = [b.unpack() if isinstance(b, gathered.PackedBatch) else b
                 for b in batches or []] + (
            self.context.data_channel.recv_each(sources, self.tags.batch) if sources else [])
        batch = (concat_batches(parts) if parts
                 else {k: np.zeros(0, np.float32) for k in ("advantages", *standardize)})
        size = len(next(iter(batch.values())))  # rows; a row may be a whole fragment (V-trace)
        comm = self.context.role_comm
        sizes = comm.allgather(size) if comm.Get_size() > 1 else [size]
        num_minibatches = min(num_minibatches, max(sizes))
        if num_minibatches == 0:
            return {"sgd_steps": 0, "learner_samples": 0}
        standardize_fields(batch, standardize, comm)
        self._set_lr(lr)
        tensors = self.transfer(batch)
        totals: dict[str, float] = {}
        steps = losses = 0
        for _ in range(num_epochs):
            # One host-to-device copy of the epoch's order, not one per minibatch; tensor_split
            # cuts it as np.array_split would.
            order = torch.as_tensor(self.rng.permutation(size), device=self.device)
            for index in torch.tensor_split(order, num_minibatches):
                minibatch = None if len(index) == 0 else {
                    k: v[index] for k, v in tensors.items()}
                losses += self._sgd_step(minibatch, totals)
                steps += 1
        result = {k: v / max(losses, 1) for k, v in totals.items()} | {
            "sgd_steps": steps, "learner_samples": size}
        self.learned_on(batch, result)
        return result

    def train_streamed(self, min_env_steps: int, env_steps: int, owed: int, wait_s: float,
                       num_epochs: int, num_minibatches: int, lr: float | None = None,
                       standardize: tuple[str, ...] = ()) -> dict[str, Any]:
        """Train on the fragments rollout ranks stream here (``sample_fragments``), update
        after update, until ``env_steps`` steps were taken, or the ``owed`` fragments (all this
        learner's workers were asked for) came, or none came within ``wait_s``; every learner
        stops after the same update (one allreduce each). Each update takes the fragments that
        came, from any ranks, once they hold ``min_env_steps`` steps (stragglers hold up
        nobody), trains on them (``train``) and pushes the new weights to their ranks, one
        message each, without waiting.

        Returns the updates' mean loss statistics, ``updates``, ``received`` (rank ->
        fragments), ``env_steps_received``, ``policy_lag_sum`` and ``policy_lag_max`` (weights
        versions behind, over the fragments)."""
        comm = self.context.role_comm
        received: dict[int, int] = {}
        rows: list[dict[str, float]] = []
        lags = [0, 0]  # sum, max
        taken = 0
        while True:
            parts, steps, sources = self._take_fragments(min_env_steps, owed, wait_s, lags)
            owed -= len(parts)
            taken += steps
            result = self.train([], parts, num_epochs, num_minibatches, lr, standardize)
            rows.append(result)
            if result["sgd_steps"]:
                self.stream_version += 1
                self._push_weights(list(sources))
            for rank, count in sources.items():
                received[rank] = received.get(rank, 0) + count
                if result["sgd_steps"]:
                    self.pushes[rank] = self.pushes.get(rank, 0) + 1
            done = taken >= env_steps or owed <= 0 or not parts
            if comm.Get_size() > 1:
                done = bool(comm.allreduce(int(done), op=MPI.MAX))
            if done:
                break
        keys = dict.fromkeys(k for row in rows for k in row)
        stats = {k: sum(float(r[k]) for r in rows if k in r) / sum(k in r for r in rows)
                 for k in keys}
        return stats | {"updates": len(rows), "received": received, "env_steps_received": taken,
                        "policy_lag_sum": lags[0], "policy_lag_max": lags[1]}

    def _push_weights(self, ranks: list[int]) -> None:
        """Start sending the weights, with their version, to rollout ``ranks`` (not to those
        that failed, under ULFM)."""
        isend_to_survivors(self.context.data_channel,
                           (self.stream_version, self.policy.get_flat_weights()), ranks,
                           self.tags.pushed_weights, self.failed_ranks)

    def _take_fragments(self, min_env_steps: int, owed: int, wait_s: float, lags: list[int]
                        ) -> tuple[list[dict], int, dict[int, int]]:
        """The fragments streamed here, once they hold ``min_env_steps`` steps and no other has
        come, or ``owed`` came, or ``wait_s`` passed: their batches, env steps and sources
        (rank -> count); ``lags`` (sum, max) takes their policy lags."""
        channel = self.context.data_channel
        parts: list[dict] = []
        sources: dict[int, int] = {}
        steps = 0
        deadline = time.monotonic() + wait_s
        # A wait on many ranks at once, as the driver's: a short spin after each fragment.
        backoff = Backoff(spin_s=DRIVER_SPIN_S)
        while len(parts) < owed:
            turn_began = time.thread_time()
            item = poll_any_source(channel, self.tags.stream)
            if item is None:
                if steps >= min_env_steps or time.monotonic() > deadline:
                    break
                backoff.sleep()
                # Waiting, not training: on rank 0 (a hosted learner) it counts as idle.
                DRIVER_CPU.idle_s += time.thread_time() - turn_began
                continue
            (version, env_steps, batch), source = item
            backoff.reset()
            parts.append(batch)
            sources[source] = sources.get(source, 0) + 1
            steps += env_steps
            lag = self.stream_version - version
            lags[0] += lag
            lags[1] = max(lags[1], lag)
        return parts, steps, sources

    def pushes_sent(self) -> dict[int, int]:
        """Rollout rank -> the weight pushes ``train_streamed`` sent it in all."""
        return dict(self.pushes)

    def train_offline(self, source: OfflineInput, num_steps: int, train_batch_size: int,
                      lr: float | None = None) -> dict[str, float]:
        """Run ``num_steps`` SGD steps on rows drawn from this learner's own shard of the dump
        at ``source.path``; each step takes ``train_batch_size`` rows summed over learners.
        Only the path crosses ranks: the shard is read here, on the first call."""
        comm = self.context.role_comm
        if self.offline_shard is None:
            self.offline_shard = load_shard(source, comm)
        self._set_lr(lr)
        rows = rows_per_learner(train_batch_size, comm.Get_size(), comm.Get_rank())
        totals: dict[str, float] = {}
        minibatch = {}
        for _ in range(num_steps):
            minibatch = self.transfer(self.offline_shard.sample(rows, self.rng))
            self._sgd_step(minibatch, totals)
        result = {k: v / max(num_steps, 1) for k, v in totals.items()} | {
            "sgd_steps": num_steps, "learner_samples": rows * num_steps}
        self.learned_on(minibatch, result)
        return result

    def learned_on(self, batch: dict[str, Any], result: dict[str, Any]) -> None:
        """Run the ``on_learn_on_batch`` callback after a training call."""
        invoke(self.callbacks, "on_learn_on_batch",
               f"learner {self.context.role_index} on rank {self.context.rank}", learner=self,
               batch=batch, result=result)

    def _set_lr(self, lr: float | None) -> None:
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def _sgd_step(self, minibatch: dict[str, torch.Tensor] | None,
                  totals: dict[str, float]) -> bool:
        """One step that every learner takes together: the gradient of every learner's rows
        (none here for ``minibatch`` None), clipped and applied. Adds the loss statistics to
        ``totals``; True if this learner had rows."""
        if minibatch is None:
            for p in self.params:
                p.grad = torch.zeros_like(p)
        else:
            loss, stats = self.loss(self.policy, minibatch, self.loss_config)
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        self._apply_shared_gradient(0.0 if minibatch is None else minibatch_rows(minibatch))
        return minibatch is not None

    def _apply_shared_gradient(self, rows: float) -> None:
        """Replace this learner's gradient (of a mean over ``rows`` rows) by the gradient of all
        learners' rows (``share_gradient``), clip it and take the optimizer step; no step when
        no learner had rows, since Adam would still move on its momentum."""
        flat = share_gradient(self.params, self.allreduce, rows)
        if flat is None:
            return
        self.grad_norms.append(float(flat.norm()))
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()

    def apply_gradients(self, flat: np.ndarray) -> np.ndarray:
        """Apply one gradient computed elsewhere (an A3C rollout worker's flat vector), clipped,
        with this learner's optimizer; return the new weights. For a single learner: no
        allreduce is made."""
        self.policy.set_flat_gradients(flat)
        self.grad_norms.append(float(np.linalg.norm(flat)))
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        return self.policy.get_flat_weights()

    def get_weights(self) -> np.ndarray:
        return self.policy.get_flat_weights()

    def histograms(self) -> dict[str, np.ndarray]:
        """What TensorBoard's histograms show: each parameter tensor (``weights/<name>``) and the
        gradient norms of the SGD steps since the last call (``grad_norm``)."""
        values = {f"weights/{name}": p.detach().cpu().numpy().reshape(-1)
                  for name, p in self.policy.named_parameters()}
        values["grad_norm"] = np.array(self.grad_norms, np.float64)
        self.grad_norms.clear()
        return values

    def set_weights(self, flat: np.ndarray) -> None:
        self.policy.set_flat_weights(flat)

    def get_state(self) -> dict[str, Any]:
        """Weights, optimizer state (moved to the CPU, so a GPU checkpoint loads anywhere), the
        RNGs that choose minibatches and the loss's own state if it has one (MARWIL's moving
        average). An offline shard is not saved: it is read again from the dump, and the
        minibatch RNG says which rows come next."""
        optimizer = _to_cpu(self.optimizer.state_dict())
        state = {WEIGHTS_KEY: self.policy.get_flat_weights(), "optimizer": optimizer,
                 "minibatch_rng": self.rng.bit_generator.state, "rng": capture_rng()}
        loss_state = self.loss.get_state()
        if loss_state is not None:
            state["loss"] = loss_state
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self.policy.set_flat_weights(state[WEIGHTS_KEY])
        self.optimizer.load_state_dict(state["optimizer"])
        # The run's config decides the learning rate, not the checkpoint's optimizer state: a
        # resume that changes lr (or PBT's explore step) must take effect.
        self._set_lr(self.lr)
        self.rng.bit_generator.state = state["minibatch_rng"]
        if "loss" in state:
            self.loss.set_state(state["loss"])
        restore_rng(state["rng"])

    def broadcast_weights(self, gather_answers: bool = False,
                          round_header: Any = None) -> list[bytes] | None:
        """Send this learner's weights to every rollout rank: the root of one ``Bcast`` (by
        message where the ranks are shared with other policies' workers: ``weights_to``). With
        ``gather_answers`` (the rollout workers' ``sample(deliver=Gathered(...))``), then the
        root of the gather of their answers (``mpirl.runtime.gathered``), which it returns:
        they cross to the driver as one message. With ``round_header`` the weights start a
        round of the rollout workers' standing ``sample_rounds`` calls, the header first
        (``gathered.start_round``)."""
        context = self.context
        # get_weights: what a subclass's rollout workers take (MBPO's: its actor and ensemble).
        flat = self.get_weights()
        if self.weights_to:  # ranks shared with other policies' workers: by message
            flush_to_survivors(context.data_channel, self.failed_ranks)  # the last round's
            isend_to_survivors(context.data_channel, flat, list(self.weights_to),
                               self.tags.broadcast, self.failed_ranks)
        elif round_header is None:
            bcast_weights(context.weights_comm, flat, context.collective_timeout_s)
        else:
            gathered.start_round(context, round_header, flat)
        if not gather_answers:
            return None
        return gathered.gather_answers(context, self.sample_round_waits)

    def end_rounds(self) -> None:
        """End the rollout workers' standing ``sample_rounds`` calls: an empty round header."""
        gathered.start_round(self.context, None, gathered.NO_WEIGHTS)
