"""Batch arithmetic shared by learners and operators: concatenation and standardized fields. Local
to one rank."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI


def concat_batches(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch from several with the same keys, rows in the order given."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def standardize_fields(batch: dict[str, np.ndarray], fields: tuple[str, ...],
                       comm: MPI.Comm | None = None) -> None:
    """Shift and scale ``fields`` in place to mean 0 and std 1, over the rows of every rank of
    ``comm`` (one small allreduce), so data-parallel learners standardize alike. A batch of
    sequences (a recurrent policy's) counts only the steps its ``mask`` keeps, and its padding
    stays 0."""
    for name in fields:
        values = batch[name].astype(np.float64)
        mask = batch.get("mask")
        weights = mask.astype(np.float64) if mask is not None and mask.shape == values.shape \
            else np.ones_like(values)
        sums = np.array([weights.sum(), (values * weights).sum(),
                         (np.square(values) * weights).sum()])
        if comm is not None and comm.Get_size() > 1:
            comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        count, total, squares = sums
        mean = total / count
        std = np.sqrt(max(squares / count - mean**2, 0.0))
        batch[name] = ((values - mean) / (std + 1e-8) * (weights > 0)).astype(np.float32)
