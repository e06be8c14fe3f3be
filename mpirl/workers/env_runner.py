"""The sampling core: a rollout rank's environments, every policy's actor, and what one step of
them leaves behind — written once for single-agent and multi-agent runs.

``EnvRunner`` steps its envs (``mpirl.workers.env_slots``: a vector env, or PettingZoo envs whose
agents are mapped to policies) with each policy's actor (``mpirl.workers.actors``), and keeps per
learning policy a *lane*: its slots' episode returns and lengths, its observation filter and the
statistics of what it saw, a recurrent policy's state, its trajectory dump, and the blocks of
steps not yet taken. It counts episodes and env failures, runs the rollout callbacks
(``on_episode_end``) and writes dumps. Turning a block into what a learner or a replay shard takes
(GAE, V-trace fragments, sequences, replay chunks) is ``mpirl.workers.postprocess``; where it goes
is the rollout worker's (``mpirl.workers.rollout``), chosen by the operator that called it.

One step of every env is ``_step``: sampling (``collect``), evaluation (``evaluate``: on
rollout ranks, and ``mpirl evaluate``'s episodes in one process, one env each) and whole
episodes played by a caller that acts itself (``play_episodes``: ES, ARS) go through it.

A single-agent rank has one lane and its rollout worker owns the runner. In a multi-agent run
the runner is a worker of its own on the rank, and each learning policy's rollout worker (of its
algorithm's kind) takes its blocks from it: a call for one policy steps every env once for all
of them, and the other policies' blocks wait in their lanes until their workers ask
(``collect``; an on-policy worker asks for steps taken with its newest weights, ``fresh``).
Nothing here crosses ranks.
"""

from __future__ import annotations

import pickle
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import numpy as np

from mpirl.config.imports import load_object
from mpirl.data.dump_writer import DumpTarget
from mpirl.data.episode_recorder import EpisodeRecorder
from mpirl.jobs.checkpoint import capture_rng, restore_rng
from mpirl.models.spaces import has_image
from mpirl.models.statistics import RunningMeanStd
from mpirl.runtime.core import RankContext, Worker
from mpirl.workers.actors import ExploringActor, PolicyActor, ScriptedActor, make_actor
from mpirl.workers.callbacks import Episode, invoke, make_callbacks
from mpirl.workers.env_slots import ActingGroup, AgentEnvs, AgentPolicy, StepOutcome, VectorEnvs
from mpirl.workers.env_spec import EnvSpec

__all__ = ["CALLER", "EnvRunner", "RunnerPolicy", "RunnerSettings", "EXPLORE"]

#: The policy id of a single-agent run's one policy.
DEFAULT_POLICY = "default"
#: Shortest time between two env-failure warnings of one rollout rank on its stderr.
FAILURE_WARNING_INTERVAL_S = 60.0
#: Acting kinds: an actor-critic samples (log-probs, values); Q networks and SAC's actor
#: explore epsilon-greedily; a scripted policy runs the user's ``compute_actions``; the caller
#: of ``play_episodes`` acts itself (ES, ARS: weights of its own for each episode).
SAMPLE, EXPLORE, SCRIPTED, CALLER = "sample", "explore", "scripted", "caller"


@dataclass(frozen=True, kw_only=True)
class RunnerPolicy:
    """One policy of a rollout rank: how it acts and what it sees. Single-agent runs have one,
    ``DEFAULT_POLICY``; a multi-agent one also names the agents it may drive (its slots)."""

    policy_id: str = DEFAULT_POLICY
    #: its place among the run's policies (the data-channel tags of its messages)
    index: int = 0
    #: the model's spec (a learning policy), or the user's class "module:Class" (scripted)
    spec: Any = None
    policy_class: str = ""
    acting: str = SAMPLE
    #: what the policy sees; the env's own observation space; the action space
    observation_space: Any = None
    env_observation_space: Any = None
    action_space: Any = None
    normalize_observations: bool = False
    #: multi-agent: its slots' agents in each env; whether it learns (a policy outside
    #: policies_to_train acts with the weights it has); its last action in what it sees;
    #: self-play snapshots kept (0: none)
    slot_agents: tuple[str, ...] = ()
    learns: bool = True
    last_action_in_obs: bool = False
    self_play_pool: int = 0
    #: a centralized critic's input size (0: the critic sees the actor's observation)
    critic_inputs: int = 0


@dataclass(frozen=True, kw_only=True)
class RunnerSettings:
    """What a rollout rank's sampling core is built from (sent once, at spawn)."""

    env: EnvSpec
    policies: tuple[RunnerPolicy, ...]
    num_envs: int
    seed: int
    torch_threads: int = 1
    max_env_failures: int = 10
    env_failure_window: int = 1_000
    callbacks: str = ""
    #: env groups on ranks of their own (``ranks_per_env`` >= 1): their replies' deadline
    ranks_per_env: int = 0
    env_step_timeout_s: float = 120.0
    #: policy id -> where its episodes are dumped (empty: no dumps)
    dumps: dict[str, DumpTarget] = field(default_factory=dict)
    #: multi-agent: ``mapping(agent, info) -> policy id``, the env's agents, its global
    #: state's size (0: none)
    mapping: Any = None
    possible_agents: tuple[str, ...] = ()
    state_size: int = 0
    #: blocks a lane keeps for a policy that has not asked for them, the oldest dropped first
    max_pending_blocks: int = 8

    @property
    def multi_agent(self) -> bool:
        return self.mapping is not None


