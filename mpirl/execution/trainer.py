"""The driver side of a run: its worker groups, counters, metrics, checkpoints and stop criteria.

``Trainer`` builds the rollout workers and learners of an algorithm module (its
``ROLLOUT_WORKER`` and ``LEARNER``, from their ``Settings``), has the module's ``setup`` make
its ``PlanState``, and turns each ``training_step(trainer, state)`` into one metrics row. What
the module defines is ``mpirl.execution.contract``'s ``AlgorithmModule``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.config.fields import Range, above
from mpirl.config.parse import positive_int_from_env
from mpirl.data.dump_index import DumpIndex
from mpirl.data.dump_writer import DumpSettings, DumpWriterTimeout
from mpirl.data.tags import DataTags
from mpirl.errors import (
    LEARNER_STOPS,
    CallbackError,
    CheckpointError,
    ConfigError,
    RankLost,
    RemoteError,
    unwrap_remote,
)
from mpirl.execution.contract import AlgorithmModule, PlanState, name_of
from mpirl.execution.operators import SampleResult, broadcast_weights
from mpirl.jobs.checkpoint import CheckpointStore, capture_rng, manifest_header, restore_rng
from mpirl.models.policy import RunningMeanStd
from mpirl.runtime.dispatch import WorkerGroup
from mpirl.runtime.driver import Driver
from mpirl.runtime.host import DRIVER_RANK
from mpirl.runtime.layout import ENV
from mpirl.runtime.state_files import read_state_file, write_state_file
from mpirl.workers.callbacks import invoke, make_callbacks
from mpirl.workers.env_guard import unwrap_env_failure
from mpirl.workers.env_spec import EnvSpec
from mpirl.workers.rollout import SamplingSettings
from mpirl.workers.sim_envs import SIMULATION_NOT_SAVED
from mpirl.workers.sim_member import SimulationMember

#: Keys a ``--stop`` criterion may use (any one reached stops the run), and the values each
#: accepts: finite numbers only, as a NaN criterion is never reached and would burn the allocation.
STOP_KEYS = {"episode_return_mean": Range(), "timesteps_total": above(0),
             "training_iteration": above(0), "time_total_s": above(0),
             # multi-agent runs only: the lowest of the policies' episode_return_mean
             "policy_return_mean_min": Range(),
             # the last evaluation's mean return, of a plan that reports one
             # (``CommonConfig.reports_eval_return``)
             "eval_return_mean": Range()}

#: The environment variable that caps every run the CLI starts at this many training
#: iterations, on top of its own stop criteria (a test that runs every documented command).
MAX_ITERATIONS_ENV = "MPIRL_MAX_ITERATIONS"


@dataclass(frozen=True)
class PolicyEnv:
    """What a plan asks of its environment, for one policy of a multi-agent run: its agents'
    spaces (``spaces()``); no single-agent preprocessing (Atari's) applies."""

    env_id: str
    observation_space: gym.Space
    action_space: gym.Space
    atari: None = None

    def spaces(self) -> tuple[gym.Space, gym.Space]:
        return self.observation_space, self.action_space


@dataclass(frozen=True)
class PolicyPlace:
    """Where one policy of a multi-agent run lives, for its ``Trainer``: the rollout ranks'
    sampling cores (``runners``) that its rollout workers are spawned beside, its learners'
    slice of the learner ranks, its spaces and model, its slots per rollout worker (its agents
    in each env) and its dump index."""

    policy_id: str
    index: int
    runners: WorkerGroup
    learner_members: list[int]
    observation_space: gym.Space
    action_space: gym.Space
    model_spec: Any
    slots_per_worker: int
    dump_index: DumpIndex | None = None


def spawn_error(error: RemoteError) -> Exception:
    """The error to report for a worker whose constructor raised on its rank: a ConfigError
    there (a setting only that rank can check, such as learner_master_addr, or a callbacks class
    whose constructor raises) as the user's error naming the rank, an env that always fails by
    its message alone, anything else as is."""
    if error.cause_type == f"{ConfigError.__module__}.{ConfigError.__qualname__}":
        return ConfigError(f"{error.role} on rank {error.rank}: {error.cause_message}")
    return unwrap_env_failure(error)


class Trainer:
    """The driver side of one algorithm's plan over its workers; ``train()`` runs one iteration
    and returns its row. A single-agent run is one ``Trainer``; a multi-agent run composes one
    per learning policy (``place``), each driving its own algorithm's plan over that policy's
    workers (``mpirl.execution.multiagent``).

    A plan reads ``trainer.config``, ``trainer.rollouts`` and ``trainer.learners`` (worker
    groups), ``trainer.obs_filter`` and ``trainer.timesteps_total``, and adds each round of
    samples with ``trainer.count(samples)``; groups of its own it makes with
    ``trainer.spawn``."""

    def __init__(self, driver: Driver, module: AlgorithmModule, config: Any, env: EnvSpec,
                 dump: DumpSettings | None = None, place: PolicyPlace | None = None) -> None:
        self.driver, self.module, self.config, self.env = driver, module, config, env
        self.place = place
        #: The name a run records: PPO for mpirl.algorithms.ppo, a plug-in's module path.
        self.name = name_of(module)
        #: A multi-agent run's policy (None: a single-agent run's one): its id, its place among
        #: the policies, and the data-channel tags of its workers' messages.
        self.policy_id = None if place is None else place.policy_id
        self.policy_index = None if place is None else place.index
        self.tags = DataTags.of_policy(self.policy_index)
        if place is None:
            observation_space, action_space = env.spaces()
            # Trajectory dumps: the driver keeps the index; each rollout rank writes its file.
            self.dump_index: DumpIndex | None = None
            if dump is not None and dump.dump_trajectories is not None:
                self.dump_index = DumpIndex(dump, env.env_id, observation_space, action_space,
                                            self.name)
            # The module's model and workers (DQN's: a Q network, epsilon-greedy rollout
            # workers, learners on replay), each worker built from the settings its class reads.
            self.policy_spec = module.model_spec(observation_space, action_space, config)
            #: Streams of steps per rollout worker (replay keeps each apart): its envs.
            self.slots_per_worker = config.num_envs_per_worker
            rollout_settings = module.ROLLOUT_WORKER.Settings.from_config(
                config, env=env, policy=self.policy_spec,
                dump=self.dump_index.target if self.dump_index is not None else None)
        else:
            observation_space, action_space = place.observation_space, place.action_space
            self.dump_index = place.dump_index
            self.policy_spec = place.model_spec
            self.slots_per_worker = place.slots_per_worker
            rollout_settings = SamplingSettings.for_policy(
                config, policy_id=place.policy_id, policy_index=place.index,
                weights_from=self._learner_rank(place.learner_members[0]))
        #: Env ranks (ranks_per_env >= 1): each serves its share of an env group's simulation
        #: in one long call, until the rollout rank or the driver's shutdown ends it.
        self.env_members = None
        if place is None and driver.placement.count(ENV):
            self.env_members = driver.spawn(ENV, SimulationMember, env)
            self.env_serving = self.env_members.call_async("serve")
        try:
            # Each worker resets its envs here: one that always fails ends the run right away.
            self.rollouts = self.spawn("rollout", module.ROLLOUT_WORKER, rollout_settings,
                                       beside=None if place is None else place.runners)
        except RemoteError as error:
            raise spawn_error(error) from None
        learner_settings = module.LEARNER.Settings.from_config(config, policy=self.policy_spec,
                                                                 loss=module.loss)
        if place is not None:
            learner_settings = learner_settings.for_policy(
                members=place.learner_members, policy_index=place.index,
                weights_to=[w.rank for w in place.runners if not w.in_process])
        try:
            self.learners = self.spawn(
                "learner", module.LEARNER, learner_settings,
                members=None if place is None else place.learner_members)
        except RemoteError as error:
            raise spawn_error(error) from None
        broadcast_weights(self.learners, self.rollouts)
        shape = observation_space.shape
        # Offline configs have no observation filter: their rollout workers only evaluate, on
        # observations as the dump holds them.
        normalize = config.observation_normalization()
        self.obs_filter = RunningMeanStd(shape) if normalize and shape else None
        self._init_run_state(config)
        if place is not None:
            self.callbacks = None  # the driver's hooks run once, for the whole run
        #: What the plan keeps between iterations (groups of its own, calls in flight).
        self.plan = module.setup(self)
        if not isinstance(self.plan, PlanState):
            raise ConfigError(f"algorithm module {module.__name__!r}: setup(trainer) returned "
                              f"{self.plan!r}, not a mpirl.execution.PlanState")
        invoke(self.callbacks, "on_algorithm_init", "driver", algorithm=self)

    def spawn(self, role: str, cls: type, settings: Any, *, members: list[int] | None = None,
              beside: WorkerGroup | None = None) -> WorkerGroup:
        """A group of this plan's workers of ``cls`` on ``role``'s ranks (one in the driver's
        process when the role has none), named for checkpoints after the role, and after its
        policy in a multi-agent run (``replay-runner``)."""
        group = self.driver.spawn(role, cls, settings, local_if_empty=True, members=members,
                                  beside=beside)
        if self.policy_id is not None:
            group.name = f"{role}-{self.policy_id}"
        return group

    @property
    def spaces(self) -> Any:
        """Its environment as its plan sees it (``spaces()``, ``atari``): the run's env, or a
        multi-agent policy's agents' (``PolicyEnv``)."""
        if self.place is None:
            return self.env
        return PolicyEnv(self.env.env_id, self.place.observation_space, self.place.action_space)

    def _learner_rank(self, index: int) -> int:
        """The rank of learner ``index`` (the driver's, 0, when the run has no learner ranks)."""
        ranks = self.driver.placement.ranks("learner")
        return ranks[index] if ranks else DRIVER_RANK

    def _init_run_state(self, config: Any) -> None:
        """Counters, metric windows and callbacks: what every run's driver keeps."""
        self.iteration = 0
        self.timesteps_total = 0
        self.episodes_total = 0
        self.num_env_failures = 0
        self.evaluation_env_steps_total = 0  # offline plans: steps played only to evaluate
        #: Where ``note`` goes: the run's display on rank 0 (None: nothing shows the run).
        self.notes_to: Callable[[str], None] | None = None
        self.returns: deque[float] = deque(maxlen=config.metrics_window)
        self.lengths: deque[int] = deque(maxlen=config.metrics_window)
        #: Callbacks: the driver's own instance, each window episode's custom metrics, and
        #: every custom metric name seen so far (reported from then on, NaN while absent).
        self.callbacks = make_callbacks(config.callbacks)
        self.custom_metrics: deque[dict[str, float]] = deque(maxlen=config.metrics_window)
        self.custom_names: dict[str, None] = {}
        self.started = time.monotonic()
        self.time_before_resume = 0.0
        self.last_row: dict[str, Any] | None = None
        #: TensorBoard histograms of the last iteration (tag -> array); empty on most.
        self.histograms: dict[str, np.ndarray] = {}
        self._warned_unsaved_envs = False

    @property
    def time_total_s(self) -> float:
        """Seconds of training in this run, the time before each resume included."""
        return self.time_before_resume + time.monotonic() - self.started

    @property
    def train_batch_size(self) -> int:
        """Environment steps per iteration, over all rollout workers (offline: dataset rows
        trained on per iteration, over all learners; a multi-agent policy's: its agents' steps,
        at most one per slot and env step)."""
        return self.config.samples_per_iteration(len(self.rollouts) * self.slots_per_worker)

    def num_minibatches(self, minibatch_size: int) -> int:
        """SGD steps per epoch such that each step sees about ``minibatch_size`` rows in total,
        whatever the number of learners (each learner's share is split this many times)."""
        return max(1, round(self.train_batch_size / minibatch_size))

    def note(self, text: str) -> None:
        """Tell the user what a long part of an iteration does while it runs (PETS's planned
        evaluation): a line, or the live display's; nothing where no display shows the run."""
        if self.notes_to is not None:
            self.notes_to(text)

    def count(self, samples: SampleResult) -> None:
        """Add one round of samples to the counters and the episode window."""
        self.timesteps_total += samples.env_steps
        self.episodes_total += len(samples.episode_returns)
        self.num_env_failures += samples.env_failures
        self.returns.extend(samples.episode_returns)
        self.lengths.extend(samples.episode_lengths)
        self.custom_metrics.extend(samples.custom_metrics)
        for metrics in samples.custom_metrics:
            self.custom_names.update(dict.fromkeys(metrics))
        if self.dump_index is not None:
            for file_name, episodes in samples.dumped:
                self.dump_index.add(file_name, episodes)

    def train(self) -> dict[str, Any]:
        start, steps_before = time.monotonic(), self.timesteps_total
        try:
            try:
                stats = self.training_step()
            except RemoteError as error:  # a callback or a learner's stop: its message alone
                raise unwrap_remote(error, CallbackError, *LEARNER_STOPS) from None
        except LEARNER_STOPS as error:
            # Raised before this iteration is counted: no checkpoint holds what failed, and the
            # last one written stays the newest.
            raise type(error)(f"training iteration {self.iteration + 1}: {error}; the run "
                              f"stopped, its last checkpoint is kept") from None
        self.iteration += 1
        if self.dump_index is not None:
            self.dump_index.commit()  # a run killed later still leaves an indexed dataset
        elapsed = time.monotonic() - start
        nan = math.nan
        row = {
            "iteration": self.iteration,
            "timesteps_total": self.timesteps_total,
            "episodes_total": self.episodes_total,
            # On the window's deques themselves: NumPy would copy each into an array first,
            # about 40 us of rank 0's CPU per iteration for the four.
            "episode_return_mean": fmean(self.returns) if self.returns else nan,
            "episode_return_min": float(min(self.returns)) if self.returns else nan,
            "episode_return_max": float(max(self.returns)) if self.returns else nan,
            "episode_len_mean": fmean(self.lengths) if self.lengths else nan,
            "num_env_failures": self.num_env_failures,
            "env_steps_per_s": (self.timesteps_total - steps_before) / max(elapsed, 1e-9),
            "time_this_iter_s": elapsed,
            "time_total_s": self.time_total_s,
            # Rollout ranks can be lost and survived (survive_rollout_loss, under ULFM).
            "num_rollout_workers": len(self.rollouts),
            "rollout_ranks_lost": len(self.rollouts.lost),
            **stats,
            **self.driver.memory_report(),
            **self.driver.perf_report(),
            **self.custom_means(),
        }
        invoke(self.callbacks, "on_train_result", "driver", algorithm=self, result=row)
        every = self.config.tensorboard_histograms_every
        self.histograms = (self.collect_histograms()
                           if every and self.iteration % every == 0 else {})
        self.last_row = row
        return row

    def training_step(self) -> dict[str, float]:
        """One iteration of the algorithm's plan; its statistics."""
        return self.module.training_step(self, self.plan)

    def collect_histograms(self) -> dict[str, np.ndarray]:
        """What TensorBoard's histograms show this iteration: learner 0's."""
        return self.plan.histograms(self.learners)

    def settle(self) -> None:
        """Bring the calls a plan keeps running across iterations to a stop, with what they
        sampled counted; the workers are then free for other calls. The next iteration starts
        them again."""
        self.plan.settle()
        if self.driver.dispatcher is not None:
            self.driver.dispatcher.release_all()  # standing rounds (execution.standing_rounds)

    def custom_means(self) -> dict[str, float]:
        """``custom/<name>_mean`` of each custom metric over the episodes of the metrics window
        that set it (NaN when none did)."""
        means = {}
        for name in self.custom_names:
            values = [m[name] for m in self.custom_metrics if name in m]
            means[f"custom/{name}_mean"] = float(np.mean(values)) if values else math.nan
        return means

    def finish_dumps(self) -> None:
        """At the end of a run: settle the calls still running, wait until every rollout rank's
        episodes are on disk, and index them all."""
        self.settle()
        if self.dump_index is None:
            return
        for future in [w.call_async("finish_dump") for w in self.rollouts]:
            try:
                result = future.result()
            except RankLost:
                continue  # its file holds what it wrote; mpirl.data.reader finds the rest
            except RemoteError as error:
                raise unwrap_remote(error, DumpWriterTimeout) from None
            self.index_written(result)
        self.dump_index.commit()

    def index_written(self, written: Any) -> None:
        """Index what a rollout worker's ``finish_dump`` returned: (file name, episodes), or
        None without a dump."""
        if written is not None:
            self.dump_index.add(*written)

    # Checkpoints. The driver's own state goes to driver.pkl; every worker writes its own file.

    def get_state(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration, "timesteps_total": self.timesteps_total,
            "episodes_total": self.episodes_total, "num_env_failures": self.num_env_failures,
            "evaluation_env_steps_total": self.evaluation_env_steps_total,
            "plan": self.plan.get_state(),
            "returns": list(self.returns),
            "lengths": list(self.lengths),
            "custom_metrics": list(self.custom_metrics),
            "custom_names": list(self.custom_names),
            "obs_filter": self.obs_filter.state() if self.obs_filter is not None else None,
            "time_total_s": self.time_total_s,
            "last_row": self.last_row, "rng": capture_rng(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.iteration = state["iteration"]
        self.timesteps_total = state["timesteps_total"]
        self.episodes_total = state["episodes_total"]
        self.num_env_failures = state["num_env_failures"]
        self.evaluation_env_steps_total = state.get("evaluation_env_steps_total", 0)
        self.plan.set_state(state["plan"])
        self.returns.clear()
        self.returns.extend(state["returns"])
        self.lengths.clear()
        self.lengths.extend(state["lengths"])
        self.custom_metrics.clear()
        self.custom_metrics.extend(state.get("custom_metrics", []))  # absent before callbacks
        self.custom_names = dict.fromkeys(state.get("custom_names", []))
        if self.obs_filter is not None and state["obs_filter"] is not None:
            self.obs_filter.mean, self.obs_filter.var, self.obs_filter.count = state["obs_filter"]
        self.time_before_resume = state["time_total_s"]
        self.started = time.monotonic()
        self.last_row = state["last_row"]
        restore_rng(state["rng"])

    @property
    def stateful_groups(self) -> list:
        """The worker groups whose state goes into a checkpoint, in the order restored: the
        learners, the rollout workers, and the plan's own (replay shards, say)."""
        return [self.learners, self.rollouts, *self.plan.groups()]

    def save_checkpoint(self, store: CheckpointStore, include_replay: bool = True) -> Path:
        """Write a checkpoint of the whole run: every worker writes its own file, in parallel."""
        self.settle()
        groups = [g for g in self.stateful_groups if include_replay or g.role != "replay"]
        while True:
            tmp = store.begin(self.iteration)
            # A rank lost before its group discarded it is left out; its group's next operator
            # takes it out, so the files' indices are the live workers', as after a restore.
            live = {group.name: [w for w in group if not w.lost] for group in groups}
            futures = [
                (f"{name}_{i}.pkl", worker.call_async("save_state", str(tmp), f"{name}_{i}.pkl"))
                for name, workers in live.items() for i, worker in enumerate(workers)
            ]
            files, lost = {}, False
            for name, future in futures:
                try:
                    files[name] = future.result()
                except RankLost:
                    # Survived (ULFM; any other loss has ended the job): the checkpoint would
                    # lack its file, so it is written again by the workers still live.
                    lost = True
            if not lost:
                break
            shutil.rmtree(tmp, ignore_errors=True)
        unsaved = {name: entry["envs_error"] for name, entry in files.items()
                   if "envs_error" in entry}
        if unsaved and not self._warned_unsaved_envs:
            self._warned_unsaved_envs = True  # once a run: every checkpoint would repeat it
            _note_unsaved_envs(unsaved)
        files["driver.pkl"] = write_state_file(tmp / "driver.pkl", self.get_state())
        layout = {name: len(workers) for name, workers in live.items()}
        manifest = manifest_header(self.name, self.env, self.config, self.iteration,
                                   self.timesteps_total, layout)
        manifest["files"] = files
        path = store.commit(tmp, manifest)
        invoke(self.callbacks, "on_checkpoint", "driver", algorithm=self, checkpoint=str(path))
        return path

    def restore(self, path: Path, manifest: dict[str, Any]) -> list[str]:
        """Load a verified checkpoint into the driver and every worker; return notes on what
        differs from the checkpoint's layout."""
        self.settle()
        files = manifest["files"]
        self.set_state(read_state_file(path / "driver.pkl", files["driver.pkl"]))
        notes = []
        old = manifest["layout"]
        futures = []
        for group in self.stateful_groups:
            saved = old.get(group.name, 0)
            if saved == 0:
                if len(group):
                    notes.append(f"{group.name} workers start empty (none in the checkpoint)")
                    self.plan.restored_empty(group, self.timesteps_total)
                continue
            if saved != len(group):
                note = f"{group.name} workers {saved} -> {len(group)}"
                if group.role == "rollout" and saved > len(group):
                    note += (f" (the episodes in progress on rollout workers {len(group)}.."
                             f"{saved - 1} are dropped)")
                elif group.role == "rollout":
                    note += f" (rollout workers {saved}..{len(group) - 1} start fresh episodes)"
                notes.append(note)
            for i, worker in enumerate(group):
                if group.role != "learner" and i >= saved:
                    continue
                name = f"{group.name}_{min(i, saved - 1)}.pkl"
                futures.append((group.name, i, name,
                                worker.call_async("load_state", str(path / name), files[name])))
        for role, i, name, future in futures:
            try:
                restored = future.result()
            except RemoteError as error:  # a worker that cannot take its file: its message
                raise unwrap_remote(error, CheckpointError) from None
            if restored is False:
                reason = files[name].get("envs_error") or (
                    "num_envs_per_worker differs from the checkpoint's, or the environments "
                    "were not saved")
                _warn(f"{role} worker {i}'s environments were reset from fresh seeds instead "
                      f"of continuing their episodes: they could not be restored ({reason})")
        self.sync_weights()
        return notes

    def sync_weights(self) -> None:
        """Give every rollout worker the learners' weights (after a restore)."""
        broadcast_weights(self.learners, self.rollouts)


def _warn(message: str) -> None:
    print(f"mpirl: warning: {message}", file=sys.stderr, flush=True)


def _note_unsaved_envs(unsaved: dict[str, str]) -> None:
    """Say once that checkpoints lack some workers' episodes in progress: a note for env
    groups, whose simulations hold them by design, a warning for envs that would not pickle."""
    simulations = [n.removesuffix(".pkl") for n, error in unsaved.items()
                   if SIMULATION_NOT_SAVED in error]
    others = {n.removesuffix(".pkl"): error for n, error in unsaved.items()
              if SIMULATION_NOT_SAVED not in error}
    if simulations:
        print(f"mpirl: note: checkpoints hold the policy, not the episodes in progress of "
              f"{', '.join(simulations)}'s env groups (their simulations keep their state on "
              f"their own ranks); a resume starts new episodes with resets", file=sys.stderr,
              flush=True)
    if others:
        _warn(f"the environments of {', '.join(others)} could not be pickled into checkpoints "
              f"({next(iter(others.values()))}); a resume resets them from fresh seeds, and "
              f"their episodes in progress are lost")


def stop_reached(row: dict[str, Any], stop: dict[str, float],
                 max_iterations: int | None = None) -> str | None:
    """The first criterion of ``stop`` that ``row`` meets, else ``MAX_ITERATIONS_ENV`` when the
    row's iteration has reached ``max_iterations``, else None."""
    values = {**row, "training_iteration": row["iteration"]}
    for key, threshold in stop.items():
        value = values.get(key)
        if value is not None and not math.isnan(value) and value >= threshold:
            return key
    if max_iterations is not None and row["iteration"] >= max_iterations:
        return MAX_ITERATIONS_ENV
    return None


def max_iterations_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """``$MPIRL_MAX_ITERATIONS`` as a number of iterations, None when unset or empty;
    ConfigError when it is not a positive integer."""
    return positive_int_from_env(MAX_ITERATIONS_ENV,
                                 "the most training iterations a run may take", environ)
