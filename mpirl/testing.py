"""Fake, deterministic workers for tests, benchmarks and ``mpirl doctor``-style checks.

They live in the package (not under tests/) because every rank must be able to import a worker
class by name when the driver spawns it.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import numpy as np

from mpirl.core import RankContext, Worker


class Echo(Worker):
    """Echoes, counts, sleeps, fails and exits on request; reports where it runs."""

    MESSAGES = (
        "echo", "ping", "count", "sleep_then", "fail", "exit_outside_task", "make_array",
        "checksum", "whoami", "unpicklable_result",
    )

    def __init__(self, context: RankContext, label: str = "") -> None:
        super().__init__(context)
        self.label = label
        self.calls = 0

    def echo(self, value: Any) -> Any:
        self.calls += 1
        return value

    def ping(self) -> None:
        return None

    def count(self) -> int:
        """How many ``echo`` calls this worker has served (its state survives errors)."""
        return self.calls

    def sleep_then(self, seconds: float, value: Any) -> Any:
        time.sleep(seconds)
        return value

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def exit_outside_task(self, code: int) -> None:
        # SystemExit is not an Exception: it escapes the serve loop like a crash of the loop.
        raise SystemExit(code)

    def make_array(self, nbytes: int, seed: int) -> np.ndarray:
        return deterministic_bytes(nbytes, seed)

    def checksum(self, array: np.ndarray) -> tuple[tuple[int, ...], str, str]:
        return array.shape, str(array.dtype), sha256(array)

    def whoami(self) -> dict[str, Any]:
        ctx = self.context
        return {"rank": ctx.rank, "role": ctx.role, "index": ctx.role_index,
                "role_size": ctx.role_size, "pid": os.getpid(), "label": self.label}

    def unpicklable_result(self) -> Any:
        return lambda: None


class FailingConstructor(Worker):
    """A worker whose constructor raises on the ranks listed, to test that spawn reports it."""

    MESSAGES = ()

    def __init__(self, context: RankContext, failing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(context)
        if not failing_ranks or context.rank in failing_ranks:
            raise RuntimeError(f"constructor refused on rank {context.rank}")


def deterministic_bytes(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` pseudo-random uint8 values, the same on every rank for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()