@dataclass
class Block:
    """One learning policy's steps over ``T`` env steps of every env, ``[T, S]`` arrays over
    its ``S`` slots (``active`` marks the slots that acted; None: all of them at every step).

    ``rewards`` are what training sees (their signs with ``clip_rewards``); ``keep`` is False on
    the steps of episodes an env failure cut short; ``failed`` marks the step at which an env
    failed (no transition). ``final_values`` is the critic's value of the observation a
    truncated episode stopped at (actor-critics), ``final_obs`` those observations, compactly,
    one per truncated step that did not fail, in row-major (t, slot) order. ``last_obs`` (and
    ``last_critic``, ``last_state``) is what each slot acts on next: the bootstrap."""

    policy_id: str
    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    failed: np.ndarray
    keep: np.ndarray
    final_obs: np.ndarray
    last_obs: np.ndarray
    active: np.ndarray | None = None
    logp: np.ndarray | None = None
    values: np.ndarray | None = None
    final_values: np.ndarray | None = None
    critic_obs: np.ndarray | None = None
    last_critic: np.ndarray | None = None
    states: np.ndarray | None = None
    starts: np.ndarray | None = None
    last_state: np.ndarray | None = None
    #: the envs were reset (evaluation, a restore) since this lane's previous block: replay
    #: streams do not continue across it
    after_reset: bool = False
    #: the policy's weights version when the block began
    weights_version: int = 0
    # What the driver hears of it.
    env_steps: int = 0
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    custom_metrics: list[dict[str, float]] = field(default_factory=list)
    env_failures: int = 0
    filter_delta: tuple | None = None

    @property
    def steps(self) -> int:
        return self.rewards.shape[0]

    @property
    def slots(self) -> int:
        return self.rewards.shape[1]

    def metrics(self) -> dict[str, Any]:
        """A sample call's metrics of this block (``SampleResult``'s fields)."""
        out = {"env_steps": self.env_steps, "episode_returns": self.episode_returns,
               "episode_lengths": self.episode_lengths, "env_failures": self.env_failures,
               "filter_delta": self.filter_delta}
        if self.custom_metrics:
            out["custom_metrics"] = self.custom_metrics
        return out


class _Columns:
    """A block under construction: ``[T, S]`` columns, allocated on the first write."""

    def __init__(self, steps: int, slots: int, dense: bool) -> None:
        self.steps, self.slots = steps, slots
        # Slots that do not act at a step keep zeros: allocate zeroed where some may not.
        self.alloc = np.zeros if not dense else np.empty
        self.arrays: dict[str, np.ndarray] = {}

    #: Columns written only at some steps (truncations, multi-agent slots that acted): zeros
    #: elsewhere, whatever the block.
    SPARSE = frozenset({"final_values", "active", "failed"})

    def put(self, name: str, t: int, rows: Any, value: np.ndarray) -> None:
        array = self.arrays.get(name)
        if array is None:
            value = np.asarray(value)
            alloc = np.zeros if name in self.SPARSE else self.alloc
            array = self.arrays[name] = alloc((self.steps, self.slots, *value.shape[1:]),
                                              value.dtype)
        if rows is None:
            array[t] = value
        else:
            array[t, rows] = value


class _Lane:
    """One learning policy on this rank: its actor, slots, filter, dump and pending blocks."""

    def __init__(self, policy: RunnerPolicy, actor: Any, slots: int, recorder: Any) -> None:
        self.policy, self.actor, self.slots = policy, actor, slots
        self.policy_id = policy.policy_id
        space = policy.observation_space
        self.normalizes = bool(policy.normalize_observations and policy.acting == SAMPLE
                               and getattr(space, "shape", None) and not has_image(space)
                               and np.issubdtype(space.dtype, np.floating))
        shape = space.shape if self.normalizes else ()
        self.filter = RunningMeanStd(shape) if self.normalizes else None
        self.delta = RunningMeanStd(shape) if self.normalizes else None
        self.returns = np.zeros(slots)
        self.lengths = np.zeros(slots, np.int64)
        self.state = actor.initial_state(slots)
        self.starts = np.ones(slots, bool)  # the next step begins an episode (recurrent state)
        self.recorder = recorder
        self.recording: tuple | None = None
        self.pending: deque[Block] = deque()
        self.custom: list[dict[str, float]] = []
        #: the weights its actor holds (as last set), and their version
        self.weights: np.ndarray | None = None
        self.weights_version = 0
        self.after_reset = True
        self.unreported_failures = 0
        # the block being stepped
        self.columns: _Columns | None = None
        self.episode_start = np.zeros(slots, np.int64)  # its first step within the block
        self.block_returns: list[float] = []
        self.block_lengths: list[int] = []
        self.final_obs: list[Any] = []
        self.active_seen = 0

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        return obs if self.filter is None else self.filter.normalize(obs)


