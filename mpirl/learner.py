"""Learners: data-parallel SGD over the learner ranks, with one gradient allreduce per step.

Every learner holds the same policy and optimizer. Each receives its share of the sample batches
straight from rollout ranks, and every SGD step averages the flattened gradients of all learners
in one allreduce, so after every update all learners hold identical weights. Offline algorithms
(BC, MARWIL) have no sampling: each learner reads its own shard of a trajectory dump instead
(``train_offline``), with the same allreduce per step.

The allreduce backend: NCCL through ``torch.distributed`` on GPUs, MPI (``Allreduce`` on the
learner communicator) on CPUs, or Gloo on request. A torch process group is bootstrapped over the
learner communicator: learner 0 opens a ``TCPStore`` and broadcasts its address, so the driver and
the rollout ranks never join it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpirl.checkpoint import capture_rng, restore_rng
from mpirl.core import RankContext, Worker
from mpirl.errors import ConfigError
from mpirl.offline import EpisodeShard, OfflineInput, load_shard, rows_per_learner
from mpirl.operators import concat_batches, standardize_fields
from mpirl.policy import PolicySpec
from mpirl.rollout import BATCH_TAG
from mpirl.ulfm import revoke_on_failure
from mpirl.waiting import wait_for_all

BACKENDS = ("auto", "mpi", "gloo", "nccl")


class GradientAllreduce:
    """Averages a flat gradient buffer over the learner ranks."""

    def __init__(self, context: RankContext, backend: str) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"learner_backend must be one of {', '.join(BACKENDS)}, "
                              f"got {backend!r}")
        if backend == "auto":
            backend = "nccl" if context.device.startswith("cuda") else "mpi"
        if backend == "nccl" and not context.device.startswith("cuda"):
            raise ConfigError("learner_backend 'nccl' needs CUDA learners; this learner runs on "
                              f"{context.device}. Use 'mpi' or 'gloo' on CPUs.")
        self.backend = backend
        self.comm = context.role_comm
        self.size = self.comm.Get_size()
        self.group = None
        if self.size > 1 and backend in ("gloo", "nccl"):
            self.group = _init_process_group(self.comm, backend)

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return flat
        if self.group is not None:
            torch.distributed.all_reduce(flat, group=self.group)
            return flat.div_(self.size)
        host = flat.cpu().numpy() if flat.is_cuda else flat.numpy()
        self.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        result = torch.from_numpy(host).div_(self.size)
        return result.to(flat.device) if flat.is_cuda else result


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _init_process_group(comm: MPI.Comm, backend: str):
    import torch.distributed as dist

    if comm.Get_rank() == 0:
        host = socket.gethostbyname(socket.gethostname())
        store = dist.TCPStore(host, 0, comm.Get_size(), is_master=True, wait_for_workers=False)
        address = (host, store.port)
    else:
        address = None
    address = comm.bcast(address, root=0)
    if comm.Get_rank() != 0:
        store = dist.TCPStore(address[0], address[1], comm.Get_size(), is_master=False)
    if not dist.is_initialized():
        dist.init_process_group(backend, store=store, rank=comm.Get_rank(),
                                world_size=comm.Get_size())
    return dist.group.WORLD


LossFn = Callable[[Any, dict[str, torch.Tensor], Any], tuple[torch.Tensor, dict[str, float]]]


class Learner(Worker):
    """One data-parallel learner: receives batches, runs minibatch SGD, shares weights."""

    MESSAGES = ("train", "train_offline", "get_weights", "set_weights", "broadcast_weights",
                "save_state", "load_state", "apply_gradients")

    def __init__(self, context: RankContext, policy: PolicySpec, loss: LossFn, loss_config: Any,
                 lr: float, grad_clip: float | None, seed: int, backend: str = "auto",
                 torch_threads: int = 1) -> None:
        super().__init__(context)
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self.device = torch.device(context.device)
        self.policy = policy.build(context.device)
        self.loss, self.loss_config = loss, loss_config
        self.allreduce = GradientAllreduce(context, backend)
        self.params = list(self.policy.parameters())
        # Learners start from learner 0's initial weights, whatever their seeds did.
        flat = self.policy.get_flat_weights()
        context.role_comm.Bcast(flat, root=0)
        self.policy.set_flat_weights(flat)
        self.optimizer = torch.optim.Adam(self.params, lr=lr, eps=1e-5)
        self.grad_clip = grad_clip
        self.rng = np.random.default_rng(seed + 7919 * context.role_index)
        # Offline algorithms only: this learner's shard of a dump, read on the first call.
        self.offline_shard: EpisodeShard | None = None

    def train(self, sources: list[int], batches: list[dict] | None, num_epochs: int,
              num_minibatches: int, lr: float | None = None,
              standardize: tuple[str, ...] = ("advantages",)) -> dict[str, float]:
        """Receive the batches of rollout ranks ``sources`` (or take ``batches`` given in the
        call), then run ``num_epochs`` passes of ``num_minibatches`` SGD steps. Every learner must
        run the same number of steps: each step is an allreduce.

        Batches may be short (rows dropped after env failures) or missing (a source rank lost
        before its batch came whole, survived under ULFM), so learners exchange their row counts
        first: with fewer rows than minibatches anywhere, every learner takes fewer steps alike,
        and with no rows at all none is taken. A learner whose share of a step is empty adds a
        zero gradient to the average."""
        parts = (batches or []) + (
            self.context.data_channel.recv_each(sources, BATCH_TAG) if sources else [])
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
        tensors = {k: torch.as_tensor(v, device=self.device) for k, v in batch.items()}
        totals: dict[str, float] = {}
        steps = losses = 0
        for _ in range(num_epochs):
            for index in np.array_split(self.rng.permutation(size), num_minibatches):
                minibatch = None if len(index) == 0 else {
                    k: v[torch.as_tensor(index, device=self.device)] for k, v in tensors.items()}
                losses += self._sgd_step(minibatch, totals)
                steps += 1
        return {k: v / max(losses, 1) for k, v in totals.items()} | {"sgd_steps": steps,
                                                                     "learner_samples": size}

    def train_offline(self, source: OfflineInput, num_steps: int, train_batch_size: int,
                      lr: float | None = None) -> dict[str, float]:
        """Run ``num_steps`` SGD steps on rows drawn from this learner's own shard of the dump
        at ``source.path``; each step takes ``train_batch_size`` rows summed over learners.
        Only the path crosses ranks: the shard is read here, on the first call."""
        if self.offline_shard is None:
            self.offline_shard = load_shard(source, self.context.role_comm)
        self._set_lr(lr)
        rows = rows_per_learner(train_batch_size, self.context.role_comm.Get_size())
        totals: dict[str, float] = {}
        for _ in range(num_steps):
            minibatch = {k: torch.as_tensor(v, device=self.device)
                         for k, v in self.offline_shard.sample(rows, self.rng).items()}
            self._sgd_step(minibatch, totals)
        return {k: v / max(num_steps, 1) for k, v in totals.items()} | {
            "sgd_steps": num_steps, "learner_samples": rows * num_steps}

    def _set_lr(self, lr: float | None) -> None:
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def _sgd_step(self, minibatch: dict[str, torch.Tensor] | None,
                  totals: dict[str, float]) -> bool:
        """One step that every learner takes together: this learner's gradient (zero for no
        rows) averaged over all learners, clipped and applied. Adds the loss statistics to
        ``totals``; True if this learner had rows."""
        if minibatch is None:
            for p in self.params:
                p.grad = torch.zeros_like(p)
        else:
            loss, stats = self.loss(self.policy, minibatch, self.loss_config)
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
            for p in self.params:
                if p.grad is None:  # a loss may leave a part unused (BC: the critic)
                    p.grad = torch.zeros_like(p)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        self._average_gradients()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        return minibatch is not None

    def apply_gradients(self, flat: np.ndarray) -> np.ndarray:
        """Apply one gradient computed elsewhere (an A3C rollout worker's flat vector), clipped,
        with this learner's optimizer; return the new weights. For a single learner: no
        allreduce is made."""
        self.policy.set_flat_gradients(flat)
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        return self.policy.get_flat_weights()

    def _average_gradients(self) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        flat = self.allreduce(flat)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n

    def get_weights(self) -> np.ndarray:
        return self.policy.get_flat_weights()

    def set_weights(self, flat: np.ndarray) -> None:
        self.policy.set_flat_weights(flat)

    def get_state(self) -> dict[str, Any]:
        """Weights, optimizer state (moved to the CPU, so a GPU checkpoint loads anywhere), the
        RNGs that choose minibatches and the loss's own state if it has one (MARWIL's moving
        average). An offline shard is not saved: it is read again from the dump, and the
        minibatch RNG says which rows come next."""
        optimizer = _to_cpu(self.optimizer.state_dict())
        state = {"weights": self.policy.get_flat_weights(), "optimizer": optimizer,
                 "minibatch_rng": self.rng.bit_generator.state, "rng": capture_rng()}
        if hasattr(self.loss, "get_state"):
            state["loss"] = self.loss.get_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self.policy.set_flat_weights(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.bit_generator.state = state["minibatch_rng"]
        if "loss" in state:
            self.loss.set_state(state["loss"])
        restore_rng(state["rng"])

    def broadcast_weights(self) -> None:
        """Send this learner's weights to every rollout rank: the root of one ``Bcast``."""
        comm = self.context.weights_comm
        with revoke_on_failure(comm, "the weight broadcast"):
            wait_for_all(comm, self.context.collective_timeout_s, "the weight broadcast")
            comm.Bcast(self.policy.get_flat_weights(), root=0)
