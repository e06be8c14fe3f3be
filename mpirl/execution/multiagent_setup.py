"""Multi-agent runs, before anything starts: which policies there are, which agent each one
drives, which algorithm trains it, on which learner ranks; every mistake is a ConfigError here.

The ``multiagent`` config key::

    {"policies": {"runner": {}, "chaser": {"algo": "DQN", "lr": 5e-4}},
     "policy_mapping": {"runner_*": "runner", "chaser": "chaser"},
     "policies_to_train": ["runner", "chaser"]}

A policy's overrides are config keys of its algorithm (model, loss and optimizer keys, its own
``num_learners``), ``"algo"`` for an algorithm other than the run's, and ``"policy_class":
"module:Class"`` for a scripted policy that never learns. ``policy_mapping`` maps agent ids to
policy ids by exact id, by glob pattern, or through ``"module:function"`` called as
``fn(agent_id, episode_info) -> policy_id``. Only the policy plans cross to other ranks.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.config.imports import load_object
from mpirl.config.parse import build, check_known_keys
from mpirl.envs.parallel import agent_spaces, flat_size, with_last_action
from mpirl.errors import ConfigError
from mpirl.execution.contract import (
    AlgorithmModule,
    algorithm_name,
    load_algorithm,
    refuse_as_policy,
)
from mpirl.execution.trainer import PolicyEnv
from mpirl.models.torch_model import build_torch_model

#: Keys that hold for the whole run (sampling, layout, bookkeeping): never a policy's override.
RUN_WIDE_KEYS = ("num_rollout_workers", "num_envs_per_worker", "rollout_fragment_length",
                 "max_env_failures", "env_failure_window", "metrics_window", "seed",
                 "callbacks", "tensorboard_histograms_every", "wandb_project",
                 "mlflow_experiment", "multiagent", "torch_threads", "num_replay_shards")
#: The keys of the ``multiagent`` object itself.
MULTIAGENT_KEYS = ("policies", "policy_mapping", "policies_to_train")
#: The policy id of the one shared policy that a run without ``policies`` trains.
SHARED_POLICY = "shared"


@dataclass
class PolicyPlan:
    """One policy: what it drives, what trains it and where."""

    policy_id: str
    index: int
    algo: str  # "PPO", "DQN"; "" for a scripted policy
    observation_space: gym.Space
    action_space: gym.Space
    config: Any = None  # its algorithm's Config, with its overrides
    model: Any = None  # the spec every rank builds its model from
    policy_class: str = ""  # "module:Class" of a scripted policy
    trainable: bool = True
    num_learners: int = 0  # learner ranks of its own; 0 shares learner 0
    agents: list[str] = field(default_factory=list)  # possible agents mapped to it
    #: self-play: {"snapshot_every": N, "pool_size": K}; {} without
    self_play: dict[str, int] = field(default_factory=dict)
    #: the agents' own observation space; ``observation_space`` is what the policy sees,
    #: which differs with ``last_action_in_obs``
    env_observation_space: gym.Space | None = None
    last_action_in_obs: bool = False
    #: the size of the global state its centralized critic sees besides the observation; 0
    #: without one
    critic_inputs: int = 0

    @property
    def scripted(self) -> bool:
        """A policy of the user's ``policy_class`` that never learns."""
        return bool(self.policy_class)

    @property
    def module(self) -> AlgorithmModule | None:
        """Its algorithm's module (None for a scripted policy)."""
        return load_algorithm(self.algo) if self.algo else None


class PolicyMapping:
    """Agent id -> policy id: a dict of exact ids and glob patterns (exact ids first, then the
    patterns in the order given), or ``"module:function"`` called as ``fn(agent_id,
    episode_info)``. Picklable: a function is imported where it is called."""

    def __init__(self, spec: dict[str, str] | str) -> None:
        self.spec = spec
        self._fn = None

    def __call__(self, agent_id: str, episode_info: dict[str, Any] | None = None) -> str:
        if isinstance(self.spec, str):
            if self._fn is None:
                self._fn = load_object(self.spec, "policy_mapping", "module:function")
            return self._fn(agent_id, episode_info or {})
        if agent_id in self.spec:
            return self.spec[agent_id]
        for pattern, policy_id in self.spec.items():
            if fnmatch.fnmatchcase(agent_id, pattern):
                return policy_id
        raise KeyError(agent_id)

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "_fn": None}

    @property
    def dynamic(self) -> bool:
        """True for a function, which may map an agent differently in each episode."""
        return isinstance(self.spec, str)


