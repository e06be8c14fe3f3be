"""Multi-agent runs on the driver: every policy's workers, and the composed plan.

One iteration, in the style of RLlib Flow's ``Concurrently``::

    samples = sample_policies(trainer)               # every env step sampled once
    pending = {pid: start_on_policy_training(trainer, pid, samples) for pid in on-policy ids}
    stats = {}
    for pid in off-policy ids:                       # DQN's replay-train meanwhile
        stats |= store_and_train_from_replay(trainer, pid, samples)
    for pid, futures in pending.items():             # PPO's learners have been at work
        stats |= finish_training(trainer, pid, futures)
    trainer.sync_weights()                           # each policy's learner 0 -> rollout ranks

The rollout workers send each policy's data straight to that policy's learner or replay ranks;
the driver hears counts and episodes. Each policy has its own learner group on its slice of the
learner ranks, and each off-policy policy its own replay shards.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from mpirl.data.dump_index import DumpIndex
from mpirl.data.dump_writer import DumpSettings
from mpirl.data.replay_buffer import ReplaySettings
from mpirl.errors import RemoteError
from mpirl.execution.contract import PlanState
from mpirl.execution.multiagent_setup import MultiAgentSetup, PolicyPlan, resolve
from mpirl.execution.operators import (
    SampleResult,
    add_sample_metrics,
    mean_stats,
    replay_dest,
    train_from_replay,
)
from mpirl.execution.replay_ops import linear_epsilon, replay_beta
from mpirl.execution.trainer import Trainer
from mpirl.models.policy import RunningMeanStd
from mpirl.models.soft_q import SAC_STATS
from mpirl.runtime.dispatch import Future
from mpirl.runtime.layout import REPLAY
from mpirl.workers.env_guard import unwrap_env_failure
from mpirl.workers.multiagent_rollout import MultiAgentRolloutSettings, MultiAgentRolloutWorker
from mpirl.workers.policy_workers import (
    PolicyLearner,
    PolicyLearnerSettings,
    PolicyQLearner,
    PolicyReplayShard,
    PolicyReplayShardSettings,
)

#: The statistics each algorithm's loss reports, NaN in a row where it did not train, so that
#: progress.csv has their columns from the first row.
LOSS_STATS = {"PPO": ("policy_loss", "vf_loss", "entropy", "approx_kl", "clip_fraction"),
              "A2C": ("policy_loss", "vf_loss", "entropy"),
              "IMPALA": ("policy_loss", "vf_loss", "entropy", "mean_rho"),
              "DQN": ("td_loss", "q_mean", "td_error_abs", "epsilon"),
              "SAC": (*SAC_STATS, "epsilon")}


def user_given(config: Any) -> dict[str, Any]:
    """The keys of ``config`` that differ from its class's defaults: what the user set."""
    default = type(config)()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)}


