"""Multi-agent runs on the driver: each policy's own algorithm, composed over one sampling core.

A multi-agent run is a composition of plans, as RLlib Flow's ``Concurrently`` is: one
``Trainer`` per learning policy drives that policy's algorithm through the same interface a
single-agent run uses (its module's ``setup`` and ``training_step``), over the policy's own
workers:

* on each rollout rank a sampling core (``EnvRunner``, the run's ``rollouts`` group) steps the
  envs for every policy, and beside it one rollout worker per learning policy, of its
  algorithm's kind (``RolloutWorker``, ``TransitionWorker``, a plug-in's), which takes that
  policy's steps from the core and delivers them as its plan says;
* each policy's learners on its slice of the learner ranks, and its plan's own groups (replay
  shards) wherever its plan puts them, with message tags of the policy's own.

One iteration::

    for pid, trainer in trainers.items():            # each policy's own plan, in turn
        stats |= trainer.module.training_step(trainer, trainer.plan)
    count the envs' steps and episodes               # from the sampling cores
    sync every policy's weights to the cores         # the next plans' shared steps are fresh

A call for one policy steps every env once for all of them; the other policies' steps wait in
the core until their rollout workers ask. No plan is written twice and nothing here knows one
algorithm from another: an algorithm that runs alone runs as a policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from pathlib import Path
from statistics import fmean
from typing import Any

import numpy as np

from mpirl.data.dump_index import DumpIndex
from mpirl.data.dump_writer import DumpSettings
from mpirl.errors import RankLost, RemoteError
from mpirl.execution.contract import PlanState, name_of
from mpirl.execution.multiagent_setup import MultiAgentSetup, PolicyPlan, resolve, user_given
from mpirl.execution.operators import SampleResult
from mpirl.execution.trainer import PolicyPlace, Trainer, spawn_error
from mpirl.runtime.dispatch import WorkerGroup
from mpirl.workers.callbacks import invoke
from mpirl.workers.env_runner import SCRIPTED, EnvRunner, RunnerPolicy, RunnerSettings
from mpirl.workers.env_spec import EnvSpec

__all__ = ["MultiAgentTrainer", "PolicyDumps", "runner_policy", "user_given"]


class MultiAgentTrainer(Trainer):
    """The driver of a multi-agent run: the sampling cores, one ``Trainer`` per learning policy
    (``trainers``), the envs' own counters and metrics, per-policy metrics, and checkpoints that
    hold every policy."""

    def __init__(self, driver: Any, module: Any, config: Any, env: EnvSpec,
                 dump: DumpSettings | None = None, setup: MultiAgentSetup | None = None) -> None:
        self.driver, self.module, self.config, self.env = driver, module, config, env
        self.place = None
        self.name = name_of(module)
        self.setup = setup or resolve(self.name, config, env)
        self.policy_id = self.policy_index = None
        self.dump_index: PolicyDumps | None = None
        if dump is not None and dump.dump_trajectories is not None:
            self.dump_index = PolicyDumps(dump, env.env_id, self.setup, self.name)
        try:
            self.rollouts = driver.spawn("rollout", EnvRunner, self._runner_settings(),
                                         local_if_empty=True)
        except RemoteError as error:
            raise spawn_error(error) from None
        slices = self.setup.learner_slices(driver.placement.count("learner"),
                                            local=driver.placement.local)
        #: Each learning policy's own trainer, in the order the policies were given.
        self.trainers: dict[str, Trainer] = {}
        for plan in self.setup.trained():
            self.trainers[plan.policy_id] = Trainer(
                driver, plan.module, plan.config, env, place=self._place(plan,
                                                                         slices[plan.policy_id]))
        self.learners = next(iter(self.trainers.values())).learners
        self.obs_filter = None
        self._init_run_state(config)
        #: self-play: each pool's size (the first weights its learner sent are its first)
        self.snapshot_pools = {pid: 1 for pid, p in self.setup.policies.items() if p.self_play}
        #: The policies that do not learn (scripted, frozen): their agents' episodes over the
        #: metrics window, and their agent steps, as the sampling cores count them.
        window = config.metrics_window
        self.others = {pid: (deque(maxlen=window), deque(maxlen=window))
                       for pid in self.setup.policies if pid not in self.trainers}
        self.other_steps = dict.fromkeys(self.others, 0)
        self.plan = ComposedPlans(self.trainers)
        invoke(self.callbacks, "on_algorithm_init", "driver", algorithm=self)

    def _runner_settings(self) -> RunnerSettings:
        config, setup = self.config, self.setup
        return RunnerSettings(
            env=self.env, num_envs=config.num_envs_per_worker, seed=config.seed,
            torch_threads=config.torch_threads, max_env_failures=config.max_env_failures,
            env_failure_window=config.env_failure_window, callbacks=config.callbacks,
            dumps=self.dump_index.targets() if self.dump_index is not None else {},
            mapping=setup.mapping, possible_agents=tuple(setup.possible_agents),
            state_size=setup.state_size,
            policies=tuple(runner_policy(plan, self._slot_agents(plan))
                           for plan in setup.policies.values()))

    def _slot_agents(self, plan: PolicyPlan) -> list[str]:
        return self.slot_agents_of(self.setup)[plan.policy_id]

    @staticmethod
    def slot_agents_of(setup: MultiAgentSetup) -> dict[str, list[str]]:
        """The agents each policy may drive in each env: its slots, one per env and agent.
        Under a mapping function any agent may be mapped to it in any episode."""
        return {pid: list(plan.agents) if plan.agents and not setup.mapping.dynamic
                else list(setup.possible_agents) for pid, plan in setup.policies.items()}

    def _place(self, plan: PolicyPlan, members: list[int]) -> PolicyPlace:
        return PolicyPlace(
            plan.policy_id, plan.index, self.rollouts, members, plan.observation_space,
            plan.action_space, plan.model,
            self.config.num_envs_per_worker * len(self._slot_agents(plan)),
            None if self.dump_index is None else self.dump_index.indexes[plan.policy_id])

    # The composed plan.

    def training_step(self) -> dict[str, float]:
        """Each learning policy's own plan in turn, then the envs' counts, self-play snapshots,
        per-policy metrics; every policy's newest weights go to the sampling cores, so that
        the steps the next iteration's plans share are fresh for all of them."""
        stats: dict[str, float] = {}
        for pid, trainer in self.trainers.items():
            stats |= {f"{pid}/{key}": value for key, value in
                      trainer.module.training_step(trainer, trainer.plan).items()}
        self._count_envs()
        stats = self.plan.fill_columns(stats)
        stats |= self.take_snapshots() | self.policy_metrics()
        self.sync_weights()
        return stats

    def _count_envs(self) -> None:
        """The sampling cores' counts of whole envs since the last look: env steps, the env
        episodes that ended (returns summed over agents), env failures."""
        for future in [w.call_async("take_env_tally") for w in self.rollouts]:
            try:
                tally = future.result()
            except RankLost:
                continue  # survived (ULFM): its steps since the last look are not counted
            self.count(SampleResult(tally["env_steps"], tally["env_failures"],
                                    tally["episode_returns"], tally["episode_lengths"]))
            for pid, count in tally["other_steps"].items():
                self.other_steps[pid] += count
            for pid, ret, length in tally["other_episodes"]:
                self.others[pid][0].append(ret)
                self.others[pid][1].append(length)
        self.rollouts.discard_lost()

    def sync_weights(self) -> None:
        """Every learning policy's learner 0 sends its weights to every sampling core."""
        for trainer in self.trainers.values():
            trainer.sync_weights()

    def take_snapshots(self) -> dict[str, float]:
        """Self-play: every ``snapshot_every`` iterations, each self-play policy's learner 0
        weights join the sampling cores' pools of opponents. Returns each pool's size."""
        stats = {}
        for pid, plan in self.setup.policies.items():
            if not plan.self_play:
                continue
            if (self.iteration + 1) % plan.self_play["snapshot_every"] == 0:
                weights = self.trainers[pid].learners[0].call("get_weights")
                sizes = self.rollouts.call("add_snapshot", pid, weights)
                self.snapshot_pools[pid] = max(sizes)
            stats[f"{pid}/snapshots"] = float(self.snapshot_pools[pid])
        return stats

    def policy_metrics(self) -> dict[str, float]:
        """Per policy: its agents' mean episode return and length over the metrics window, its
        agent steps; and ``policy_return_mean_min``, the lowest of those returns (NaN until
        every learning policy has one), to stop when every policy has reached a return."""
        row = {}
        for pid in self.setup.policies:
            trainer = self.trainers.get(pid)
            returns, lengths = ((trainer.returns, trainer.lengths) if trainer is not None
                                else self.others[pid])
            row[f"episode_return_mean/{pid}"] = fmean(returns) if returns else math.nan
            row[f"episode_len_mean/{pid}"] = fmean(lengths) if lengths else math.nan
            row[f"agent_steps_total/{pid}"] = (trainer.timesteps_total if trainer is not None
                                              else self.other_steps[pid])
        means = [row[f"episode_return_mean/{pid}"] for pid in self.setup.policies]
        row["policy_return_mean_min"] = min(means) if not any(map(math.isnan, means)) \
            else math.nan
        return row

    def custom_means(self) -> dict[str, float]:
        """``custom/<name>_mean`` over the window episodes of every policy's agents."""
        names = dict.fromkeys(n for t in self.trainers.values() for n in t.custom_names)
        means = {}
        for name in names:
            values = [m[name] for t in self.trainers.values() for m in t.custom_metrics
                      if name in m]
            means[f"custom/{name}_mean"] = float(np.mean(values)) if values else math.nan
        return means

    @property
    def train_batch_size(self) -> int:
        c = self.config
        return len(self.rollouts) * c.num_envs_per_worker * c.rollout_fragment_length

    @property
    def stateful_groups(self) -> list[WorkerGroup]:
        return [self.rollouts, *self.plan.groups()]

    def collect_histograms(self) -> dict[str, np.ndarray]:
        return {f"{pid}/{tag}": values for pid, trainer in self.trainers.items()
                for tag, values in trainer.collect_histograms().items()}

    def index_written(self, written: Any) -> None:
        """A sampling core's ``finish_dump``: ((policy id, file name), episodes) per policy."""
        for key, episodes in written:
            self.dump_index.add(key, episodes)

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "snapshot_pools": dict(self.snapshot_pools),
                "others": {pid: (list(r), list(n)) for pid, (r, n) in self.others.items()},
                "other_steps": dict(self.other_steps)}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.snapshot_pools.update(state.get("snapshot_pools", {}))
        for pid, (returns, lengths) in state.get("others", {}).items():
            if pid in self.others:
                self.others[pid][0].clear()
                self.others[pid][1].clear()
                self.others[pid][0].extend(returns)
                self.others[pid][1].extend(lengths)
        self.other_steps.update(state.get("other_steps", {}))


