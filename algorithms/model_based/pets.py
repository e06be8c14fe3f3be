"""PETS: probabilistic ensembles with trajectory sampling (Chua et al. 2018), for continuous
actions.

The learner (in the driver's process with ``num_learners`` 0, or learner ranks) keeps the real
transitions and, every iteration, fits the dynamics ensemble to all of them
(``EnsembleTrainer``: bootstraps, early stopping on held-out transitions, elites); its held-out
one-step error is the ``model_error`` column (the elites' mean squared error in normalized
units: 1 is no better than predicting the mean change). Learner 0 then broadcasts the whole
ensemble (parameters, normalizers, elites) to the rollout ranks. With several learner ranks
each trains its own block of the members on the same transitions (learner 0 broadcasts them to
the others), and learner 0 gathers the blocks (``DynamicsLearner``).

Each rollout rank (``RealStepWorker``) steps its own real envs, planning every action with CEM
over the ensemble: ``cem_iterations`` rounds of ``cem_population`` action sequences of
``planning_horizon`` steps, each scored by ``particles`` TS-inf particles through the elites,
batched over envs x candidates x particles in one ``predict`` per horizon step (``planner``);
``planner`` "mppi" plans with MPPI over the same particles. The first ``initial_random_steps``
env steps take uniformly random actions, to seed the data. The reward is learned with the
dynamics.

A member whose loss becomes NaN, or transitions that are not finite, stop the run with one line
naming the training iteration (exit 2; the last checkpoint stays the newest).

Every ``evaluation_interval`` iterations the rollout ranks play ``evaluation_episodes`` with the
CEM mean's first action (``eval_return_mean``); the episodes in progress are abandoned. The
evaluation's episodes count with the sampling's (``episodes_total``, ``episode_return_mean``),
their env steps apart (``evaluation_env_steps_total``), and the live line says when one starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from mpirl.algorithms.model_based.dynamics_spec import EnsembleTrainerSpec, dynamics_spec_for
from mpirl.algorithms.model_based.operators import on_every_learner, transitions_to_learner
from mpirl.algorithms.model_based.pets_learner import DynamicsLearner
from mpirl.algorithms.model_based.planner import PLANNERS, PETSSpec
from mpirl.algorithms.model_based.rollout_workers import RealStepWorker

from mpirl.config.fields import CommonConfig, Range, above, at_least, within
from mpirl.errors import ConfigError
from mpirl.execution.contract import PlanState
from mpirl.execution.operators import broadcast_weights, evaluate_policy
from mpirl.execution.trainer import Trainer

ROLLOUT_WORKER = RealStepWorker
LEARNER = DynamicsLearner
RECURRENT = False  # it learns from single transitions
loss = None  # the learner fits the ensemble with its own trainer


@dataclass
class Config(CommonConfig):
    """PETS's settings. Defaults suit Pendulum-v1 on a CPU; every field is a ``--config`` key."""

    # Sampling
    num_envs_per_worker: int = 5
    """Real environments each rollout rank steps together (and plans for in one batch)."""
    rollout_fragment_length: int = 20
    """Steps per environment per iteration: the ensemble is retrained after every
    ``rollout_fragment_length x num_envs_per_worker x`` rollout ranks real steps."""
    initial_random_steps: int = 200
    """Env steps of uniformly random actions before planning starts (whole iterations: all
    iterations that start below this many steps)."""
    buffer_size: int = 100_000
    """Real transitions kept for training the ensemble (the newest)."""

    # Planning (CEM or MPPI, with TS-inf)
    planning_horizon: int = 30
    """Steps each candidate action sequence looks ahead (PETS: 15-30). Pendulum needs 30: with
    the true dynamics and the other defaults, 15 never swung up from near the bottom (mean
    -619 over 10 starts) where 30 did (-181)."""
    cem_population: int = 200
    """Candidate action sequences per CEM round and env (PETS: popsize 400-500)."""
    cem_elites: int = 20
    """Best candidates that refit CEM's Gaussian each round (PETS: num_elites 40-50)."""
    cem_iterations: int = 5
    """CEM rounds per action (PETS: max_iters 5)."""
    cem_alpha: float = 0.1
    """Smoothing of CEM's mean and variance: new = alpha x old + (1 - alpha) x elites' (PETS:
    0.1)."""
    particles: int = 2
    """TS-inf particles per candidate: each follows one elite member for the whole horizon
    (PETS: npart 20). Here 5 envs plan in 0.13 s a step with 2, 0.4 s with 3."""
    planner: str = "cem"
    """How actions are planned over the ensemble: "cem" (the cem_* keys) or "mppi" (the mppi_*
    keys); both score candidates with the same TS-inf particles over planning_horizon."""
    mppi_population: int = 200
    """MPPI's perturbed action sequences per round and env (the first is the mean itself)."""
    mppi_iterations: int = 3
    """MPPI's rounds per action: each reweights a fresh population around the last mean."""
    mppi_temperature: float = 1.0
    """MPPI's lambda, in units of the predicted return over the horizon: candidates are weighted
    by exp((return - best return) / lambda); smaller follows the best candidates more
    greedily. On Pendulum (seed 0, 2,000 steps) 1 reached -130, 10 -146."""
    mppi_noise_std: float = 0.5
    """Standard deviation of MPPI's perturbations, as a fraction of half the action range."""

    # The dynamics ensemble
    ensemble_size: int = 5
    """Probabilistic members of the ensemble (PETS: 5)."""
    elites: int = 5
    """Members the planner samples from: those with the lowest held-out error."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden widths of every member (PETS: 3-4 x 200). Planning runs the ensemble
    horizon x CEM rounds times per action on a rollout rank's CPU: 2 x 64 plans 5 envs about
    6x faster than 2 x 200 here, and models Pendulum well enough."""
    activation: str = "silu"
    """The members' activation: silu (PETS's swish), relu, tanh or elu."""
    termination_fn: str = ""
    """Your termination function as "module:function", fn(obs, action, next_obs) -> bool
    array [N] on NumPy batches; planned particles stop collecting reward after it says True.
    "": model transitions never terminate."""
    learn_termination: bool = False
    """Learn when model transitions terminate: a classifier head on every member, trained on
    the real steps' terminations, weighted to balance the steps that go on (terminated steps
    are kept for it, their unknown next state left out of the dynamics loss; its held-out
    cross-entropy joins early stopping). Exclusive with termination_fn; neither: model
    transitions never terminate."""
    lr: float = 1e-3
    """Adam learning rate of the ensemble."""
    model_weight_decay: float = 5e-5
    """L2 penalty on the members' weights."""
    model_batch_size: int = 64
    """Transitions per member in one minibatch of the ensemble's training."""
    model_holdout_ratio: float = 0.2
    """Share of the transitions held out for early stopping, the elites and model_error."""
    model_patience: int = 5
    """Epochs without improvement of any member's held-out error that stop its training."""
    model_max_epochs: int = 50
    """At most this many epochs per iteration."""

    # Evaluation
    evaluation_interval: int = 0
    """Every this many iterations, play evaluation_episodes with the plan's mean action
    (eval_return_mean); 0 never."""
    evaluation_episodes: int = 10
    """Episodes of each evaluation, over all rollout ranks."""

    ranges: ClassVar[dict[str, Range]] = {
        "rollout_fragment_length": at_least(1), "initial_random_steps": at_least(0),
        "buffer_size": at_least(2), "planning_horizon": at_least(1),
        "cem_population": at_least(1), "cem_elites": at_least(1), "cem_iterations": at_least(1),
        "cem_alpha": within(0, 1, ), "particles": at_least(1), "ensemble_size": at_least(1),
        "mppi_population": at_least(1), "mppi_iterations": at_least(1),
        "mppi_temperature": above(0), "mppi_noise_std": above(0),
        "elites": at_least(1), "model_weight_decay": at_least(0),
        "model_batch_size": at_least(1), "model_holdout_ratio": Range(0, 1, high_open=True),
        "model_patience": at_least(1), "model_max_epochs": at_least(1),
        "evaluation_interval": at_least(0), "evaluation_episodes": at_least(1)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.elites > self.ensemble_size:
            raise ConfigError(f"PETS: elites ({self.elites}) cannot exceed ensemble_size "
                              f"({self.ensemble_size}): the elites are chosen among the "
                              f"members")
        if self.planner not in PLANNERS:
            raise ConfigError(f"PETS: planner {self.planner!r}: use one of "
                              f"{', '.join(repr(p) for p in PLANNERS)}")
        if self.cem_elites > self.cem_population:
            raise ConfigError(f"PETS: cem_elites ({self.cem_elites}) cannot exceed "
                              f"cem_population ({self.cem_population})")
        if self.num_learners > self.ensemble_size:
            raise ConfigError(f"PETS trains at least one ensemble member per learner rank: "
                              f"num_learners ({self.num_learners}) cannot exceed ensemble_size "
                              f"({self.ensemble_size})")

    def live_values(self) -> tuple[tuple[str, str], ...]:
        # The learned model's held-out one-step error: 1 is no better than predicting the mean
        # change, so a rise says the planner is misled.
        return (("model err", "model_error"),)

    def reports_eval_return(self) -> bool:
        return self.evaluation_interval > 0

    def trainer_spec(self) -> EnsembleTrainerSpec:
        return EnsembleTrainerSpec(
            learning_rate=self.lr, weight_decay=self.model_weight_decay,
            batch_size=self.model_batch_size, holdout_ratio=self.model_holdout_ratio,
            patience=self.model_patience, max_epochs=self.model_max_epochs)


def _refuse_space(action_space: gym.Space) -> None:
    if not isinstance(action_space, gym.spaces.Box):
        raise ConfigError(f"PETS plans continuous actions: it needs a Box action space, and "
                          f"this environment's is {action_space}")


def model_spec(observation_space: gym.Space, action_space: gym.Space, config: Config
               ) -> PETSSpec:
    """The ensemble every rank builds, and CEM's settings."""
    _refuse_space(action_space)
    dynamics = dynamics_spec_for("PETS", observation_space, action_space, config,
                                 hidden_sizes=config.hidden_sizes, activation=config.activation)
    return PETSSpec(dynamics=dynamics,
                    action_low=tuple(float(v) for v in np.ravel(action_space.low)),
                    action_high=tuple(float(v) for v in np.ravel(action_space.high)),
                    planning_horizon=config.planning_horizon,
                    cem_population=config.cem_population, cem_elites=config.cem_elites,
                    cem_iterations=config.cem_iterations, cem_alpha=config.cem_alpha,
                    particles=config.particles, planner=config.planner,
                    mppi_population=config.mppi_population,
                    mppi_iterations=config.mppi_iterations,
                    mppi_temperature=config.mppi_temperature,
                    mppi_noise_std=config.mppi_noise_std)


def check_config(config: Config, env: Any) -> None:
    _, action_space = env.spaces()
    _refuse_space(action_space)
    if not np.all(np.isfinite(action_space.low)) or not np.all(np.isfinite(action_space.high)):
        raise ConfigError("PETS samples actions between the action space's bounds: this "
                          "environment's Box is unbounded")


class PETSState(PlanState):
    """The latest evaluation's mean return."""

    def __init__(self) -> None:
        self.eval_return_mean = math.nan

    def get_state(self) -> dict[str, Any]:
        return {"eval_return_mean": self.eval_return_mean}

    def set_state(self, state: dict[str, Any]) -> None:
        self.eval_return_mean = state.get("eval_return_mean", math.nan)


def setup(trainer: Trainer) -> PETSState:
    return PETSState()


def training_step(trainer: Trainer, state: PETSState) -> dict[str, float]:
    """Sample (random actions until ``initial_random_steps``, planned ones after), fit the
    ensemble to every real transition (each learner rank its members), broadcast it from
    learner 0; evaluate every ``evaluation_interval``."""
    config = trainer.config
    random_actions = trainer.timesteps_total < config.initial_random_steps
    samples = transitions_to_learner(trainer.rollouts, trainer.learners,
                                     config.rollout_fragment_length,
                                     1.0 if random_actions else 0.0)
    trainer.count(samples)
    stats = on_every_learner(trainer.learners, "train")
    broadcast_weights(trainer.learners, trainer.rollouts)
    if config.evaluation_interval and (trainer.iteration + 1) % config.evaluation_interval == 0:
        # Every step of every episode is planned: on a busy CPU this takes minutes, which the
        # user should not spend looking at a line that does not move.
        trainer.note(f"iter {trainer.iteration + 1}: evaluating {config.evaluation_episodes} "
                     f"episodes, every step planned, on {len(trainer.rollouts)} rollout "
                     f"rank{'s' if len(trainer.rollouts) != 1 else ''} ...")
        played = evaluate_policy(trainer.rollouts, config.evaluation_episodes,
                                 deterministic=True)
        state.eval_return_mean = (float(np.mean(played.episode_returns))
                                  if played.episode_returns else math.nan)
        # The evaluation's episodes are real ones, and often the only ones that end: it
        # abandons the sampling's episodes in progress, so with evaluation_interval x
        # rollout_fragment_length below an episode's length no other ever does. They count
        # with the episodes (the return, episodes_total); their steps apart, as offline plans
        # count theirs.
        trainer.evaluation_env_steps_total += played.env_steps
        played.env_steps = 0
        trainer.count(played)
    return {**stats, "random_actions": float(random_actions),
            "eval_return_mean": state.eval_return_mean,
            "evaluation_env_steps_total": float(trainer.evaluation_env_steps_total)}