class MultiAgentTrainer(Trainer):
    """The driver of a multi-agent run: policies, their learner and replay groups, per-policy
    metrics, and checkpoints that hold every policy. Its plan is this module's
    ``training_step``; what it keeps between iterations lives on the trainer."""

    def __init__(self, driver: Any, module: Any, config: Any, env: Any, dump: Any = None,
                 setup: MultiAgentSetup | None = None) -> None:
        self.driver, self.module, self.config, self.env = driver, module, config, env
        self.name = module.__name__.rsplit(".", 1)[-1].upper()
        self.setup = setup or resolve(self.name, user_given(config), env)
        self.dump_index = None
        if dump is not None and dump.dump_trajectories is not None:
            self.dump_index = PolicyDumps(dump, env.env_id, self.setup, self.name)
        self.obs_filter = None
        settings = MultiAgentRolloutSettings(
            env=env, setup=self.setup, **MultiAgentRolloutSettings.config_values(config),
            dumps=self.dump_index.targets() if self.dump_index is not None else None)
        try:
            self.rollouts = driver.spawn("rollout", MultiAgentRolloutWorker, settings,
                                         local_if_empty=True)
        except RemoteError as error:
            raise unwrap_env_failure(error) from None
        slices = self.setup.learner_slices(driver.placement.count("learner"))
        self.policy_learners: dict[str, Any] = {}
        self.policy_replay: dict[str, Any] = {}
        for plan in self.setup.trained():
            self._spawn_policy(plan, slices[plan.policy_id])
        self.learners = next(iter(self.policy_learners.values()), None)
        self.policy_filters = {
            pid: RunningMeanStd(plan.observation_space.shape)
            for pid, plan in self.setup.policies.items()
            if plan.kind == "on_policy" and getattr(plan.config, "normalize_observations", False)
            and plan.observation_space.shape}
        self.sync_weights()
        self._init_run_state(config)
        self.plan = PlanState()  # its groups are stateful_groups' own
        window = config.metrics_window
        self.policy_returns = {pid: deque(maxlen=window) for pid in self.setup.policies}
        self.policy_lengths = {pid: deque(maxlen=window) for pid in self.setup.policies}
        #: agent steps of each policy so far, and what replay plans carry between iterations
        self.agent_steps = dict.fromkeys(self.setup.policies, 0)
        self.policy_debt = dict.fromkeys(self.setup.policies, 0.0)
        #: self-play: each pool's size (the initial weights are its first snapshot)
        self.snapshot_pools = {pid: 1 for pid, p in self.setup.policies.items() if p.self_play}

    def _spawn_policy(self, plan: PolicyPlan, members: list[int]) -> None:
        config, pid = plan.config, plan.policy_id
        cls = PolicyQLearner if plan.kind == "off_policy" else PolicyLearner
        settings = PolicyLearnerSettings(
            policy=plan.model, loss=plan.module.loss, loss_config=config, lr=config.lr,
            grad_clip=config.grad_clip, seed=self.config.seed + 31 * plan.index, backend="mpi",
            torch_threads=self.config.torch_threads, members=tuple(members),
            policy_index=plan.index)
        learners = self.driver.spawn("learner", cls, settings, local_if_empty=True,
                                     members=members)
        learners.name = f"learner-{pid}"
        self.policy_learners[pid] = learners
        if plan.kind != "off_policy":
            return
        shards = max(1, self.driver.placement.count(REPLAY))
        slots = len(plan.agents) if plan.agents and not self.setup.mapping.dynamic else \
            len(self.setup.possible_agents)
        per_worker = self.config.num_envs_per_worker * slots
        streams = math.ceil(len(self.rollouts) / shards) * per_worker
        settings = PolicyReplayShardSettings(
            capacity=config.buffer_size // shards, num_streams=streams,
            observation_space=plan.observation_space, action_space=plan.action_space,
            replay=ReplaySettings.from_config(config), num_shards=shards, num_envs=per_worker,
            seed=self.config.seed + plan.index, policy_index=plan.index)
        replay = self.driver.spawn(REPLAY, PolicyReplayShard, settings, local_if_empty=True)
        replay.name = f"replay-{pid}"
        self.policy_replay[pid] = replay

    @property
    def stateful_groups(self) -> list:
        return [*self.policy_learners.values(), self.rollouts, *self.policy_replay.values()]

    @property
    def train_batch_size(self) -> int:
        c = self.config
        return len(self.rollouts) * c.num_envs_per_worker * c.rollout_fragment_length

    def training_step(self) -> dict[str, float]:
        return training_step(self)

    # Weights.

    def sync_weights(self) -> None:
        """Every trained policy's learner 0 sends its weights to every rollout worker: by
        message to rollout ranks, in the call to rollout workers in the driver's process."""
        remote = [w for w in self.rollouts if not w.in_process]
        local = [w for w in self.rollouts if w.in_process]
        sources = {}
        for pid, learners in self.policy_learners.items():
            if remote:
                sources[pid] = (learners[0].rank, self.setup.policies[pid].index)
        futures = [w.call_async("receive_policy_weights", sources) for w in remote]
        futures += [learners[0].call_async("post_weights", [w.rank for w in remote])
                    for learners in self.policy_learners.values() if remote]
        if local:
            weights = {pid: learners[0].call("get_weights")
                       for pid, learners in self.policy_learners.items()}
            for worker in local:
                worker.call("set_policy_weights", weights)
        for future in futures:
            future.result()

    # Metrics and checkpoints.

    def policy_metrics(self) -> dict[str, float]:
        """Per policy: its agents' mean episode return and length over the metrics window, its
        agent steps; and ``policy_return_mean_min``, the lowest of those returns (NaN until
        every policy has one), to stop when every policy has reached a return."""
        row = {}
        for pid in self.setup.policies:
            returns, lengths = self.policy_returns[pid], self.policy_lengths[pid]
            row[f"episode_return_mean/{pid}"] = float(np.mean(returns)) if returns else math.nan
            row[f"episode_len_mean/{pid}"] = float(np.mean(lengths)) if lengths else math.nan
            row[f"agent_steps_total/{pid}"] = self.agent_steps[pid]
        means = [row[f"episode_return_mean/{pid}"] for pid in self.setup.policies]
        row["policy_return_mean_min"] = min(means) if not any(map(math.isnan, means)) \
            else math.nan
        return row

    def index_written(self, written: Any) -> None:
        """A multi-agent rollout worker's ``finish_dump``: ((policy id, file name), episodes)
        per policy."""
        for key, episodes in written:
            self.dump_index.add(key, episodes)

    def collect_histograms(self) -> dict[str, np.ndarray]:
        return {f"{pid}/{tag}": values for pid, learners in self.policy_learners.items()
                for tag, values in learners[0].call("histograms").items()}

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(),
                "policy_returns": {p: list(v) for p, v in self.policy_returns.items()},
                "policy_lengths": {p: list(v) for p, v in self.policy_lengths.items()},
                "agent_steps": dict(self.agent_steps), "policy_debt": dict(self.policy_debt),
                "snapshot_pools": dict(self.snapshot_pools),
                "policy_filters": {p: f.state() for p, f in self.policy_filters.items()}}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        for pid in self.setup.policies:
            self.policy_returns[pid].clear()
            self.policy_returns[pid].extend(state["policy_returns"].get(pid, []))
            self.policy_lengths[pid].clear()
            self.policy_lengths[pid].extend(state["policy_lengths"].get(pid, []))
        self.agent_steps.update(state["agent_steps"])
        self.policy_debt.update(state["policy_debt"])
        self.snapshot_pools.update(state["snapshot_pools"])
        for pid, saved in state["policy_filters"].items():
            if pid in self.policy_filters:
                f = self.policy_filters[pid]
                f.mean, f.var, f.count = saved