class ComposedPlans(PlanState):
    """The plan state of a multi-agent run: every policy's trainer, each with its own plan
    state, settled, checkpointed and restored together."""

    def __init__(self, trainers: dict[str, Trainer]) -> None:
        self.trainers = trainers
        #: Each policy's row columns seen so far: a plan that reports none in an iteration
        #: (nothing trained yet) still fills its columns, with NaN.
        self.columns: dict[str, None] = {}

    def groups(self) -> list[WorkerGroup]:
        return [group for trainer in self.trainers.values()
                for group in (trainer.learners, trainer.rollouts, *trainer.plan.groups())]

    def settle(self) -> None:
        for trainer in self.trainers.values():
            trainer.plan.settle()

    def get_state(self) -> dict[str, Any]:
        return {"policies": {pid: trainer.get_state() for pid, trainer in self.trainers.items()},
                "columns": list(self.columns)}

    def set_state(self, state: dict[str, Any]) -> None:
        for pid, trainer in self.trainers.items():
            saved = state["policies"].get(pid)
            if saved is not None:
                trainer.set_state(saved)
        self.columns = dict.fromkeys(state.get("columns", []))

    def restored_empty(self, group: WorkerGroup, timesteps_total: int) -> None:
        for trainer in self.trainers.values():
            trainer.plan.restored_empty(group, trainer.timesteps_total)

    def fill_columns(self, stats: dict[str, float]) -> dict[str, float]:
        """``stats`` with every column seen so far (NaN where absent this iteration)."""
        self.columns.update(dict.fromkeys(stats))
        return {**dict.fromkeys(self.columns, math.nan), **stats}


