"""SampleTally: the sample metrics of many chunks of steps, summed on their way to the driver.

Streamed Ape-X sends no answer to the driver per sampling call: each chunk carries its own
metrics to its replay shard, the shard sums those of the chunks it stored into the replies it
gives the learner, and the learner sums the shards' into one report per iteration. Rank 0
then reads one message per iteration, however many rollout ranks there are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SampleTally"]


@dataclass
class SampleTally:
    """Counts and episodes of the chunks summed so far; picklable, with no torch in it."""

    chunks: int = 0
    env_steps: int = 0
    env_failures: int = 0
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    #: with callbacks: each episode's custom metrics, in the order of ``episode_returns``
    custom_metrics: list[dict[str, float]] = field(default_factory=list)
    #: episodes of explorers (epsilon above ``metrics_max_epsilon``): counted, not averaged
    episodes_counted_only: int = 0
    #: with trajectory dumps on: (rank's file name, [(local episode id, steps)]) per chunk
    dumped: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    #: the SGD step count of the weights each chunk was sampled with
    weights_versions: list[int] = field(default_factory=list)

    @classmethod
    def of_chunk(cls, metrics: dict[str, Any], counted_only: bool) -> SampleTally:
        """One chunk's tally from its sample metrics; ``counted_only``: an explorer's, whose
        episodes are only counted."""
        tally = cls(chunks=1, env_steps=metrics["env_steps"],
                    env_failures=metrics["env_failures"],
                    weights_versions=[metrics["weights_version"]])
        if counted_only:
            tally.episodes_counted_only = len(metrics["episode_returns"])
        else:
            tally.episode_returns = list(metrics["episode_returns"])
            tally.episode_lengths = list(metrics["episode_lengths"])
            tally.custom_metrics = list(metrics.get("custom_metrics", []))
        if "dumped" in metrics:
            tally.dumped.append(metrics["dumped"])
        return tally

    def add(self, other: SampleTally) -> None:
        """Sum ``other`` into this tally."""
        self.chunks += other.chunks
        self.env_steps += other.env_steps
        self.env_failures += other.env_failures
        self.episode_returns += other.episode_returns
        self.episode_lengths += other.episode_lengths
        self.custom_metrics += other.custom_metrics
        self.episodes_counted_only += other.episodes_counted_only
        self.dumped += other.dumped
        self.weights_versions += other.weights_versions

    def take(self) -> SampleTally:
        """This tally's sums, leaving it empty."""
        taken = SampleTally(**vars(self))
        vars(self).update(vars(SampleTally()))
        return taken
