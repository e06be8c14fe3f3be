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

#: The fields of one recorded vector-env step, in the order EpisodeRecorder keeps them (plain
#: tuples: this runs on the sampling loop). obs is the observation the step was taken from.
STEP_FIELDS = ("obs", "actions", "rewards", "terminated", "truncated", "logp")


class EpisodeRecorder:
    """Buffers the episodes of a worker's ``num_envs`` sub-envs and sends each completed one to
    the rank's writer.

    Steps are kept as the vector env returns them (one record per step for all sub-envs); an
    episode is gathered from them when it ends, and records older than every episode in
    progress are dropped. Nothing here crosses ranks.
    """

    def __init__(self, target: DumpTarget, worker: int, num_envs: int, env_id: str,
                 observation_space: gym.Space, action_space: gym.Space, seed: int) -> None:
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
        self.num_envs = num_envs
        self.next_id = 0
        self.steps: list[tuple[Any, ...]] = []  # one per vector-env step: STEP_FIELDS
        self.base = 0  # global step number of steps[0]
        self.now = 0  # global step number of the next step
        self.start = np.zeros(num_envs, dtype=np.int64)
        # An episode whose beginning this recorder did not see (restored from a checkpoint) is
        # not written.
        self.tracked = np.zeros(num_envs, dtype=bool)
        self.seeds: list[int | None] = [None] * num_envs
        # Episodes ended since the last flush: (local id, sub-env, first step, last step,
        # seed), and their final observations.
        self.ends: list[tuple[int, int, int, int, int | None]] = []
        self.finals: list[Any] = []
        self.written: list[tuple[int, int]] = []  # in-process mode: written, not yet reported
        self._seed = seed
        self._next_send = time.monotonic() + SEND_INTERVAL_S

    def begin(self, seeded: bool = False) -> None:
        """Every sub-env starts a new episode at the next step (after a reset)."""
        for i in range(self.num_envs):
            self._start_episode(i, self._seed + i if seeded else None)

    def untrack(self) -> None:
        """Episodes in progress (restored from a checkpoint) began elsewhere: skip them."""
        self.tracked[:] = False

    def _start_episode(self, i: int, seed: int | None = None) -> None:
        self.start[i] = self.now
        self.tracked[i] = True
        self.seeds[i] = seed

    def step(self, obs: Any, env_actions: np.ndarray, rewards: np.ndarray,
             terminated: np.ndarray, truncated: np.ndarray, logp: np.ndarray,
             infos: dict[str, Any], dropped: np.ndarray | None) -> None:
        """Record one vector-env step taken from ``obs``; finish the episodes that ended on it
        (their last observation is ``infos["final_obs"]``)."""
        self.steps.append((obs, env_actions, rewards, terminated, truncated, logp))
        t = self.now
        self.now += 1
        if dropped is not None:
            for i in np.flatnonzero(dropped):
                self._start_episode(i)  # the partial episode is lost with the failed env
        done = terminated | truncated
        if done.any():
            final_obs = infos["final_obs"]
            for i in np.flatnonzero(done).tolist():
                if self.tracked[i]:
                    self.ends.append((self.next_id, i, int(self.start[i]), t, self.seeds[i]))
                    self.finals.append(final_obs[i])
                    self.next_id += 1
                self._start_episode(i)
        if self.ends and time.monotonic() >= self._next_send:
            # Completed episodes reach the writer within SEND_INTERVAL_S, not only at the end
            # of the sample call: a killed rank loses at most that much.
            self._send()

    def flush(self, wait: bool = False) -> list[tuple[int, int]]:
        """Hand the episodes completed since the last call to the writer; return (local id,
        steps) of the episodes now safely on disk (with ``wait``: all of them)."""
        self._send()
        oldest = int(self.start.min())  # records before it no episode in progress needs
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
            if self.writer is not None:
                self.writer.send(block)
            else:
                self.written += self.file.write_block(block)
            self.ends, self.finals = [], []

    def close(self) -> list[tuple[int, int]]:
        written = self.flush(wait=True)
        if self.writer is not None:
            self.writer.close()
        elif self.file is not None:
            self.file.close()
        return written


def _stack(items: list[Any]) -> Any:
    first = items[0]
    if isinstance(first, dict):
        return {k: _stack([item[k] for item in items]) for k in first}
    if isinstance(first, tuple):
        return tuple(_stack([item[j] for item in items]) for j in range(len(first)))
    return np.stack([np.asarray(item) for item in items])


class AgentEpisodeRecorder(EpisodeRecorder):
    """The episodes of one policy's agents on a multi-agent rollout rank: each agent's episode
    (its steps from when it appeared to when it left) is one episode of the file, with its
    agent id and policy id. Agents act at different steps, so each is handed over whole."""

    def __init__(self, target: DumpTarget, worker: int, env_id: str,
                 observation_space: gym.Space, action_space: gym.Space, seed: int,
                 policy_id: str) -> None:
        super().__init__(target, worker, 1, env_id, observation_space, action_space, seed)
        self.policy_id = policy_id
        self.pending: list[dict[str, Any]] = []

    def record(self, agent_id: str, steps: list[tuple[Any, ...]], final_obs: Any) -> None:
        """One agent's whole episode: ``steps`` of STEP_FIELDS, then its last observation."""
        columns = zip(*steps, strict=True)
        block = {"lo": 0, "ends": [(self.next_id, 0, 0, len(steps) - 1, None)],
                 "finals": [final_obs], "agents": [(agent_id, self.policy_id)],
                 **{key: _stack([np.asarray(v)[None] for v in column])
                    for key, column in zip(STEP_FIELDS, columns, strict=True)}}
        block["logp"] = block["logp"].astype(np.float32, copy=False)
        self.next_id += 1
        self.pending.append(block)
        if time.monotonic() >= self._next_send:
            self._send()

    def _send(self) -> None:
        self._next_send = time.monotonic() + SEND_INTERVAL_S
        for block in self.pending:
            if self.writer is not None:
                self.writer.send(block)
            else:
                self.written += self.file.write_block(block)
        self.pending = []
