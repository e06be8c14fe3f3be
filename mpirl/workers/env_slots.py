"""A rollout rank's environments as *slots*: what the sampling core steps.

Each learning policy sees a fixed number of slots, the places where one of its agents can act:

* ``VectorEnvs`` (single-agent): a gymnasium vector env (or EnvPool's); the one policy has one
  slot per sub-env, and every slot acts at every step;
* ``AgentEnvs`` (multi-agent, PettingZoo's Parallel API): a policy has one slot per env and
  agent it may drive (the agents mapped to it, or every possible agent under a mapping
  function); a slot acts while its agent is in the env and mapped to the policy.

Each step the core asks for the acting groups (one forward pass each: a policy's acting slots,
a self-play snapshot's agents, a scripted policy's agents), acts, and steps the envs with the
actions; the outcome gives each policy its slots' rewards, ends and failures. Episodes of agents
and of whole envs are kept apart: the core counts a policy's episodes per slot, and an env's
(``StepOutcome.env_episodes``) only where they differ (multi-agent). Nothing here crosses ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.envs.atari import EnvPoolVectorEnv
from mpirl.envs.parallel import flatten_value
from mpirl.workers.env_guard import EPISODE_DROPPED, ERROR, FAILURES, GuardedEnv, GuardedParallelEnv
from mpirl.workers.env_spec import EnvSpec


@dataclass
class ActingGroup:
    """Observations that one actor acts on in one forward pass.

    ``key`` is the actor: a policy id, or ``<id>@<k>`` for snapshot k of a self-play policy.
    ``slots`` are the learning policy's slots the rows belong to (None: all of them, in order);
    a group of a snapshot or a scripted policy has no slots (``policy_id`` None): its steps are
    not collected. ``obs`` is what the policy sees (with its last action, if it asked), ``raw``
    the env's own observations (dumps), ``critic`` a centralized critic's inputs."""

    key: str
    policy_id: str | None
    obs: np.ndarray
    raw: np.ndarray
    slots: np.ndarray | None = None
    critic: np.ndarray | None = None


@dataclass
class PolicyOutcome:
    """One learning policy's slots after an env step (arrays over all its slots; only the
    slots that acted mean anything). ``final_obs`` / ``final_raw`` / ``final_critic``: the
    observation each slot's episode ended on (slot -> value), for the slots whose episode
    ended; ``dropped`` marks slots whose env failed on this step (their episode is lost)."""

    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    dropped: np.ndarray | None = None
    #: single-agent: the env's rewards as it gave them (``rewards`` are float32, as training
    #: takes them), for mpirl evaluate's returns
    env_rewards: np.ndarray | None = None
    final_obs: dict[int, Any] = field(default_factory=dict)
    final_raw: dict[int, Any] = field(default_factory=dict)
    final_critic: dict[int, Any] = field(default_factory=dict)


@dataclass
class StepOutcome:
    """What one step of every env did: each learning policy's ``PolicyOutcome``; the env
    episodes that ended (multi-agent: env index, return summed over agents, length), env
    failures recovered and the latest one's (env index, error), for warnings."""

    policies: dict[str, PolicyOutcome]
    env_episodes: list[tuple[int, float, int]] = field(default_factory=list)
    #: the policies that do not learn (scripted, frozen): their agents' steps, and the agent
    #: episodes that ended (policy id, return, length)
    other_steps: dict[str, int] = field(default_factory=dict)
    other_episodes: list[tuple[str, float, int]] = field(default_factory=list)
    failures: int = 0
    failure_note: tuple[int, str] | None = None


