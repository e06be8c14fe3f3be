"""DQN: double, dueling, n-step Q-learning from (prioritized) replay, with a target network.

Each iteration every rollout worker steps its environments epsilon-greedily and sends the steps
to its replay shard (a replay rank, or the driver's process with ``num_replay_shards`` 0); the
learners then take ``sgd_steps_per_env_step`` SGD steps per new env step on minibatches the shards
send them, return the TD errors to the shards as priorities, and learner 0 broadcasts the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpirl.algorithms.q_learning.network import DQN_STATS, dqn_loss, q_model_spec

from mpirl.config.fields import QLearningConfig
from mpirl.execution.operators import store_to_replay
from mpirl.execution.replay_ops import (
    ReplayState,
    check_q_config,
    linear_epsilon,
    replay_beta,
    spawn_replay,
    train_owed_sgd_steps,
    untrained_replay_stats,
)
from mpirl.execution.trainer import Trainer
from mpirl.workers.optimizer import decayed_lr
from mpirl.workers.q_workers import QLearner, TransitionWorker

ROLLOUT_WORKER = TransitionWorker
LEARNER = QLearner
model_spec = q_model_spec
loss = dqn_loss
RECURRENT = False  # it learns from stored single steps


@dataclass
class Config(QLearningConfig):
    """DQN's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Exploration
    initial_epsilon: float = 1.0
    """Probability of a random action at the start."""
    final_epsilon: float = 0.02
    """Probability of a random action after exploration_steps."""
    exploration_steps: int = 8_000
    """Env steps over which epsilon falls linearly from initial_epsilon to final_epsilon."""

    # Optimization
    sgd_steps_per_env_step: float = 0.5
    """SGD steps per new env step (0.5: 128 steps after each 256 env steps)."""
    # On CartPole-v1, lr 1e-3 with a target copy every 128 SGD steps peaked near 340 and then
    # collapsed (seeds 1 and 2 ended at 69 and 243 after 100k steps). A constant lr 5e-4 with a
    # copy every 500 passed on the trajectories it was chosen on and failed 3 of 10 runs on
    # others (benchmarks/RESULTS.md, 2026-11-28): near the top the two actions' Q values differ
    # by far less than one step's TD noise, so the greedy policy collapses and relearns.
    lr: float = 5e-4
    """Adam learning rate at the start."""
    lr_final: float = 5e-5
    """Learning rate reached after lr_decay_steps env steps, and kept from then on."""
    lr_decay_steps: int = 150_000
    """Env steps over which the learning rate falls linearly from lr to lr_final; 0 keeps lr."""
    target_network_update_freq: int = 500


def check_config(config: Config, env) -> None:
    check_q_config(config, env, "DQN")


def setup(trainer: Trainer) -> ReplayState:
    """The replay shards, and the SGD steps owed from one iteration to the next."""
    return ReplayState(spawn_replay(trainer))


def training_step(trainer: Trainer, state: ReplayState) -> dict[str, float]:
    """One DQN iteration: sample epsilon-greedily into replay; once ``learning_starts`` steps
    are stored (again, in a run resumed without its replay), train ``sgd_steps_per_env_step``
    SGD steps per new env step from replay and broadcast the weights."""
    config, rollouts = trainer.config, trainer.rollouts
    epsilon = linear_epsilon(trainer.timesteps_total, config.initial_epsilon,
                             config.final_epsilon, config.exploration_steps)
    samples = store_to_replay(rollouts, state.replay, config.rollout_fragment_length,
                              [epsilon] * len(rollouts))
    trainer.count(samples)
    beta = replay_beta(config, trainer.timesteps_total)
    lr = decayed_lr(config.lr, config.lr_final, config.lr_decay_steps,
                    trainer.timesteps_total)
    stats = {"epsilon": epsilon, "lr": lr, **untrained_replay_stats(DQN_STATS, config, beta)}
    return stats | train_owed_sgd_steps(trainer, state, samples.env_steps, beta, lr)

