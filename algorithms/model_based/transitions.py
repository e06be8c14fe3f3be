"""Real transitions of the model-based plans (PETS, MBPO), torch-free: from a rollout rank's
blocks of env steps to the buffers their learner keeps.

A block's steps become transitions ``(obs, actions, rewards, next_obs, terminated)``: the next
observation of a step is the following step's, the block's ``last_obs`` for its last step, or
the final observation of a truncated episode. A step that ended its episode by termination has
no observed next state, and a failed step no transition: neither is kept, unless the learner
asks for terminated steps too (``keep_terminated``). A learner keeps them as a dict of arrays,
the newest ``capacity`` rows (``append_transitions``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpirl.data.tags import DataTags
from mpirl.errors import NonFiniteDataError
from mpirl.runtime.core import RankContext

#: The fields of a transitions dataset, which ``EnsembleTrainer.train`` reads.
DATASET_KEYS = ("obs", "actions", "rewards", "next_obs", "terminated")
#: What a transition may carry: the dataset's arrays, and where some next states are unknown,
#: which are known.
TRANSITION_KEYS = (*DATASET_KEYS, "next_obs_observed")


def block_transitions(block: Any, keep_terminated: bool = False) -> dict[str, np.ndarray]:
    """A block's steps as transitions (see the module's docstring). With ``keep_terminated``
    the steps that ended their episode by termination are kept too, their ``next_obs`` the
    step's own observation (a placeholder: the next state is not observed), and
    ``next_obs_observed`` says which rows have a real one."""
    obs, steps, slots = block.obs, block.steps, block.slots
    next_obs = np.empty_like(obs)
    next_obs[:-1] = obs[1:]
    next_obs[-1] = block.last_obs
    truncated = block.truncated & ~block.terminated & ~block.failed
    t_idx, s_idx = np.nonzero(truncated)  # row-major (t, slot): final_obs's order
    if len(t_idx):
        next_obs[t_idx, s_idx] = np.asarray(block.final_obs).reshape(len(t_idx), *obs.shape[2:])
    terminated = np.asarray(block.terminated, bool)
    next_obs[terminated] = obs[terminated]
    keep = ~block.failed & np.asarray(block.keep, bool)
    if not keep_terminated:
        keep &= ~terminated
    if block.active is not None:
        keep &= block.active
    rows = keep.reshape(-1)
    flat = (steps * slots,)
    transitions = {
        "obs": obs.reshape(*flat, -1)[rows].astype(np.float32),
        "actions": np.asarray(block.actions, np.float32).reshape(*flat, -1)[rows],
        "rewards": np.asarray(block.rewards, np.float32).reshape(-1)[rows],
        "next_obs": next_obs.reshape(*flat, -1)[rows].astype(np.float32),
        "terminated": terminated.astype(np.float32).reshape(-1)[rows]}
    if keep_terminated:
        transitions["next_obs_observed"] = ~terminated.reshape(-1)[rows]
    return transitions


def concat_transitions(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``parts`` joined, with the keys every part has."""
    return {key: np.concatenate([part[key] for part in parts]) for key in TRANSITION_KEYS
            if all(key in part for part in parts)}


def append_transitions(buffer: dict[str, np.ndarray], parts: list[dict[str, np.ndarray]],
                       capacity: int) -> dict[str, np.ndarray]:
    """``buffer`` with ``parts`` appended, the newest ``capacity`` rows kept (FIFO)."""
    parts = [part for part in ([buffer] if buffer else []) + parts if len(part["obs"])]
    if not parts:
        return buffer
    joined = concat_transitions(parts)
    return {key: value[-capacity:] for key, value in joined.items()}


def received_transitions(context: RankContext, sources: list[int],
                         batches: list[dict[str, np.ndarray]] | None
                         ) -> list[dict[str, np.ndarray]]:
    """The transitions ``batches`` given in a call, then those rollout ranks ``sources`` sent
    over the data channel."""
    received = (context.data_channel.recv_each(sources, DataTags().batch) if sources else [])
    return [*(batches or []), *received]


def check_finite(parts: list[dict[str, np.ndarray]]) -> None:
    """Refuse transitions that hold NaN or infinite values: a model fitted to them is NaN."""
    for part in parts:
        for key in DATASET_KEYS:
            values = np.asarray(part[key])
            bad = ~np.isfinite(values.reshape(len(values), -1)).all(1)
            if bad.any():
                raise NonFiniteDataError(
                    f"{int(bad.sum())} of {len(values)} new transitions have NaN or infinite "
                    f"{key}: the environment returned them, and the dynamics model cannot "
                    f"learn from them")