class VectorEnvs:
    """A single-agent rank's sub-envs; the one policy ``policy_id`` has a slot in each."""

    multi_agent = False

    def __init__(self, env: EnvSpec, num_envs: int, seed: int, where: str, max_failures: int,
                 failure_window: int, policy_id: str, vector: Any = None) -> None:
        """``vector``: a vector env built already (``SimEnvs``: env groups on ranks of their
        own) to step instead of one made here."""
        self.policy_id = policy_id
        #: The env groups (``SimEnvs``) when the envs step on ranks of their own, else None.
        self.groups = vector
        if vector is not None:
            self.envs: Any = vector
        elif env.atari is not None and env.atari.backend == "envpool":
            # One C++ pool of envs; it recovers no failed env (GuardedEnv's job otherwise).
            self.envs = EnvPoolVectorEnv(env.env_id, env.atari, env.env_config, num_envs,
                                              seed)
        else:
            self.envs = gym.vector.SyncVectorEnv(
                [partial(GuardedEnv, env, max_failures, seed, i, where, failure_window)
                 for i in range(num_envs)],
                autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        self.num_envs = num_envs
        self.observation_space = self.envs.single_observation_space
        self.action_space = self.envs.single_action_space
        self.obs: Any = None
        self._fresh: list[Any] = []  # failures noted at reset, reported with the next step

    def slots(self, policy_id: str) -> int:
        return self.num_envs

    def sub_envs(self) -> list[Any]:
        """The guarded sub-envs themselves, for playing whole episodes one by one."""
        if isinstance(self.envs, EnvPoolVectorEnv):
            raise ValueError("env_backend 'envpool' runs its envs as one batch; episodes played "
                             "one by one (ES, ARS) need env_backend 'gymnasium'")
        if self.groups is not None:
            raise ValueError("env groups (ranks_per_env >= 1) run on ranks of their own: no "
                             "sub-env of theirs is in this process")
        return list(self.envs.envs)

    def reset(self, seed: int | None = None) -> int:
        """Start every env afresh; returns the env failures the reset recovered from."""
        self.obs, infos = self.envs.reset(seed=seed)
        return _failures(infos)[0]

    def acting_groups(self) -> list[ActingGroup]:
        return [ActingGroup(self.policy_id, self.policy_id, self.obs, self.obs)]

    def wrap_sub_envs(self, wrap: Callable[[int, gym.Env], gym.Env]) -> None:
        """Wrap each sub-env's own env, inside its guard, with ``wrap(index, env)``: mpirl
        evaluate's video recorders (an env rebuilt after a failure is not wrapped)."""
        for i, guarded in enumerate(self.sub_envs()):
            guarded.env = wrap(i, guarded.env)

    def step(self, acted: dict[str, np.ndarray], held: np.ndarray | None = None
             ) -> StepOutcome:
        """Step every sub-env with its action, one that ends its episode reset at once. With
        ``held`` (a mask: ``EnvRunner`` playing whole episodes), only the others step, and
        none is reset: a held one keeps its observation, with no reward, and one whose episode
        ends keeps its final observation until ``reset_sub_env``."""
        if held is not None:
            obs, rewards, terminated, truncated, infos = self._step_unheld(
                acted[self.policy_id], held)
        else:
            obs, rewards, terminated, truncated, infos = self.envs.step(acted[self.policy_id])
        return self._outcome(obs, rewards, terminated, truncated, infos)

    def steps_when_ready(self) -> bool:
        """Whether the slots can step each on its own clock: env groups (``SimEnvs``), more
        than one, stepped as each replies (``start``, ``step_ready``)."""
        return self.groups is not None and self.num_envs > 1

    def start(self, rows: np.ndarray, actions: np.ndarray) -> None:
        """Send the slots ``rows`` (idle ones) their actions; ``step_ready`` takes outcomes."""
        self.envs.start(rows, actions)

    def step_ready(self) -> tuple[np.ndarray, StepOutcome]:
        """Wait until some slots' steps are done: a mask of them, and the outcome (arrays over
        all slots; the others have no reward and did not end)."""
        ready = self.envs.wait_ready()
        return ready, self._outcome(*self.envs.finish(ready))

    def _outcome(self, obs: Any, rewards: Any, terminated: np.ndarray, truncated: np.ndarray,
                 infos: dict[str, Any]) -> StepOutcome:
        outcome = PolicyOutcome(np.asarray(rewards, np.float32), terminated, truncated,
                                env_rewards=np.asarray(rewards, np.float64))
        done = terminated | truncated
        if done.any():
            finals = infos["final_obs"]
            for i in np.flatnonzero(done).tolist():
                outcome.final_obs[i] = outcome.final_raw[i] = finals[i]
        failures, note = _failures(infos)
        if failures:
            outcome.dropped = infos.get(EPISODE_DROPPED, np.zeros(self.num_envs, bool))
        self.obs = obs
        return StepOutcome({self.policy_id: outcome}, failures=failures, failure_note=note)

    def episode_slots(self) -> int:
        """How many sub-envs can play whole episodes one by one (ES, ARS); ValueError for
        EnvPool's batch."""
        if self.groups is not None:
            return self.num_envs
        return len(self.sub_envs())

    def reset_sub_env(self, index: int) -> None:
        """Start sub-env ``index``'s next episode (after a ``held`` step ended one)."""
        if self.groups is not None:
            self.obs[index] = self.groups.reset_one(index)
            return
        self.obs[index], _ = self.sub_envs()[index].reset()

    def _step_unheld(self, actions: np.ndarray, held: np.ndarray) -> tuple:
        """The vector env's step, without its autoreset, on the sub-envs not ``held``."""
        if self.groups is not None:
            return self.groups.step_held(actions, held)
        vector = self.envs
        obs = np.array(self.obs)
        count = self.num_envs
        rewards = np.zeros(count)
        terminated, truncated = np.zeros(count, bool), np.zeros(count, bool)
        infos: dict[str, Any] = {}
        for i in np.flatnonzero(~held).tolist():
            sub = vector.envs[i]
            obs[i], rewards[i], terminated[i], truncated[i], info = sub.step(actions[i])
            if terminated[i] or truncated[i]:
                infos = vector._add_info(infos, {"final_obs": obs[i].copy(),
                                                 "final_info": info}, i)
            infos = vector._add_info(infos, info, i)
        return obs, rewards, terminated, truncated, infos

    def close(self) -> None:
        self.envs.close()

    # Checkpoints: the vector env is pickled whole, with its episodes in progress.

    def get_envs(self) -> Any:
        return self.envs

    def set_envs(self, envs: Any, obs: Any) -> bool:
        if self.groups is not None or envs.num_envs != self.num_envs:
            envs.close()
            return False
        self.envs.close()
        self.envs, self.obs = envs, obs
        return True


def _failures(infos: dict[str, Any]) -> tuple[int, tuple[int, str] | None]:
    """The failures a vector env's ``infos`` report, and the latest one's (sub-env, error)."""
    if FAILURES not in infos:
        return 0, None
    counts = infos[FAILURES]
    i = int(np.flatnonzero(counts)[-1])
    return int(counts.sum()), (i, str(infos[ERROR][i]))


@dataclass
class AgentPolicy:
    """One policy of a multi-agent rank, as its envs see it: the agents it may drive
    (``slot_agents``: its slots in each env, in this order), the spaces, whether it learns
    (a scripted policy or one not trained has no slots) and what it sees."""

    policy_id: str
    observation_space: gym.Space
    env_observation_space: gym.Space
    action_space: gym.Space
    slot_agents: list[str]
    learns: bool = True
    last_action_in_obs: bool = False
    critic_inputs: int = 0
    #: self-play: snapshots of this policy play its other agents in each episode
    self_play: bool = False


class AgentEnvs:
    """A multi-agent rank's envs (``GuardedParallelEnv``), every agent mapped to a policy.

    ``mapping(agent, info) -> policy id`` assigns each agent when it appears; of a self-play
    policy's agents in an env, one (chosen at random) learns and the others play a snapshot
    drawn from ``snapshot_counts()``."""

    multi_agent = True

    def __init__(self, env: EnvSpec, num_envs: int, seed: int, where: str, max_failures: int,
                 failure_window: int, policies: dict[str, AgentPolicy], mapping: Any,
                 possible_agents: list[str], state_size: int, rng: np.random.Generator,
                 worker_index: int) -> None:
        self.policies, self.mapping = policies, mapping
        self.possible_agents, self.state_size = possible_agents, state_size
        self.rng, self.worker_index = rng, worker_index
        self.envs = [GuardedParallelEnv(env, max_failures, seed, i, where, failure_window)
                     for i in range(num_envs)]
        self.num_envs = num_envs
        self.slot_of = {pid: {agent: k for k, agent in enumerate(p.slot_agents)}
                        for pid, p in policies.items() if p.learns}
        self.agent_obs_spaces: dict[str, gym.Space] = {}
        if any(p.critic_inputs for p in policies.values()) and not state_size:
            probe = env.make()
            self.agent_obs_spaces = {a: probe.observation_space(a)
                                     for a in probe.possible_agents}
            getattr(probe, "close", lambda: None)()
        #: self-play pools' sizes (the runner holds the weights), read when assigning
        self.pool_sizes: dict[str, int] = {pid: 1 for pid, p in policies.items() if p.self_play}
        self.episodes_started = 0
        self.obs: list[dict[str, Any]] = [{} for _ in range(num_envs)]
        self.assigned: list[dict[str, str]] = [{} for _ in range(num_envs)]
        #: (env index, agent) -> its previous action, for policies with last_action_in_obs
        self.last_actions: dict[tuple[int, str], Any] = {}
        self.env_return = np.zeros(num_envs)
        self.env_length = np.zeros(num_envs, np.int64)
        #: (env index, agent) -> (return, length) of agents of policies that do not learn
        self.other_agents: dict[tuple[int, str], list[float]] = {}
        self._members: dict[str, list[tuple[int, str]]] = {}

    def slots(self, policy_id: str) -> int:
        return self.num_envs * len(self.policies[policy_id].slot_agents)

    def reset(self, seed: int | None = None) -> int:
        failures = 0
        for e in range(self.num_envs):
            failures += self._reset_env(e, None if seed is None else seed + e)
        return failures

    def _reset_env(self, e: int, seed: int | None = None) -> int:
        env = self.envs[e]
        obs, _ = env.reset(seed=seed)
        failures, env.failures = env.failures, 0
        self._start_fresh(e, obs)
        return failures

    def _start_fresh(self, e: int, obs: dict[str, Any]) -> None:
        """The env's first observations ``obs`` begin a new episode for every agent."""
        for key in [k for k in self.last_actions if k[0] == e]:
            del self.last_actions[key]
        for key in [k for k in self.other_agents if k[0] == e]:
            del self.other_agents[key]
        self.obs[e] = dict(obs)
        self.assigned[e] = {}
        self.env_return[e] = 0.0
        self.env_length[e] = 0
        self.episodes_started += 1
        self._assign_new_agents(e)

    def _assign_new_agents(self, e: int) -> None:
        info = {"episode": self.episodes_started, "env_index": e,
                "worker_index": self.worker_index}
        new = [a for a in self.envs[e].agents if a not in self.assigned[e] and a in self.obs[e]]
        if self.pool_sizes and len(new) > 1:
            new = [new[i] for i in self.rng.permutation(len(new))]
        for agent in new:
            pid = self.mapping(agent, info)
            if pid not in self.policies:
                raise ValueError(f"policy_mapping mapped agent {agent!r} to {pid!r}, which "
                                 f"is not a policy of this run ({sorted(self.policies)})")
            if pid in self.pool_sizes and pid in self.assigned[e].values():
                pid = f"{pid}@{int(self.rng.integers(self.pool_sizes[pid]))}"
            self.assigned[e][agent] = pid

    def policy_obs(self, pid: str, e: int, agent: str, raw: Any, last: Any = ...) -> Any:
        """What policy ``pid`` sees of agent ``agent``'s observation ``raw``: itself, or with
        ``last_action_in_obs`` followed by the agent's previous action (``last`` if given)."""
        policy = self.policies[pid.partition("@")[0]]
        if not policy.last_action_in_obs:
            return np.asarray(raw)
        action = self.last_actions.get((e, agent)) if last is ... else last
        return np.concatenate([flatten_value(raw, policy.env_observation_space),
                               flatten_value(action, policy.action_space)])

    def critic_obs(self, e: int, obs: dict[str, Any]) -> np.ndarray:
        """A centralized critic's inputs in env ``e``: its global ``state()``, or when it has
        none every possible agent's observation in ``obs`` (zeros for those absent)."""
        if self.state_size:
            return np.asarray(self.envs[e].state(), np.float32).reshape(-1)
        parts = []
        for agent in self.possible_agents:
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

    def acting_groups(self) -> list[ActingGroup]:
        members: dict[str, list[tuple[int, str]]] = {}
        for e, assigned in enumerate(self.assigned):
            for agent, key in assigned.items():
                if agent in self.obs[e]:
                    members.setdefault(key, []).append((e, agent))
        self._members = members
        groups = []
        for key, rows in members.items():
            base = key.partition("@")[0]
            policy = self.policies[base]
            raw = np.stack([np.asarray(self.obs[e][a]) for e, a in rows])
            obs = raw if not policy.last_action_in_obs else np.stack(
                [self.policy_obs(key, e, a, self.obs[e][a]) for e, a in rows])
            learner = policy.learns and "@" not in key
            slots = None
            if learner:
                width = len(policy.slot_agents)
                slots = np.array([e * width + self.slot_of[base][a] for e, a in rows])
            critic = None
            if policy.critic_inputs:
                critic = np.stack([self.critic_obs(e, self.obs[e]) for e, _ in rows])
            groups.append(ActingGroup(key, base if learner else None, obs, raw, slots, critic))
        return groups

    def step(self, acted: dict[str, np.ndarray], held: np.ndarray | None = None
             ) -> StepOutcome:
        """Step every env with the groups' actions (``acted[key]``, rows in the order of the
        last ``acting_groups``); none can be ``held``."""
        if held is not None:
            raise ValueError("a multi-agent env steps all its envs: none can be held")
        actions: list[dict[str, Any]] = [{} for _ in self.envs]
        for key, rows in self._members.items():
            for (e, agent), action in zip(rows, acted[key], strict=True):
                actions[e][agent] = action
        outcome = StepOutcome({
            pid: PolicyOutcome(np.zeros(self.slots(pid), np.float32),
                               np.zeros(self.slots(pid), bool), np.zeros(self.slots(pid), bool))
            for pid, p in self.policies.items() if p.learns})
        for e, env in enumerate(self.envs):
            acting = actions[e]
            next_obs, rewards, terms, truncs, _ = env.step(acting)
            if env.dropped:
                outcome.failures += env.failures
                outcome.failure_note = (e, str(env.last_error))
                env.failures = 0
                for agent, key in self.assigned[e].items():
                    slot = self._slot(key, e, agent)
                    if slot is not None:
                        pid_outcome = outcome.policies[key]
                        if pid_outcome.dropped is None:
                            pid_outcome.dropped = np.zeros(len(pid_outcome.rewards), bool)
                        pid_outcome.dropped[slot] = True
                self._start_fresh(e, next_obs)
                continue
            self.env_length[e] += 1
            for agent, action in acting.items():
                key = self.assigned[e][agent]
                reward = float(rewards.get(agent, 0.0))
                term = bool(terms.get(agent, False))
                trunc = bool(truncs.get(agent, False)) and not term
                left = agent not in env.agents
                # An agent that disappears without a flag has ended its episode.
                term = term or (left and not trunc)
                self.env_return[e] += reward
                slot = self._slot(key, e, agent)
                if slot is None and "@" not in key:  # a policy that does not learn
                    kept = self.other_agents.setdefault((e, agent), [0.0, 0])
                    kept[0] += reward
                    kept[1] += 1
                    outcome.other_steps[key] = outcome.other_steps.get(key, 0) + 1
                    if term or trunc:
                        ret, length = self.other_agents.pop((e, agent))
                        outcome.other_episodes.append((key, ret, int(length)))
                if slot is not None:
                    result = outcome.policies[key]
                    result.rewards[slot] = reward
                    result.terminated[slot] = term
                    result.truncated[slot] = trunc
                    if term or trunc:
                        final = next_obs.get(agent, self.obs[e][agent])
                        result.final_raw[slot] = final
                        result.final_obs[slot] = self.policy_obs(key, e, agent, final,
                                                                  last=action)
                        if self.policies[key].critic_inputs:
                            result.final_critic[slot] = self.critic_obs(e, next_obs)
                self.last_actions[(e, agent)] = action
                if term or trunc:
                    self.last_actions.pop((e, agent), None)
                    del self.assigned[e][agent]
            self.obs[e] = {a: o for a, o in next_obs.items() if a in env.agents}
            if not env.agents:
                outcome.env_episodes.append((e, float(self.env_return[e]),
                                             int(self.env_length[e])))
                outcome.failures += self._reset_env(e)
            else:
                self._assign_new_agents(e)
        return outcome

    def _slot(self, key: str, e: int, agent: str) -> int | None:
        """The slot of ``agent`` in env ``e`` for its policy ``key``, or None when the policy
        does not learn from it (a snapshot's or a scripted agent)."""
        slots = self.slot_of.get(key)
        if slots is None:
            return None
        return e * len(self.policies[key].slot_agents) + slots[agent]

    def close(self) -> None:
        for env in self.envs:
            env.close()

    # Checkpoints: the envs are pickled whole, with the agents' episodes in progress.

    def get_envs(self) -> Any:
        return {"envs": self.envs, "assigned": self.assigned, "last_actions": self.last_actions,
                "env_return": self.env_return, "env_length": self.env_length,
                "episodes_started": self.episodes_started, "other_agents": self.other_agents}

    def set_envs(self, saved: Any, obs: Any) -> bool:
        if len(saved["envs"]) != self.num_envs:
            for env in saved["envs"]:
                env.close()
            return False
        self.close()
        self.envs, self.obs = saved["envs"], obs
        for key in ("assigned", "last_actions", "env_return", "env_length",
                    "episodes_started", "other_agents"):
            setattr(self, key, saved[key])
        return True
