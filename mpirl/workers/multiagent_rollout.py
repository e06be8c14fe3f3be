"""Multi-agent rollout workers: PettingZoo Parallel envs, every policy's model, one batch per
policy.

Each rollout rank steps ``num_envs_per_worker`` multi-agent envs. At every step the agents are
grouped by the policy they are mapped to, and each policy acts for all of its agents in one
forward pass. Every env step is sampled once; each policy's data goes where its algorithm wants
it, straight from this rank (the driver gets counts and episode metrics only):

* on-policy policies (PPO, A2C): each agent's steps form trajectories with GAE computed here, and
  the policy's batch goes to one of its learner ranks (``BATCH_TAG`` + its tag offset);
* off-policy policies (DQN): each agent in each env is one replay stream, and the steps go to
  one of the policy's replay shards (``INSERT_TAG`` + its tag offset);
* scripted policies act and send nothing.

Agents may join late and leave early; a step an agent is truncated at bootstraps from its last
observation, a termination does not. An env that raises is rebuilt (``GuardedParallelEnv``) and
its episode dropped, for every agent in it. New weights come from each policy's learner 0, by
message on the data channel (``WEIGHTS_TAG`` + the offset).
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch

from mpirl.config.imports import load_object
from mpirl.data.dump_writer import DumpTarget
from mpirl.data.episode_recorder import AgentEpisodeRecorder
from mpirl.data.replay_buffer import INSERT_TAG, WEIGHTS_TAG
from mpirl.envs.parallel import flatten_value
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.policy import RunningMeanStd, compute_gae
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.core import RankContext, Worker
from mpirl.workers.env_guard import GuardedParallelEnv
from mpirl.workers.env_spec import EnvWorkerSettings
from mpirl.workers.rollout import BATCH_TAG

#: Each policy's messages use its own tags: the base tag plus ``TAG_STRIDE * (index + 1)``.
TAG_STRIDE = 100


def policy_tag(base: int, index: int) -> int:
    """The data-channel tag of policy ``index``'s messages of kind ``base`` (``BATCH_TAG``...)."""
    return base + TAG_STRIDE * (index + 1)


class _Trajectory:
    """One agent's on-policy steps since its last flush."""

    __slots__ = ("obs", "actions", "logp", "values", "rewards", "dones", "critic_obs")

    def __init__(self) -> None:
        self.obs, self.actions, self.logp = [], [], []
        self.values, self.rewards, self.dones = [], [], []
        self.critic_obs = []  # a centralized critic's inputs, else empty

    def __len__(self) -> int:
        return len(self.rewards)


class _Stream:
    """One agent's off-policy steps since they were last sent to replay."""

    __slots__ = ("obs", "actions", "rewards", "terminated", "truncated", "final_obs", "cut")

    def __init__(self, cut: bool = False) -> None:
        self.obs, self.actions, self.rewards = [], [], []
        self.terminated, self.truncated, self.final_obs = [], [], []
        self.cut = cut

    def __len__(self) -> int:
        return len(self.rewards)


@dataclass(frozen=True, kw_only=True)
class MultiAgentRolloutSettings(EnvWorkerSettings):
    """What a multi-agent rollout worker is built from; it crosses to each rollout rank once,
    when the worker is spawned."""

    setup: Any
    """The run's policies (``MultiAgentSetup``): their plans, models and mapping."""
    dumps: dict[str, DumpTarget] | None = None
    """Per policy id, where its agents' episodes go with ``--dump-trajectories``."""


