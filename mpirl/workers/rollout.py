"""Rollout workers: one policy's sampling on a rollout rank, for an on-policy plan.

A rollout worker takes its policy's blocks of steps from the rank's sampling core
(``mpirl.workers.env_runner.EnvRunner``: its own in a single-agent run, the rank's shared one in
a multi-agent run), postprocesses them (``mpirl.workers.postprocess``: GAE advantages, V-trace
fragments, sequences) and delivers the batch where the calling operator said
(``mpirl.workers.delivery``): straight to its learner rank over the data channel, through learner
0's gather, or in the answer. The driver gets back only counts and episode metrics. Weights
arrive by broadcast from learner 0 (or, in a multi-agent run, by message from its policy's
learner 0), given in a call, or pushed by the learner that trained on its fragments.

An environment that raises is rebuilt in place (``mpirl.workers.env_guard``); the episode it was in
is dropped from the batch and the episode metrics, and the driver gets the number of failures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mpirl.data.batches import concat_batches
from mpirl.data.dump_writer import DumpTarget
from mpirl.data.tags import DataTags
from mpirl.models.numpy_policy import NumpyPolicy
from mpirl.models.statistics import RunningMeanStd
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.gathered import (
    PackedBatch,
    answer_through_gather,
    fits_in_gather,
    send_answer,
    serve_rounds,
)
from mpirl.runtime.host import DRIVER_RANK, latest_stopped_round
from mpirl.runtime.signals import report_received
from mpirl.runtime.ulfm import bcast_weights
from mpirl.runtime.waiting import Backoff
from mpirl.workers.callbacks import invoke
from mpirl.workers.delivery import (
    BROADCAST,
    IN_ANSWER,
    KEEP,
    Delivery,
    Gathered,
    ToLearnerOf,
    ToRank,
)
from mpirl.workers.env_runner import (
    DEFAULT_POLICY,
    SAMPLE,
    Block,
    EnvRunner,
    RunnerPolicy,
    RunnerSettings,
)
from mpirl.workers.env_spec import EnvSpec, EnvWorkerSettings
from mpirl.workers.postprocess import advantage_batch, fragment_batch

__all__ = ["ADVANTAGES", "FRAGMENTS", "SamplingSettings", "RolloutSettings", "RolloutWorker",
           "merge_sample_metrics"]

#: The forms of batch a rollout worker makes: rows with GAE advantages (PPO, A2C, A3C) or one
#: V-trace fragment per slot (IMPALA).
ADVANTAGES, FRAGMENTS = "advantages", "fragments"


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """What a rollout worker itself uses: its policy, how it postprocesses, where new weights
    come from. A multi-agent run's rollout worker of a policy is built from these alone and
    takes its blocks from the rank's shared sampling core (``beside`` at spawn)."""

    policy_id: str = DEFAULT_POLICY
    #: the policy's place among a multi-agent run's policies (its messages' tags); None: a
    #: single-agent run
    policy_index: int | None = None
    gamma: float = 1.0
    """Discount of the returns and advantages it computes (on-policy plans); time limits
    bootstrap with it."""
    lam: float = 1.0
    """GAE lambda of the advantages it computes (on-policy plans)."""
    torch_threads: int = 1
    """Threads of a torch copy of the policy (A3C's gradients)."""
    weights_from: int | None = None
    """Where new weights come from by message (a multi-agent policy's learner 0); None: the
    broadcast over the weights communicator."""

    @classmethod
    def for_policy(cls, config: Any, *, policy_id: str, policy_index: int,
                   weights_from: int) -> SamplingSettings:
        """A multi-agent run's rollout worker of policy ``policy_id``, whose algorithm's config
        is ``config``."""
        return cls(policy_id=policy_id, policy_index=policy_index,
                   gamma=config.discount(), lam=config.advantage_lambda(),
                   torch_threads=config.torch_threads,
                   weights_from=weights_from)


