"""Operators, the contract and the Trainer: the dataflow that algorithms' plans are written in.
Runs on the driver (rank 0) and calls workers.

The names below are the stable public API for writing an algorithm of your own (``mpirl train
--algo my_package.my_algo``): a module that defines every piece of ``AlgorithmModule``
(``Config``, ``loss``, ``ROLLOUT_WORKER``, ``LEARNER``, ``RECURRENT``, ``model_spec``,
``check_config``, ``setup(trainer) -> PlanState`` and ``training_step(trainer, state) ->
stats``), where ``trainer`` is the run's ``Trainer`` and ``state`` what ``setup`` returned.
The defaults a module may assign (``RolloutWorker``, ``Learner``, ``actor_critic_model``,
``no_config_checks``, ``stateless``) are here too. Everything else in mpirl may change.
"""

from mpirl.config.fields import (
    AllreduceConfig,
    CommonConfig,
    OfflineConfig,
    OnPolicyConfig,
    QLearningConfig,
    ReplayConfig,
)
from mpirl.execution.async_ops import (
    GradientRequests,
    SampleRequests,
    async_apply_gradients,
    async_sample,
    sync_weights,
)
from mpirl.execution.contract import (
    WEIGHTS_KEY,
    AlgorithmModule,
    LearnerClass,
    LearnerSettingsClass,
    PlanState,
    PolicyLearnerSettings,
    PolicyRolloutWorkerClass,
    RolloutSettingsClass,
    RolloutWorkerClass,
    no_config_checks,
    stateless,
)
from mpirl.execution.operators import (
    SampleResult,
    broadcast_weights,
    evaluate_policy,
    mean_stats,
    parallel_rollouts,
    sample_with_new_weights,
    store_to_replay,
    train_from_replay,
    train_on_dataset,
    train_one_step,
)
from mpirl.execution.trainer import Trainer
from mpirl.models.policy import actor_critic_model
from mpirl.workers.learner import Learner, LearnerSettings, StatefulLoss
from mpirl.workers.rollout import RolloutSettings, RolloutWorker

__all__ = [
    # The contract: what an algorithm module defines, and what its plan keeps.
    "AlgorithmModule", "PlanState",
    # What mpirl asks of a module's workers and their settings, and the key of a learner's
    # checkpoint that holds its weights.
    "RolloutWorkerClass", "PolicyRolloutWorkerClass", "RolloutSettingsClass", "LearnerClass",
    "LearnerSettingsClass", "PolicyLearnerSettings", "WEIGHTS_KEY",
    # Defaults a module may assign: ROLLOUT_WORKER, LEARNER, model_spec, check_config, setup.
    "RolloutWorker", "Learner", "actor_critic_model", "no_config_checks", "stateless",
    # The settings those workers are built from (a worker class of your own subclasses them).
    "RolloutSettings", "LearnerSettings",
    # A loss with state of its own (a plain loss function needs none of its hooks).
    "StatefulLoss",
    # Config bases: a plug-in's Config subclasses one (and AllreduceConfig for an allreduce).
    "AllreduceConfig", "CommonConfig", "OfflineConfig", "OnPolicyConfig", "QLearningConfig",
    "ReplayConfig",
    # The run's driver side that setup and training_step receive.
    "Trainer",
    # Synchronous operators.
    "SampleResult", "broadcast_weights", "evaluate_policy", "mean_stats", "parallel_rollouts",
    "sample_with_new_weights", "store_to_replay", "train_from_replay", "train_on_dataset",
    "train_one_step",
    # Asynchronous plan states and operators (IMPALA, A3C).
    "GradientRequests", "SampleRequests", "async_apply_gradients", "async_sample",
    "sync_weights",
]