@dataclass
class MultiAgentSetup:
    """Everything a multi-agent run is built from; made on every rank from the same config."""

    possible_agents: list[str]
    policies: dict[str, PolicyPlan]
    mapping: PolicyMapping
    state_size: int = 0  # the env's global state() length; 0 without one

    def policy(self, policy_id: str | None) -> PolicyPlan:
        """The plan of ``policy_id``; the only policy when it is None. ConfigError if unknown,
        or if there are several and none was named."""
        if policy_id is None:
            if len(self.policies) != 1:
                raise ConfigError(f"this multi-agent run has policies {sorted(self.policies)}: "
                                  f"name one")
            return next(iter(self.policies.values()))
        if policy_id not in self.policies:
            raise ConfigError(f"unknown policy id {policy_id!r}; the policies are "
                              f"{sorted(self.policies)}")
        return self.policies[policy_id]

    def trained(self) -> list[PolicyPlan]:
        return [p for p in self.policies.values() if p.trainable]

    def learner_slices(self, num_learner_ranks: int,
                       local: bool = False) -> dict[str, list[int]]:
        """Each trained policy's learner indices: policies with ``num_learners`` get their own
        ranks, in the order given; the others share learner 0. ConfigError if they don't fit.
        In local mode (``local``) every policy's learner is one in-process object of its own,
        as local mode folds every role to one worker (its layout note says so)."""
        if local:
            return {plan.policy_id: [0] for plan in self.trained()}
        wanted = sum(p.num_learners for p in self.trained())
        if wanted > max(num_learner_ranks, 0):
            asks = ", ".join(f"{p.policy_id}: {p.num_learners}" for p in self.trained()
                             if p.num_learners)
            raise ConfigError(
                f"the policies ask for {wanted} learner ranks of their own ({asks}) "
                f"but the run has {num_learner_ranks}: set num_learners to at least {wanted}, "
                f"or give the policies fewer")
        slices, next_index = {}, 0
        for plan in self.trained():
            if plan.num_learners:
                slices[plan.policy_id] = list(range(next_index, next_index + plan.num_learners))
                next_index += plan.num_learners
            else:
                slices[plan.policy_id] = [0]
        return slices


def resolve(algo: str, config: Any, env: Any) -> MultiAgentSetup:
    """The multi-agent setup of a run of ``algo`` on the multi-agent env ``env`` (an EnvSpec)
    with ``config`` (the run's, ``multiagent`` included). Each policy's config takes the keys
    the user gave at the top level where its algorithm has them, and the run's values of the
    keys that hold for the whole run (``RUN_WIDE_KEYS``): every policy's plan steps the envs it
    shares with the others by the same fragments."""
    given = user_given(config)
    run_wide = {key: getattr(config, key) for key in RUN_WIDE_KEYS
                if key != "multiagent" and hasattr(config, key)}
    spec = given.get("multiagent") or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"config key 'multiagent' must be an object, got {spec!r}")
    check_known_keys(spec, list(MULTIAGENT_KEYS), "multiagent")
    base = algorithm_name(algo)
    made = env.make()
    try:
        spaces = agent_spaces(made)
        state_size = _state_size(made)
    finally:
        _close(made)
    possible = list(spaces)
    if not possible:
        raise ConfigError(f"environment {env.env_id!r} has no possible_agents")
    policies_spec = spec.get("policies")
    mapping_spec = spec.get("policy_mapping")
    if policies_spec is None:
        distinct = {_space_key(s) for s in spaces.values()}
        if len(distinct) == 1:  # parameter sharing
            policies_spec = {SHARED_POLICY: {}}
            mapping_spec = mapping_spec or {"*": SHARED_POLICY}
        else:
            policies_spec = {agent: {} for agent in possible}
            mapping_spec = mapping_spec or {agent: agent for agent in possible}
    if not isinstance(policies_spec, dict) or not policies_spec:
        raise ConfigError(f"multiagent.policies must be a non-empty object of policy id -> "
                          f"overrides, got {policies_spec!r}")
    if mapping_spec is None:
        if len(policies_spec) == 1:
            mapping_spec = {"*": next(iter(policies_spec))}
        elif set(policies_spec) >= set(possible):
            mapping_spec = {agent: agent for agent in possible}
        else:
            raise ConfigError(
                f"multiagent.policy_mapping is missing: with policies "
                f"{sorted(policies_spec)} and agents {possible}, say which policy drives which "
                f"agent, e.g. {{\"{possible[0]}\": \"{next(iter(policies_spec))}\"}}")
    if not isinstance(mapping_spec, dict | str):
        raise ConfigError("multiagent.policy_mapping must be an object of agent id or glob -> "
                          f"policy id, or 'module:function'; got {mapping_spec!r}")
    mapping = PolicyMapping(mapping_spec)
    if isinstance(mapping_spec, dict):
        unknown = sorted(set(mapping_spec.values()) - set(policies_spec))
        if unknown:
            raise ConfigError(f"multiagent.policy_mapping names unknown policy ids {unknown}; "
                              f"the policies are {sorted(policies_spec)}")
    mapped: dict[str, list[str]] = {pid: [] for pid in policies_spec}
    for agent in possible:
        try:
            pid = mapping(agent, {"episode": 0, "env_index": 0, "worker_index": 0})
        except KeyError:
            raise ConfigError(f"agent {agent!r} is mapped to no policy: add it (or a glob that "
                              f"matches it) to multiagent.policy_mapping") from None
        if pid not in policies_spec:
            raise ConfigError(f"policy_mapping maps agent {agent!r} to {pid!r}, which is not a "
                              f"policy; the policies are {sorted(policies_spec)}")
        mapped[pid].append(agent)
    to_train = spec.get("policies_to_train")
    if to_train is None:
        to_train = [pid for pid, o in policies_spec.items()
                    if not (isinstance(o, dict) and o.get("policy_class"))]
    if not isinstance(to_train, list) or not all(isinstance(p, str) for p in to_train):
        raise ConfigError(f"multiagent.policies_to_train must be a list of policy ids, got "
                          f"{to_train!r}")
    unknown = sorted(set(to_train) - set(policies_spec))
    if unknown:
        raise ConfigError(f"multiagent.policies_to_train names unknown policy ids {unknown}; the "
                          f"policies are {sorted(policies_spec)}")
    top = {k: v for k, v in given.items() if k != "multiagent"}
    plans = {}
    for index, (pid, overrides) in enumerate(policies_spec.items()):
        if not isinstance(pid, str) or not pid or "/" in pid:
            raise ConfigError(f"policy id {pid!r} must be a non-empty string without '/'")
        plans[pid] = _plan(pid, index, overrides, base, top, run_wide, spaces, mapped[pid],
                           mapping, pid in to_train, state_size or joint_size(spaces),
                           env.env_id)
    return MultiAgentSetup(possible, plans, mapping, state_size)


