"""MBPO: model-based policy optimization (Janner et al. 2019), for continuous actions.

The rollout ranks step their real envs with SAC's actor (uniformly random actions for the first
``initial_random_steps``) and send the transitions to the learner (in the driver's process with
``num_learners`` 0, or one learner rank), which keeps them in the real buffer. Every
``model_train_freq`` env steps the learner fits the dynamics ensemble to the real buffer
(``EnsembleTrainer``, as PETS) and broadcasts SAC's weights and the whole ensemble in one vector;
it then draws ``rollout_batch_size`` start states from the real buffer, which the driver splits
over the rollout ranks. Each rollout rank rolls SAC's actor through the ensemble for k steps
from its share (TS-1 or TS-inf among the elites) and sends the model transitions to the
learner's model buffer (FIFO). k follows ``rollout_schedule`` over epochs of ``epoch_length``
env steps.

Every iteration the learner then takes ``sgd_steps_per_env_step`` SAC steps (``sac_loss``) per
new env step, on minibatches of ``real_ratio`` real rows and model rows otherwise, and broadcasts
the weights again. Every ``evaluation_interval`` iterations the rollout ranks play
``evaluation_episodes`` with the actor's mean action (``eval_return_mean``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from mpirl.algorithms.model_based.dynamics import MODEL_STATS
from mpirl.algorithms.model_based.dynamics_spec import EnsembleTrainerSpec, dynamics_spec_for
from mpirl.algorithms.model_based.mbpo_learner import MBPOLearner
from mpirl.algorithms.model_based.model_rollouts import TRAJECTORY_SAMPLING, MBPOSpec
from mpirl.algorithms.model_based.operators import transitions_to_learner
from mpirl.algorithms.model_based.rollout_workers import ModelRolloutWorker

from mpirl.config.fields import CommonConfig, Range, above, at_least, within
from mpirl.errors import ConfigError, RankLost
from mpirl.execution.contract import PlanState
from mpirl.execution.operators import (
    broadcast_weights,
    discard_lost_rollouts,
    evaluate_policy,
    replay_dest,
)
from mpirl.execution.trainer import Trainer
from mpirl.models.soft_q import SAC_STATS, sac_loss, sac_model_spec

ROLLOUT_WORKER = ModelRolloutWorker
LEARNER = MBPOLearner
RECURRENT = False  # it learns from single transitions
loss = sac_loss


@dataclass
class Config(CommonConfig):
    """MBPO's settings. Defaults suit Pendulum-v1 on a CPU; every field is a ``--config``
    key."""

    # Sampling
    num_envs_per_worker: int = 1
    """Real environments each rollout rank steps."""
    rollout_fragment_length: int = 25
    """Real steps per environment per iteration: SAC trains, and the weights are broadcast,
    after every ``rollout_fragment_length x num_envs_per_worker x`` rollout ranks env steps."""
    initial_random_steps: int = 300
    """Env steps of uniformly random actions before SAC acts and the model is first trained
    (MBPO's init_exploration_steps: 5000 on MuJoCo)."""
    buffer_size: int = 100_000
    """Real transitions kept (the newest; MBPO's replay_size: 1,000,000)."""

    # Model rollouts
    model_train_freq: int = 250
    """Env steps between two fits of the ensemble, each followed by a round of model rollouts
    (MBPO: 250)."""
    rollout_batch_size: int = 2500
    """Model rollouts started at each retrain, from states drawn from the real buffer, shared
    over the rollout ranks (MBPO: 100,000 on a GPU). More rollouts cost the rollout ranks
    little and keep SAC from reusing each model row hundreds of times."""
    rollout_schedule: tuple[int, ...] = (0, 2, 1, 5)
    """[min_epoch, max_epoch, min_length, max_length]: the model rollouts' length k is
    min_length up to min_epoch, then grows linearly to max_length at max_epoch (epochs of
    ``epoch_length`` env steps; MBPO on Hopper: [20, 100, 1, 15]). Pendulum's model is
    accurate early (held-out error about 0.01 after 1,000 steps): k is 1, 3 and then 5 from
    its third epoch."""
    epoch_length: int = 1000
    """Env steps of one epoch of ``rollout_schedule`` and ``model_retain_epochs`` (MBPO:
    1000)."""
    model_retain_epochs: int = 1
    """Epochs of model rollouts the model buffer holds: its capacity is rollout_batch_size x
    (retrains per epoch) x k x model_retain_epochs (MBPO: 1)."""
    trajectory_sampling: str = "ts1"
    """Which elite each model step goes through: ts1 a random one every step (MBPO's), tsinf
    one per rollout."""

    # SAC
    real_ratio: float = 0.05
    """Share of real transitions in each SAC minibatch, the rest from the model buffer
    (MBPO: 0.05)."""
    sgd_steps_per_env_step: float = 10.0
    """SAC SGD steps per new env step, once the first model rollouts are in (MBPO's
    num_train_repeat: 20 on MuJoCo; one step takes about 2 ms on a CPU here)."""
    train_batch_size: int = 256
    """Rows of each SAC minibatch (MBPO: 256)."""
    lr: float = 3e-4
    """Adam learning rate of SAC's actor, critics and temperature (MBPO: 3e-4). At 1e-3 seed 1
    had not reached -200 on Pendulum after 2,800 env steps (it swung between -400 and -1,600);
    at 3e-4 it did at 2,800."""
    gamma: float = 0.99
    """Discount of SAC's targets (MBPO: 0.99)."""
    tau: float = 0.005
    """Soft target update after every SGD step (MBPO: 0.005)."""
    initial_alpha: float = 1.0
    """SAC's starting entropy temperature."""
    target_entropy: str | float = "auto"
    """Entropy the temperature aims for; auto is minus the action dimension (MBPO's)."""
    grad_clip: float = 0.0
    """Global gradient-norm clip of SAC's steps; 0 off."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden widths of SAC's actor and each critic (MBPO: 256 x 2)."""
    activation: str = "relu"
    """Activation of SAC's networks."""

    # The dynamics ensemble
    ensemble_size: int = 7
    """Probabilistic members of the ensemble (MBPO: 7)."""
    elites: int = 5
    """Members the model rollouts sample from: those with the lowest held-out error (MBPO's
    num_elites: 5)."""
    model_hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden widths of every member (MBPO: 4 x 200); 2 x 64 models Pendulum well enough and
    trains several times faster on a CPU."""
    model_activation: str = "silu"
    """The members' activation: silu (MBPO's swish), relu, tanh or elu."""
    termination_fn: str = ""
    """Your termination function as "module:function", fn(obs, action, next_obs) -> bool
    array [N] on NumPy batches; a model rollout stops after a step it says True for. "": model
    transitions never terminate (Pendulum's)."""
    learn_termination: bool = False
    """Learn when model transitions terminate: a classifier head on every member, trained on
    the real steps' terminations, weighted to balance the steps that go on (terminated steps
    are kept for it, their unknown next state left out of the dynamics loss; its held-out
    cross-entropy joins early stopping). Exclusive with termination_fn; neither: model
    transitions never terminate."""
    model_lr: float = 1e-3
    """Adam learning rate of the ensemble (MBPO: 1e-3)."""
    model_weight_decay: float = 5e-5
    """L2 penalty on the members' weights (MBPO: 2.5e-5 to 1e-4 by layer)."""
    model_batch_size: int = 256
    """Transitions per member in one minibatch of the ensemble's training (MBPO: 256)."""
    model_holdout_ratio: float = 0.2
    """Share of the real transitions held out for early stopping, the elites and model_error
    (MBPO: 0.2)."""
    model_patience: int = 5
    """Epochs without improvement of any member's held-out error that stop its training
    (MBPO: 5)."""
    model_max_epochs: int = 50
    """At most this many epochs per fit."""

    # Evaluation
    evaluation_interval: int = 0
    """Every this many iterations, play evaluation_episodes with the actor's mean action
    (eval_return_mean); 0 never. It abandons the training episodes in progress: 8 evaluates at
    the end of each 200-step Pendulum episode."""
    evaluation_episodes: int = 10
    """Episodes of each evaluation, over all rollout ranks."""

    ranges: ClassVar[dict[str, Range]] = {
        "rollout_fragment_length": at_least(1), "initial_random_steps": at_least(0),
        "buffer_size": at_least(2), "model_train_freq": at_least(1),
        "rollout_batch_size": at_least(1), "rollout_schedule": at_least(0),
        "epoch_length": at_least(1), "model_hidden_sizes": at_least(1), "model_lr": above(0),
        "model_retain_epochs": at_least(1), "real_ratio": within(0, 1),
        "sgd_steps_per_env_step": at_least(0), "train_batch_size": at_least(1),
        "gamma": within(0, 1), "tau": within(0, 1, low_open=True),
        "ensemble_size": at_least(1), "elites": at_least(1),
        "model_weight_decay": at_least(0), "model_batch_size": at_least(1),
        "model_holdout_ratio": Range(0, 1, high_open=True), "model_patience": at_least(1),
        "model_max_epochs": at_least(1), "evaluation_interval": at_least(0),
        "evaluation_episodes": at_least(1)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.elites > self.ensemble_size:
            raise ConfigError(f"MBPO: elites ({self.elites}) cannot exceed ensemble_size "
                              f"({self.ensemble_size}): the elites are chosen among the "
                              f"members")
        schedule = tuple(self.rollout_schedule)
        if len(schedule) != 4:
            raise ConfigError(f"MBPO: rollout_schedule must be [min_epoch, max_epoch, "
                              f"min_length, max_length], got {list(schedule)}")
        if min(schedule[2:]) < 1:
            raise ConfigError(f"MBPO: rollout_schedule {list(schedule)} has a rollout length "
                              f"below 1: model rollouts take at least one step")
        if schedule[1] < schedule[0]:
            raise ConfigError(f"MBPO: rollout_schedule {list(schedule)}: max_epoch cannot be "
                              f"below min_epoch")
        if self.trajectory_sampling not in TRAJECTORY_SAMPLING:
            raise ConfigError(f"MBPO: trajectory_sampling {self.trajectory_sampling!r}: use "
                              f"{' or '.join(TRAJECTORY_SAMPLING)}")
        if self.num_learners > 1:
            raise ConfigError(f"MBPO keeps its buffers, its ensemble and SAC on one learner: "
                              f"num_learners {self.num_learners} must be 0 or 1")

    def discount(self) -> float:
        return self.gamma

    def target_updates(self) -> tuple[int, float]:
        return 1, self.tau  # a soft update after every SGD step

    def live_values(self) -> tuple[tuple[str, str], ...]:
        # The learned model's held-out one-step error: 1 is no better than predicting the mean
        # change, so a rise says the model rollouts mislead SAC.
        return (("model err", "model_error"),)

    def reports_eval_return(self) -> bool:
        return self.evaluation_interval > 0

    def trainer_spec(self) -> EnsembleTrainerSpec:
        return EnsembleTrainerSpec(
            learning_rate=self.model_lr, weight_decay=self.model_weight_decay,
            batch_size=self.model_batch_size, holdout_ratio=self.model_holdout_ratio,
            patience=self.model_patience, max_epochs=self.model_max_epochs)


def rollout_length(config: Config, env_steps: int) -> int:
    """k at ``env_steps``: ``rollout_schedule`` at epoch ``env_steps // epoch_length``."""
    min_epoch, max_epoch, min_length, max_length = config.rollout_schedule
    epoch = env_steps // config.epoch_length
    if epoch <= min_epoch:
        return int(min_length)
    progress = min((epoch - min_epoch) / max(max_epoch - min_epoch, 1e-9), 1.0)
    return int(min_length + progress * (max_length - min_length))


def model_buffer_capacity(config: Config, length: int) -> int:
    """The model buffer's rows for rollouts of ``length`` steps (MBPO's formula)."""
    retrains_per_epoch = max(1, math.ceil(config.epoch_length / config.model_train_freq))
    return config.rollout_batch_size * retrains_per_epoch * length * config.model_retain_epochs


def _refuse_space(action_space: gym.Space) -> None:
    if not isinstance(action_space, gym.spaces.Box):
        raise ConfigError(f"MBPO acts with SAC on continuous actions: it needs a Box action "
                          f"space, and this environment's is {action_space}")


def model_spec(observation_space: gym.Space, action_space: gym.Space, config: Config
               ) -> MBPOSpec:
    """SAC's model and the ensemble, which every rank builds."""
    _refuse_space(action_space)
    dynamics = dynamics_spec_for("MBPO", observation_space, action_space, config,
                                 hidden_sizes=config.model_hidden_sizes,
                                 activation=config.model_activation)
    return MBPOSpec(sac=sac_model_spec(observation_space, action_space, config),
                    dynamics=dynamics, trajectory_sampling=config.trajectory_sampling)


def check_config(config: Config, env: Any) -> None:
    _, action_space = env.spaces()
    _refuse_space(action_space)
    if not np.all(np.isfinite(action_space.low)) or not np.all(np.isfinite(action_space.high)):
        raise ConfigError("MBPO's actor squashes actions between the action space's bounds: "
                          "this environment's Box is unbounded")


class MBPOState(PlanState):
    """The driver's schedule: when the model was last fitted, the rollout length, the SAC
    steps taken since the first model rollouts, and the last model fit's and evaluation's
    values (repeated in every row)."""

    def __init__(self) -> None:
        self.trained_at: int | None = None
        self.sac_from: int | None = None
        self.sgd_steps_done = 0
        self.rollout_length = 0
        self.model_stats = dict.fromkeys(MODEL_STATS, math.nan)
        self.eval_return_mean = math.nan

    def get_state(self) -> dict[str, Any]:
        return {"trained_at": self.trained_at, "sac_from": self.sac_from,
                "sgd_steps_done": self.sgd_steps_done, "rollout_length": self.rollout_length,
                "model_stats": dict(self.model_stats),
                "eval_return_mean": self.eval_return_mean}

    def set_state(self, state: dict[str, Any]) -> None:
        self.trained_at, self.sac_from = state.get("trained_at"), state.get("sac_from")
        self.sgd_steps_done = state.get("sgd_steps_done", 0)
        self.rollout_length = state.get("rollout_length", 0)
        self.model_stats = dict(state.get("model_stats", self.model_stats))
        self.eval_return_mean = state.get("eval_return_mean", math.nan)


def setup(trainer: Trainer) -> MBPOState:
    return MBPOState()


def model_rollouts(trainer: Trainer, length: int) -> dict[str, int]:
    """The learner draws ``rollout_batch_size`` start states from its real buffer; each rollout
    rank rolls its share ``length`` steps through the ensemble and sends the transitions to the
    learner's model buffer. Returns the buffers' sizes. A rank lost meanwhile (survived,
    under ULFM) is left out: its share of the start states is not rolled out this time, and
    the next time the shares are those of the ranks left."""
    config, learner = trainer.config, trainer.learners[0]
    discard_lost_rollouts(trainer.learners, trainer.rollouts)
    starts = learner.call("start_states", config.rollout_batch_size)
    shares = np.array_split(starts, len(trainer.rollouts))
    futures = [(worker, worker.call_async("model_rollouts", share, length,
                                          replay_dest(worker, learner)))
               for worker, share in zip(trainer.rollouts, shares, strict=True)]
    sources, batches = [], []
    for worker, future in futures:
        try:
            answer = future.result()
        except RankLost:  # its model transitions are not waited for
            continue
        if "transitions" in answer:
            batches.append(answer["transitions"])
        else:
            sources.append(worker.rank)
    return learner.call("add_model", sources, batches, model_buffer_capacity(config, length))


def training_step(trainer: Trainer, state: MBPOState) -> dict[str, float]:
    """Sample real steps; every ``model_train_freq`` env steps (from ``initial_random_steps``
    on) fit the ensemble, broadcast it and roll the actor out through it; train SAC on real
    and model rows; broadcast; evaluate every ``evaluation_interval`` iterations."""
    config, learner = trainer.config, trainer.learners[0]
    random_actions = trainer.timesteps_total < config.initial_random_steps
    samples = transitions_to_learner(trainer.rollouts, trainer.learners,
                                     config.rollout_fragment_length,
                                     1.0 if random_actions else 0.0)
    trainer.count(samples)
    steps = trainer.timesteps_total
    sizes = None
    due = state.trained_at is None or steps - state.trained_at >= config.model_train_freq
    if steps >= config.initial_random_steps and due:
        state.model_stats = learner.call("train_model")
        state.trained_at = steps
        state.rollout_length = rollout_length(config, steps)
        broadcast_weights(trainer.learners, trainer.rollouts)
        sizes = model_rollouts(trainer, state.rollout_length)
        if state.sac_from is None:
            state.sac_from = steps
    owed = 0
    if state.sac_from is not None:
        owed = int(config.sgd_steps_per_env_step * (steps - state.sac_from)) \
            - state.sgd_steps_done
    sac_stats = learner.call("train_sac", max(owed, 0))
    state.sgd_steps_done += int(sac_stats["sgd_steps"])
    if sizes is None:
        sizes = learner.call("sizes")
    broadcast_weights(trainer.learners, trainer.rollouts)
    if config.evaluation_interval and (trainer.iteration + 1) % config.evaluation_interval == 0:
        played = evaluate_policy(trainer.rollouts, config.evaluation_episodes,
                                 deterministic=True)
        state.eval_return_mean = (float(np.mean(played.episode_returns))
                                  if played.episode_returns else math.nan)
    return {**state.model_stats, **{key: sac_stats[key] for key in SAC_STATS},
            "sgd_steps": sac_stats["sgd_steps"], "sgd_steps_total": float(state.sgd_steps_done),
            "rollout_length": float(state.rollout_length),
            "model_buffer_size": float(sizes["model_buffer_size"]),
            "real_buffer_size": float(sizes["real_buffer_size"]),
            "random_actions": float(random_actions), "eval_return_mean": state.eval_return_mean}