@dataclass(frozen=True, kw_only=True)
class RolloutSettings(EnvWorkerSettings, SamplingSettings):
    """What a single-agent run's rollout worker (``RolloutWorker``, ``TransitionWorker``) is
    built from: ``SamplingSettings`` and its own sampling core's (envs, model, dumps); it
    crosses to each rollout rank once, when the worker is spawned."""

    policy: Any
    """The spec of the model it acts with (``PolicySpec``, ``QSpec``, ...)."""
    dump: DumpTarget | None = None
    """Where its episodes go with ``--dump-trajectories``; None without."""
    callbacks: str = ""
    """``"module:Class"`` of the run's callbacks, or empty."""
    normalize_observations: bool = False
    """Normalize vector observations by running statistics the driver merges."""

    @classmethod
    def from_config(cls, config: Any, *, env: EnvSpec, policy: Any,
                    dump: DumpTarget | None = None) -> RolloutSettings:
        """The settings of a run with ``config``. Offline configs have no GAE and no observation
        filter (BC no discount either), and replay configs sample no advantages: their workers
        keep the neutral defaults."""
        return cls(env=env, policy=policy, **cls.config_values(config), dump=dump,
                   callbacks=config.callbacks, gamma=config.discount(),
                   lam=config.advantage_lambda(),
                   normalize_observations=config.observation_normalization())

    def runner(self, acting: str) -> RunnerSettings:
        """Its own sampling core's settings: one policy, acting as ``acting``."""
        observation_space, action_space = self.env.spaces()
        return RunnerSettings(
            env=self.env, num_envs=self.num_envs, seed=self.seed,
            torch_threads=self.torch_threads, max_env_failures=self.max_env_failures,
            env_failure_window=self.env_failure_window, callbacks=self.callbacks,
            ranks_per_env=self.ranks_per_env, env_step_timeout_s=self.env_step_timeout_s,
            dumps={self.policy_id: self.dump} if self.dump is not None else {},
            policies=(RunnerPolicy(policy_id=self.policy_id, spec=self.policy, acting=acting,
                                   observation_space=observation_space,
                                   action_space=action_space,
                                   normalize_observations=self.normalize_observations),))


def empty_sample_metrics() -> dict[str, Any]:
    """A sample call's metrics for no steps at all."""
    return {"env_steps": 0, "env_failures": 0, "episode_returns": [], "episode_lengths": [],
            "filter_delta": None}