class MultiAgentRolloutWorker(Worker):
    """Samples multi-agent envs with every policy of the run; one per rollout rank."""

    MESSAGES = ("sample", "evaluate", "set_policy_weights", "get_policy_weights",
                "receive_policy_weights", "add_snapshot", "save_state", "load_state",
                "finish_dump")

    Settings: ClassVar[type[MultiAgentRolloutSettings]] = MultiAgentRolloutSettings

    def __init__(self, context: RankContext, settings: MultiAgentRolloutSettings) -> None:
        super().__init__(context)
        env, setup, num_envs, seed = settings.env, settings.setup, settings.num_envs, \
            settings.seed
        torch.set_num_threads(settings.torch_threads)
        self.setup = setup
        self.plans = setup.policies
        self.seed = seed + 1000 * context.role_index
        self.where = f"rollout worker {context.role_index} on rank {context.rank}"
        self.env_id = env.env_id
        self.models: dict[str, Any] = {}
        for plan in self.plans.values():
            # The same seed on every rank: a policy no learner trains starts alike everywhere.
            torch.manual_seed(seed + 7919 * (plan.index + 1))
            if plan.kind == "scripted":
                cls = load_object(plan.policy_class,
                                  f"multiagent.policies.{plan.policy_id}.policy_class",
                                  "module:Class")
                self.models[plan.policy_id] = cls(plan.observation_space, plan.action_space,
                                                  {"seed": self.seed + plan.index})
            else:
                self.models[plan.policy_id] = build_torch_model(plan.model)
        torch.manual_seed(self.seed)
        #: self-play: each such policy's pool of frozen snapshots (flat weights), oldest first,
        #: starting with its initial weights; an opponent plays policy id "<id>@<k>"
        self.snapshots = {pid: [self.models[pid].get_flat_weights()]
                          for pid, plan in self.plans.items() if plan.self_play}
        self.snapshot_models: dict[str, Any] = {}
        self.agent_obs_spaces = {}
        if any(self._centralized(pid) for pid in self.plans) and not setup.state_size:
            probe = env.make()
            self.agent_obs_spaces = {a: probe.observation_space(a) for a in probe.possible_agents}
            getattr(probe, "close", lambda: None)()
        self.filters = {pid: RunningMeanStd(plan.observation_space.shape)
                        for pid, plan in self.plans.items() if self._normalizes(plan)}
        self.rng = np.random.default_rng(self.seed + 17)
        #: trajectory dumps: one file per policy on this rank; each agent's episode is kept
        #: here (its steps) until it ends, and dropped if its env fails
        self.recorders = {pid: AgentEpisodeRecorder(
            target, context.role_index, env.env_id, self.plans[pid].env_observation_space,
            self.plans[pid].action_space, self.seed, pid)
            for pid, target in (settings.dumps or {}).items()}
        self.recording: dict[tuple[int, str], list[tuple]] = {}
        self.record_episodes = bool(self.recorders)
        self.envs = [GuardedParallelEnv(env, settings.max_env_failures, self.seed, i, self.where,
                                        settings.env_failure_window) for i in range(num_envs)]
        self.episodes_started = 0
        self.env_failures = 0
        self.restores = 0
        self.chunks_sent = 0
        #: replay stream slots per env of each off-policy policy: its agents, in order
        self.slots = {pid: (plan.agents if plan.agents and not setup.mapping.dynamic
                            else list(setup.possible_agents))
                      for pid, plan in self.plans.items() if plan.kind == "off_policy"}
        #: (policy id, env index, agent) -> its replay stream's steps not yet sent
        self.streams: dict[tuple[str, int, str], _Stream] = {}
        #: (env index, agent) -> its previous action, for policies with last_action_in_obs
        self.last_actions: dict[tuple[int, str], Any] = {}
        self.trajectories: dict[tuple[int, str], _Trajectory] = {}
        self.obs: list[dict[str, Any]] = []
        self.assigned: list[dict[str, str]] = []
        self.agent_return: list[dict[str, float]] = []
        self.agent_length: list[dict[str, int]] = []
        self.env_return = np.zeros(num_envs)
        self.env_length = np.zeros(num_envs, np.int64)
        for e in range(num_envs):
            self.obs.append({})
            self.assigned.append({})
            self.agent_return.append({})
            self.agent_length.append({})
            self._reset_env(e, seed=self.seed + e)

    @staticmethod
    def _normalizes(plan: Any) -> bool:
        return (plan.kind == "on_policy" and getattr(plan.config, "normalize_observations", False)
                and isinstance(plan.observation_space, gym.spaces.Box))

    # Episodes and agents.

    def _reset_env(self, e: int, seed: int | None = None) -> None:
        obs, _ = self.envs[e].reset(seed=seed)
        self._note_failures(e)
        self._start_fresh(e, obs)

    def _assign_new_agents(self, e: int) -> None:
        """Map the agents that have just appeared in env ``e`` to their policies. Of a self-play
        policy's agents, one (chosen at random) learns; the others play snapshots."""
        info = {"episode": self.episodes_started, "env_index": e,
                "worker_index": self.context.role_index}
        new = [a for a in self.envs[e].agents if a not in self.assigned[e] and a in self.obs[e]]
        if self.snapshots and len(new) > 1:
            new = [new[i] for i in self.rng.permutation(len(new))]
        for agent in new:
            pid = self.setup.mapping(agent, info)
            if pid not in self.plans:
                raise ValueError(f"policy_mapping mapped agent {agent!r} to {pid!r}, which "
                                 f"is not a policy of this run ({sorted(self.plans)})")
            if pid in self.snapshots and pid in self.assigned[e].values():
                pid = f"{pid}@{int(self.rng.integers(len(self.snapshots[pid])))}"
            self.assigned[e][agent] = pid
            self.agent_return[e][agent] = 0.0
            self.agent_length[e][agent] = 0
            if self.record_episodes:
                self.recording[(e, agent)] = []

    def _plan(self, pid: str) -> Any:
        """The plan of ``pid``; a snapshot ("<id>@<k>") has its policy's."""
        return self.plans[pid.partition("@")[0]]

    def _model(self, pid: str) -> Any:
        """The model that acts for ``pid``: a snapshot's is built on first use."""
        if "@" not in pid:
            return self.models[pid]
        model = self.snapshot_models.get(pid)
        if model is None:
            base, _, k = pid.partition("@")
            model = self.snapshot_models[pid] = build_torch_model(self._plan(pid).model)
            model.set_flat_weights(self.snapshots[base][int(k)])
        return model

    def add_snapshot(self, pid: str, weights: np.ndarray) -> int:
        """Self-play: add a snapshot of policy ``pid``'s weights to its pool, dropping the
        oldest beyond ``pool_size``; returns the pool's size. Episodes in progress keep the
        opponents they drew."""
        pool = self.snapshots[pid]
        pool.append(np.asarray(weights, np.float32))
        del pool[:max(0, len(pool) - self.plans[pid].self_play["pool_size"])]
        for key in [k for k in self.snapshot_models if k.partition("@")[0] == pid]:
            del self.snapshot_models[key]
        return len(pool)

    def _note_failures(self, e: int) -> None:
        env = self.envs[e]
        if env.failures:
            self.env_failures += env.failures
            self._unreported_failures = getattr(self, "_unreported_failures", 0) + env.failures
            env.failures = 0

    def _drop_episode(self, e: int) -> None:
        """Env ``e`` failed: its episode is lost for every agent in it."""
        for key in [k for k in self.trajectories if k[0] == e]:
            del self.trajectories[key]
        for key in [k for k in self.streams if k[1] == e]:
            self.streams[key] = _Stream(cut=True)
        for key in [k for k in self.recording if k[0] == e]:
            del self.recording[key]

    # Sampling.

    def _centralized(self, pid: str) -> bool:
        return bool(getattr(self.plans[pid].model, "critic_inputs", 0))

    def _critic_obs(self, e: int, obs: dict[str, Any]) -> np.ndarray:
        """What a centralized critic sees in env ``e``: its global ``state()``, or when it has
        none every possible agent's observation in ``obs`` (zeros for those absent)."""
        if self.setup.state_size:
            return np.asarray(self.envs[e].state(), np.float32).reshape(-1)
        parts = []
        for agent in self.setup.possible_agents:
            space = self.agent_obs_spaces[agent]
            if isinstance(space, gym.spaces.Discrete):
                part = np.zeros(int(space.n), np.float32)
                if agent in obs:
                    part[int(obs[agent])] = 1.0
            else:
                part = (np.asarray(obs[agent], np.float32).reshape(-1) if agent in obs
                        else np.zeros(int(np.prod(space.shape)), np.float32))
            parts.append(part)
        return np.concatenate(parts)

    def _policy_obs(self, pid: str, e: int, agent: str, raw: Any, last: Any = ...) -> Any:
        """What policy ``pid`` sees of agent ``agent``'s observation ``raw``: itself, or with
        ``last_action_in_obs`` followed by the agent's previous action (``last`` if given)."""
        plan = self._plan(pid)
        if not plan.last_action_in_obs:
            return np.asarray(raw)
        action = self.last_actions.get((e, agent)) if last is ... else last
        return np.concatenate([flatten_value(raw, plan.env_observation_space),
                               flatten_value(action, plan.action_space)])

    def _normalize(self, pid: str, obs: np.ndarray) -> np.ndarray:
        filt = self.filters.get(pid)
        return obs if filt is None else filt.normalize(obs)

    def sample(self, steps_per_env: int, routes: dict[str, tuple[int | None, int]],
               epsilons: dict[str, float] | None = None,
               filter_states: dict[str, tuple] | None = None) -> dict[str, Any]:
        """Step every env ``steps_per_env`` times. ``routes[pid]`` is (rank, tag offset index)
        for each policy whose data is wanted: its batch (on-policy) or chunk of steps
        (off-policy) goes to that rank, or into the result (``payloads``) when the rank is None.
        ``epsilons`` are the off-policy policies' exploration rates."""
        epsilons = epsilons or {}
        self.fragment_length = steps_per_env  # V-trace rows are this long
        for pid, state in (filter_states or {}).items():
            if pid in self.filters:
                self.filters[pid].mean, self.filters[pid].var, self.filters[pid].count = state
        deltas = {pid: RunningMeanStd(self.plans[pid].observation_space.shape)
                  for pid in self.filters}
        finished: dict[str, list[dict[str, np.ndarray]]] = defaultdict(list)
        policy_returns: dict[str, list[float]] = defaultdict(list)
        policy_lengths: dict[str, list[int]] = defaultdict(list)
        agent_steps: dict[str, int] = defaultdict(int)
        returns, lengths = [], []
        for _ in range(steps_per_env):
            actions, extras = self._act(epsilons, deltas)
            for e, env in enumerate(self.envs):
                acting = actions[e]
                next_obs, rewards, terms, truncs, _ = env.step(acting)
                self._next_obs = next_obs
                if env.dropped:
                    self._note_failures(e)
                    self._drop_episode(e)
                    self._start_fresh(e, next_obs)
                    continue
                self.env_length[e] += 1
                for agent in acting:
                    pid = self.assigned[e][agent]
                    reward = float(rewards.get(agent, 0.0))
                    term = bool(terms.get(agent, False))
                    trunc = bool(truncs.get(agent, False)) and not term
                    left = agent not in env.agents
                    # An agent that disappears without a flag has ended its episode.
                    term = term or (left and not trunc)
                    self.agent_return[e][agent] += reward
                    self.agent_length[e][agent] += 1
                    self.env_return[e] += reward
                    if "@" not in pid:
                        agent_steps[pid] += 1
                    self._record(e, agent, pid, reward, term, trunc, next_obs.get(agent),
                                 extras[e][agent], finished)
                    steps = self.recording.get((e, agent))
                    if steps is not None:
                        extra = extras[e][agent]
                        steps.append((self.obs[e][agent], acting[agent], reward, term, trunc,
                                      extra[2] if len(extra) > 2 else 0.0))
                    self.last_actions[(e, agent)] = acting[agent]
                    if term or trunc:
                        self.last_actions.pop((e, agent), None)
                        steps = self.recording.pop((e, agent), None)
                        if steps:
                            self.recorders[pid.partition("@")[0]].record(
                                agent, steps, next_obs.get(agent, self.obs[e][agent]))
                        ret, length = (self.agent_return[e].pop(agent),
                                       self.agent_length[e].pop(agent))
                        if "@" not in pid:
                            policy_returns[pid].append(ret)
                            policy_lengths[pid].append(length)
                        del self.assigned[e][agent]
                self.obs[e] = {a: o for a, o in next_obs.items() if a in env.agents}
                if not env.agents:
                    returns.append(float(self.env_return[e]))
                    lengths.append(int(self.env_length[e]))
                    self._reset_env(e)
                else:
                    self._assign_new_agents(e)
        self._flush_trajectories(finished)
        metrics = {"env_steps": steps_per_env * len(self.envs), "episode_returns": returns,
                   "episode_lengths": lengths, "policy_returns": dict(policy_returns),
                   "policy_lengths": dict(policy_lengths), "agent_steps": dict(agent_steps),
                   "env_failures": getattr(self, "_unreported_failures", 0),
                   "filter_deltas": {pid: d.state() for pid, d in deltas.items()},
                   "payloads": {}}
        if self.recorders:
            # Written and flushed before the driver hears of them: an indexed episode is on disk.
            metrics["dumped"] = [((pid, r.path.name), r.flush())
                                 for pid, r in self.recorders.items()]
        self._unreported_failures = 0
        channel = self.context.data_channel
        if channel is not None:
            channel.flush()  # the last round's batches: the learners took them long ago
        for pid, (dest, index) in routes.items():
            plan = self.plans[pid]
            if plan.kind == "on_policy":
                payload, tag = _concat(finished.get(pid, []), plan), BATCH_TAG
            else:
                payload, tag = self._take_chunk(pid), INSERT_TAG
            if dest is None:
                metrics["payloads"][pid] = payload
            else:
                channel.isend(payload, dest, policy_tag(tag, index))
        self.chunks_sent += 1
        return metrics

    def _forget_last_actions(self, e: int) -> None:
        for key in [k for k in self.last_actions if k[0] == e]:
            del self.last_actions[key]

    def _start_fresh(self, e: int, obs: dict[str, Any]) -> None:
        """The env's first observations ``obs`` (after a reset, or from the env rebuilt after a
        failure) begin a new episode."""
        self._forget_last_actions(e)
        self.obs[e] = dict(obs)
        self.assigned[e] = {}
        self.agent_return[e] = {}
        self.agent_length[e] = {}
        self.env_return[e] = 0.0
        self.env_length[e] = 0
        self.episodes_started += 1
        self._assign_new_agents(e)

    def _act(self, epsilons: dict[str, float], deltas: dict[str, RunningMeanStd]
             ) -> tuple[list[dict[str, Any]], list[dict[str, tuple]]]:
        """Every live agent's action, one forward pass per policy; and per agent what its
        trajectory keeps (normalized observation, action, log-prob, value)."""
        groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for e, assigned in enumerate(self.assigned):
            for agent, pid in assigned.items():
                if agent in self.obs[e]:
                    groups[pid].append((e, agent))
        actions: list[dict[str, Any]] = [{} for _ in self.envs]
        extras: list[dict[str, tuple]] = [{} for _ in self.envs]
        for pid, members in groups.items():
            plan, model = self._plan(pid), self._model(pid)
            raw = np.stack([self._policy_obs(pid, e, a, self.obs[e][a]) for e, a in members])
            if plan.kind == "scripted":
                chosen = np.asarray(model.compute_actions(raw))
                for (e, agent), action in zip(members, chosen, strict=True):
                    actions[e][agent] = action
                    extras[e][agent] = (raw, action)
                continue
            if plan.kind == "off_policy":
                chosen = model.explore(raw, epsilons.get(pid, 0.0), self.rng)
                for i, (e, agent) in enumerate(members):
                    actions[e][agent] = chosen[i]
                    extras[e][agent] = (raw[i], chosen[i])
                continue
            if pid in deltas:
                deltas[pid].update(raw)
            obs = self._normalize(pid.partition("@")[0], raw)
            critic = (np.stack([self._critic_obs(e, self.obs[e]) for e, _ in members])
                      if self._centralized(pid.partition("@")[0]) else None)
            acts, logp, values = model.act(obs, critic_obs=critic)
            env_acts = model.env_actions(acts)
            for i, (e, agent) in enumerate(members):
                actions[e][agent] = env_acts[i]
                extras[e][agent] = (obs[i], acts[i], logp[i], values[i],
                                    None if critic is None else critic[i])
        return actions, extras

    def _record(self, e: int, agent: str, pid: str, reward: float, term: bool, trunc: bool,
                next_obs: Any, extra: tuple, finished: dict[str, list]) -> None:
        if "@" in pid:
            return  # a self-play snapshot: frozen, nothing to learn from its side
        plan = self.plans[pid]
        if plan.kind == "on_policy":
            traj = self.trajectories.setdefault((e, agent), _Trajectory())
            obs, action, logp, value, critic = extra
            if trunc and next_obs is not None:  # a time limit: bootstrap from where it stopped
                final = self._normalize(
                    pid, self._policy_obs(pid, e, agent, next_obs, last=action)[None])
                final_critic = (self._critic_obs(e, self._next_obs)[None]
                                if critic is not None else None)
                reward += plan.config.gamma * float(
                    self.models[pid].value(final, final_critic)[0])
            if critic is not None:
                traj.critic_obs.append(critic)
            traj.obs.append(obs)
            traj.actions.append(action)
            traj.logp.append(logp)
            traj.values.append(value)
            traj.rewards.append(reward)
            traj.dones.append(term or trunc)
            if term or trunc:
                finished[pid].append(self._segment(pid, self.trajectories.pop((e, agent)), 0.0,
                                                   None))
        elif plan.kind == "off_policy":
            stream = self.streams.setdefault((pid, e, agent), _Stream())
            obs, action = extra
            stream.obs.append(obs)
            stream.actions.append(action)
            stream.rewards.append(reward)
            stream.terminated.append(term)
            stream.truncated.append(trunc and next_obs is not None)
            if trunc and next_obs is not None:
                stream.final_obs.append(self._policy_obs(pid, e, agent, next_obs, last=action))

    def _segment(self, pid: str, traj: _Trajectory, last_value: float,
                 bootstrap_obs: np.ndarray | None) -> dict[str, np.ndarray]:
        """One agent's steps as rows of its policy's batch: GAE rows (PPO, A2C), or for V-trace
        (IMPALA) one fragment-long row, left-padded with masked steps."""
        if self.plans[pid].algo != "IMPALA":
            return self._gae(pid, traj, last_value)
        steps, count = self.fragment_length, len(traj)
        pad = steps - count

        def padded(values: list, dtype: Any = np.float32) -> np.ndarray:
            array = np.asarray(values, dtype)
            return np.concatenate([np.zeros((pad, *array.shape[1:]), array.dtype), array])[None]

        first = np.asarray(traj.obs[0], np.float32)
        dones = padded(traj.dones)
        dones[0, :pad] = 1.0  # nothing flows from the real steps into the padding before them
        return {"obs": padded(traj.obs), "actions": padded(traj.actions, np.asarray(
                    traj.actions[0]).dtype), "logp": padded(traj.logp),
                "rewards": padded(traj.rewards), "dones": dones,
                "mask": np.concatenate([np.zeros(pad), np.ones(count)]).astype(np.float32)[None],
                "bootstrap_obs": (np.zeros_like(first) if bootstrap_obs is None
                                  else np.asarray(bootstrap_obs, np.float32))[None]}

    def _gae(self, pid: str, traj: _Trajectory, last_value: float) -> dict[str, np.ndarray]:
        config = self.plans[pid].config
        rewards = np.asarray(traj.rewards, np.float32)[:, None]
        values = np.asarray(traj.values, np.float32)[:, None]
        dones = np.asarray(traj.dones, np.float32)[:, None]
        advantages, targets = compute_gae(rewards, values, dones,
                                          np.array([last_value], np.float32), config.gamma,
                                          config.gae_lambda)
        batch = {"obs": np.stack(traj.obs), "actions": np.stack(traj.actions),
                 "logp": np.asarray(traj.logp, np.float32),
                 "values": values[:, 0], "advantages": advantages[:, 0],
                 "value_targets": targets[:, 0]}
        if traj.critic_obs:
            batch["critic_obs"] = np.stack(traj.critic_obs)
        return batch

    def _flush_trajectories(self, finished: dict[str, list]) -> None:
        """End of a fragment: every open trajectory bootstraps from its agent's current
        observation (one forward pass per policy) and goes into its policy's batch."""
        open_by_policy: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for (e, agent), traj in self.trajectories.items():
            if len(traj):
                open_by_policy[self.assigned[e][agent]].append((e, agent))
        for pid, members in open_by_policy.items():
            obs = self._normalize(pid, np.stack([self._policy_obs(pid, e, a, self.obs[e][a])
                                                 for e, a in members]))
            critic = (np.stack([self._critic_obs(e, self.obs[e]) for e, _ in members])
                      if self._centralized(pid) else None)
            last = self.models[pid].value(obs, critic)
            for i, key in enumerate(members):
                finished[pid].append(self._segment(pid, self.trajectories.pop(key),
                                                   float(last[i]), obs[i]))
        self.trajectories.clear()

    def _take_chunk(self, pid: str) -> dict[str, Any]:
        """The steps of policy ``pid``'s streams since the last chunk, for its replay shard."""
        slots = self.slots[pid]
        columns = []
        for (owner, e, agent), stream in list(self.streams.items()):
            if owner != pid or (not len(stream) and not stream.cut):
                continue
            local = e * len(slots) + slots.index(agent)
            columns.append((local, _stream_arrays(stream, self.plans[pid]), stream.cut))
            self.streams[(owner, e, agent)] = _Stream()
        return {"worker": self.context.role_index, "seq": self.chunks_sent,
                "streams_per_worker": len(self.envs) * len(slots), "columns": columns}

    # Weights.

    def set_policy_weights(self, weights: dict[str, np.ndarray]) -> None:
        for pid, flat in weights.items():
            self.models[pid].set_flat_weights(flat)

    def get_policy_weights(self) -> dict[str, np.ndarray]:
        return {pid: m.get_flat_weights() for pid, m in self.models.items()
                if self.plans[pid].kind != "scripted"}

    def receive_policy_weights(self, sources: dict[str, tuple[int, int]]) -> None:
        """Take each policy's new weights from its learner 0 (rank, tag offset index)."""
        channel = self.context.data_channel
        for pid, (rank, index) in sources.items():
            self.models[pid].set_flat_weights(channel.recv(rank, policy_tag(WEIGHTS_TAG, index)))

    # Evaluation.

    def evaluate(self, episodes: int, deterministic: bool = True) -> dict[str, Any]:
        """Play ``episodes`` whole episodes (round-robin over the envs) with the current
        weights; nothing is trained on. Returns env returns and lengths, per-policy returns."""
        returns, lengths, env_steps = [], [], 0
        policy_returns: dict[str, list[float]] = defaultdict(list)
        recording, self.record_episodes = self.record_episodes, False  # never dumped
        for e in range(len(self.envs)):
            self._drop_episode(e)
            self._reset_env(e)
        quota = [len(p) for p in np.array_split(np.arange(episodes), len(self.envs))]
        while any(quota):
            actions: list[dict[str, Any]] = [{} for _ in self.envs]
            for e, assigned in enumerate(self.assigned):
                if not quota[e]:
                    continue
                for agent, pid in assigned.items():
                    actions[e][agent] = self._act_one(pid, e, agent, deterministic)
            for e, env in enumerate(self.envs):
                if not quota[e]:
                    continue
                next_obs, rewards, terms, truncs, _ = env.step(actions[e])
                env_steps += 1
                if env.dropped:
                    self._note_failures(e)
                    self._start_fresh(e, next_obs)
                    continue
                self.env_length[e] += 1
                for agent in actions[e]:
                    self.last_actions[(e, agent)] = actions[e][agent]
                    reward = float(rewards.get(agent, 0.0))
                    self.env_return[e] += reward
                    self.agent_return[e][agent] += reward
                    if agent not in env.agents:
                        pid, ret = self.assigned[e].pop(agent), self.agent_return[e].pop(agent)
                        if "@" not in pid:
                            policy_returns[pid].append(ret)
                self.obs[e] = {a: o for a, o in next_obs.items() if a in env.agents}
                if not env.agents:
                    returns.append(float(self.env_return[e]))
                    lengths.append(int(self.env_length[e]))
                    quota[e] -= 1
                    self._reset_env(e)
                else:
                    self._assign_new_agents(e)
        self.record_episodes = recording
        for e in range(len(self.envs)):
            self._drop_episode(e)
            self._reset_env(e)
        failures, self._unreported_failures = getattr(self, "_unreported_failures", 0), 0
        return {"env_steps": env_steps, "episode_returns": returns, "episode_lengths": lengths,
                "policy_returns": dict(policy_returns), "env_failures": failures}

    def _act_one(self, pid: str, e: int, agent: str, deterministic: bool) -> Any:
        plan, model = self._plan(pid), self._model(pid)
        raw = self._policy_obs(pid, e, agent, self.obs[e][agent])[None]
        if plan.kind == "scripted":
            return np.asarray(model.compute_actions(raw))[0]
        if plan.kind == "off_policy":
            return model.explore(raw, 0.0 if deterministic else 0.05, self.rng)[0]
        critic = None
        if self._centralized(plan.policy_id):
            critic = np.zeros((1, plan.model.critic_inputs), np.float32)  # values unused here
        acts, _, _ = model.act(self._normalize(plan.policy_id, raw), deterministic, critic)
        return model.env_actions(acts)[0]

    def finish_dump(self) -> list[tuple[tuple[str, str], list[tuple[int, int]]]]:
        """Wait until every completed episode is on disk; ((policy id, file name), [(local id,
        steps)]) of those not reported yet, per policy."""
        done = [((pid, r.path.name), r.close()) for pid, r in self.recorders.items()]
        self.recorders, self.record_episodes = {}, False
        return done

    # Checkpoints.

    def get_state(self) -> dict[str, Any]:
        """Envs (pickled whole), episodes in progress, open replay streams, filters, every
        policy's weights (those no learner trains live only here), RNGs."""
        try:
            envs, error = pickle.dumps(self.envs, protocol=5), None
        except Exception as exc:  # noqa: BLE001 - any env may refuse to pickle
            envs, error = None, f"{type(exc).__name__}: {exc}"
        self.envs_error = error
        return {"envs": envs, "envs_error": error, "obs": self.obs, "assigned": self.assigned,
                "agent_return": self.agent_return, "agent_length": self.agent_length,
                "env_return": self.env_return, "env_length": self.env_length,
                "streams": self.streams, "episodes_started": self.episodes_started,
                "last_actions": self.last_actions,
                "filters": {pid: f.state() for pid, f in self.filters.items()},
                "weights": self.get_policy_weights(), "snapshots": self.snapshots,
                "rng": capture_rng(),
                "epsilon_rng": self.rng.bit_generator.state, "chunks_sent": self.chunks_sent,
                "env_failures": self.env_failures, "restores": self.restores}

    def save_state(self, directory: str, name: str) -> dict[str, Any]:
        entry = super().save_state(directory, name)
        if getattr(self, "envs_error", None) is not None:
            entry["envs_error"] = self.envs_error
        return entry

    def set_state(self, state: dict[str, Any]) -> bool:
        self.restores = state["restores"] + 1
        self.env_failures = state["env_failures"]
        for pid, saved in state["filters"].items():
            if pid in self.filters:
                self.filters[pid].mean, self.filters[pid].var, self.filters[pid].count = saved
        self.set_policy_weights({pid: w for pid, w in state["weights"].items()
                                 if pid in self.models})
        self.rng.bit_generator.state = state["epsilon_rng"]
        self.chunks_sent = state["chunks_sent"]
        self.snapshots.update({pid: pool for pid, pool in state.get("snapshots", {}).items()
                               if pid in self.snapshots})
        self.snapshot_models.clear()
        self.recording = {}  # episodes in progress began in an earlier session: not dumped
        if state["envs"] is not None:
            envs = pickle.loads(state["envs"])
            if len(envs) == len(self.envs):
                for env in self.envs:
                    env.close()
                self.envs = envs
                for key in ("obs", "assigned", "agent_return", "agent_length", "env_return",
                            "env_length", "streams", "episodes_started", "last_actions"):
                    setattr(self, key, state[key])
                restore_rng(state["rng"])
                return True
            for env in envs:
                env.close()
        self.chunks_sent += 1
        self.streams = {}
        for e in range(len(self.envs)):
            self._reset_env(e, seed=self.seed + e + 7_777_777 * self.restores)
        restore_rng(state["rng"])
        return False


