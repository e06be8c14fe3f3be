"""SAC: soft actor-critic for continuous actions, with twin Q critics and a learned temperature.

Each iteration every rollout worker samples actions from the actor (uniformly random ones until
``learning_starts`` env steps are stored) and sends its steps to replay; the learners take
``sgd_steps_per_env_step`` SGD steps per new env step on minibatches from replay, soft-updating the
target critics after each; learner 0 broadcasts the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpirl.config.fields import ReplayConfig
from mpirl.execution.operators import store_to_replay
from mpirl.execution.replay_ops import (
    ReplayState,
    check_q_config,
    replay_beta,
    spawn_replay,
    train_owed_sgd_steps,
    untrained_replay_stats,
)
from mpirl.execution.trainer import Trainer
from mpirl.models.soft_q import SAC_STATS, SACSpec, sac_loss, sac_model_spec
from mpirl.workers.q_workers import QLearner, TransitionWorker

if TYPE_CHECKING:
    import gymnasium as gym

ROLLOUT_WORKER = TransitionWorker
LEARNER = QLearner


def model_spec(observation_space: gym.Space, action_space: gym.Space, config: Config
               ) -> SACSpec:
    return sac_model_spec(observation_space, action_space, config, config.custom_q_model)


loss = sac_loss
RECURRENT = False  # it learns from stored single steps


@dataclass
class Config(ReplayConfig):
    """SAC's settings. Defaults suit Pendulum-v1; every field is a ``--config`` key."""

    # Layout
    num_replay_shards: int = 0
    """Replay ranks. 0 keeps the buffer in the driver's process."""

    # Sampling
    num_envs_per_worker: int = 1

    # Replay
    learning_starts: int = 128
    """Env steps of uniformly random actions stored before the first SGD step."""
    prioritized_replay: bool = False
    """Sample in proportion to |TD error of Q1|**alpha instead of uniformly."""
    n_step: int = 1

    # Optimization
    lr: float = 1e-3
    """Adam learning rate of the actor, the critics and the temperature."""
    train_batch_size: int = 256
    sgd_steps_per_env_step: float = 1.0
    """SGD steps per new env step."""
    tau: float = 0.005
    """Soft target update: target += tau * (online - target) after every SGD step."""
    initial_alpha: float = 1.0
    """Starting entropy temperature."""
    target_entropy: str | float = "auto"
    """Entropy the temperature aims for; auto is minus the action dimension."""
    grad_clip: float = 0.0

    # Model
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor and of each critic (64: 4x cheaper SGD steps than 256
    on a CPU, enough for Pendulum)."""
    custom_q_model: str = ""
    """Your own critic as "module:Class", built twice (Q1 and Q2) as Class(observation_space,
    action_space, custom_model_config); forward(obs, action) returns Q [B] of actions scaled to
    [-1, 1]. custom_model, if given, is the actor: forward(obs) returns mean and log std
    concatenated [B, 2 * action_dim]."""

    def custom_models(self) -> list[str]:
        return [*super().custom_models(), *([self.custom_q_model] if self.custom_q_model else [])]

    def target_updates(self) -> tuple[int, float]:
        return 1, self.tau  # a soft update after every SGD step


def check_config(config: Config, env) -> None:
    check_q_config(config, env, "SAC", continuous=True)


def setup(trainer: Trainer) -> ReplayState:
    """The replay shards, and the SGD steps owed from one iteration to the next."""
    return ReplayState(spawn_replay(trainer))


def training_step(trainer: Trainer, state: ReplayState) -> dict[str, float]:
    """One SAC iteration: sample into replay (uniformly random actions for the first
    ``learning_starts`` steps, the actor's after); once the replay is ready, train
    ``sgd_steps_per_env_step`` SGD steps per new env step and broadcast the weights."""
    config, rollouts = trainer.config, trainer.rollouts
    random_actions = 1.0 if trainer.timesteps_total < config.learning_starts else 0.0
    samples = store_to_replay(rollouts, state.replay, config.rollout_fragment_length,
                              [random_actions] * len(rollouts))
    trainer.count(samples)
    beta = replay_beta(config, trainer.timesteps_total)
    stats = untrained_replay_stats(SAC_STATS, config, beta)
    return stats | train_owed_sgd_steps(trainer, state, samples.env_steps, beta)