def merge_sample_metrics(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """Two sample calls' metrics as one (counts summed, episodes joined, observation statistics
    merged, dumped episodes of this rank's file joined); ``total`` is updated and returned."""
    total["env_steps"] += more["env_steps"]
    total["env_failures"] += more["env_failures"]
    total["episode_returns"] = total["episode_returns"] + more["episode_returns"]
    total["episode_lengths"] = total["episode_lengths"] + more["episode_lengths"]
    if "custom_metrics" in more:
        total["custom_metrics"] = total.get("custom_metrics", []) + more["custom_metrics"]
    if total.get("filter_delta") is not None:  # observation statistics: not Q-learning's
        merged = RunningMeanStd(total["filter_delta"][0].shape)
        merged.merge(*total["filter_delta"])
        merged.merge(*more["filter_delta"])
        total["filter_delta"] = merged.state()
    if "dumped" in more:
        name, episodes = total["dumped"]
        total["dumped"] = (name, list(episodes) + list(more["dumped"][1]))
    return total


class RolloutWorker(Worker):
    """Samples one policy's experience for an on-policy plan; one per rollout rank (or
    in-process)."""

    MESSAGES = ("sample", "evaluate", "receive_weights", "set_weights", "get_weights",
                "save_state", "load_state", "finish_dump", "compute_gradients",
                "sample_fragments", "take_pushed_weights", "sample_rounds")
    #: How the sampling core acts for its policy (``env_runner.SAMPLE``: an actor-critic).
    ACTING: ClassVar[str] = SAMPLE
    #: Beside a rank's sampling core, it takes one policy's steps (``SamplingSettings``).
    SERVES_A_POLICY = True

    Settings: ClassVar[type[RolloutSettings]] = RolloutSettings

    def __init__(self, context: RankContext, settings: SamplingSettings,
                 beside: EnvRunner | None = None) -> None:
        super().__init__(context)
        self.settings = settings
        self.owns_runner = beside is None
        if beside is None:
            if not isinstance(settings, RolloutSettings):
                raise TypeError("a rollout worker without the rank's sampling core (beside) "
                                "needs RolloutSettings: the envs and model of its own")
            beside = EnvRunner(context, settings.runner(self.ACTING))
        self.runner = beside
        self.policy_id = settings.policy_id
        self.lane = self.runner.lane(self.policy_id)
        #: the model it acts with (``on_sample_end`` callbacks see it)
        self.policy = self.lane.actor.model
        self.callbacks = self.runner.callbacks
        self.where = self.runner.where
        self.tags = DataTags.of_policy(settings.policy_index)
        self._torch_policy: Any = None  # A3C's gradients: a torch copy of the actor, made once
        self._weights = np.empty(self.policy.num_weights(), np.float32)
        # Streamed fragments: the version of the weights last pushed by the learner, and how
        # many pushes were taken in all (a checkpoint waits until every push was).
        self.weights_version = 0
        self.pushes_taken = 0
        self.stopped_round = -1  # calls of this round of the stream, or earlier, stop early

    @property
    def envs(self) -> Any:
        """A single-agent worker's vector env (its sampling core's)."""
        return self.runner.envs.envs

    @property
    def env_failures(self) -> int:
        """Env failures recovered on this rank since it started."""
        return self.runner.env_failures

    @property
    def recorder(self) -> Any:
        """Its policy's trajectory dump's recorder (None without a dump)."""
        return self.lane.recorder

    @property
    def state(self) -> np.ndarray | None:
        """A recurrent policy's state per slot, carried across calls (None without one)."""
        return self.lane.state

    # Sampling.

    def sample(self, steps_per_env: int, filter_state: tuple | None = None,
               deliver: Delivery = IN_ANSWER, form: str = ADVANTAGES, *,
               weights: Any = KEEP) -> Any:
        """Take ``weights`` (``mpirl.workers.delivery``), step every environment
        ``steps_per_env`` times and deliver the batch (``form``: GAE rows or V-trace
        fragments) as ``deliver`` says; return the metrics (env steps, episodes, env
        failures, observation statistics), with the batch when it rides in the answer. Rows of
        episodes that an env failure cut short are left out, so the batch may be short."""
        if isinstance(deliver, Gathered):
            return answer_through_gather(self.context, lambda: self._sample_gathered(
                steps_per_env, filter_state, weights, deliver, form))
        self._take_weights(weights)
        return self._deliver(*self._collect(steps_per_env, filter_state, form), deliver)

    def _sample_gathered(self, steps_per_env: int, filter_state: tuple | None, weights: Any,
                         deliver: Gathered, form: str) -> dict[str, Any]:
        self._take_weights(weights)
        metrics, batch = self._collect(steps_per_env, filter_state, form)
        rank = self._rank_of(deliver.batch)
        if deliver.rides and rank == DRIVER_RANK:
            return self._batch_in_answer(metrics, batch, rank)
        return self._deliver(metrics, batch, deliver.batch)

    def _batch_in_answer(self, metrics: dict[str, Any], batch: dict[str, np.ndarray],
                         send_to: int) -> dict[str, Any]:
        """Keep ``batch`` in ``metrics``, packed, if it fits in the gather, else send it to
        ``send_to``."""
        if fits_in_gather(batch, self.context.weights_comm.Get_size()):
            metrics["batch"] = PackedBatch(batch)
        else:
            self._send_batch(batch, send_to)
        return metrics

    def _collect(self, steps_per_env: int, filter_state: tuple | None, form: str
                 ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The policy's next block, postprocessed: (metrics, batch)."""
        runner = self.runner
        runner.set_filter(self.policy_id, filter_state)
        blocks = runner.collect(self.policy_id, steps_per_env, fresh=form == ADVANTAGES)
        batches = [self._postprocess(block, form) for block in blocks]
        batch = batches[0] if len(batches) == 1 else concat_batches(batches)
        metrics = blocks[0].metrics()
        for block in blocks[1:]:
            metrics = merge_sample_metrics(metrics, block.metrics())
        dumped = runner.take_dumped(self.policy_id)
        if dumped is not None:
            # Written and flushed before the driver hears of them: an indexed episode is on disk.
            metrics["dumped"] = dumped
        if self.callbacks is not None:
            invoke(self.callbacks, "on_sample_end", self.where, worker=self, batch=batch,
                   metrics=metrics)
        return metrics, batch

    def _postprocess(self, block: Block, form: str) -> dict[str, np.ndarray]:
        s = self.settings
        if form == FRAGMENTS:
            return fragment_batch(block, s.gamma)
        last_values = self.lane.actor.value(block.last_obs, block.last_state, block.last_critic)
        length = self.lane.policy.spec.model.max_seq_len if block.states is not None else 0
        return advantage_batch(block, last_values, s.gamma, s.lam, length)

    def _rank_of(self, deliver: ToRank | ToLearnerOf) -> int:
        return deliver.rank_for(self.context.role_index)

    def _deliver(self, metrics: dict[str, Any], batch: dict[str, np.ndarray],
                 deliver: Delivery) -> dict[str, Any]:
        if deliver is IN_ANSWER:
            metrics["batch"] = batch
        else:
            self._send_batch(batch, self._rank_of(deliver))
        return metrics

    def _send_batch(self, batch: Any, send_to: int, tag: int | None = None) -> None:
        """Send a batch to its learner over the data channel (without blocking)."""
        channel = self.context.data_channel
        channel.flush()
        channel.isend(batch, send_to, self.tags.batch if tag is None else tag)

    def sample_rounds(self, learner_ranks: tuple[int, ...], batch_in_answer: bool
                      ) -> dict[str, int]:
        """Standing synchronous rounds (``mpirl.execution.standing_rounds``): each round starts
        with learner 0's broadcast of ``(steps_per_env, filter_state)`` and its weights
        (``gathered.serve_rounds``); this worker then samples as ``sample(weights=BROADCAST,
        deliver=Gathered(ToLearnerOf(learner_ranks), batch_in_answer))`` would and answers
        through the gather. Returns ``{"rounds": n}`` once the rounds end. A round whose
        sampling raised joins the gather with no result (the driver then ends the rounds); the
        error is raised when they end."""
        deliver = Gathered(ToLearnerOf(learner_ranks), batch_in_answer)

        def one_round(header: tuple[int, tuple | None]) -> Exception | None:
            steps_per_env, filter_state = header
            self.runner.set_weights(self.policy_id, self._weights)
            result, failure = None, None
            try:
                result = self._sample_gathered(steps_per_env, filter_state, KEEP, deliver,
                                               ADVANTAGES)
            except Exception as error:  # noqa: BLE001 - raised once the driver ends the rounds
                failure = error
            send_answer(self.context, result)
            return failure

        return serve_rounds(self.context, self._weights, one_round)

    def sample_fragments(self, fragments: int, steps_per_env: int, filter_state: tuple | None,
                         send_to: int, stream_round: int = 0) -> dict[str, Any]:
        """Sample up to ``fragments`` V-trace fragments in a row, each sent to learner rank
        ``send_to`` as soon as it is done (its stream tag, with its env steps and the version
        of the weights that sampled it); before each, take the newest weights that learner
        pushed. The driver gets one answer for them all: their metrics summed
        (``merge_sample_metrics``) and ``fragments``, those sent. Once the driver's word to stop
        round ``stream_round`` came, no more are sampled."""
        def one_fragment() -> dict[str, Any]:
            self.take_pushed_weights(send_to)
            metrics, batch = self._collect(steps_per_env, filter_state, FRAGMENTS)
            self._send_batch((self.weights_version, metrics["env_steps"], batch), send_to,
                             self.tags.stream)
            return metrics

        return self.stream_calls(fragments, stream_round, one_fragment)

    def stream_calls(self, fragments: int | None, stream_round: int | None,
                     sample_one: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run ``sample_one`` (which samples and sends one fragment and returns its metrics) up
        to ``fragments`` times (None: until stopped), stopping early once the driver's word to
        stop ``stream_round`` came (None: never); return their metrics merged
        (``merge_sample_metrics``) with ``fragments``, how many were sent."""
        total: dict[str, Any] = {}
        sent = 0
        while fragments is None or sent < fragments:
            if self.stop_came(stream_round):
                break
            metrics = sample_one()
            total = merge_sample_metrics(total, metrics) if total else metrics
            sent += 1
        if not total:  # stopped before the first: an answer with nothing in it
            total = empty_sample_metrics()
        total["fragments"] = sent
        return total

    def stop_came(self, stream_round: int | None) -> bool:
        """Whether the driver's word to stop ``stream_round`` came (None: a call that is never
        stopped). A stop signal this rank received meanwhile goes to the driver from here
        (``report_received``): the call may run until the next checkpoint."""
        report_received()
        self.stopped_round = latest_stopped_round(self.context.data_channel, self.stopped_round,
                                                  self.tags.stop_stream)
        return stream_round is not None and stream_round <= self.stopped_round

    def compute_gradients(self, steps_per_env: int, loss: Callable, loss_config: Any,
                          filter_state: tuple | None = None,
                          weights: np.ndarray | None = None) -> dict[str, Any]:
        """Sample like ``sample()`` (taking ``weights`` first, if given), then take the gradient
        of ``loss(policy, batch, config)`` on that batch with this worker's own policy copy
        (A3C). Returns sample()'s metrics with, instead of the batch, ``"gradients"``: one flat
        float32 vector (None when env failures left no rows), and ``"stats"``: the loss
        statistics. Only these cross to the driver."""
        self._take_weights(KEEP if weights is None else weights)
        metrics, batch = self._collect(steps_per_env, filter_state, ADVANTAGES)
        metrics["gradients"], metrics["stats"] = None, {}
        if len(batch["logp"]):
            import torch

            policy = self.policy
            if isinstance(policy, NumpyPolicy):  # acting ran in NumPy; the gradient needs torch
                if self._torch_policy is None:
                    from mpirl.models.torch_model import build_torch_model

                    torch.set_num_threads(self.settings.torch_threads)
                    self._torch_policy = build_torch_model(policy.spec)
                self._torch_policy.set_flat_weights(policy.get_flat_weights())
                policy = self._torch_policy
            tensors = {k: torch.as_tensor(v) for k, v in batch.items()}
            policy.zero_grad(set_to_none=True)
            total, metrics["stats"] = loss(policy, tensors, loss_config)
            total.backward()
            metrics["gradients"] = policy.get_flat_gradients()
        return metrics

    def evaluate(self, episodes: int, deterministic: bool = False) -> dict[str, Any]:
        """Play ``episodes`` whole episodes with the current weights (``EnvRunner.evaluate``);
        returns their returns and lengths (its policy's agents', in a multi-agent run) and the
        env steps played. Nothing is trained on."""
        result = self.runner.evaluate(episodes, deterministic)
        if not self.owns_runner:
            result["episode_returns"] = result["policy_returns"][self.policy_id]
            result["episode_lengths"] = result["policy_lengths"][self.policy_id]
        return result

    def finish_dump(self) -> tuple[str, list[tuple[int, int]]] | None:
        """Wait until every completed episode is on disk; return (file name, [(local id,
        steps)]) of those not reported yet, for the driver's index. None without dumps."""
        for (pid, name), written in self.runner.finish_dump():
            if pid == self.policy_id:
                return name, written
        return None

    # Weights.

    def _take_weights(self, weights: Any) -> None:
        if weights is BROADCAST:
            self.receive_weights()
        elif weights is not KEEP:
            self.set_weights(weights)

    def receive_weights(self) -> None:
        """Take part in the weight broadcast from learner 0 (a collective on weights_comm), or
        take its policy's newest weights by message (a multi-agent run's policy)."""
        source = self.settings.weights_from
        if source is None:
            bcast_weights(self.context.weights_comm, self._weights,
                          self.context.collective_timeout_s)
        else:
            self._weights = self.context.data_channel.recv(
                source, self.tags.broadcast, self.context.collective_timeout_s)
        self.runner.set_weights(self.policy_id, self._weights)

    def set_weights(self, flat: np.ndarray) -> None:
        self.runner.set_weights(self.policy_id, flat)

    def get_weights(self) -> np.ndarray:
        return self.lane.actor.get_weights()

    def take_pushed_weights(self, source: int, until: int | None = None) -> int:
        """Take the weights learner rank ``source`` pushed (its pushed-weights tag) and load the
        newest; with ``until``, first wait until that many pushes were taken in all (before a
        checkpoint, so that none is left in flight). Returns the pushes taken in all."""
        channel = self.context.data_channel
        newest = None
        deadline = time.monotonic() + self.context.collective_timeout_s
        backoff = Backoff()
        while True:
            item = channel.poll(source, self.tags.pushed_weights)
            if item is None:
                if until is None or self.pushes_taken >= until:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.where}: {until - self.pushes_taken} weight "
                                       f"pushes from rank {source} never came")
                backoff.sleep()
                continue
            newest = item[0]
            self.pushes_taken += 1
        if newest is not None:
            self.weights_version, flat = newest
            self.runner.set_weights(self.policy_id, flat)
        return self.pushes_taken

    # Checkpoints: a worker that owns its sampling core saves it; a shared one is saved on its
    # own (the multi-agent run's rollout group).

    def get_state(self) -> dict[str, Any]:
        # Pushed weights are counted per session (the learners' counts start again too).
        return {"runner": self.runner.get_state()} if self.owns_runner else {}

    def save_state(self, directory: str, name: str) -> dict[str, Any]:
        """Worker.save_state's checksum entry, plus ``envs_error`` when the environments could
        not be pickled: the driver warns, and the manifest keeps the reason."""
        entry = super().save_state(directory, name)
        if self.owns_runner and self.runner.envs_error is not None:
            entry["envs_error"] = self.runner.envs_error
        return entry

    def set_state(self, state: dict[str, Any]) -> bool:
        """Restore from ``get_state``; True when the environments continue their episodes,
        False when they were reset instead (the driver warns)."""
        if self.owns_runner:
            return self.runner.set_state(state["runner"])
        return True