def _concat(parts: list[dict[str, np.ndarray]], plan: Any) -> dict[str, np.ndarray]:
    """One policy's trajectories as one batch (an empty one when it had none)."""
    if parts:
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if plan.algo == "IMPALA":  # no rows: what a V-trace batch holds, with 0 rows
        shape = plan.observation_space.shape or ()
        return {"obs": np.zeros((0, 1, *shape), np.float32),
                "actions": np.zeros((0, 1, *(plan.action_space.shape or ())),
                                    plan.action_space.dtype or np.int64),
                **{k: np.zeros((0, 1), np.float32) for k in ("logp", "rewards", "dones",
                                                              "mask")},
                "bootstrap_obs": np.zeros((0, *shape), np.float32)}
    space = plan.observation_space
    shape = space.shape if isinstance(space, gym.spaces.Box) else ()
    action_shape = plan.action_space.shape or ()
    batch = {"obs": np.zeros((0, *shape), np.float32),
             "actions": np.zeros((0, *action_shape), plan.action_space.dtype or np.int64),
             **{k: np.zeros(0, np.float32)
                for k in ("logp", "values", "advantages", "value_targets")}}
    if getattr(plan.model, "critic_inputs", 0):
        batch["critic_obs"] = np.zeros((0, plan.model.critic_inputs), np.float32)
    return batch


def _stream_arrays(stream: _Stream, plan: Any) -> dict[str, np.ndarray]:
    obs_space, act_space = plan.observation_space, plan.action_space
    count = len(stream)
    return {
        "obs": np.asarray(stream.obs, obs_space.dtype).reshape(count, 1, *obs_space.shape),
        "actions": np.asarray(stream.actions, act_space.dtype).reshape(count, 1,
                                                                       *act_space.shape),
        "rewards": np.asarray(stream.rewards, np.float32).reshape(count, 1),
        "terminated": np.asarray(stream.terminated, bool).reshape(count, 1),
        "truncated": np.asarray(stream.truncated, bool).reshape(count, 1),
        "final_obs": np.asarray(stream.final_obs, obs_space.dtype).reshape(-1, *obs_space.shape),
    }
