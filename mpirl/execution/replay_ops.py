"""The replay dataflow that DQN, Ape-X and SAC share, on the driver: building the replay group,
checking replay configs, and what the synchronous plans (DQN, SAC) keep between iterations
(``ReplayState``). Ape-X's asynchronous loops are its own (``mpirl.algorithms.q_learning``).

The networks and losses are the algorithms' own (``mpirl.algorithms.q_learning.network``,
``mpirl.models.soft_q``); the workers are in ``mpirl.workers.q_workers`` and
``mpirl.workers.replay_shard``. An off-policy loss is
``(policy, target, batch, config) -> (loss, td_errors, stats)``.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym

from mpirl.data.replay_buffer import ReplaySettings
from mpirl.errors import ConfigError
from mpirl.execution.contract import PlanState
from mpirl.execution.operators import broadcast_weights, train_from_replay
from mpirl.runtime.dispatch import WorkerGroup
from mpirl.runtime.layout import REPLAY
from mpirl.workers.replay_shard import ReplayShard, ReplayShardSettings

__all__ = ["ReplayState", "check_q_config", "linear_epsilon", "replay_beta", "spawn_replay",
           "train_owed_sgd_steps", "untrained_replay_stats", "check_discrete"]

# What DQN, SAC and Ape-X share: the replay group, the config checks, the plans' state.


def replay_beta(config: Any, timesteps: int) -> float:
    """The importance-sampling exponent after ``timesteps`` env steps: annealed linearly from
    ``prioritized_replay_beta`` to ``prioritized_replay_beta_final`` over
    ``prioritized_replay_beta_anneal_steps`` (Schaul et al., 2016). It follows from
    ``timesteps_total``, so a resumed run continues the schedule."""
    if not config.prioritized_replay_beta_anneal_steps:
        return config.prioritized_replay_beta
    return linear_epsilon(timesteps, config.prioritized_replay_beta,
                          config.prioritized_replay_beta_final,
                          config.prioritized_replay_beta_anneal_steps)


def check_discrete(action_space: gym.Space, algo: str) -> None:
    """ConfigError unless ``action_space`` is Discrete (Q networks need a finite action set)."""
    if not isinstance(action_space, gym.spaces.Discrete):
        raise ConfigError(f"{algo} needs a Discrete action space; this environment's is "
                          f"{action_space}. Use SAC or PPO for continuous actions.")


def check_q_config(config: Any, env: Any, algo: str, continuous: bool = False) -> None:
    """ConfigError on every rank, before anything starts, for a config or environment that a
    replay plan cannot run: DQN-family plans need Discrete actions, SAC Box actions."""
    ReplaySettings.from_config(config).check(config.train_batch_size,
                                             max(config.num_replay_shards, 1))
    action_space = env.spaces()[1]
    if not continuous:
        check_discrete(action_space, algo)
    elif not isinstance(action_space, gym.spaces.Box):
        raise ConfigError(f"{algo} needs a continuous (Box) action space; this environment's "
                          f"is {action_space}. Use DQN or PPO for discrete actions.")


def spawn_replay(trainer: Any) -> WorkerGroup:
    """The replay shards of ``trainer``'s run: one per replay rank, or one in the driver's
    process when there are none. Rollout worker i feeds shard i mod K, each of its envs a
    stream of its own. The plan's state names the group, so that it joins the checkpoint
    (``checkpoint_replay``)."""
    shards = max(1, trainer.driver.placement.count(REPLAY))
    settings = ReplayShardSettings.from_config(
        trainer.config, env=trainer.spaces, num_shards=shards,
        num_rollout_workers=len(trainer.rollouts), streams_per_worker=trainer.slots_per_worker,
        policy_index=trainer.policy_index)
    return trainer.spawn(REPLAY, ReplayShard, settings)


class ReplayState(PlanState):
    """What DQN's and SAC's plans keep: the replay shards, the fraction of an SGD step owed, and
    the env steps at which the replay was last empty. Both values are checkpointed, so that a
    resumed run takes the SGD steps the uninterrupted run would have, and refills a replay that
    was not checkpointed before training goes on."""

    def __init__(self, replay: WorkerGroup) -> None:
        self.replay = replay
        #: the fraction of an SGD step owed to the env steps sampled so far
        #: (``sgd_steps_per_env_step`` times a round's steps is seldom whole)
        self.sgd_step_debt = 0.0
        #: env steps at which the replay buffer was last empty: 0 at the start, the steps of a
        #: run resumed without its replay (``checkpoint_replay`` false)
        self.replay_empty_at = 0

    def groups(self) -> list[WorkerGroup]:
        return [self.replay]

    def get_state(self) -> dict[str, Any]:
        return {"sgd_step_debt": self.sgd_step_debt, "replay_empty_at": self.replay_empty_at}

    def set_state(self, state: dict[str, Any]) -> None:
        self.sgd_step_debt = state.get("sgd_step_debt", 0.0)  # absent before it was saved
        self.replay_empty_at = state.get("replay_empty_at", 0)

    def restored_empty(self, group: WorkerGroup, timesteps_total: int) -> None:
        if group is self.replay:  # refilled before training goes on
            self.replay_empty_at = timesteps_total

    def replay_ready(self, timesteps_total: int, learning_starts: int) -> bool:
        """Whether ``learning_starts`` env steps were stored since the replay was last empty."""
        return timesteps_total >= self.replay_empty_at + learning_starts

    def owed_sgd_steps(self, env_steps: int, sgd_steps_per_env_step: float) -> int:
        """The whole SGD steps owed for ``env_steps`` new env steps; the fraction carries over."""
        debt = self.sgd_step_debt + env_steps * sgd_steps_per_env_step
        steps, self.sgd_step_debt = divmod(debt, 1.0)
        return int(steps)


def train_owed_sgd_steps(trainer: Any, state: ReplayState, env_steps: int, beta: float,
                         lr: float | None = None) -> dict[str, float]:
    """Once the replay is ready (``learning_starts`` env steps stored since it was last empty):
    the SGD steps owed for ``env_steps`` new env steps on replay minibatches (at learning rate
    ``lr`` if given), then learner 0's weights to every rollout worker; the training's
    statistics. Nothing before."""
    config = trainer.config
    if not state.replay_ready(trainer.timesteps_total, config.learning_starts):
        return {}
    steps = state.owed_sgd_steps(env_steps, config.sgd_steps_per_env_step)
    stats = train_from_replay(trainer.learners, state.replay, steps, config.train_batch_size,
                              beta, lr)
    broadcast_weights(trainer.learners, trainer.rollouts)
    return stats


def untrained_replay_stats(loss_stats: tuple[str, ...], config: Any, beta: float
                           ) -> dict[str, float]:
    """A replay iteration's row before its training: the loss's statistics, ``sgd_steps`` and
    ``learner_samples`` as NaN (so that progress.csv has their columns from the first row), and
    prioritized replay's ``beta``."""
    stats = dict.fromkeys((*loss_stats, "sgd_steps", "learner_samples"), math.nan)
    if config.prioritized_replay:
        stats["prioritized_replay_beta"] = beta
    return stats


def linear_epsilon(step: int, initial: float, final: float, steps: int) -> float:
    """A value annealed linearly from ``initial`` to ``final`` over ``steps`` env steps
    (DQN's epsilon, prioritized replay's beta)."""
    fraction = min(1.0, step / max(steps, 1))
    return initial + fraction * (final - initial)
