"""Rollout workers: environments plus a policy copy, sampling batches of experience.

Each rollout rank steps ``num_envs_per_worker`` environments in a gymnasium vector env, computes
advantages (GAE) itself, and sends the batch straight to its learner rank over the data channel;
the driver gets back only counts and episode metrics. Weights arrive by broadcast from learner 0.

An environment that raises is rebuilt in place (``mpirl.workers.env_guard``); the episode it was in
is dropped from the batch and the episode metrics, and the driver gets the number of failures.
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from mpirl.data.dump_writer import DumpTarget
from mpirl.data.episode_recorder import EpisodeRecorder
from mpirl.envs.atari import EnvPoolVectorEnv
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.numpy_policy import NumpyPolicy, numpy_unsupported
from mpirl.models.policy_spec import PolicySpec, act_with_state
from mpirl.models.q_spec import NumpyQPolicy, QSpec
from mpirl.models.q_spec import numpy_unsupported as q_numpy_unsupported
from mpirl.models.spaces import has_image
from mpirl.models.statistics import RunningMeanStd, compute_gae
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
from mpirl.workers.callbacks import Episode, invoke, make_callbacks
from mpirl.workers.env_guard import EPISODE_DROPPED, ERROR, FAILURES, GuardedEnv
from mpirl.workers.env_spec import EnvSpec, EnvWorkerSettings

#: Tag of sample batches on the data channel.
BATCH_TAG = 21
#: Tag of streamed fragments (``sample_fragments``), which their learner takes from any rank.
STREAM_TAG = 22
#: Tag of the weights a learner pushes to the rollout ranks whose fragments it trained on.
PUSHED_WEIGHTS_TAG = 23
#: Shortest time between two env-failure warnings of one rollout worker on its stderr.
FAILURE_WARNING_INTERVAL_S = 60.0


def trajectory_batch(arrays: dict[str, np.ndarray], keep: np.ndarray,
                     last_obs: np.ndarray) -> dict[str, np.ndarray]:
    """One fragment per environment, for off-policy corrections that walk along time (V-trace):
    ``[N, T, ...]`` arrays built from sample()'s ``[T, N, ...]`` columns, so that every row is
    one environment's whole fragment and rows can be shuffled and split like any batch.

    ``logp`` is the behaviour policy's; ``dones`` end episodes (time limits too, with
    ``gamma * V(final_obs)`` folded into the reward); ``mask`` is 0 on the steps of episodes an
    env failure cut short; ``bootstrap_obs`` is the observation after the last step."""
    def rows(value: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.swapaxes(value, 0, 1))

    return {
        "obs": rows(arrays["obs"]), "actions": rows(arrays["actions"]),
        "logp": rows(arrays["logp"]), "rewards": rows(arrays["rewards"]),
        "dones": rows(arrays["dones"]).astype(np.float32),
        "mask": rows(keep).astype(np.float32),
        # In the observations' own dtype: uint8 images stay bytes on the wire.
        "bootstrap_obs": np.ascontiguousarray(last_obs),
    }


def sequence_batch(batch: dict[str, np.ndarray], states: np.ndarray, starts: np.ndarray,
                   keep: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """A recurrent policy's batch: ``[T, N, ...]`` step columns cut into sequences of ``length``
    steps along each environment, ``[S, L, ...]``, the last one of each padded. ``state_in`` is
    the state before each sequence's first step, ``resets`` marks the steps that start an
    episode, and ``mask`` keeps the real steps (not padding, nor episodes an env failure cut
    short). Sequences with no step to keep are left out."""
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


def build_actor(spec: Any, seed: int, torch_threads: int = 1) -> Any:
    """The model a rollout rank acts with: ``NumpyPolicy`` for an actor-critic it can run, or
    ``NumpyQPolicy`` for a Q network (no torch in the process: about 1 s and 200 MB less per
    rank), else the torch model of ``spec`` on ``torch_threads`` threads. The actor-critics
    sample with a generator seeded from ``seed``."""
    if isinstance(spec, PolicySpec) and numpy_unsupported(spec) is None:
        return NumpyPolicy(spec, seed=seed)
    if isinstance(spec, QSpec) and q_numpy_unsupported(spec) is None:
        return NumpyQPolicy(spec)
    import torch

    from mpirl.models.torch_model import build_torch_model

    torch.set_num_threads(torch_threads)
    torch.manual_seed(seed)
    return build_torch_model(spec)


@dataclass(frozen=True, kw_only=True)
class RolloutSettings(EnvWorkerSettings):
    """What a rollout worker (``RolloutWorker``, ``TransitionWorker``) is built from; it crosses
    to each rollout rank once, when the worker is spawned."""

    policy: Any
    """The spec of the model it acts with (``PolicySpec``, ``QSpec``, ...)."""
    dump: DumpTarget | None = None
    """Where its episodes go with ``--dump-trajectories``; None without."""
    callbacks: str = ""
    """``"module:Class"`` of the run's callbacks, or empty."""
    gamma: float = 1.0
    """Discount of the returns and advantages it computes (on-policy plans)."""
    lam: float = 1.0
    """GAE lambda of the advantages it computes (on-policy plans)."""
    normalize_observations: bool = False
    """Normalize vector observations by running statistics the driver merges."""

    @classmethod
    def from_config(cls, config: Any, *, env: EnvSpec, policy: Any,
                    dump: DumpTarget | None = None) -> RolloutSettings:
        """The settings of a run with ``config``. Offline configs have no GAE and no observation
        filter (BC no discount either), and replay configs sample no advantages: their workers
        keep the neutral defaults."""
        return cls(env=env, policy=policy, **cls.config_values(config), dump=dump,
                   callbacks=config.callbacks, gamma=getattr(config, "gamma", 1.0),
                   lam=getattr(config, "gae_lambda", 1.0),
                   normalize_observations=getattr(config, "normalize_observations", False))