class PolicyDumps:
    """A multi-agent run's trajectory dump: one dump per policy, in ``<dump_trajectories>/<policy
    id>``, each a dataset ``mpirl.open_dataset`` reads like a single-agent one, whose episodes
    are agents' episodes with their agent id and policy id."""

    def __init__(self, settings: DumpSettings, env_id: str, setup: MultiAgentSetup,
                 algorithm_name: str) -> None:
        root = Path(settings.dump_trajectories)
        self.indexes = {
            pid: DumpIndex(dataclasses.replace(settings, dump_trajectories=str(root / pid)),
                           env_id, plan.env_observation_space, plan.action_space,
                           algorithm_name)
            for pid, plan in setup.policies.items()}

    def targets(self) -> dict[str, Any]:
        return {pid: index.target for pid, index in self.indexes.items()}

    def add(self, key: tuple[str, str], episodes: list[tuple[int, int]]) -> None:
        pid, file_name = key
        self.indexes[pid].add(file_name, episodes)

    def commit(self) -> None:
        for index in self.indexes.values():
            index.commit()


# Operators of the composed plan.


@dataclasses.dataclass
class PolicySamples(SampleResult):
    """One round of multi-agent sampling: SampleResult's env counts and episodes, and per
    policy where its data went (``routes``: rank per rollout worker) or its data itself."""

    agent_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    policy_sources: dict[str, dict[int, list[int]]] = dataclasses.field(default_factory=dict)
    policy_payloads: dict[str, dict[int, list]] = dataclasses.field(default_factory=dict)


