"""A generation's records: what one rollout rank of ES or ARS answers for a generation, and the
update every rank applies, made from all of them.

A rank's record is one float64 vector (``pack_generation``): per pair its noise index, returns and
lengths, the evaluation episodes, and the observation statistics' delta; never weights. The
records gather where the update is made (``UPDATE_ROOT``, or the driver under ULFM), which sums
them up (``summarize_generation``) into the update message broadcast to every rank
(``update_message``).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from mpirl.models.statistics import RunningMeanStd

UPDATE_ROOT = 1
"""weights_comm's member (the first rollout rank) that gathers a generation's records, makes
its update and broadcasts it, where the answers gather: rank 0 (member 0) does none of it."""

GENERATION_HEAD = ("pairs", "evaluations", "filter_size", "env_steps", "pairs_abandoned",
                   "env_failures", "pss_mb", "filter_count")
"""The fixed fields that open a rank's generation record (``pack_generation``)."""


def pack_generation(indices: list[int], returns: list[list[float]], lengths: list[list[int]],
                    eval_returns: list[float], eval_lengths: list[int], env_steps: int,
                    pairs_abandoned: int, env_failures: int, pss_mb: float,
                    delta: RunningMeanStd | None) -> np.ndarray:
    """A rank's answer to a generation as one float64 vector: ``GENERATION_HEAD``, then the n
    pairs' noise indices, returns (2n) and lengths (2n), the e evaluation returns and lengths,
    and the observation statistics' delta (mean, variance; none if ``delta`` is None). It
    crosses to rank 0 as raw bytes (``gathered.encode_answer``), and rank 0 reads every rank's
    in a few array operations (``unpack_generations``), not one unpickling per rank. Every
    number is exact in a float64: indices and counts are far below 2**53."""
    size = 0 if delta is None else delta.mean.size
    head = [len(indices), len(eval_returns), size, env_steps, pairs_abandoned, env_failures,
            pss_mb, 0.0 if delta is None else delta.count]
    parts = [head, indices, np.ravel(returns), np.ravel(lengths), eval_returns, eval_lengths]
    if delta is not None:
        parts += [delta.mean.ravel(), delta.var.ravel()]
    return np.concatenate([np.asarray(part, np.float64) for part in parts])


_RECORD_FIELDS = ("indices", "returns", "lengths", "eval_returns", "eval_lengths",
                  "filter_means", "filter_vars")
"""The variable parts of a generation record, in order after its head."""


def unpack_generations(records: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The ranks' records (``pack_generation``), in rank order, as arrays: ``indices`` [N],
    ``returns`` and ``lengths`` [N, 2], ``eval_returns`` and ``eval_lengths``, the
    per-rank ``GENERATION_HEAD`` fields (``env_steps`` and so on, [R]), and the filter
    deltas ``filter_means`` and ``filter_vars`` [R, size]. Each value is labelled with its
    part, and each part is taken in one step: some 30 array operations, whatever the ranks."""
    count, width = len(records), len(GENERATION_HEAD)
    values = np.concatenate(records)
    sizes = np.fromiter(map(len, records), np.int64, count)
    head = values[(np.cumsum(sizes) - sizes)[:, None] + np.arange(width)]
    pairs, evaluations, filter_size = head[:, 0], head[:, 1], head[:, 2]
    spans = np.stack([np.full(count, width), pairs, 2 * pairs, 2 * pairs, evaluations,
                      evaluations, filter_size, filter_size], axis=1).astype(np.int64)
    labels = np.repeat(np.tile(np.arange(len(_RECORD_FIELDS) + 1), count), spans.ravel())
    out = {name: head[:, i] for i, name in enumerate(GENERATION_HEAD)}
    for label, name in enumerate(_RECORD_FIELDS, 1):
        out[name] = values[labels == label]
    out["indices"] = out["indices"].astype(np.int64)
    out["returns"] = out["returns"].reshape(-1, 2)
    out["lengths"] = out["lengths"].astype(np.int64).reshape(-1, 2)
    out["eval_lengths"] = out["eval_lengths"].astype(np.int64)
    size = int(filter_size.max(initial=0))
    out["filter_means"] = out["filter_means"].reshape(count, size)
    out["filter_vars"] = out["filter_vars"].reshape(count, size)
    return out


def summarize_generation(records: list[np.ndarray]) -> dict[str, Any]:
    """What a generation's update and its statistics need of the ranks' records, in rank
    order: the pairs' noise ``indices`` and ``returns``, the summed ``filter_delta`` (flat mean,
    variance, count), the evaluation episodes, and totals. Its size grows with the pairs and
    evaluation episodes, not with the ranks' other fields. Made by the update's root where the
    answers gather (``PerturbationWorker._generation_then_update``), else by the driver."""
    found = unpack_generations(records)
    delta = RunningMeanStd(found["filter_means"].shape[1:])
    delta.merge_stacked(found["filter_count"], found["filter_means"], found["filter_vars"])
    lengths = found["lengths"]
    return {"indices": found["indices"], "returns": found["returns"],
            "filter_delta": (delta.mean, delta.var, delta.count),
            "len_mean": float(lengths.mean()) if lengths.size else float("nan"),
            "eval_returns": found["eval_returns"].tolist(),
            "eval_lengths": found["eval_lengths"].tolist(),
            "env_steps": int(found["env_steps"].sum()),
            "env_failures": int(found["env_failures"].sum()),
            "pairs_abandoned": int(found["pairs_abandoned"].sum()),
            "pss_mb": float(found["pss_mb"].sum()),
            "record_bytes": int(records[0].nbytes) if records else 0}


def update_message(generation: int, summary: dict[str, Any]) -> bytes:
    """The update every rank applies (``PerturbationWorker._take_update_message``): the
    generation's number and its ``summarize_generation``."""
    return pickle.dumps((generation, summary), protocol=5)
