"""ReplayShard: a replay rank's worker. Rollout ranks send it transitions; learners sample from it
and send back priorities."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from mpi4py import MPI

from mpirl.data.replay_buffer import ReplayBuffer, ReplaySettings, stream_of
from mpirl.data.sample_tally import SampleTally
from mpirl.data.tags import DataTags
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.dispatch import DRIVER_SPIN_S
from mpirl.runtime.host import latest_stopped_round
from mpirl.runtime.ulfm import poll_any_source
from mpirl.runtime.waiting import Backoff


def stacked_frames(env: Any) -> int:
    """Frames per observation that the env's preprocessing stacks (Atari's), else 0."""
    atari = getattr(env, "atari", None)
    return atari.frame_stack if atari is not None else 0


@dataclass(frozen=True, kw_only=True)
class ReplayShardSettings:
    """What a replay shard is built from; it crosses to each replay rank once, when the shard is
    spawned."""

    capacity: int
    """Rows this shard holds."""
    num_streams: int
    """Streams of consecutive steps it keeps apart: one per env of each rollout worker that
    feeds it."""
    observation_space: gym.Space
    action_space: gym.Space
    replay: ReplaySettings
    num_shards: int
    """Shards in the run: rollout worker i feeds shard i mod ``num_shards``."""
    num_envs: int
    """Streams per rollout worker: its envs (a multi-agent policy's: its slots, an env's agents
    it may drive in each env)."""
    seed: int
    policy_index: int | None = None
    """A multi-agent run's policy: its place among the policies (its messages' tags)."""

    @classmethod
    def from_config(cls, config: Any, *, env: Any, num_shards: int,
                    num_rollout_workers: int, streams_per_worker: int | None = None,
                    policy_index: int | None = None) -> ReplayShardSettings:
        """One of ``num_shards`` shards of a run with ``config``: ``buffer_size / num_shards``
        rows, a stream per env (``streams_per_worker``: per slot) of each rollout worker that
        feeds it. ``env`` gives the spaces (``spaces()``)."""
        observation_space, action_space = env.spaces()
        per_worker = streams_per_worker or config.num_envs_per_worker
        streams = math.ceil(num_rollout_workers / num_shards) * per_worker
        return cls(capacity=config.buffer_size // num_shards, num_streams=streams,
                   observation_space=observation_space, action_space=action_space,
                   replay=ReplaySettings.from_config(config, stacked_frames(env)),
                   num_shards=num_shards, num_envs=per_worker, seed=config.seed,
                   policy_index=policy_index)


class ReplayShard(Worker):
    """One shard of the replay buffer; one per replay rank (or in the driver's process).

    Chunks of steps arrive from rollout ranks (``insert``), minibatches leave for learner ranks
    (``sample``), TD errors come back (``update_priorities``). Priority messages that arrive
    while the shard does something else are applied at the start of its next call.
    """

    MESSAGES = ("insert", "sample", "update_priorities", "size", "save_state", "load_state",
                "serve")
    #: Data-channel tags: steps in, minibatches out, TD errors in (a multi-agent policy's differ).
    tags = DataTags()

    Settings: ClassVar[type[ReplayShardSettings]] = ReplayShardSettings

    def __init__(self, context: RankContext, settings: ReplayShardSettings) -> None:
        super().__init__(context)
        self.tags = DataTags.of_policy(settings.policy_index)
        self.buffer = ReplayBuffer(settings.capacity, settings.num_streams,
                                   settings.observation_space, settings.action_space,
                                   settings.replay,
                                   settings.seed + 104_729 * (context.role_index + 1))
        self.num_shards, self.num_envs = settings.num_shards, settings.num_envs
        self.priority_messages = 0  # received since start, to match the driver's expectation
        self.priority_expected = 0
        self.last_chunk: dict[int, int] = {}  # each rollout worker's last chunk stored
        self.stopped_round = -1  # the driver's last word to stop serving (``serve``)
        self.env_steps_served = 0  # env steps stored by the current serve() call
        # The metrics the stored chunks carried (streamed Ape-X), until a reply takes them.
        self.tally = SampleTally()

    def _drain_priorities(self) -> None:
        channel = self.context.data_channel
        if channel is None:
            return
        while (item := channel.poll(tag=self.tags.priority)) is not None:
            self._apply(item[0])

    def _apply(self, update: dict[str, np.ndarray]) -> None:
        self.buffer.update_priorities(update["indices"], update["generations"], update["td"])
        self.priority_messages += 1

    def receive_chunks(self, sources: list[int], chunks: list[dict] | None) -> list[dict]:
        """The chunks of rollout ranks ``sources`` and those given in the call; priorities that
        came meanwhile are applied first."""
        self._drain_priorities()
        received = list(chunks or [])
        if sources:
            received += self.context.data_channel.recv_each(sources, self.tags.insert)
        return received

    def insert(self, sources: list[int], chunks: list[dict] | None = None) -> int:
        """Store the chunks that rollout ranks ``sources`` sent (or ``chunks`` given in the
        call); returns the rows stored."""
        return sum(self._store(chunk) for chunk in self.receive_chunks(sources, chunks))

    def serve(self, stream_round: int, until_chunks: int | None = None, wait_s: float = 0.0
              ) -> dict[str, Any]:
        """Until the driver's word to stop ``stream_round`` comes (its stop tag), or,
        with ``until_chunks``, until that many chunks were stored or ``wait_s`` passed: store
        the chunks rollout ranks send, from any of them, as they come; answer each learner's
        request for minibatches (its sample-request tag: ``(num_batches, batch_size, beta)``)
        as ``sample`` does, the message saying how many env steps this call has stored so far
        (``env_steps_served``) and the buffer's size, and carrying the metrics of the chunks
        stored since the last reply (``samples``, a ``SampleTally``, when there are any); apply
        the TD errors that come. Returns ``chunks`` (rollout rank -> chunks stored), ``size``
        and the metrics no reply took (``samples``)."""
        channel = self.context.data_channel
        chunks: dict[int, int] = {}
        self.env_steps_served = 0
        backoff = Backoff(spin_s=DRIVER_SPIN_S)
        deadline = time.monotonic() + wait_s
        while True:
            busy = False
            while (item := poll_any_source(channel, self.tags.insert)) is not None:
                chunk, source = item
                self._store(chunk)
                chunks[source] = chunks.get(source, 0) + 1
                self.env_steps_served += _env_steps(chunk)
                busy = True
            while (item := poll_any_source(channel, self.tags.priority)) is not None:
                self._apply(item[0])
                busy = True
            while (item := poll_any_source(channel, self.tags.sample_request)) is not None:
                (num_batches, batch_size, beta), source = item
                self.sample(num_batches, batch_size, source, beta)
                busy = True
            self.stopped_round = latest_stopped_round(channel, self.stopped_round,
                                                      self.tags.stop_stream)
            if stream_round <= self.stopped_round or until_chunks is not None and (
                    sum(chunks.values()) >= until_chunks or time.monotonic() > deadline):
                return {"chunks": chunks, "size": len(self.buffer),
                        "samples": self.tally.take()}
            if busy:
                backoff.reset()
            else:
                backoff.sleep()

    def _store(self, chunk: dict) -> int:
        """Add one chunk of a rollout worker's steps (or several in a row, ``chunks``: the
        blocks a multi-agent policy's worker took at once); returns the rows stored."""
        if "chunks" in chunk:
            if (metrics := chunk.get("metrics")) is not None:
                self.tally.add(metrics)
            return sum(self._store(part) for part in chunk["chunks"])
        worker, seq = chunk["worker"], chunk["seq"]
        streams = stream_of(worker, self.num_shards, self.num_envs)
        # A chunk that does not follow the last one stored (the envs were reset, or one was
        # lost in flight at a checkpoint) must not continue its streams' last rows.
        follows = self.last_chunk.get(worker) == seq - 1
        cut = None if follows else np.ones(len(streams), bool)
        self.last_chunk[worker] = seq
        if (metrics := chunk.get("metrics")) is not None:
            self.tally.add(metrics)
        return self.buffer.add(streams, chunk["obs"], chunk["actions"], chunk["rewards"],
                               chunk["terminated"], chunk["truncated"], chunk["final_obs"],
                               chunk["failed"], cut, chunk.get("active"))

    def sample(self, num_batches: int, batch_size: int, dest: int | None,
               beta: float | None = None) -> dict | None:
        """Draw ``num_batches`` minibatches and send them to learner rank ``dest`` (or return
        them when ``dest`` is None). Nothing is sent while the buffer is empty."""
        self._drain_priorities()
        message = {"batches": [], "shard": self.context.role_index,
                   "env_steps_served": self.env_steps_served, "size": len(self.buffer)}
        if self.tally.chunks:
            message["samples"] = self.tally.take()
        try:
            message["batches"] = [self.buffer.sample(batch_size, beta)
                                  for _ in range(num_batches)]
        except ValueError as error:
            # The learner waits for this message: it must come, and say why it is empty.
            message["error"] = f"replay shard {self.context.role_index}: {error}"
        if dest is None:
            return message
        self.context.data_channel.isend(message, dest, self.tags.sample)
        self.context.data_channel.flush()
        return None

    def update_priorities(self, expect: int = 0, updates: list[dict] | None = None,
                          timeout: float = 600.0) -> int:
        """Apply ``updates`` given in the call, and wait until ``expect`` more priority messages
        than expected before have come from learner ranks. Returns the buffer's size."""
        for update in updates or []:
            self._apply(update)
            self.priority_expected += 1
        self.priority_expected += expect
        channel = self.context.data_channel
        while self.priority_messages < self.priority_expected:
            self._apply(channel.recv(MPI.ANY_SOURCE, self.tags.priority, timeout))
        return len(self.buffer)

    def size(self) -> int:
        self._drain_priorities()
        return len(self.buffer)

    def get_state(self) -> dict[str, Any]:
        self._drain_priorities()
        return {**self.buffer.get_state(), "last_chunk": dict(self.last_chunk)}

    def set_state(self, state: dict[str, Any]) -> None:
        self.buffer.set_state(state)
        self.last_chunk = dict(state.get("last_chunk", {}))


def _env_steps(chunk: dict) -> int:
    """The steps an agent took in ``chunk`` (of every chunk, for several in a row)."""
    if "chunks" in chunk:
        return sum(_env_steps(part) for part in chunk["chunks"])
    active = chunk.get("active")
    return chunk["rewards"].size if active is None else int(active.sum())