def _epsilon(trainer: MultiAgentTrainer, plan: PolicyPlan) -> float:
    """An off-policy policy's exploration: DQN's epsilon, annealed over its agent steps; for
    SAC 1 (uniformly random actions) until ``learning_starts`` of its agent steps."""
    c = plan.config
    if plan.algo == "SAC":
        return 1.0 if trainer.agent_steps[plan.policy_id] < c.learning_starts else 0.0
    return linear_epsilon(trainer.agent_steps[plan.policy_id], c.initial_epsilon, c.final_epsilon,
                          c.exploration_steps)


def sample_policies(trainer: MultiAgentTrainer) -> PolicySamples:
    """Every rollout worker steps its envs ``rollout_fragment_length`` times; rollout worker i
    sends a trained policy's data to its learner i mod L (on-policy) or its replay shard
    i mod K (off-policy)."""
    setup, result = trainer.setup, PolicySamples()
    epsilons = {pid: _epsilon(trainer, plan) for pid, plan in setup.policies.items()
                if plan.kind == "off_policy"}
    filters = {pid: f.state() for pid, f in trainer.policy_filters.items()}
    calls = []
    for i, worker in enumerate(trainer.rollouts):
        routes, targets = {}, {}
        for pid in trainer.policy_learners:
            plan = setup.policies[pid]
            group = trainer.policy_replay.get(pid) or trainer.policy_learners[pid]
            target = i % len(group)
            targets[pid] = target
            routes[pid] = (replay_dest(worker, group[target]), plan.index)
        calls.append((worker, targets, routes,
                      worker.call_async("sample", trainer.config.rollout_fragment_length, routes,
                                        epsilons, filters)))
    for worker, targets, routes, future in calls:
        try:
            metrics = future.result()
        except RemoteError as error:
            raise unwrap_env_failure(error) from None
        dumped = metrics.pop("dumped", [])  # one entry per policy, not one per worker
        add_sample_metrics(result, metrics)
        result.dumped += dumped
        for pid, steps in metrics["agent_steps"].items():
            result.agent_steps[pid] = result.agent_steps.get(pid, 0) + steps
        for pid, returns in metrics["policy_returns"].items():
            trainer.policy_returns[pid].extend(returns)
            trainer.policy_lengths[pid].extend(metrics["policy_lengths"][pid])
        for pid, (mean, var, count) in metrics["filter_deltas"].items():
            trainer.policy_filters[pid].merge(mean, var, count)
        for pid, target in targets.items():
            if routes[pid][0] is None:
                result.policy_payloads.setdefault(pid, {}).setdefault(target, []).append(
                    metrics["payloads"][pid])
            else:
                result.policy_sources.setdefault(pid, {}).setdefault(target, []).append(
                    worker.rank)
    for pid, steps in result.agent_steps.items():
        trainer.agent_steps[pid] += steps
    return result


def start_on_policy_training(trainer: MultiAgentTrainer, pid: str, samples: PolicySamples
                             ) -> list[Future]:
    """Start policy ``pid``'s learners on its batches; returns their futures at once."""
    plan, learners = trainer.setup.policies[pid], trainer.policy_learners[pid]
    config = plan.config
    sources = samples.policy_sources.get(pid, {})
    payloads = samples.policy_payloads.get(pid, {})
    rows = samples.agent_steps.get(pid, 0)
    if plan.algo == "PPO":
        args = {"num_epochs": config.num_epochs,
                "num_minibatches": max(1, round(rows / config.minibatch_size))}
    elif plan.algo == "IMPALA":  # V-trace on this round's fragments, learning rate decayed
        args = {"num_epochs": config.num_epochs, "num_minibatches": config.num_minibatches,
                "standardize": (), "lr": plan.module.decayed_lr(config, trainer.agent_steps[pid])}
    else:  # A2C: one step on the whole batch
        args = {"num_epochs": 1, "num_minibatches": 1,
                "standardize": ("advantages",) if config.standardize_advantages else ()}
    return [learner.call_async("train", sources.get(i, []), payloads.get(i), **args)
            for i, learner in enumerate(learners)]


