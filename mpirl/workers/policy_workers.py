"""The workers of one policy of a multi-agent run: its learners and its replay shards.

A policy's learners live on a slice of the learner ranks (learner 0 alone when it has none of its
own) and average gradients over a sub-communicator of the learner communicator made for that
slice, so that the policies of a run train side by side. Every message a policy's workers send or
take uses its own tags (``policy_tag``), so several policies' workers can share a rank. Learner 0
of a policy sends its weights to the rollout ranks by message, not by a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mpirl.data.replay_buffer import INSERT_TAG, PRIORITY_TAG, SAMPLE_TAG, WEIGHTS_TAG
from mpirl.runtime.core import RankContext
from mpirl.workers.learner import Learner, LearnerSettings
from mpirl.workers.multiagent_rollout import policy_tag
from mpirl.workers.q_workers import QLearner
from mpirl.workers.replay_shard import ReplayShard, ReplayShardSettings
from mpirl.workers.rollout import BATCH_TAG


def policy_context(context: RankContext, members: list[int]) -> RankContext:
    """``context`` with ``role_comm`` narrowed to the learner indices ``members`` (a collective
    over those members only)."""
    if len(members) == context.role_comm.Get_size():
        return context
    comm = context.role_comm.Create_group(context.role_comm.Get_group().Incl(members))
    return dataclasses.replace(context, role_comm=comm,
                               role_index=members.index(context.role_index),
                               role_size=len(members))


class _PostsWeights:
    """What a policy's learner adds: sending its weights to rollout ranks by message."""

    policy_index: int
    policy: Any
    context: RankContext

    def post_weights(self, ranks: list[int]) -> None:
        """Send this learner's weights to ``ranks`` (rollout ranks), tagged for its policy."""
        flat = self.policy.get_flat_weights()
        channel = self.context.data_channel
        channel.flush()  # the last round's sends; these are taken while this call returns
        for rank in ranks:
            channel.isend(flat, rank, policy_tag(WEIGHTS_TAG, self.policy_index))


@dataclass(frozen=True, kw_only=True)
class PolicyLearnerSettings(LearnerSettings):
    """A policy's learner: ``LearnerSettings``, and where the policy's learners are."""

    members: tuple[int, ...]
    """The learner indices of the policy's slice of the learner ranks."""
    policy_index: int
    """The policy's index in the run: its messages' tags."""


class PolicyLearner(_PostsWeights, Learner):
    """A learner of one on-policy policy (PPO, A2C) of a multi-agent run."""

    MESSAGES = (*Learner.MESSAGES, "post_weights")

    Settings: ClassVar[type[PolicyLearnerSettings]] = PolicyLearnerSettings

    def __init__(self, context: RankContext, settings: PolicyLearnerSettings) -> None:
        self.policy_index = settings.policy_index
        self.batch_tag = policy_tag(BATCH_TAG, settings.policy_index)
        super().__init__(policy_context(context, list(settings.members)), settings)


class PolicyQLearner(_PostsWeights, QLearner):
    """A learner of one off-policy policy (DQN) of a multi-agent run."""

    MESSAGES = (*QLearner.MESSAGES, "post_weights")

    Settings: ClassVar[type[PolicyLearnerSettings]] = PolicyLearnerSettings

    def __init__(self, context: RankContext, settings: PolicyLearnerSettings) -> None:
        self.policy_index = settings.policy_index
        self.sample_tag = policy_tag(SAMPLE_TAG, settings.policy_index)
        self.priority_tag = policy_tag(PRIORITY_TAG, settings.policy_index)
        super().__init__(policy_context(context, list(settings.members)), settings)


@dataclass(frozen=True, kw_only=True)
class PolicyReplayShardSettings(ReplayShardSettings):
    """A policy's replay shard: ``ReplayShardSettings``, and the policy's index (its tags)."""

    policy_index: int


class PolicyReplayShard(ReplayShard):
    """One replay shard of one off-policy policy. Each agent of each env of a rollout worker is
    a stream; chunks hold per-stream columns, since agents act at different steps."""

    Settings: ClassVar[type[PolicyReplayShardSettings]] = PolicyReplayShardSettings

    def __init__(self, context: RankContext, settings: PolicyReplayShardSettings) -> None:
        self.insert_tag = policy_tag(INSERT_TAG, settings.policy_index)
        self.sample_tag = policy_tag(SAMPLE_TAG, settings.policy_index)
        self.priority_tag = policy_tag(PRIORITY_TAG, settings.policy_index)
        super().__init__(context, settings)

    def insert(self, sources: list[int], chunks: list[dict] | None = None) -> int:
        """Store the chunks of rollout ranks ``sources`` (or ``chunks`` given in the call)."""
        received = self.receive_chunks(sources, chunks)
        rows = 0
        for chunk in received:
            worker, seq = chunk["worker"], chunk["seq"]
            base = (worker // max(self.num_shards, 1)) * chunk["streams_per_worker"]
            follows = self.last_chunk.get(worker) == seq - 1
            self.last_chunk[worker] = seq
            for local, arrays, cut in chunk["columns"]:
                if not len(arrays["rewards"]) and not cut:
                    continue
                rows += self.buffer.add(
                    np.array([base + local]), arrays["obs"], arrays["actions"],
                    arrays["rewards"], arrays["terminated"], arrays["truncated"],
                    arrays["final_obs"], None, np.array([cut or not follows]))
        return rows