class RolloutWorker(Worker):
    """Samples experience with the current policy; one per rollout rank (or in-process)."""

    MESSAGES = ("sample", "evaluate", "receive_weights", "set_weights", "get_weights",
                "save_state", "load_state", "finish_dump", "compute_gradients",
                "sample_fragments", "take_pushed_weights", "sample_rounds")

    Settings: ClassVar[type[RolloutSettings]] = RolloutSettings

    def __init__(self, context: RankContext, settings: RolloutSettings) -> None:
        super().__init__(context)
        env, num_envs, dump = settings.env, settings.num_envs, settings.dump
        self.callbacks = make_callbacks(settings.callbacks)
        #: The custom metrics of each training episode since the last sample() returned.
        self._custom_metrics: list[dict[str, float]] = []
        self.seed = settings.seed + 1000 * context.role_index
        self.env_id = env.env_id
        self.where = f"rollout worker {context.role_index} on rank {context.rank}"
        #: Train on the sign of each reward (Atari); returns are reported unclipped.
        self.clip_rewards = env.clip_rewards
        if env.atari is not None and env.atari.backend == "envpool":
            # One C++ pool of envs; it recovers no failed env (GuardedEnv's job otherwise).
            self.envs = EnvPoolVectorEnv(env.env_id, env.atari, env.env_config, num_envs,
                                         self.seed)
        else:
            self.envs = gym.vector.SyncVectorEnv(
                [partial(GuardedEnv, env, settings.max_env_failures, self.seed, i, self.where,
                         settings.env_failure_window)
                 for i in range(num_envs)],
                autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            )
        self.env_failures = 0  # on this worker, since it started
        self._unreported_failures = 0  # not yet returned by sample()
        self._next_warning_at = 0.0
        self.policy = build_actor(settings.policy, self.seed, settings.torch_threads)
        self._torch_policy: Any = None  # A3C's gradients: a torch copy of the actor, made once
        # A recurrent policy's state per env, zero at each episode's first step; carried across
        # sample() calls and saved in checkpoints.
        self.state = self.policy.initial_state(num_envs) \
            if getattr(self.policy, "recurrent", False) else None
        self.episode_starts = np.ones(num_envs, dtype=bool)
        self.gamma, self.lam = settings.gamma, settings.lam
        # Only real-valued vectors are normalized; a Discrete one is one-hot encoded, and images
        # stay as they are (uint8 on the wire, scaled inside the model).
        space = self.envs.single_observation_space
        self.normalize_observations = settings.normalize_observations and isinstance(
            space, gym.spaces.Box) and not has_image(space)
        self.obs_shape = self.envs.single_observation_space.shape
        self.filter = RunningMeanStd(self.obs_shape)
        self.obs, infos = self.envs.reset(seed=self.seed)
        self._note_failures(infos)
        # With trajectory dumps on, every completed episode goes to this rank's HDF5 file.
        self.recorder: EpisodeRecorder | None = None
        if dump is not None:
            self.recorder = EpisodeRecorder(
                dump, context.role_index, num_envs, env.env_id,
                self.envs.single_observation_space, self.envs.single_action_space, self.seed)
            self.recorder.begin(seeded=True)
        self.episode_return = np.zeros(num_envs)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self._weights = np.empty(self.policy.num_weights(), np.float32)
        self.restores = 0
        self.envs_error: str | None = None  # why get_state could not pickle the envs
        # Streamed fragments: the version of the weights last pushed by the learner, and how
        # many pushes were taken in all (a checkpoint waits until every push was).
        self.weights_version = 0
        self.pushes_taken = 0
        self.stopped_round = -1  # calls of this round of the stream, or earlier, stop early

    def _state_kwargs(self, state: np.ndarray | None = None, rows: Any = slice(None)
                      ) -> dict[str, Any]:
        """``value()``'s state argument: a recurrent policy's ``state[rows]`` (the carried
        state by default); nothing for a memoryless one."""
        if self.state is None:
            return {}
        return {"state": (self.state if state is None else state)[rows]}

    def _normalize(self, obs: np.ndarray) -> np.ndarray:
        if not self.normalize_observations:
            return obs
        return self.filter.normalize(obs)

    def sample(self, steps_per_env: int, filter_state: tuple | None = None,
               send_to: int | None = None, trajectories: bool = False,
               take_weights: bool = False, weights: np.ndarray | None = None,
               gather_answer: bool = False, batch_in_answer: bool = False,
               learner_ranks: tuple[int, ...] | None = None) -> dict[str, Any]:
        """Step every environment ``steps_per_env`` times; return metrics, and the batch itself
        unless ``send_to`` names the learner rank to send it to over the data channel. Rows of
        episodes that an env failure cut short are left out, so the batch may be short; the
        metrics count the failures (``env_failures``).

        With ``trajectories`` the batch holds raw fragments for off-policy corrections (V-trace)
        instead of GAE advantages; see ``trajectory_batch``. With ``take_weights`` it first
        takes part in the weight broadcast from learner 0 (``receive_weights``); given
        ``weights`` (flat, as ``set_weights``), it takes those first: the asynchronous plans send
        new weights in the next call instead of a call of their own.

        With ``gather_answer`` (and ``take_weights``) the metrics go to the driver through the
        gather that learner 0 roots on weights_comm after the broadcast, and the call returns
        ``ANSWERED`` (``mpirl.runtime.gathered``). With ``batch_in_answer`` too (the learner
        ``send_to`` shares the driver's process), the batch rides in that gathered answer when it
        is small enough (``gathered.fits_in_gather``), instead of a message of its own.

        ``learner_ranks`` in place of ``send_to``: the batch goes to learner ``role_index mod
        len(learner_ranks)`` (one call for every rollout worker), in the gathered answer with
        ``batch_in_answer`` only where that learner is in the driver's process (rank 0)."""
        if learner_ranks is not None:
            send_to = learner_ranks[self.context.role_index % len(learner_ranks)]
            batch_in_answer = batch_in_answer and send_to == DRIVER_RANK
        if gather_answer:
            if batch_in_answer and send_to is not None:
                return answer_through_gather(self.context, lambda: self._batch_in_answer(
                    self.sample(steps_per_env, filter_state, None, trajectories, take_weights,
                                weights), send_to))
            return answer_through_gather(self.context, lambda: self.sample(
                steps_per_env, filter_state, send_to, trajectories, take_weights, weights))
        if take_weights:
            self.receive_weights()
        if weights is not None:
            self.set_weights(weights)
        if filter_state is not None:
            self.filter.mean, self.filter.var, self.filter.count = filter_state
        delta = RunningMeanStd(self.obs_shape)  # what this call saw, merged on the driver
        num_envs = self.envs.num_envs
        columns = {k: [] for k in ("obs", "actions", "logp", "values", "rewards", "dones")}
        states, starts = [], []  # a recurrent policy's state before each step, episode starts
        returns, lengths = [], []
        # Rows of episodes cut short by an env failure are dropped after GAE.
        keep = np.ones((steps_per_env, num_envs), dtype=bool)
        episode_start = np.zeros(num_envs, dtype=np.int64)  # row of each episode's first step
        for t in range(steps_per_env):
            if self.normalize_observations:
                delta.update(self.obs)
            obs = self._normalize(self.obs)
            if self.state is not None:
                states.append(self.state)
                starts.append(self.episode_starts.copy())
            actions, logp, values, next_state = act_with_state(self.policy, obs, self.state)
            env_actions = self.policy.env_actions(actions)
            next_obs, rewards, terminated, truncated, infos = self.envs.step(env_actions)
            env_rewards = np.asarray(rewards, dtype=np.float32)  # recorded and reported
            self.episode_return += env_rewards
            rewards = self.trained_rewards(env_rewards)  # the bootstrap below adds to a copy
            self.episode_length += 1
            done = terminated | truncated
            # A time limit is not a terminal state: bootstrap from the final observation. A step
            # can be both (gymnasium's TimeLimit truncates a terminal last step too): terminal.
            cut = truncated & ~terminated
            if cut.any():
                final = np.stack([infos["final_obs"][i] for i in np.flatnonzero(cut)])
                rewards = rewards.copy()
                rewards[cut] += self.gamma * self.policy.value(
                    self._normalize(final), **self._state_kwargs(next_state, cut))
            for i in np.flatnonzero(done):
                self.episode_ended(i, returns, lengths)
            self.episode_return[done] = 0.0
            self.episode_length[done] = 0
            if FAILURES in infos:
                self._note_failures(infos)
                dropped = infos.get(EPISODE_DROPPED, np.zeros(num_envs, dtype=bool))
                for i in np.flatnonzero(dropped):
                    # The failed step is no transition, and its episode has no end to learn
                    # from: drop both. Rows sent in earlier fragments are gone already.
                    keep[episode_start[i]:t + 1, i] = False
                self.episode_return[dropped] = 0.0
                self.episode_length[dropped] = 0
                # A cut, so that GAE bootstraps nothing from the fresh env into these rows.
                done = done | dropped
            if self.recorder is not None:
                self.recorder.step(self.obs, env_actions, env_rewards, terminated, truncated,
                                   logp, infos, infos.get(EPISODE_DROPPED))
            episode_start[done] = t + 1
            if next_state is not None:
                next_state[done] = 0.0  # the next episode starts from a blank memory
                self.state = next_state
            self.episode_starts = done.copy()
            for key, value in (("obs", obs), ("actions", actions), ("logp", logp),
                               ("values", values), ("rewards", rewards), ("dones", done)):
                columns[key].append(value)
            self.obs = next_obs
        arrays = {k: np.stack(v) for k, v in columns.items()}
        if trajectories:
            batch = trajectory_batch(arrays, keep, self._normalize(self.obs))
            if self.state is not None:  # one sequence per fragment (V-trace walks all of it)
                batch["state_in"] = np.ascontiguousarray(states[0])
                batch["resets"] = np.ascontiguousarray(np.swapaxes(np.stack(starts), 0, 1),
                                                       dtype=np.float32)
            return self._finish_sample(batch, keep.size, returns, lengths, delta, send_to)
        last_values = self.policy.value(self._normalize(self.obs), **self._state_kwargs())
        advantages, targets = compute_gae(arrays["rewards"], arrays["values"],
                                          arrays["dones"].astype(np.float32), last_values,
                                          self.gamma, self.lam)
        count = steps_per_env * num_envs
        if self.state is not None:
            steps = {"obs": arrays["obs"], "actions": arrays["actions"], "logp": arrays["logp"],
                     "values": arrays["values"], "advantages": advantages,
                     "value_targets": targets}
            batch = sequence_batch(steps, np.stack(states), np.stack(starts), keep,
                                   self.policy.spec.model.max_seq_len)
            return self._finish_sample(batch, count, returns, lengths, delta, send_to)
        batch = {
            "obs": arrays["obs"].reshape(count, *arrays["obs"].shape[2:]),
            "actions": arrays["actions"].reshape(count, *arrays["actions"].shape[2:]),
            "logp": arrays["logp"].reshape(count),
            "values": arrays["values"].reshape(count),
            "advantages": advantages.reshape(count),
            "value_targets": targets.reshape(count),
        }
        if not keep.all():
            rows = keep.reshape(count)  # [T, N] flattened row-major, as the batch was
            batch = {key: value[rows] for key, value in batch.items()}
        return self._finish_sample(batch, count, returns, lengths, delta, send_to)

    def sample_rounds(self, learner_ranks: tuple[int, ...], batch_in_answer: bool
                      ) -> dict[str, int]:
        """Standing synchronous rounds (``mpirl.execution.standing_rounds``): each round starts
        with learner 0's broadcast of ``(steps_per_env, filter_state)`` and its weights
        (``gathered.serve_rounds``); this worker then samples as ``sample(gather_answer=True,
        learner_ranks=...)`` would and answers through the gather. Returns ``{"rounds": n}``
        once the rounds end. A round whose sampling raised joins the gather with no result
        (the driver then ends the rounds); the error is raised when they end."""
        context = self.context
        send_to = learner_ranks[context.role_index % len(learner_ranks)]
        batch_in_answer = batch_in_answer and send_to == DRIVER_RANK

        def one_round(header: tuple[int, tuple | None]) -> Exception | None:
            steps_per_env, filter_state = header
            self.policy.set_flat_weights(self._weights)
            result, failure = None, None
            try:
                if batch_in_answer:
                    result = self._batch_in_answer(
                        self.sample(steps_per_env, filter_state, None), send_to)
                else:
                    result = self.sample(steps_per_env, filter_state, send_to)
            except Exception as error:  # noqa: BLE001 - raised once the driver ends the rounds
                failure = error
            send_answer(context, result)
            return failure

        return serve_rounds(context, self._weights, one_round)

    def sample_fragments(self, fragments: int, steps_per_env: int, filter_state: tuple | None,
                         send_to: int, stream_round: int = 0) -> dict[str, Any]:
        """Sample up to ``fragments`` V-trace fragments in a row, each sent to learner rank
        ``send_to`` as soon as it is done (``STREAM_TAG``, with its env steps and the version
        of the weights that sampled it); before each, take the newest weights that
        learner pushed. The driver gets one answer for them all: their metrics summed
        (``merge_sample_metrics``) and ``fragments``, those sent. Once the driver's word to stop
        round ``stream_round`` came (``STOP_STREAM_TAG``, before a checkpoint), no more are
        sampled."""
        if filter_state is not None:
            self.filter.mean, self.filter.var, self.filter.count = filter_state

        def one_fragment() -> dict[str, Any]:
            self.take_pushed_weights(send_to)
            metrics = self.sample(steps_per_env, trajectories=True)
            self._send_batch((self.weights_version, metrics["env_steps"], metrics.pop("batch")),
                             send_to, STREAM_TAG)
            return metrics

        return self.stream_calls(fragments, stream_round, one_fragment)

    def stream_calls(self, fragments: int | None, stream_round: int | None,
                     sample_one: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run ``sample_one`` (which samples and sends one fragment and returns its metrics) up
        to ``fragments`` times (None: until stopped), stopping early once the driver's word to
        stop ``stream_round`` came (``STOP_STREAM_TAG``; None: never); return their metrics
        merged (``merge_sample_metrics``) with ``fragments``, how many were sent."""
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
        """Whether the driver's word to stop ``stream_round`` came (``STOP_STREAM_TAG``; None:
        a call that is never stopped). A stop signal this rank received meanwhile goes to the
        driver from here (``report_received``): the call may run until the next checkpoint."""
        report_received()
        self.stopped_round = latest_stopped_round(self.context.data_channel, self.stopped_round)
        return stream_round is not None and stream_round <= self.stopped_round

    def take_pushed_weights(self, source: int, until: int | None = None) -> int:
        """Take the weights learner rank ``source`` pushed (``PUSHED_WEIGHTS_TAG``) and load the
        newest; with ``until``, first wait until that many pushes were taken in all (before a
        checkpoint, so that none is left in flight). Returns the pushes taken in all."""
        channel = self.context.data_channel
        newest = None
        deadline = time.monotonic() + self.context.collective_timeout_s
        backoff = Backoff()
        while True:
            item = channel.poll(source, PUSHED_WEIGHTS_TAG)
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
            self.policy.set_flat_weights(flat)
        return self.pushes_taken

    def _batch_in_answer(self, metrics: dict[str, Any], send_to: int) -> dict[str, Any]:
        """Keep the batch in ``metrics``, packed, if it fits in the gather, else send it to
        ``send_to``."""
        batch = metrics.pop("batch")
        if fits_in_gather(batch, self.context.weights_comm.Get_size()):
            metrics["batch"] = PackedBatch(batch)
        else:
            self._send_batch(batch, send_to)
        return metrics

    def _send_batch(self, batch: Any, send_to: int, tag: int = BATCH_TAG) -> None:
        """Send a batch to its learner over the data channel (without blocking)."""
        channel = self.context.data_channel
        channel.flush()
        channel.isend(batch, send_to, tag)

    def trained_rewards(self, rewards: np.ndarray) -> np.ndarray:
        """The rewards training sees: their signs with ``clip_rewards``, else themselves."""
        return np.sign(rewards) if self.clip_rewards else rewards

    def _finish_sample(self, batch: dict[str, np.ndarray], count: int, returns: list[float],
                       lengths: list[int], delta: RunningMeanStd,
                       send_to: int | None) -> dict[str, Any]:
        """The metrics of one sample() call (``count`` env steps); the batch goes to
        ``send_to`` over the data channel, or into the metrics."""
        failures, self._unreported_failures = self._unreported_failures, 0
        metrics = {"env_steps": count, "episode_returns": returns, "episode_lengths": lengths,
                   "env_failures": failures,
                   "filter_delta": delta.state() if self.normalize_observations else None}
        if self.recorder is not None:
            # Written and flushed before the driver hears of them: an indexed episode is on disk.
            metrics["dumped"] = (self.recorder.path.name, self.recorder.flush())
        self.report_custom_metrics(metrics, batch)
        if send_to is None:
            metrics["batch"] = batch
        else:
            self._send_batch(batch, send_to)
        return metrics

    def episode_ended(self, env_index: int, returns: list[float], lengths: list[int]) -> None:
        """A training episode ended in environment ``env_index``: count it, and run the
        ``on_episode_end`` callback, keeping the custom metrics it set."""
        returns.append(float(self.episode_return[env_index]))
        lengths.append(int(self.episode_length[env_index]))
        if self.callbacks is not None:
            episode = Episode(returns[-1], lengths[-1], self.context.role_index, int(env_index))
            invoke(self.callbacks, "on_episode_end", self.where, episode=episode, worker=self)
            self._custom_metrics.append({k: float(v) for k, v in
                                         episode.custom_metrics.items()})

    def report_custom_metrics(self, metrics: dict[str, Any], batch: dict | None) -> None:
        """Put the episodes' custom metrics into a sample call's ``metrics`` (one dict per
        episode, in the order of ``episode_returns``), and run ``on_sample_end``."""
        if self.callbacks is None:
            return
        metrics["custom_metrics"], self._custom_metrics = self._custom_metrics, []
        invoke(self.callbacks, "on_sample_end", self.where, worker=self, batch=batch,
               metrics=metrics)

    def compute_gradients(self, steps_per_env: int, loss: Callable, loss_config: Any,
                          filter_state: tuple | None = None,
                          weights: np.ndarray | None = None) -> dict[str, Any]:
        """Sample like ``sample()`` (taking ``weights`` first, if given), then take the gradient
        of ``loss(policy, batch, config)`` on that batch with this worker's own policy copy
        (A3C). Returns sample()'s metrics with,
        instead of the batch, ``"gradients"``: one flat float32 vector (None when env failures
        left no rows), and ``"stats"``: the loss statistics. Only these cross to the driver."""
        metrics = self.sample(steps_per_env, filter_state, weights=weights)
        batch = metrics.pop("batch")
        metrics["gradients"], metrics["stats"] = None, {}
        if len(batch["logp"]):
            import torch

            from mpirl.models.torch_model import build_torch_model

            policy = self.policy
            if isinstance(policy, NumpyPolicy):  # acting ran in NumPy; the gradient needs torch
                if self._torch_policy is None:
                    self._torch_policy = build_torch_model(policy.spec)
                self._torch_policy.set_flat_weights(policy.get_flat_weights())
                policy = self._torch_policy
            tensors = {k: torch.as_tensor(v) for k, v in batch.items()}
            policy.zero_grad(set_to_none=True)
            total, metrics["stats"] = loss(policy, tensors, loss_config)
            total.backward()
            metrics["gradients"] = policy.get_flat_gradients()
        return metrics

    def finish_dump(self) -> tuple[str, list[tuple[int, int]]] | None:
        """Wait until every completed episode is on disk; return (file name, [(local id,
        steps)]) of those not reported yet, for the driver's index. None without dumps."""
        if self.recorder is None:
            return None
        name, written = self.recorder.path.name, self.recorder.close()
        self.recorder = None
        return name, written

    def evaluate(self, episodes: int, deterministic: bool = False) -> dict[str, Any]:
        """Play ``episodes`` whole episodes with the current weights from freshly reset
        environments; return their returns and lengths and the env steps played (nothing is
        trained on). Each sub-env plays a fixed share of the episodes, so that short episodes
        are not favoured. Episodes that sampling had in progress are abandoned."""
        num_envs = self.envs.num_envs
        quota = np.array([len(part) for part in np.array_split(np.arange(episodes), num_envs)])
        self.obs, infos = self.envs.reset()
        self._note_failures(infos)
        self.episode_return[:] = 0.0
        self.episode_length[:] = 0
        returns, lengths, env_steps = [], [], 0
        state = None if self.state is None else np.zeros_like(self.state)
        while quota.any():
            actions, _, _, state = act_with_state(self.policy, self._normalize(self.obs), state,
                                                  deterministic)
            self.obs, rewards, terminated, truncated, infos = self.envs.step(
                self.policy.env_actions(actions))
            env_steps += int((quota > 0).sum())
            self.episode_return += rewards
            self.episode_length += 1
            done = terminated | truncated
            dropped = np.zeros(num_envs, dtype=bool)
            if FAILURES in infos:
                self._note_failures(infos)
                dropped = infos.get(EPISODE_DROPPED, dropped)
            for i in np.flatnonzero(done & ~dropped & (quota > 0)):
                returns.append(float(self.episode_return[i]))
                lengths.append(int(self.episode_length[i]))
                quota[i] -= 1
            self.episode_return[done | dropped] = 0.0
            self.episode_length[done | dropped] = 0
            if state is not None:
                state[done | dropped] = 0.0
        # Sampling starts its interrupted episodes' successors from a blank memory.
        if self.state is not None:
            self.state[:] = 0.0
        self.episode_starts[:] = True
        if self.recorder is not None:
            # The episodes now in progress began during evaluation, unrecorded: never dump them.
            self.recorder.untrack()
        failures, self._unreported_failures = self._unreported_failures, 0
        return {"env_steps": env_steps, "episode_returns": returns, "episode_lengths": lengths,
                "env_failures": failures}

    def _note_failures(self, infos: dict[str, Any]) -> None:
        """Count the failures the guarded envs report in ``infos``; warn on stderr now and then
        (the driver sees them all in num_env_failures)."""
        if FAILURES not in infos:
            return
        counts = infos[FAILURES]
        self.env_failures += int(counts.sum())
        self._unreported_failures += int(counts.sum())
        now = time.monotonic()
        if now < self._next_warning_at:
            return
        self._next_warning_at = now + FAILURE_WARNING_INTERVAL_S
        i = int(np.flatnonzero(counts)[-1])
        print(f"mpirl: warning: {self.where}: {self.env_id} sub-env {i} raised {infos[ERROR][i]}; "
              f"rebuilt it. {self.env_failures} env failures on this worker so far "
              f"(num_env_failures counts them all; this warning repeats at most every "
              f"{FAILURE_WARNING_INTERVAL_S:g} s).", file=sys.stderr, flush=True)

    def receive_weights(self) -> None:
        """Take part in the weight broadcast from learner 0 (a collective on weights_comm)."""
        bcast_weights(self.context.weights_comm, self._weights, self.context.collective_timeout_s)
        self.policy.set_flat_weights(self._weights)

    def set_weights(self, flat: np.ndarray) -> None:
        self.policy.set_flat_weights(flat)

    def get_weights(self) -> np.ndarray:
        return self.policy.get_flat_weights()

    def get_state(self) -> dict[str, Any]:
        """Environments (pickled whole, with their episodes in progress), RNGs, counters.

        Weights are not included: they equal learner 0's, broadcast again on restore. An
        environment that cannot be pickled (one holding a simulator handle, say) is saved as
        None; on restore it is reset from a fresh seed instead of continuing its episodes.
        """
        try:
            envs = pickle.dumps(self.envs, protocol=5)
            self.envs_error = None
        except Exception as error:  # noqa: BLE001 - any env may refuse to pickle
            envs, self.envs_error = None, f"{type(error).__name__}: {error}"
        return {
            "envs": envs, "envs_error": self.envs_error, "obs": self.obs,
            "episode_return": self.episode_return, "episode_length": self.episode_length,
            "filter": self.filter.state(), "rng": capture_rng(), "restores": self.restores,
            "actor_rng": (self.policy.rng.bit_generator.state
                          if isinstance(self.policy, NumpyPolicy) else None),
            "seed": self.seed,
            "env_failures": self.env_failures, "unreported_failures": self._unreported_failures,
            "policy_state": self.state, "episode_starts": self.episode_starts,
        }

    def save_state(self, directory: str, name: str) -> dict[str, Any]:
        """Worker.save_state's checksum entry, plus ``envs_error`` when the environments could
        not be pickled: the driver warns, and the manifest keeps the reason."""
        entry = super().save_state(directory, name)
        if self.envs_error is not None:
            entry["envs_error"] = self.envs_error
        return entry

    def set_state(self, state: dict[str, Any]) -> bool:
        """Restore from ``get_state``; True when the environments continue their episodes,
        False when they were reset instead (the driver warns)."""
        self.restores = state["restores"] + 1
        self.env_failures = state["env_failures"]
        self._unreported_failures = state["unreported_failures"]
        self.filter.mean, self.filter.var, self.filter.count = state["filter"]
        if state["envs"] is not None:
            envs = pickle.loads(state["envs"])
            if envs.num_envs == self.envs.num_envs:
                self.envs.close()
                self.envs = envs
                self.obs = state["obs"]
                self.episode_return = state["episode_return"]
                self.episode_length = state["episode_length"]
                if self.state is not None and state.get("policy_state") is not None:
                    self.state = state["policy_state"]
                self.episode_starts = state.get("episode_starts", self.episode_starts)
                self._restore_rngs(state)
                if self.recorder is not None:
                    self.recorder.untrack()  # their beginnings are in an earlier session
                return True
            envs.close()
        # Environments start over (from a seed that differs from the first run's) when they
        # could not be saved or num_envs_per_worker changed.
        self.obs, _ = self.envs.reset(seed=self.seed + 7_777_777 * self.restores)
        self.episode_return[:] = 0.0
        self.episode_length[:] = 0
        if self.state is not None:
            self.state[:] = 0.0
        self.episode_starts[:] = True
        if self.recorder is not None:
            self.recorder.begin()
        self._restore_rngs(state)
        return False

    def _restore_rngs(self, state: dict[str, Any]) -> None:
        restore_rng(state["rng"])
        if not isinstance(self.policy, NumpyPolicy):
            return
        if state.get("seed", self.seed) != self.seed:
            # Another run's state (PBT's exploit copies the winner's checkpoint): continue from
            # it, but draw this run's own actions, or the two members would stay clones.
            self.policy.rng = np.random.default_rng([self.seed, self.restores])
        elif state.get("actor_rng") is not None:  # this run's own: resume bit-identically
            self.policy.rng.bit_generator.state = state["actor_rng"]