def finish_training(trainer: MultiAgentTrainer, pid: str, futures: list[Future]
                    ) -> dict[str, float]:
    """Policy ``pid``'s loss statistics, averaged over its learners, as ``<pid>/<stat>``."""
    results = [f.result() for f in futures]
    stats = dict.fromkeys(LOSS_STATS.get(trainer.setup.policies[pid].algo, ()), math.nan)
    stats |= mean_stats(results)
    stats["learner_samples"] = float(sum(r["learner_samples"] for r in results))
    return {f"{pid}/{k}": v for k, v in stats.items()}


def store_and_train_from_replay(trainer: MultiAgentTrainer, pid: str, samples: PolicySamples
                                ) -> dict[str, float]:
    """Store policy ``pid``'s new steps in its replay shards; once ``learning_starts`` of its
    agent steps are stored, take ``sgd_steps_per_env_step`` SGD steps per new agent step."""
    plan = trainer.setup.policies[pid]
    config, replay = plan.config, trainer.policy_replay[pid]
    sources = samples.policy_sources.get(pid, {})
    payloads = samples.policy_payloads.get(pid, {})
    for future in [shard.call_async("insert", sources.get(k, []), payloads.get(k))
                   for k, shard in enumerate(replay)]:
        future.result()
    stats = dict.fromkeys((*LOSS_STATS[plan.algo], "sgd_steps", "learner_samples",
                           "num_target_updates"), math.nan)
    stats["epsilon"] = _epsilon(trainer, plan)
    if trainer.agent_steps[pid] >= config.learning_starts:
        debt = trainer.policy_debt[pid] + samples.agent_steps.get(pid, 0) * \
            config.sgd_steps_per_env_step
        steps, trainer.policy_debt[pid] = divmod(debt, 1.0)
        if steps:
            beta = replay_beta(config, trainer.agent_steps[pid])
            stats |= train_from_replay(trainer.policy_learners[pid], replay, int(steps),
                                       config.train_batch_size, beta)
    return {f"{pid}/{k}": v for k, v in stats.items()}


def training_step(trainer: MultiAgentTrainer) -> dict[str, float]:
    """One multi-agent iteration: sample once for every policy, train the on-policy and the
    off-policy policies side by side, send every trained policy's weights out."""
    samples = sample_policies(trainer)
    trainer.count(samples)
    kinds = {pid: trainer.setup.policies[pid].kind for pid in trainer.policy_learners}
    pending = {pid: start_on_policy_training(trainer, pid, samples)
               for pid, kind in kinds.items() if kind == "on_policy"}
    stats: dict[str, float] = {}
    for pid, kind in kinds.items():
        if kind == "off_policy":
            stats |= store_and_train_from_replay(trainer, pid, samples)
    for pid, futures in pending.items():
        stats |= finish_training(trainer, pid, futures)
    trainer.sync_weights()
    return stats | take_snapshots(trainer) | trainer.policy_metrics()


def take_snapshots(trainer: MultiAgentTrainer) -> dict[str, float]:
    """Self-play: every ``snapshot_every`` iterations, each self-play policy's learner 0 weights
    join the rollout workers' pools of opponents. Returns each pool's size."""
    stats = {}
    for pid, plan in trainer.setup.policies.items():
        if not plan.self_play:
            continue
        if (trainer.iteration + 1) % plan.self_play["snapshot_every"] == 0:
            weights = trainer.policy_learners[pid][0].call("get_weights")
            sizes = trainer.rollouts.call("add_snapshot", pid, weights)
            trainer.snapshot_pools[pid] = max(sizes)
        stats[f"{pid}/snapshots"] = float(trainer.snapshot_pools[pid])
    return stats
