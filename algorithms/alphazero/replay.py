"""AlphaZero's replay shard: the newest positions of finished self-play games, on a learner."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpirl.algorithms.alphazero.self_play import SelfPlayBatch


class PositionReplay:
    """The newest ``capacity`` positions (a FIFO ring), sampled uniformly; each with the
    version of the weights that played it (``versions``)."""

    FIELDS = ("observations", "masks", "policies", "outcomes", "versions")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.arrays: dict[str, np.ndarray] = {}
        self.size = self.next = 0
        self.added = 0

    def add(self, batch: SelfPlayBatch, version: int = 0) -> None:
        """Add ``batch``'s positions, played by the weights of ``version``."""
        n = len(batch)
        if not n:
            return
        rows = batch.as_dict() | {"versions": np.full(n, version, np.int64)}
        if not self.arrays:
            self.arrays = {k: np.zeros((self.capacity, *v.shape[1:]), v.dtype)
                           for k, v in rows.items()}
        # Only the newest capacity rows of an oversized batch can stay.
        rows = {k: v[-self.capacity:] for k, v in rows.items()}
        kept = min(n, self.capacity)
        index = (self.next + np.arange(kept)) % self.capacity
        for key, value in rows.items():
            self.arrays[key][index] = value
        self.next = int((self.next + kept) % self.capacity)
        self.size = min(self.size + kept, self.capacity)
        self.added += n

    def sample(self, count: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """``count`` positions drawn uniformly (``FIELDS``, ``versions`` among them)."""
        rows = rng.integers(0, self.size, count)
        return {k: v[rows] for k, v in self.arrays.items()}

    def get_state(self) -> dict[str, Any]:
        return {"arrays": {k: v[:self.size].copy() for k, v in self.arrays.items()},
                "size": self.size, "next": self.next, "added": self.added}

    def set_state(self, state: dict[str, Any]) -> None:
        self.arrays, self.size = {}, state["size"]
        for key, value in state["arrays"].items():
            full = np.zeros((self.capacity, *value.shape[1:]), value.dtype)
            kept = min(len(value), self.capacity)
            full[:kept] = value[:kept]
            self.arrays[key] = full
        if self.arrays and "versions" not in self.arrays:  # saved before versions were kept
            self.arrays["versions"] = np.zeros(self.capacity, np.int64)
        self.size = min(self.size, self.capacity)
        self.next = state["next"] % self.capacity
        self.added = state["added"]