def user_given(config: Any) -> dict[str, Any]:
    """The keys of ``config`` that differ from its class's defaults: what the user set."""
    default = type(config)()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)}


def joint_size(spaces: dict[str, tuple[gym.Space, gym.Space]]) -> int:
    """Floats of every possible agent's observation concatenated."""
    return sum(flat_size(obs) for obs, _ in spaces.values())


def _plan(pid: str, index: int, overrides: Any, base: str, top: dict[str, Any],
          run_values: dict[str, Any], spaces: dict[str, tuple[gym.Space, gym.Space]],
          agents: list[str],
          mapping: PolicyMapping, trainable: bool, critic_size: int, env_id: str) -> PolicyPlan:
    where = f"multiagent.policies.{pid}"
    if not isinstance(overrides, dict):
        raise ConfigError(f"{where} must be an object of config overrides, got {overrides!r}")
    overrides = dict(overrides)
    algo = algorithm_name(str(overrides.pop("algo", base)))
    policy_class = overrides.pop("policy_class", "")
    self_play = _self_play(overrides.pop("self_play", None), where, agents, trainable,
                           mapping.dynamic)
    last_action = overrides.pop("last_action_in_obs", False)
    if not isinstance(last_action, bool):
        raise ConfigError(f"{where}.last_action_in_obs must be true or false, got "
                          f"{last_action!r}")
    run_wide = sorted(set(overrides) & set(RUN_WIDE_KEYS))
    if run_wide:
        raise ConfigError(f"{where} sets {run_wide}, which hold for the whole run: set them at "
                          f"the top level of --config")
    if not agents and not mapping.dynamic:
        raise ConfigError(f"policy {pid!r} drives no agent: map some agent to it in "
                          f"multiagent.policy_mapping, or remove it")
    # With a mapping function, the policy's spaces are those of the agents it got at the check.
    sample_agents = agents or list(spaces)
    first = spaces[sample_agents[0]]
    for agent in agents[1:]:
        if _space_key(spaces[agent]) != _space_key(first):
            raise ConfigError(
                f"policy {pid!r} drives agents with different spaces: {agents[0]} has "
                f"{first[0]} / {first[1]}, {agent} has {spaces[agent][0]} / {spaces[agent][1]}. "
                f"A policy needs one observation and one action space: give them separate "
                f"policies")
    env_obs_space, act_space = first
    obs_space = with_last_action(env_obs_space, act_space) if last_action else env_obs_space
    if policy_class:
        if last_action:
            raise ConfigError(f"{where}: a scripted policy sees its agent's observation as the "
                              f"env gives it; last_action_in_obs is for learning policies")
        if overrides:
            raise ConfigError(f"{where} is scripted (policy_class); it takes no other keys, "
                              f"got {sorted(overrides)}")
        cls = load_object(policy_class, f"{where}.policy_class", "module:Class")
        if not callable(getattr(cls, "compute_actions", None)):
            raise ConfigError(f"{where}.policy_class {policy_class!r} has no compute_actions("
                              f"obs_batch) method")
        return PolicyPlan(pid, index, "", obs_space, act_space, policy_class=policy_class,
                          trainable=False, agents=agents, env_observation_space=env_obs_space)
    module = load_algorithm(algo)
    refuse_as_policy(module, algo, pid)
    names = {f.name for f in dataclasses.fields(module.Config)}
    # The run's num_learners is its layout; a policy's own is what its overrides say.
    top = {k: v for k, v in top.items() if k != "num_learners"}
    inherited = {k: v for k, v in top.items() if k in names} if algo != base else dict(top)
    inherited |= {k: v for k, v in run_values.items() if k in names}
    try:
        config = build(module.Config, {**inherited, **overrides})
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    try:
        module.check_config(config, PolicyEnv(env_id, obs_space, act_space))
    except ConfigError as error:
        raise ConfigError(f"policy {pid!r} ({algo}): {error}") from None
    if config.use_lstm:
        raise ConfigError(f"policy {pid!r} ({algo}): use_lstm is for single-agent runs so far; "
                          f"multi-agent rollouts carry no recurrent state. Leave it out.")
    try:
        spec = module.model_spec(obs_space, act_space, config)
        critic_inputs = critic_size if config.centralizes_critic() else 0
        if critic_inputs:
            spec = dataclasses.replace(spec, critic_inputs=critic_inputs)
        build_torch_model(spec)
    except ConfigError as error:
        raise ConfigError(f"policy {pid!r} ({algo}) cannot handle its agents' spaces "
                          f"({obs_space} / {act_space}): {error}") from None
    return PolicyPlan(pid, index, algo, obs_space, act_space, config, spec,
                      trainable=trainable, num_learners=config.num_learners, agents=agents,
                      self_play=self_play, env_observation_space=env_obs_space,
                      last_action_in_obs=last_action, critic_inputs=critic_inputs)




