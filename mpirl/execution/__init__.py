"""Operators and the Algorithm loop: the dataflow that algorithms' plans are written in. Runs on
the driver (rank 0) and calls workers.

The names below are the stable public API for writing an algorithm of your own (``mpirl train
--algo my_package.my_algo``): a module that defines ``Config`` (a dataclass subclassing one of
the config bases), ``loss(policy, batch, config) -> (loss, stats)`` and ``training_step(algo)
-> stats``, where ``algo`` is the ``Algorithm`` of the run. Everything else in mpirl may change.
"""

from mpirl.config.fields import (
    AllreduceConfig,
    CommonConfig,
    OfflineConfig,
    OnPolicyConfig,
    QLearningConfig,
    ReplayConfig,
)
from mpirl.execution.algorithm import Algorithm
from mpirl.execution.async_ops import (
    async_apply_gradients,
    async_sample,
    gradient_requests,
    sample_requests,
    sync_weights,
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

__all__ = [
    # Config bases: a plug-in's Config subclasses one (and AllreduceConfig for an allreduce).
    "AllreduceConfig", "CommonConfig", "OfflineConfig", "OnPolicyConfig", "QLearningConfig",
    "ReplayConfig",
    # The run's driver-side state that training_step receives.
    "Algorithm",
    # Synchronous operators.
    "SampleResult", "broadcast_weights", "evaluate_policy", "mean_stats", "parallel_rollouts",
    "sample_with_new_weights", "store_to_replay", "train_from_replay", "train_on_dataset",
    "train_one_step",
    # Asynchronous operators (IMPALA, A3C).
    "async_apply_gradients", "async_sample", "gradient_requests", "sample_requests",
    "sync_weights",
]