def runner_policy(plan: PolicyPlan, slot_agents: list[str]) -> RunnerPolicy:
    """How the sampling cores act for ``plan``'s policy: as its algorithm's rollout worker
    asks (``ACTING``), or its scripted class."""
    spec = plan.model
    return RunnerPolicy(
        policy_id=plan.policy_id, index=plan.index, spec=spec, policy_class=plan.policy_class,
        acting=SCRIPTED if plan.policy_class else plan.module.ROLLOUT_WORKER.ACTING,
        observation_space=plan.observation_space,
        env_observation_space=plan.env_observation_space or plan.observation_space,
        action_space=plan.action_space,
        # A scripted policy has no config: it sees observations as the env gives them.
        normalize_observations=not plan.scripted and plan.config.observation_normalization(),
        slot_agents=tuple(slot_agents), learns=plan.trainable,
        last_action_in_obs=plan.last_action_in_obs,
        self_play_pool=plan.self_play.get("pool_size", 0),
        critic_inputs=plan.critic_inputs)


class PolicyDumps:
    """A multi-agent run's trajectory dump: one dump per learning policy, in
    ``<dump_trajectories>/<policy id>``, each a dataset ``mpirl.open_dataset`` reads like a
    single-agent one, whose episodes are agents' episodes with their agent id and policy id."""

    def __init__(self, settings: DumpSettings, env_id: str, setup: MultiAgentSetup,
                 algorithm_name: str) -> None:
        root = Path(settings.dump_trajectories)
        self.indexes = {
            pid: DumpIndex(dataclasses.replace(settings, dump_trajectories=str(root / pid)),
                           env_id, plan.env_observation_space, plan.action_space,
                           algorithm_name)
            for pid, plan in setup.policies.items() if plan.trainable}

    def targets(self) -> dict[str, Any]:
        return {pid: index.target for pid, index in self.indexes.items()}

    def add(self, key: tuple[str, str], episodes: list[tuple[int, int]]) -> None:
        pid, file_name = key
        self.indexes[pid].add(file_name, episodes)

    def commit(self) -> None:
        for index in self.indexes.values():
            index.commit()

