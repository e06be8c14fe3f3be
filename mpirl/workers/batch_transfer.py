"""Moving a sample batch from host memory onto a learner's device.

On a CUDA learner each array of a batch is copied into a page-locked (pinned) host buffer that
is kept for its key and grown as batches grow, then sent with an asynchronous host-to-device copy.
A copy from pageable memory makes the driver stage it through pinned memory of its own, in
chunks, waiting on each; from a buffer that is already pinned the copy engine reads the host
memory directly. ``benchmarks/learner_throughput.py`` measures both. Nothing here crosses ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

#: How a batch reaches the device: "pinned" (a reused page-locked buffer per key, then an
#: asynchronous copy), "pageable" (``torch.as_tensor`` straight from the NumPy array) or
#: "auto" (pinned on CUDA, pageable elsewhere, where there is no copy to speed up).
TRANSFER_MODES = ("auto", "pinned", "pageable")


class BatchTransfer:
    """Copies batches (``{key: ndarray}``) onto ``device``, reusing pinned buffers across calls.

    The buffers are rewritten by the next call, so before refilling them that call waits for
    the copies of the last one to finish reading them (a CUDA event), not for anything else
    queued on the device."""

    def __init__(self, device: torch.device | str, mode: str = "auto") -> None:
        if mode not in TRANSFER_MODES:
            raise ValueError(f"transfer mode must be one of {', '.join(TRANSFER_MODES)}, "
                             f"got {mode!r}")
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.pinned = cuda if mode == "auto" else mode == "pinned"
        if self.pinned and not cuda:
            raise ValueError(f"pinned transfers need a CUDA device, not {self.device}")
        self.mode = "pinned" if self.pinned else "pageable"
        #: One page-locked byte buffer per batch key, never shrunk.
        self.buffers: dict[str, torch.Tensor] = {}
        self._copied: Any = None  # torch.cuda.Event of the last call's copies

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The batch's arrays as tensors on the device (the same dtypes and shapes)."""
        if not self.pinned:
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
