"""Postprocessing: a block of steps (``mpirl.workers.env_runner.Block``) turned into what its
consumer takes, on the rollout rank. Written once for single-agent and multi-agent runs:

* ``advantage_batch``: rows with GAE advantages and value targets (PPO, A2C, A3C; a recurrent
  policy's as sequences, ``sequence_batch``);
* ``fragment_batch``: one V-trace fragment per slot, ``[S, T]`` (IMPALA);
* ``replay_chunk``: the steps a replay shard stores (DQN, Ape-X, SAC).

A slot's steps are its agent's: a step where the slot did not act, or that belongs to an episode
an env failure cut short, is left out of advantage rows and masked in fragments. Nothing here
crosses ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpirl.models.statistics import compute_gae


def _ends(block: Any) -> np.ndarray:
    """Where nothing flows back across a step: an episode's end, an env failure, or a step the
    slot did not act at (between its agents' episodes)."""
    ends = block.terminated | block.truncated | block.failed
    if block.active is not None:
        ends = ends | ~block.active
    return ends


def _used(block: Any) -> np.ndarray:
    """The steps training may use: the slot acted, and no env failure cut its episode."""
    return block.keep if block.active is None else block.keep & block.active


def _bootstrapped_rewards(block: Any, gamma: float) -> np.ndarray:
    """Rewards with ``gamma * V(final_obs)`` folded into the steps a time limit truncated."""
    if block.final_values is None:
        return block.rewards
    return block.rewards + gamma * block.final_values


def advantage_batch(block: Any, last_values: np.ndarray, gamma: float, lam: float,
                    max_seq_len: int = 0) -> dict[str, np.ndarray]:
    """The block as rows for a policy-gradient learner: ``obs``, ``actions``, ``logp`` (the
    behaviour policy's), ``values``, ``advantages`` (GAE) and ``value_targets``; ``critic_obs``
    for a centralized critic. ``last_values`` are the critic's values of ``block.last_obs``.
    A recurrent policy's (``max_seq_len``) come as sequences (``sequence_batch``)."""
    advantages, targets = compute_gae(_bootstrapped_rewards(block, gamma), block.values,
                                      _ends(block).astype(np.float32), last_values, gamma, lam)
    columns = {"obs": block.obs, "actions": block.actions, "logp": block.logp,
               "values": block.values, "advantages": advantages, "value_targets": targets}
    if block.critic_obs is not None:
        columns["critic_obs"] = block.critic_obs
    used = _used(block)
    if block.states is not None:
        return sequence_batch(columns, block.states, block.starts, used, max_seq_len)
    count = used.size
    batch = {key: value.reshape(count, *value.shape[2:]) for key, value in columns.items()}
    if not used.all():
        rows = used.reshape(count)  # [T, S] flattened row-major, as the batch was
        batch = {key: value[rows] for key, value in batch.items()}
    return batch


def sequence_batch(batch: dict[str, np.ndarray], states: np.ndarray, starts: np.ndarray,
                   keep: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """A recurrent policy's batch: ``[T, N, ...]`` step columns cut into sequences of ``length``
    steps along each slot, ``[S, L, ...]``, the last one of each padded. ``state_in`` is the
    state before each sequence's first step, ``resets`` marks the steps that start an episode,
    and ``mask`` keeps the real steps (not padding, nor steps ``keep`` leaves out). Sequences
    with no step to keep are left out."""
    steps, envs = keep.shape
    chunks = -(-steps // length)
    pad = chunks * length - steps

    def cut(value: np.ndarray) -> np.ndarray:
        value = np.swapaxes(value, 0, 1)  # [N, T, ...]
        if pad:
            value = np.concatenate([value, np.zeros((envs, pad, *value.shape[2:]), value.dtype)],
                                   1)
        return value.reshape(envs * chunks, length, *value.shape[2:])

    out = {key: cut(value) for key, value in batch.items()}
    out["resets"] = cut(starts.astype(np.float32))
    out["mask"] = cut(keep.astype(np.float32))
    out["state_in"] = np.swapaxes(states, 0, 1)[:, ::length].reshape(envs * chunks,
                                                                      *states.shape[2:])
    used = out["mask"].any(1)
    if not used.all():
        out = {key: value[used] for key, value in out.items()}
    return {key: np.ascontiguousarray(value) for key, value in out.items()}


def fragment_batch(block: Any, gamma: float) -> dict[str, np.ndarray]:
    """One fragment per slot, for off-policy corrections that walk along time (V-trace):
    ``[S, T, ...]`` arrays, so that every row is one slot's whole fragment and rows can be
    shuffled and split like any batch.

    ``logp`` is the behaviour policy's; ``dones`` end episodes (time limits too, with
    ``gamma * V(final_obs)`` folded into the reward); ``mask`` is 0 on the steps training may
    not use; ``bootstrap_obs`` is what each slot acts on next. A recurrent policy's fragments
    are one sequence each, from ``state_in``, with ``resets`` at its episodes' first steps."""
    def rows(value: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.swapaxes(value, 0, 1))

    batch = {
        "obs": rows(block.obs), "actions": rows(block.actions), "logp": rows(block.logp),
        "rewards": rows(_bootstrapped_rewards(block, gamma)),
        "dones": rows(_ends(block)).astype(np.float32),
        "mask": rows(_used(block)).astype(np.float32),
        # In the observations' own dtype: uint8 images stay bytes on the wire.
        "bootstrap_obs": np.ascontiguousarray(block.last_obs),
    }
    if block.states is not None:
        batch["state_in"] = np.ascontiguousarray(block.states[0])
        batch["resets"] = rows(block.starts).astype(np.float32)
    return batch


def replay_chunk(block: Any, worker: int, seq: int) -> dict[str, Any]:
    """The block as a replay shard stores it: ``[T, S]`` columns of observations, actions,
    rewards, terminations and truncations (with the final observations of truncated steps,
    compactly), the steps at which an env failed, the slots that acted (None: all), the
    rollout worker's index and the chunk's number (a shard continues a worker's streams only
    from the chunk numbered just before)."""
    return {"worker": worker, "obs": block.obs, "actions": block.actions,
            "rewards": block.rewards, "terminated": block.terminated,
            # A step that is both ends its episode: terminal, with no final observation to
            # bootstrap from (``final_obs`` holds those of the other truncated steps).
            "truncated": block.truncated & ~block.terminated & ~block.failed,
            "final_obs": block.final_obs,
            "failed": block.failed, "active": block.active, "seq": seq}