class EnvRunner(Worker):
    """The sampling core of one rollout rank (see the module's docstring). In a multi-agent
    run it is a worker of its own, answering ``MESSAGES``; a single-agent rollout worker
    owns one and calls it directly."""

    MESSAGES = ("evaluate", "set_policy_weights", "get_policy_weights", "add_snapshot",
                "take_env_tally", "save_state", "load_state", "finish_dump")

    Settings: ClassVar[type[RunnerSettings]] = RunnerSettings

    def __init__(self, context: RankContext, settings: RunnerSettings, *,
                 models: dict[str, Any] | None = None) -> None:
        """``models``: policy id -> a model built already to act with, as it is (mpirl
        evaluate's checkpoint or exported policy), instead of one built from the spec."""
        super().__init__(context)
        self.settings = settings
        index = context.role_index
        self.seed = settings.seed + 1000 * index
        self.where = f"rollout worker {index} on rank {context.rank}"
        self.callbacks = make_callbacks(settings.callbacks)
        self.rng = np.random.default_rng(self.seed + 17)
        policies = {p.policy_id: p for p in settings.policies}
        self.policies = policies
        if settings.multi_agent:
            self.envs: Any = AgentEnvs(
                settings.env, settings.num_envs, self.seed, self.where,
                settings.max_env_failures, settings.env_failure_window,
                {pid: AgentPolicy(pid, p.observation_space, p.env_observation_space,
                                  p.action_space, list(p.slot_agents), p.learns,
                                  p.last_action_in_obs, p.critic_inputs, p.self_play_pool > 0)
                 for pid, p in policies.items()},
                settings.mapping, list(settings.possible_agents), settings.state_size,
                self.rng, index)
        else:
            (only,) = policies.values()
            self.envs = VectorEnvs(settings.env, settings.num_envs, self.seed, self.where,
                                   settings.max_env_failures, settings.env_failure_window,
                                   only.policy_id,
                                   vector=_env_groups_of(context, settings, self.seed,
                                                         self.where))
        self.clip_rewards = settings.env.clip_rewards
        self.actors: dict[str, Any] = {}
        self.lanes: dict[str, _Lane] = {}
        for policy in settings.policies:
            pid = policy.policy_id
            if policy.acting == SCRIPTED:
                self.actors[pid] = ScriptedActor(_scripted(policy, self.seed + policy.index))
                continue
            if policy.acting == CALLER:
                continue
            if models and pid in models:
                actor = PolicyActor(models[pid])
            else:
                actor = make_actor(policy.spec, self.seed, settings.torch_threads,
                                   exploring=policy.acting == EXPLORE)
            if not policy.learns:
                # No learner sends it weights: the same start on every rank.
                actor.set_weights(_initial_weights(policy, settings.seed))
            self.actors[pid] = actor
            if policy.learns:
                target = settings.dumps.get(pid)
                recorder = None
                if target is not None:
                    recorder = EpisodeRecorder(
                        target, index, self.envs.slots(pid), settings.env.env_id,
                        policy.env_observation_space or policy.observation_space,
                        policy.action_space, self.seed, policy_id=pid if
                        settings.multi_agent else None,
                        slot_agents=list(policy.slot_agents) or None)
                self.lanes[pid] = _Lane(policy, actor, self.envs.slots(pid), recorder)
        #: self-play: each such policy's pool of frozen snapshots (flat weights), oldest first;
        #: the first is the weights its learner sends first
        self.snapshots: dict[str, list[np.ndarray]] = {
            pid: [] for pid, p in policies.items() if p.self_play_pool}
        self.snapshot_actors: dict[str, Any] = {}
        self.env_failures = 0  # on this rank, since it started
        self.restores = 0
        self._next_warning_at = 0.0
        #: what the driver of a multi-agent run hears of whole envs (``take_env_tally``)
        self.tally: dict[str, Any] = _empty_tally()
        self.envs_error: str | None = None
        self._note_failures(self.envs.reset(seed=self.seed), None)
        for lane in self.lanes.values():
            if lane.recorder is not None:
                lane.recorder.begin(seeded=not settings.multi_agent)

    # Acting parameters, set by each policy's rollout worker.

    def lane(self, policy_id: str) -> _Lane:
        return self.lanes[policy_id]

    def set_weights(self, policy_id: str, flat: np.ndarray) -> None:
        """Weights for ``policy_id``: blocks stepped from now on are of a new version, unless
        they are the ones it has (a policy's weights sent again, as every iteration of a
        multi-agent run ends: its steps since are still on-policy)."""
        lane = self.lanes.get(policy_id)
        if lane is not None:
            if lane.weights is not None and np.array_equal(lane.weights, flat):
                return
            lane.weights = np.array(flat, np.float32)
            lane.weights_version += 1
        self.actors[policy_id].set_weights(flat)
        pool = self.snapshots.get(policy_id)
        if pool is not None and not pool:
            pool.append(np.array(flat, np.float32))

    def set_epsilon(self, policy_id: str, epsilon: float) -> None:
        self.actors[policy_id].epsilon = epsilon

    def set_filter(self, policy_id: str, state: tuple | None) -> None:
        lane = self.lanes[policy_id]
        if state is not None and lane.filter is not None:
            lane.filter.mean, lane.filter.var, lane.filter.count = state

    # Sampling.

    def collect(self, policy_id: str, steps_per_env: int, fresh: bool = False) -> list[Block]:
        """``policy_id``'s next blocks of steps: those waiting in its lane (sampled while another
        policy's worker asked), else one of ``steps_per_env`` new steps of every env. With
        ``fresh`` (on-policy plans) only a block taken with the policy's newest weights counts,
        one; otherwise every block waiting is taken (replay and V-trace take what was sampled
        with older weights, and no step is wasted)."""
        lane = self.lanes[policy_id]
        if fresh:
            while lane.pending and lane.pending[0].weights_version != lane.weights_version:
                lane.pending.popleft()
            if lane.pending:
                return [lane.pending.popleft()]
        elif lane.pending:
            taken = list(lane.pending)
            lane.pending.clear()
            return taken
        self._advance(steps_per_env)
        return [lane.pending.popleft()]

    def _advance(self, steps: int) -> None:
        """Step every env ``steps`` times; every learning lane gets a block of them."""
        lanes = self.lanes
        multi = self.settings.multi_agent
        for lane in lanes.values():
            lane.columns = _Columns(steps, lane.slots, dense=not multi)
            lane.episode_start[:] = 0
            lane.block_returns, lane.block_lengths, lane.final_obs = [], [], []
            lane.active_seen = 0
            lane.block_version = lane.weights_version
        failures_before = self.env_failures
        if self._steps_when_ready():
            self._advance_ready(steps)
        else:
            self._advance_lockstep(steps)
        failures = self.env_failures - failures_before
        for lane in lanes.values():
            lane.pending.append(self._finish_block(lane, failures))
            while len(lane.pending) > self.settings.max_pending_blocks:
                lane.pending.popleft()

    def _advance_lockstep(self, steps: int) -> None:
        """``_advance``'s steps where every env steps at once, ``steps`` times."""
        lanes = self.lanes
        multi = self.settings.multi_agent
        for t in range(steps):
            for lane in lanes.values():
                lane.recording = None  # what its slots acted on at this step, for its dump
            outcome = self._step(partial(self._act, t=t))
            if outcome.failures:
                self._note_failures(outcome.failures, outcome.failure_note)
            for pid, result in outcome.policies.items():
                self._record_outcome(lanes[pid], t, result)
            if outcome.env_episodes:
                tally = self.tally
                for _, ret, length in outcome.env_episodes:
                    tally["episode_returns"].append(ret)
                    tally["episode_lengths"].append(length)
            if multi:
                tally = self.tally
                tally["env_steps"] += len(self.envs.envs)
                for pid, count in outcome.other_steps.items():
                    tally["other_steps"][pid] = tally["other_steps"].get(pid, 0) + count
                tally["other_episodes"] += outcome.other_episodes

    def _steps_when_ready(self) -> bool:
        """Whether this rank's slots step each on its own clock: several env groups, one
        policy, no dump (its recorder books whole steps of every slot)."""
        envs = self.envs
        return (not self.settings.multi_agent and envs.steps_when_ready()
                and all(lane.recorder is None for lane in self.lanes.values()))

    def _advance_ready(self, steps: int) -> None:
        """``_advance``'s steps where each slot (an env group) has its own clock: the groups
        that replied get their next actions in one forward pass while the others are still
        stepping, so a slow group holds back no other. A slot that has its ``steps`` parks;
        the block ends when all have (its last observations are their next ones)."""
        (lane,) = self.lanes.values()
        envs, pid = self.envs, lane.policy_id
        clock = np.zeros(envs.num_envs, np.int64)
        idle = np.ones(envs.num_envs, bool)
        while True:
            rows = np.flatnonzero(idle & (clock < steps))
            if rows.size:
                obs = envs.obs[rows]
                acting = ActingGroup(pid, pid, obs, obs, slots=rows)
                envs.start(rows, self._act(acting, clock[rows], mark_active=False))
                idle[rows] = False
            if idle.all():
                return
            ready, outcome = envs.step_ready()
            if outcome.failures:
                self._note_failures(outcome.failures, outcome.failure_note)
            self._record_outcome(lane, clock, outcome.policies[pid], ready)
            clock[ready] += 1
            idle |= ready

    def _step(self, act: Callable[[ActingGroup], np.ndarray],
              held: np.ndarray | None = None) -> StepOutcome:
        """One step of every env (the stepping loop of sampling and of evaluation): each acting
        group's actions from one forward pass, ``act(group)``, then the envs step with them
        (``held`` envs wait: see ``VectorEnvs.step``)."""
        acted = {group.key: act(group) for group in self.envs.acting_groups()}
        return self.envs.step(acted, held=held)

    def _act(self, group: ActingGroup, t: int | np.ndarray, mark_active: bool = True
             ) -> np.ndarray:
        """One forward pass for ``group``; the learning policy's columns get its step (at
        ``t``, or for slots on clocks of their own at ``t[i]`` for the group's row i; those
        ``mark_active`` False: every slot acts at every step of the block)."""
        lane = self.lanes.get(group.policy_id) if group.policy_id is not None else None
        if lane is None:
            return self._act_without_lane(group)
        rows = group.slots
        obs = group.obs
        if lane.delta is not None:
            lane.delta.update(obs)
            obs = lane.filter.normalize(obs)
        state = None
        if lane.state is not None:
            state = lane.state if rows is None else lane.state[rows]
        acted = lane.actor.act(obs, state, group.critic)
        columns = lane.columns
        columns.put("obs", t, rows, obs)
        columns.put("actions", t, rows, acted.actions)
        if acted.logp is not None:
            columns.put("logp", t, rows, acted.logp)
            columns.put("values", t, rows, acted.values)
        if group.critic is not None:
            columns.put("critic_obs", t, rows, group.critic)
        if state is not None:
            columns.put("states", t, rows, state)
            columns.put("starts", t, rows, lane.starts if rows is None else lane.starts[rows])
            if rows is None:
                lane.state = acted.next_state
            else:
                lane.state[rows] = acted.next_state
        if rows is not None:
            if mark_active:
                columns.put("active", t, rows, np.ones(len(rows), bool))
            lane.active_seen += len(rows)
        else:
            lane.active_seen += lane.slots
        if lane.recorder is not None:
            lane.recording = (group.raw, acted.env_actions, acted.logp, rows)
        return acted.env_actions

    def _act_without_lane(self, group: ActingGroup, deterministic: bool = False) -> np.ndarray:
        """The env actions of a group no learning policy owns: a snapshot (on its policy's
        normalized observations), a scripted policy, or one that does not learn."""
        actor = self._actor(group.key)
        obs = group.obs
        base = self.lanes.get(group.key.partition("@")[0])
        if base is not None:
            obs = base.normalize(obs)
        state = None
        if getattr(actor, "recurrent", False):
            state = actor.initial_state(len(obs))  # opponents act without memory
        return actor.act(obs, state, group.critic, deterministic).env_actions

    def _record_outcome(self, lane: _Lane, t: int | np.ndarray, result: Any,
                        ready: np.ndarray | None = None) -> None:
        """Book one env step's outcome for ``lane``: rewards, episode ends (returns, callbacks,
        the critic's value where a time limit cut an episode), env failures, dumps. With
        ``ready`` (slots on clocks of their own) only those slots stepped, slot i at ``t[i]``."""
        columns = lane.columns

        def at(index: Any) -> Any:
            return t if ready is None else t[index]

        def put(name: str, value: np.ndarray) -> None:
            if ready is None:
                columns.put(name, t, None, value)
            else:
                rows = np.flatnonzero(ready)
                columns.put(name, t[rows], rows, value[rows])

        env_rewards = result.rewards
        rewards = np.sign(env_rewards) if self.clip_rewards else env_rewards
        terminated, truncated = result.terminated, result.truncated
        active = None
        if self.settings.multi_agent:  # the slots that acted at this step (none: no column yet)
            acted = columns.arrays.get("active")
            active = np.zeros(columns.slots, bool) if acted is None else acted[t]
        if ready is not None:
            active = ready
        if active is None:
            lane.returns += env_rewards
            lane.lengths += 1
        else:
            lane.returns[active] += env_rewards[active]
            lane.lengths[active] += 1
        done = terminated | truncated
        # A time limit is not a terminal state: bootstrap from the final observation. A step
        # can be both (gymnasium's TimeLimit truncates a terminal last step too): terminal.
        cut = truncated & ~terminated
        dropped = result.dropped
        if dropped is not None:
            cut = cut & ~dropped
        if cut.any():
            slots = np.flatnonzero(cut)
            finals = [result.final_obs[int(i)] for i in slots]
            lane.final_obs.extend(finals)
            if lane.actor.collects_values:
                final = lane.normalize(np.stack(finals))
                state = None if lane.state is None else lane.state[slots]
                critic = (np.stack([result.final_critic[int(i)] for i in slots])
                          if result.final_critic else None)
                columns.put("final_values", at(slots), slots,
                            lane.actor.value(final, state, critic))
        put("rewards", rewards)
        put("terminated", terminated)
        put("truncated", truncated)
        if done.any():
            for i in np.flatnonzero(done if dropped is None else done & ~dropped):
                self._episode_ended(lane, int(i))
        failed = None
        if dropped is not None and dropped.any():
            failed = dropped
            keep = columns.arrays.get("keep")
            if keep is None:
                keep = columns.arrays["keep"] = np.ones((columns.steps, columns.slots), bool)
            for i in np.flatnonzero(dropped):
                # The failed step is no transition, and its episode has no end to learn from:
                # drop both. Rows sent in earlier blocks are gone already.
                keep[lane.episode_start[i]:at(i) + 1, i] = False
            lane.returns[dropped] = 0.0
            lane.lengths[dropped] = 0
            done = done | dropped
            put("failed", dropped)
        if lane.recorder is not None:
            raw, env_actions, logp, rows = lane.recording or (None, None, None, None)
            lane.recorder.step(raw, env_actions, env_rewards, terminated, truncated, logp,
                               result.final_raw, failed, rows)
        if done.any():
            lane.episode_start[done] = at(done) + 1
            lane.returns[done] = 0.0
            lane.lengths[done] = 0
            if lane.state is not None:
                lane.state[done] = 0.0  # the next episode starts from a blank memory
        if active is None:
            lane.starts = done.copy()
        else:  # a slot that did not act keeps waiting for its next agent's first step
            lane.starts[active] = done[active]

    def _episode_ended(self, lane: _Lane, slot: int) -> None:
        """A training episode ended in ``slot``: count it, and run ``on_episode_end``, keeping
        the custom metrics it set."""
        ret, length = float(lane.returns[slot]), int(lane.lengths[slot])
        lane.block_returns.append(ret)
        lane.block_lengths.append(length)
        if self.callbacks is None:
            return
        agents = lane.policy.slot_agents
        env_index = slot // len(agents) if agents else slot
        episode = Episode(ret, length, self.context.role_index, env_index,
                          agent_id=agents[slot % len(agents)] if agents else None,
                          policy_id=lane.policy_id if agents else None)
        invoke(self.callbacks, "on_episode_end", self.where, episode=episode, worker=self)
        lane.custom.append({k: float(v) for k, v in episode.custom_metrics.items()})

    def _finish_block(self, lane: _Lane, failures: int) -> Block:
        columns = lane.columns
        arrays = columns.arrays
        steps, slots = columns.steps, columns.slots
        multi = self.settings.multi_agent
        active = arrays.get("active")
        for name in ("obs", "actions"):
            if name not in arrays:  # no slot of this policy acted in the whole block
                space = (lane.policy.observation_space if name == "obs"
                         else lane.policy.action_space)
                arrays[name] = np.zeros((steps, slots, *(space.shape or ())),
                                        np.float32 if name == "obs" else space.dtype)
        if multi and active is None:
            active = np.zeros((steps, slots), bool)
        keep = arrays.get("keep")
        if keep is None:
            keep = np.ones((steps, slots), bool)
        failed = arrays.get("failed")
        if failed is None:
            failed = np.zeros((steps, slots), bool)
        final_space = lane.policy.observation_space
        final_obs = (np.stack(lane.final_obs) if lane.final_obs else
                     np.zeros((0, *(final_space.shape or ())), final_space.dtype))
        last = self._last_observations(lane)
        block = Block(
            lane.policy_id, arrays["obs"], arrays["actions"], arrays["rewards"],
            arrays["terminated"], arrays["truncated"], failed, keep, final_obs, last[0],
            active=active, logp=arrays.get("logp"), values=arrays.get("values"),
            critic_obs=arrays.get("critic_obs"), last_critic=last[1],
            states=arrays.get("states"), starts=arrays.get("starts"),
            last_state=None if lane.state is None else lane.state.copy(),
            after_reset=lane.after_reset, weights_version=lane.block_version,
            env_steps=lane.active_seen, episode_returns=lane.block_returns,
            episode_lengths=lane.block_lengths, env_failures=failures)
        if lane.actor.collects_values:
            final_values = arrays.get("final_values")
            block.final_values = (final_values if final_values is not None
                                  else np.zeros((steps, slots), np.float32))
            if block.logp is None:  # no slot acted
                block.logp = np.zeros((steps, slots), np.float32)
                block.values = np.zeros((steps, slots), np.float32)
        lane.after_reset = False
        if lane.delta is not None:
            block.filter_delta = lane.delta.state()
            lane.delta = RunningMeanStd(lane.delta.mean.shape)
        if lane.custom:
            block.custom_metrics, lane.custom = lane.custom, []
        lane.columns = None
        return block

    def _last_observations(self, lane: _Lane) -> tuple[np.ndarray, np.ndarray | None]:
        """What each of ``lane``'s slots acts on next, as the policy sees it (zeros for slots
        with no agent now), and a centralized critic's inputs."""
        if not self.settings.multi_agent:
            return lane.normalize(self.envs.obs), None
        policy, envs = lane.policy, self.envs
        width = len(policy.slot_agents)
        space = policy.observation_space
        obs = np.zeros((lane.slots, *(space.shape or ())), np.float32)
        critic = (np.zeros((lane.slots, policy.critic_inputs), np.float32)
                  if policy.critic_inputs else None)
        for e in range(envs.num_envs):
            for agent, key in envs.assigned[e].items():
                if key != lane.policy_id or agent not in envs.obs[e]:
                    continue
                slot = e * width + envs.slot_of[key][agent]
                obs[slot] = envs.policy_obs(key, e, agent, envs.obs[e][agent])
                if critic is not None:
                    critic[slot] = envs.critic_obs(e, envs.obs[e])
        return lane.normalize(obs), critic

    def _actor(self, key: str) -> Any:
        """The actor for ``key``: a policy's own, or a self-play snapshot's ("<id>@<k>"),
        built on first use."""
        if "@" not in key:
            return self.actors[key]
        actor = self.snapshot_actors.get(key)
        if actor is None:
            base, _, k = key.partition("@")
            policy = self.policies[base]
            actor = make_actor(policy.spec, self.seed, self.settings.torch_threads,
                               exploring=policy.acting == EXPLORE)
            actor.set_weights(self.snapshots[base][int(k)])
            self.snapshot_actors[key] = actor
        return actor

    def _note_failures(self, count: int, note: tuple[int, str] | None) -> None:
        """Count env failures; warn on stderr now and then (the driver sees them all)."""
        if not count:
            return
        self.env_failures += count
        self.tally["env_failures"] += count
        for lane in self.lanes.values():
            lane.unreported_failures += count
        now = time.monotonic()
        if note is None or now < self._next_warning_at:
            return
        self._next_warning_at = now + FAILURE_WARNING_INTERVAL_S
        i, error = note
        print(f"mpirl: warning: {self.where}: {self.settings.env.env_id} sub-env {i} raised "
              f"{error}; rebuilt it. {self.env_failures} env failures on this worker so far "
              f"(num_env_failures counts them all; this warning repeats at most every "
              f"{FAILURE_WARNING_INTERVAL_S:g} s).", file=sys.stderr, flush=True)

    def take_dumped(self, policy_id: str) -> tuple[str, list[tuple[int, int]]] | None:
        """The episodes of ``policy_id`` written since the last take: (file name, [(local id,
        steps)]), flushed to disk before the driver hears of them; None without a dump."""
        recorder = self.lanes[policy_id].recorder
        if recorder is None:
            return None
        return recorder.path.name, recorder.flush()

    def finish_dump(self) -> list[tuple[tuple[str, str], list[tuple[int, int]]]]:
        """Wait until every completed episode is on disk; ((policy id, file name), [(local id,
        steps)]) of those not reported yet, per policy with a dump."""
        done = []
        for pid, lane in self.lanes.items():
            if lane.recorder is not None:
                done.append(((pid, lane.recorder.path.name), lane.recorder.close()))
                lane.recorder = None
        return done

    def take_env_tally(self) -> dict[str, Any]:
        """Whole envs since the last take (multi-agent runs): env steps, the env episodes that
        ended (returns summed over agents, lengths), env failures; and the agent steps and
        agent episodes (policy id, return, length) of the policies that do not learn."""
        tally, self.tally = self.tally, _empty_tally()
        return tally

    # Evaluation.

    def evaluate(self, episodes: int, deterministic: bool = False, *, seed: int | None = None,
                 standalone: bool = False) -> dict[str, Any]:
        """Play ``episodes`` whole episodes with the current weights from freshly reset envs
        (from ``seed``: env i from ``seed + i``; each env a fixed share, so that short episodes
        are not favoured); nothing is trained on or dumped, and the episodes sampling had in
        progress are abandoned. Returns the env steps, the episodes' returns and lengths (a
        multi-agent env's summed over its agents) and, per learning policy, its agents'
        returns (``policy_returns``).

        ``standalone`` (single-agent: mpirl evaluate, whose runner samples nothing else): an env
        whose share is played waits, neither stepped nor reset, on its last observation, still
        a row of each forward pass; returns sum the env's rewards as it gave them, and are
        listed in the order of the envs (env i's from ``seed + i`` first). Without
        it every env steps throughout and returns sum the float32 rewards training sees: what
        rollout ranks' evaluation has always done, and the episodes sampled after it depend on
        those steps; the envs are then reset for sampling, not after a standalone one."""
        envs, lanes = self.envs, self.lanes
        quota = np.array([len(p) for p in np.array_split(np.arange(episodes), envs.num_envs)])
        failures = envs.reset(seed=seed)
        returns, lengths, env_steps = [], [], 0
        played_on: list[int] = []  # the env of each episode in ``returns``
        policy_returns: dict[str, list[float]] = {pid: [] for pid in lanes}
        policy_lengths: dict[str, list[int]] = {pid: [] for pid in lanes}
        slot_returns = {pid: np.zeros(lane.slots) for pid, lane in lanes.items()}
        slot_lengths = {pid: np.zeros(lane.slots, np.int64) for pid, lane in lanes.items()}
        states = {pid: lane.actor.initial_state(lane.slots) for pid, lane in lanes.items()}
        acting_slots: dict[str, np.ndarray | None] = {}

        def act(group: ActingGroup) -> np.ndarray:
            lane = lanes.get(group.policy_id) if group.policy_id is not None else None
            if lane is None:
                return self._act_without_lane(group, deterministic)
            rows = group.slots
            state = states[lane.policy_id]
            if state is not None and rows is not None:
                state = state[rows]
            result = lane.actor.act(lane.normalize(group.obs), state, group.critic,
                                    deterministic)
            if result.next_state is not None:
                if rows is None:
                    states[lane.policy_id] = result.next_state
                else:
                    states[lane.policy_id][rows] = result.next_state
            acting_slots[lane.policy_id] = rows
            return result.env_actions

        multi = self.settings.multi_agent
        while quota.any():
            acting_slots.clear()
            live = quota > 0
            outcome = self._step(act, held=~live if standalone else None)
            failures += outcome.failures
            env_steps += int(live.sum())
            for pid, result in outcome.policies.items():
                rows = acting_slots.get(pid)
                rewards = result.env_rewards if standalone else result.rewards
                if rows is None:
                    slot_returns[pid] += rewards
                    slot_lengths[pid] += 1
                else:
                    slot_returns[pid][rows] += rewards[rows]
                    slot_lengths[pid][rows] += 1
                done = result.terminated | result.truncated
                dropped = result.dropped if result.dropped is not None else np.zeros_like(done)
                width = max(1, len(lanes[pid].policy.slot_agents))
                for i in np.flatnonzero(done & ~dropped):
                    if live[i // width]:
                        policy_returns[pid].append(float(slot_returns[pid][i]))
                        policy_lengths[pid].append(int(slot_lengths[pid][i]))
                        if not multi:
                            returns.append(float(slot_returns[pid][i]))
                            lengths.append(int(slot_lengths[pid][i]))
                            played_on.append(int(i))
                            quota[i] -= 1
                ended = done | dropped
                if standalone:  # held steps reset nothing: an env with a share left goes on
                    for i in np.flatnonzero(done & ~dropped & (quota > 0)):
                        envs.reset_sub_env(int(i))
                slot_returns[pid][ended] = 0.0
                slot_lengths[pid][ended] = 0
                if states[pid] is not None:
                    states[pid][ended] = 0.0
            for e, ret, length in outcome.env_episodes:
                if live[e]:  # an env's episodes count while its share lasts
                    returns.append(ret)
                    lengths.append(length)
                    played_on.append(e)
                    quota[e] -= 1
        if standalone:  # mpirl evaluate's envs stop; its report lists them in order
            order = np.argsort(played_on, kind="stable")
            returns, lengths = [returns[i] for i in order], [lengths[i] for i in order]
        else:  # sampling goes on from fresh episodes
            self._start_afresh()
        self.env_failures += failures
        result = {"env_steps": env_steps, "episode_returns": returns, "episode_lengths": lengths,
                  "env_failures": failures, "policy_returns": policy_returns,
                  "policy_lengths": policy_lengths}
        return result

    def _start_afresh(self, seed: int | None = None) -> None:
        """Reset every env (from ``seed``): every lane's episodes in progress and blocks not
        taken are dropped, its memory cleared, and its dump records from the next step on."""
        self._note_failures(self.envs.reset(seed=seed), None)
        for lane in self.lanes.values():
            lane.returns[:] = 0.0
            lane.lengths[:] = 0
            if lane.state is not None:
                lane.state[:] = 0.0
            lane.starts[:] = True
            lane.after_reset = True
            lane.pending.clear()
            if lane.recorder is not None:
                lane.recorder.begin()

    def play_episodes(self, start: Callable[[int], bool],
                      act: Callable[[list[int], np.ndarray], np.ndarray],
                      end: Callable[[int, float, int, bool], None]) -> tuple[int, int]:
        """Whole episodes on each sub-env of a single-agent rank, one at a time per slot, each
        from a fresh reset: ``start(slot)`` says whether the free slot plays another (the
        caller keeps what it plays, a perturbation of the weights, say), ``act(slots, obs)``
        gives the env actions of the slots playing, ``end(slot, return, length, failed)`` takes
        each episode that ended (``failed``: an env failure cut it short). Returns the env steps
        played and the env failures met. Sampling's episodes in progress are abandoned; a slot
        not playing waits, unstepped (``_step`` holds it)."""
        envs = self.envs
        count = envs.episode_slots()  # EnvPool's batch cannot play its envs one by one
        playing = np.zeros(count, bool)
        returns, lengths = np.zeros(count), np.zeros(count, np.int64)
        steps = failures = 0
        while True:
            for i in range(count):
                if not playing[i] and start(i):
                    playing[i] = True
                    envs.reset_sub_env(i)
                    returns[i], lengths[i] = 0.0, 0
            active = np.flatnonzero(playing)
            if not len(active):
                break

            def act_playing(group: ActingGroup, active: np.ndarray = active) -> np.ndarray:
                actions = np.asarray(act(active.tolist(), group.obs[active]))
                every = np.zeros((count, *actions.shape[1:]), actions.dtype)
                every[active] = actions
                return every

            (result,) = self._step(act_playing, held=~playing).policies.values()
            steps += len(active)
            for i in active.tolist():
                returns[i] += result.env_rewards[i]
                lengths[i] += 1
                failed = result.dropped is not None and bool(result.dropped[i])
                if failed or result.terminated[i] or result.truncated[i]:
                    failures += failed
                    playing[i] = False
                    end(i, float(returns[i]), int(lengths[i]), failed)
        self.env_failures += failures
        return steps, failures

    # Self-play and weights of every policy (multi-agent).

    def add_snapshot(self, policy_id: str, weights: np.ndarray) -> int:
        """Self-play: add a snapshot of ``policy_id``'s weights to its pool, dropping the
        oldest beyond its size; returns the pool's size. Episodes in progress keep the
        opponents they drew."""
        pool = self.snapshots[policy_id]
        pool.append(np.asarray(weights, np.float32))
        del pool[:max(0, len(pool) - self.policies[policy_id].self_play_pool)]
        for key in [k for k in self.snapshot_actors if k.partition("@")[0] == policy_id]:
            del self.snapshot_actors[key]
        self.envs.pool_sizes[policy_id] = len(pool)
        return len(pool)

    def set_policy_weights(self, weights: dict[str, np.ndarray]) -> None:
        for pid, flat in weights.items():
            self.set_weights(pid, flat)

    def get_policy_weights(self) -> dict[str, np.ndarray]:
        return {pid: actor.get_weights() for pid, actor in self.actors.items()
                if not isinstance(actor, ScriptedActor)}

    # Checkpoints.

    def get_state(self) -> dict[str, Any]:
        """Envs (pickled whole, with their episodes in progress), each lane's slots, filters
        and RNGs, every policy's weights (those no learner trains live only here)."""
        try:
            envs = pickle.dumps(self.envs.get_envs(), protocol=5)
            self.envs_error = None
        except Exception as error:  # noqa: BLE001 - any env may refuse to pickle
            envs, self.envs_error = None, f"{type(error).__name__}: {error}"
        return {
            "envs": envs, "envs_error": self.envs_error, "obs": self.envs.obs,
            "lanes": {pid: {"returns": lane.returns, "lengths": lane.lengths,
                            "state": lane.state, "starts": lane.starts,
                            "filter": None if lane.filter is None else lane.filter.state()}
                      for pid, lane in self.lanes.items()},
            "actor_rngs": {pid: actor.rng_state() for pid, actor in self.actors.items()},
            # The exploration each policy's worker set last: it acts with it while another
            # policy's worker steps the envs.
            "epsilons": {pid: actor.epsilon for pid, actor in self.actors.items()
                         if isinstance(actor, ExploringActor)},
            "weights": self.get_policy_weights(), "snapshots": self.snapshots,
            "rng": capture_rng(), "runner_rng": self.rng.bit_generator.state,
            "seed": self.seed, "env_failures": self.env_failures, "restores": self.restores,
            "unreported_failures": {pid: lane.unreported_failures
                                    for pid, lane in self.lanes.items()},
        }

    def save_state(self, directory: str, name: str) -> dict[str, Any]:
        """Worker.save_state's checksum entry, plus ``envs_error`` when the environments could
        not be pickled: the driver warns, and the manifest keeps the reason."""
        entry = super().save_state(directory, name)
        if self.envs_error is not None:
            entry["envs_error"] = self.envs_error
        return entry

    def set_state(self, state: dict[str, Any]) -> bool:
        """Restore from ``get_state``; True when the envs continue their episodes, False when
        they were reset instead (the driver warns)."""
        self.restores = state["restores"] + 1
        self.env_failures = state["env_failures"]
        self.rng.bit_generator.state = state["runner_rng"]
        for pid, flat in state["weights"].items():
            if pid in self.actors:
                self.actors[pid].set_weights(flat)
                if pid in self.lanes:
                    self.lanes[pid].weights = np.array(flat, np.float32)
        for pid, epsilon in state["epsilons"].items():
            if pid in self.actors:
                self.actors[pid].epsilon = epsilon
        for pid, pool in state["snapshots"].items():
            if pid in self.snapshots:
                self.snapshots[pid] = pool
                self.envs.pool_sizes[pid] = len(pool)
        self.snapshot_actors.clear()
        for pid, saved in state["lanes"].items():
            lane = self.lanes.get(pid)
            if lane is not None and saved["filter"] is not None and lane.filter is not None:
                lane.filter.mean, lane.filter.var, lane.filter.count = saved["filter"]
            if lane is not None:
                lane.unreported_failures = state["unreported_failures"].get(pid, 0)
                lane.pending.clear()
        continued = False
        if state["envs"] is not None:
            continued = self.envs.set_envs(pickle.loads(state["envs"]), state["obs"])
        if continued:
            for pid, saved in state["lanes"].items():
                lane = self.lanes.get(pid)
                if lane is None or len(saved["returns"]) != lane.slots:
                    continue
                lane.returns, lane.lengths = saved["returns"], saved["lengths"]
                if lane.state is not None and saved["state"] is not None:
                    lane.state = saved["state"]
                lane.starts = saved["starts"]
                lane.after_reset = False  # its replay streams go on where they were
                if lane.recorder is not None:
                    lane.recorder.untrack()  # their beginnings are in an earlier session
        else:
            # Environments start over (from a seed that differs from the first run's) when they
            # could not be saved or num_envs_per_worker changed.
            self._start_afresh(seed=self.seed + 7_777_777 * self.restores)
        restore_rng(state["rng"])
        own_run = state.get("seed", self.seed) == self.seed
        for pid, actor in self.actors.items():
            if own_run:  # this run's own: resume bit-identically
                actor.set_rng_state(state["actor_rngs"].get(pid))
            else:
                # Another run's state (PBT's exploit copies the winner's checkpoint): continue
                # from it, but draw this run's own actions, or the two would stay clones.
                actor.reseed([self.seed, self.restores])
        return continued


def _env_groups_of(context: RankContext, settings: RunnerSettings, seed: int,
                   where: str) -> Any:
    """``SimEnvs`` over the env groups the placement gives this rank, when its env is a
    Simulation with ranks of its own; else None (the envs step in this process)."""
    if settings.ranks_per_env < 1 or context.sim_link is None:
        return None
    groups = context.placement.groups_of(context.rank)
    if not groups or settings.env.simulation_class() is None:
        return None
    from mpirl.runtime.apps import solver_table
    from mpirl.workers.sim_envs import LinkedGroup, SimEnvs

    # A solver program's group is named by the program too: what its user recognizes.
    solvers = solver_table()
    programs = {g.index: solvers[g.root].program for g in groups
                if g.external and g.root < len(solvers)}
    observation_space, action_space = settings.env.spaces()
    return SimEnvs(context.sim_link,
                   [LinkedGroup(g.index, g.root, g.members, g.describe(programs.get(g.index, "")))
                    for g in groups],
                   observation_space, action_space, dict(settings.env.env_config), seed,
                   num_groups=len(context.placement.env_groups),
                   timeout_s=settings.env_step_timeout_s, backoff=context.collective_backoff,
                   where=where, max_failures=settings.max_env_failures)


def _empty_tally() -> dict[str, Any]:
    return {"env_steps": 0, "episode_returns": [], "episode_lengths": [], "env_failures": 0,
            "other_steps": {}, "other_episodes": []}


def _scripted(policy: RunnerPolicy, seed: int) -> Any:
    """The user's scripted policy object, built as ``Class(observation_space, action_space,
    {"seed": ...})``."""
    cls = load_object(policy.policy_class, "policy_class", "module:Class")
    return cls(policy.observation_space, policy.action_space, {"seed": seed})


def _initial_weights(policy: RunnerPolicy, seed: int) -> np.ndarray:
    """The weights a policy no learner trains starts from: its torch model's, built from the
    run's seed, alike on every rank."""
    import torch

    from mpirl.models.torch_model import build_torch_model

    torch.manual_seed(seed + 7919 * (policy.index + 1))
    return build_torch_model(policy.spec).get_flat_weights()
