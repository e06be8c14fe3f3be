"""EpisodeRecorder: collects each env's steps on a rollout rank and hands finished episodes to the
dump writer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.data.dump_format import FORMAT_ATTR, FORMAT_VERSION, serialize_space
from mpirl.data.dump_writer import SEND_INTERVAL_S, DumpTarget, _WriterProcess
from mpirl.data.episode_file import EpisodeFile
from mpirl.errors import ConfigError

__all__ = ["EpisodeRecorder"]

#: The fields of one recorded vector-env step, in the order EpisodeRecorder keeps them (plain
#: tuples: this runs on the sampling loop). obs is the observation the step was taken from.
STEP_FIELDS = ("obs", "actions", "rewards", "terminated", "truncated", "logp")


class EpisodeRecorder:
    """Buffers the episodes of a rollout rank's slots (one per sub-env; a multi-agent policy's
    one per env and agent) and sends each completed one to the rank's writer.

    Steps are kept as they are taken (one record per step for all slots); an episode is
    gathered from them when it ends, and records older than every episode in progress are
    dropped. A multi-agent policy's file holds its agents' episodes, each with its agent id and
    policy id; a slot's episode starts at the first step its agent acts. Nothing here crosses
    ranks.
    """

    def __init__(self, target: DumpTarget, worker: int, num_slots: int, env_id: str,
                 observation_space: gym.Space, action_space: gym.Space, seed: int,
                 policy_id: str | None = None, slot_agents: list[str] | None = None) -> None:
        self.target = target
        self.path = Path(target.directory) / target.file_name(worker)
        if self.path.exists():
            raise ConfigError(f"trajectory file {self.path} exists already; it is not "
                              f"overwritten")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create {self.path.parent}: {error}") from None
        attrs = {FORMAT_ATTR: FORMAT_VERSION, "env_id": env_id,
                 "observation_space": serialize_space(observation_space),
                 "action_space": serialize_space(action_space),
                 "rollout_worker": worker, "session": target.session}
        self.writer: _WriterProcess | None = None
        self.file: EpisodeFile | None = None
        if target.writer_process:
            self.writer = _WriterProcess(self.path, attrs, target.compression_level,
                                         target.compression_min_bytes)
        else:
            try:
                self.file = EpisodeFile(self.path, attrs, target.compression_level,
                                        target.compression_min_bytes)
            except OSError as error:
                raise ConfigError(f"cannot create trajectory file {self.path}: "
                                  f"{error}") from None
        self.num_slots = num_slots
        self.observation_space, self.action_space = observation_space, action_space
        self.policy_id, self.slot_agents = policy_id, slot_agents
        self.next_id = 0
        self.steps: list[tuple[Any, ...]] = []  # one per step: STEP_FIELDS
        self.base = 0  # global step number of steps[0]
        self.now = 0  # global step number of the next step
        #: each slot's episode's first step; WAITING: it starts at the slot's next step
        self.start = np.full(num_slots, WAITING, dtype=np.int64)
        # An episode whose beginning this recorder did not see (restored from a checkpoint) is
        # not written.
        self.tracked = np.zeros(num_slots, dtype=bool)
        self.seeds: list[int | None] = [None] * num_slots
        # Episodes ended since the last flush: (local id, slot, first step, last step, seed),
        # their final observations and (multi-agent) their (agent id, policy id).
        self.ends: list[tuple[int, int, int, int, int | None]] = []
        self.finals: list[Any] = []
        self.agents: list[tuple[str, str]] = []
        self.written: list[tuple[int, int]] = []  # in-process mode: written, not yet reported
        self._seed = seed
        self._next_send = time.monotonic() + SEND_INTERVAL_S

    def begin(self, seeded: bool = False) -> None:
        """Every slot starts a new episode at its next step (after a reset); ``seeded``: the
        envs were reset with seed ``seed + slot``."""
        self.start[:] = WAITING
        self.tracked[:] = True
        self.seeds = [self._seed + i if seeded else None for i in range(self.num_slots)]

    def untrack(self) -> None:
        """Episodes in progress (restored from a checkpoint) began elsewhere: skip them."""
        self.tracked[:] = False
        self.start[self.start == WAITING] = self.now

    def step(self, obs: Any, env_actions: np.ndarray, rewards: np.ndarray,
             terminated: np.ndarray, truncated: np.ndarray, logp: np.ndarray | None,
             finals: dict[int, Any], dropped: np.ndarray | None,
             rows: np.ndarray | None = None) -> None:
        """Record one step: ``obs``, ``env_actions`` and ``logp`` of the slots that acted
        (``rows``; None: all, in order; ``obs`` None: no slot acted), the rewards and ends of
        all slots; finish the episodes that ended on it (``finals[slot]`` is the observation
        each ended on)."""
        if obs is None:
            rows = np.zeros(0, np.int64)
            obs, env_actions, logp = NOTHING_ACTED, NOTHING_ACTED, NOTHING_ACTED
        elif logp is None:
            logp = np.zeros(len(env_actions), np.float32)
        if rows is not None and obs is not NOTHING_ACTED:
            obs, env_actions, logp = (_widen(value, rows, self.num_slots)
                                      for value in (obs, env_actions, logp))
        self.steps.append((obs, env_actions, rewards, terminated, truncated, logp))
        t = self.now
        self.now += 1
        starting = self.start == WAITING
        if rows is not None:
            acting = np.zeros(self.num_slots, bool)
            acting[rows] = True
            starting &= acting
        self.start[starting] = t
        if dropped is not None:
            for i in np.flatnonzero(dropped):
                self._start_episode(i)  # the partial episode is lost with the failed env
        done = terminated | truncated
        if done.any():
            for i in np.flatnonzero(done).tolist():
                if self.tracked[i]:
                    self.ends.append((self.next_id, i, int(self.start[i]), t, self.seeds[i]))
                    self.finals.append(finals[i])
                    if self.slot_agents is not None:
                        self.agents.append((self.slot_agents[i % len(self.slot_agents)],
                                            self.policy_id))
                    self.next_id += 1
                self._start_episode(i)
        if self.ends and time.monotonic() >= self._next_send:
            # Completed episodes reach the writer within SEND_INTERVAL_S, not only at the end
            # of the sample call: a killed rank loses at most that much.
            self._send()

    def _start_episode(self, i: int) -> None:
        self.start[i] = WAITING
        self.tracked[i] = True
        self.seeds[i] = None

    def flush(self, wait: bool = False) -> list[tuple[int, int]]:
        """Hand the episodes completed since the last call to the writer; return (local id,
        steps) of the episodes now safely on disk (with ``wait``: all of them)."""
        self._send()
        needed = self.start[(self.start != WAITING) & self.tracked]
        oldest = int(needed.min()) if needed.size else self.now
        if oldest > self.base:
            del self.steps[:oldest - self.base]
            self.base = oldest
        if self.writer is not None:
            return self.writer.take_acked(wait=wait)
        written, self.written = self.written, []
        return written

    def _send(self) -> None:
        """The steps that the completed episodes span go as one block of stacked arrays: a few
        large pickles instead of many small ones; the writer slices the episodes out."""
        self._next_send = time.monotonic() + SEND_INTERVAL_S
        if self.ends:
            lo = min(first for _, _, first, _, _ in self.ends)
            hi = max(last for _, _, _, last, _ in self.ends) + 1
            columns = zip(*self.steps[lo - self.base:hi - self.base], strict=True)
            block = {"lo": lo, "ends": self.ends, "finals": self.finals,
                     **{key: _stack(list(column)) for key, column in zip(STEP_FIELDS, columns,
                                                                         strict=True)}}
            block["logp"] = block["logp"].astype(np.float32, copy=False)
            if self.agents:
                block["agents"] = self.agents
            if self.writer is not None:
                self.writer.send(block)
            else:
                self.written += self.file.write_block(block)
            self.ends, self.finals, self.agents = [], [], []

    def close(self) -> list[tuple[int, int]]:
        written = self.flush(wait=True)
        if self.writer is not None:
            self.writer.close()
        elif self.file is not None:
            self.file.close()
        return written


#: ``EpisodeRecorder.start`` of a slot whose next episode starts at its next step.
WAITING = -1
#: What a step at which no slot acted records in place of observations, actions, log-probs.
NOTHING_ACTED = None


def _zeros_like(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _zeros_like(v) for k, v in value.items()}
    return np.zeros_like(np.asarray(value))


def _widen(rows_value: Any, rows: np.ndarray, slots: int) -> Any:
    """Values of the slots ``rows`` as an array over all ``slots`` (zeros elsewhere)."""
    if isinstance(rows_value, dict):
        return {k: _widen(v, rows, slots) for k, v in rows_value.items()}
    value = np.asarray(rows_value)
    out = np.zeros((slots, *value.shape[1:]), value.dtype)
    out[rows] = value
    return out


def _stack(items: list[Any]) -> Any:
    if any(item is NOTHING_ACTED for item in items):
        # A step at which no slot acted sits between two recorded episodes: zeros, never
        # part of an episode.
        like = next(item for item in items if item is not NOTHING_ACTED)
        items = [_zeros_like(like) if item is NOTHING_ACTED else item for item in items]
    first = items[0]
    if isinstance(first, dict):
        return {k: _stack([item[k] for item in items]) for k in first}
    if isinstance(first, tuple):
        return tuple(_stack([item[j] for item in items]) for j in range(len(first)))
    return np.stack([np.asarray(item) for item in items])
