"""Ape-X DQN: many epsilon-greedy rollout ranks, sharded prioritized replay, one learner, async.

Rollout worker i explores with its own fixed epsilon (``epsilon ** (1 + alpha * i / (N - 1))``)
and streams its steps to replay shard i mod K; the learner trains on minibatches the shards send
it and returns TD errors as priorities; learner 0 posts its weights to the rollout ranks every
``weight_sync_every`` SGD steps. Sampling, storing and training overlap: the driver only keeps
every rank busy (``AsyncReplayLoop``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpirl.algorithms.q_learning.apex_learner import ApexLearner
from mpirl.algorithms.q_learning.apex_loops import (
    AsyncReplayLoop,
    StreamedReplayLoop,
    apex_epsilons,
)
from mpirl.algorithms.q_learning.network import dqn_loss, q_model_spec

from mpirl.config.fields import QLearningConfig
from mpirl.execution.replay_ops import check_q_config, spawn_replay
from mpirl.execution.trainer import Trainer
from mpirl.workers.q_workers import TransitionWorker

ROLLOUT_WORKER = TransitionWorker
LEARNER = ApexLearner
model_spec = q_model_spec
loss = dqn_loss
RECURRENT = False  # it learns from stored single steps


@dataclass
class Config(QLearningConfig):
    """Ape-X's settings. Defaults suit CartPole-v1; every field is a ``--config`` key."""

    # Layout
    num_replay_shards: int = 2
    """Replay ranks, each holding buffer_size / num_replay_shards rows."""
    num_learners: int = 1
    """Learner ranks; Ape-X has one. 0 trains in the driver's process (no overlap then)."""

    # Sampling and exploration
    rollout_fragment_length: int = 32
    """Steps per environment per sampling call."""
    epsilon: float = 0.4
    """Base of the per-worker epsilons."""
    epsilon_alpha: float = 7.0
    """Exponent spread of the per-worker epsilons."""
    min_env_steps_per_iteration: int = 1_000
    """Env steps stored per reported iteration."""
    fragments_per_call: int = 0
    """0: the driver starts every sampling call (one fragment each), every insert and every
    training round. n >= 1 (streamed, for runs of hundreds of rollout ranks;
    ``StreamedReplayLoop``): the calls run from one checkpoint to the next. Each rollout rank
    sends its fragments straight to its shard, with their metrics; the shards store them and
    serve the learner's requests for minibatches themselves; the learner reports each
    iteration to the driver, which reads one message per iteration. Needs one learner rank and
    replay ranks of their own. ``throttle_sampling`` then makes each rollout rank wait for the
    SGD steps its posted weights say the learner took, letting sampling run 2n fragments per
    rank ahead of them."""

    # Replay
    learning_starts: int = 1_000
    """Env steps stored before the first SGD step."""
    prioritized_replay: bool = True
    prioritized_replay_beta_anneal_steps: int = 0
    """Env steps over which beta rises to prioritized_replay_beta_final; 0 keeps it at
    prioritized_replay_beta (0.4), as the Ape-X paper does. Annealed over 100k steps, 2 rollout
    ranks reached a 100-episode mean of 475 within 150k steps on 1 of 5 seeds; constant, on 4."""

    # Optimization
    sgd_steps_per_env_step: float = 0.5
    """Upper bound on SGD steps per stored env step (the learner never runs ahead of it)."""
    throttle_sampling: bool = True
    """Pause sampling while it runs more than two rounds ahead of the learner's
    sgd_steps_per_env_step (off: rollout ranks sample flat out, as in the Ape-X paper)."""
    batches_per_train: int = 16
    """Minibatches a shard sends the learner per training call."""
    weight_sync_every: int = 16
    """SGD steps between weight posts from learner 0 to the rollout ranks."""

    # Bookkeeping
    metrics_max_epsilon: float = 0.02
    """Only the episodes of rollout workers exploring with at most this epsilon go into
    episode_return_mean (all of them if none does); the others are only counted."""


def check_config(config: Config, env) -> None:
    check_q_config(config, env, "APEX")


def setup(trainer: Trainer) -> AsyncReplayLoop | StreamedReplayLoop:
    """The replay shards and the asynchronous loop over them, which keeps the SGD steps of
    the training calls started so far."""
    config, replay = trainer.config, spawn_replay(trainer)
    epsilons = apex_epsilons(len(trainer.rollouts), config.epsilon, config.epsilon_alpha)
    if config.fragments_per_call:
        return StreamedReplayLoop(trainer, replay, epsilons, config.fragments_per_call,
                                  config.batches_per_train)
    return AsyncReplayLoop(trainer, replay, epsilons, config.batches_per_train)


def training_step(trainer: Trainer, loop: AsyncReplayLoop | StreamedReplayLoop
                  ) -> dict[str, float]:
    """One Ape-X report: keep sampling and training until enough new env steps are stored."""
    config = trainer.config
    if config.fragments_per_call:  # the calls run from checkpoint to checkpoint
        return loop.next_report(config.min_env_steps_per_iteration)
    stored, trained = 0, []
    while stored < config.min_env_steps_per_iteration:
        loop.start_sampling()  # on the idle rollout workers, unless far ahead of training
        loop.start_training()  # within sgd_steps_per_env_step of the env steps stored
        env_steps, results = loop.take_finished()  # fragments sent to be stored, TD errors back
        stored += env_steps
        trained += results
    return loop.finish_iteration(trained)