def _self_play(spec: Any, where: str, agents: list[str], trainable: bool,
               dynamic: bool) -> dict[str, int]:
    """A policy's ``self_play`` override, checked: every this many iterations a snapshot of its
    weights joins a pool of at most ``pool_size``; in each episode one of its agents learns and
    the others play a snapshot drawn from the pool."""
    if spec is None:
        return {}
    example = '{"snapshot_every": 10, "pool_size": 5}'
    if not isinstance(spec, dict) or set(spec) != {"snapshot_every", "pool_size"}:
        raise ConfigError(f"{where}.self_play must be an object like {example}, got {spec!r}")
    for key, value in spec.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}.self_play.{key} must be a whole number of at least 1, "
                              f"got {value!r}")
    if not trainable:
        raise ConfigError(f"{where} plays against snapshots of itself (self_play) but is not "
                          f"trained: add it to policies_to_train")
    if len(agents) < 2 and not dynamic:
        raise ConfigError(f"{where}.self_play needs at least two agents mapped to the policy "
                          f"(one learns, the others play its snapshots); it has {agents}")
    return dict(spec)


def _space_key(pair: tuple[gym.Space, gym.Space]) -> str:
    return repr(pair)


def _state_size(env: Any) -> int:
    """The length of the env's global ``state()``; 0 when it has none."""
    if not callable(getattr(env, "state", None)):
        return 0
    try:
        env.reset(seed=0)
        state = np.asarray(env.state(), np.float32)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return 0
    return int(getattr(state, "size", 0))


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


def check_stop_keys(stop: dict[str, Any], setup: MultiAgentSetup) -> None:
    """``--stop`` may name per-policy metrics: ``episode_return_mean/<policy id>`` and
    ``episode_len_mean/<policy id>``."""
    for key in stop:
        metric, sep, pid = key.partition("/")
        if not sep:
            continue
        if metric not in ("episode_return_mean", "episode_len_mean") or \
                pid not in setup.policies:
            raise ConfigError(
                f"unknown --stop key {key!r}: per-policy criteria are episode_return_mean/<id> "
                f"and episode_len_mean/<id> with a policy id of {sorted(setup.policies)}")
