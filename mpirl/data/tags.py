"""The data channel's message tags, in one place, and each policy's own set of them.

Workers of several policies of a multi-agent run share ranks (a rollout rank steps the envs for
every policy; learner rank 0 and the replay ranks may hold several policies' workers), so each
policy's messages use tags of their own: the base tag plus ``POLICY_STRIDE * (index + 1)``. A
single-agent run's one policy uses the base tags (``DataTags()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpirl.runtime.host import STOP_STREAM_TAG

__all__ = ["DataTags"]

#: rollout -> learner: an on-policy batch
BATCH = 21
#: rollout -> learner: a streamed V-trace fragment (IMPALA's ``sample_fragments``)
STREAM = 22
#: learner -> rollout: weights pushed to the ranks whose fragments it trained on
PUSHED_WEIGHTS = 23
#: driver -> any worker: stop the streaming calls of a round and earlier ones
STOP_STREAM = STOP_STREAM_TAG
#: learner 0 -> rollout: its weights, by message where a broadcast cannot reach (ranks shared
#: by several policies' workers)
BROADCAST = 25
#: rollout -> replay: a chunk of steps
INSERT = 31
#: replay -> learner: minibatches
SAMPLE = 32
#: learner -> replay: TD errors as priorities
PRIORITY = 33
#: learner 0 -> rollout: weights posted asynchronously (Ape-X)
WEIGHTS = 34
#: learner -> replay: a request for minibatches (streamed Ape-X)
SAMPLE_REQUEST = 35
#: learner -> driver: an iteration's report (streamed Ape-X)
REPORT = 36
#: Each policy's tags are its base tags shifted by this much times (its index + 1).
POLICY_STRIDE = 100


@dataclass(frozen=True)
class DataTags:
    """The tags of one policy's messages (``offset``: 0 for a single-agent run)."""

    offset: int = 0

    @classmethod
    def of_policy(cls, index: int | None) -> DataTags:
        """Policy ``index``'s tags; None: a single-agent run's."""
        return cls(0 if index is None else POLICY_STRIDE * (index + 1))

    @property
    def batch(self) -> int:
        return BATCH + self.offset

    @property
    def stream(self) -> int:
        return STREAM + self.offset

    @property
    def pushed_weights(self) -> int:
        return PUSHED_WEIGHTS + self.offset

    @property
    def stop_stream(self) -> int:
        return STOP_STREAM + self.offset

    @property
    def broadcast(self) -> int:
        return BROADCAST + self.offset

    @property
    def insert(self) -> int:
        return INSERT + self.offset

    @property
    def sample(self) -> int:
        return SAMPLE + self.offset

    @property
    def priority(self) -> int:
        return PRIORITY + self.offset

    @property
    def weights(self) -> int:
        return WEIGHTS + self.offset

    @property
    def sample_request(self) -> int:
        return SAMPLE_REQUEST + self.offset

    @property
    def report(self) -> int:
        return REPORT + self.offset
