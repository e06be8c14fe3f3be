"""Moving a sample batch from host memory onto a learner's device.

Two ways. ``pageable``: ``torch.as_tensor`` straight from the NumPy array, where CUDA's driver
stages the copy through pinned memory of its own, overlapping its host copies with the transfer.
``pinned``: each array is first copied into a page-locked buffer kept for its key (grown as
batches grow), then sent with an asynchronous copy that reads host memory directly. Pageable is
the default everywhere: on an H200 with 16 host cores (``benchmarks/learner_throughput.py``,
RESULTS.md, 2026-11-26) a 55 MB Atari batch moved at 18 GB/s pageable against 12.5 GB/s through
the reused pinned buffers, the extra host copy costing more than the faster transfer saves. The
pinned way pays only where batches land in pinned memory to begin with. Nothing here crosses
ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

#: How a batch reaches the device: "pageable" (``torch.as_tensor`` straight from the NumPy
#: array), "pinned" (a reused page-locked buffer per key, then an asynchronous copy; CUDA only)
#: or "auto", which is pageable: the faster of the two where measured (see above).
TRANSFER_MODES = ("auto", "pinned", "pageable")


class BatchTransfer:
    """Copies batches (``{key: ndarray}``) onto ``device``, the pinned way through buffers kept
    across calls.

    The buffers are rewritten by the next call, so before refilling them that call waits for
    the copies of the last one to finish reading them (a CUDA event), not for anything else
    queued on the device."""

    def __init__(self, device: torch.device | str, mode: str = "auto") -> None:
        if mode not in TRANSFER_MODES:
            raise ValueError(f"transfer mode must be one of {', '.join(TRANSFER_MODES)}, "
                             f"got {mode!r}")
        self.device = torch.device(device)
        self.mode = "pinned" if mode == "pinned" else "pageable"
        if self.mode == "pinned" and self.device.type != "cuda":
            raise ValueError(f"pinned transfers need a CUDA device, not {self.device}")
        #: One page-locked byte buffer per batch key, never shrunk.
        self.buffers: dict[str, torch.Tensor] = {}
        self._copied: Any = None  # torch.cuda.Event of the last call's copies

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The batch's arrays as tensors on the device (the same dtypes and shapes)."""
        if self.mode == "pageable":
            return {k: torch.as_tensor(v, device=self.device) for k, v in batch.items()}
        if self._copied is not None:
            self._copied.synchronize()
        tensors = {k: self._send(k, v) for k, v in batch.items()}
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return tensors

    def _send(self, key: str, value: Any) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(value))
        nbytes = host.numel() * host.element_size()
        if nbytes == 0:
            return host.to(self.device)
        staged = self._buffer(key, nbytes)[:nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)

    def _buffer(self, key: str, nbytes: int) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            # Grown by half again: batches of a varying row count (async fragments, dropped
            # rows) then settle on a buffer instead of pinning anew on each larger one.
            size = max(nbytes, int(buffer.numel() * 1.5) if buffer is not None else 0)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.buffers[key] = buffer
        return buffer

    def pinned_bytes(self) -> int:
        """Page-locked host memory held by this learner's buffers."""
        return sum(buffer.numel() for buffer in self.buffers.values())
