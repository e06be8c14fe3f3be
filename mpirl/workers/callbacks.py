"""Callbacks: user code that runs at fixed points of a run, on the rank where the data is.

Subclass ``Callbacks`` and name it in the config (``{"callbacks": "my_module:MyCallbacks"}``, or
``callbacks=MyCallbacks`` in ``mpirl.train``). Every rank that runs a hook makes its own instance,
so the module must be importable on every rank, and an instance's attributes are local to its
rank: what crosses ranks is only an episode's ``custom_metrics`` (floats), averaged into the
progress row as ``custom/<name>_mean``.

A hook that raises ends the run with one line naming the hook and the rank, and the run's exit
code 1; a constructor that raises, with one line naming the class and the rank, and exit code 2.
Neither hangs the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpirl.config.imports import load_object
from mpirl.errors import CallbackError, ConfigError

__all__ = ["Episode", "invoke", "make_callbacks"]


@dataclass
class Episode:
    """An episode that just ended on a rollout rank, as ``on_episode_end`` sees it."""

    total_reward: float
    length: int
    #: The rollout worker's index (0 .. num_rollout_workers - 1).
    worker_index: int
    #: Which of the worker's environments played it.
    env_index: int
    #: Floats set here are averaged over the episodes of the metrics window (like
    #: ``episode_return_mean``) and reported as ``custom/<name>_mean``.
    custom_metrics: dict[str, float] = field(default_factory=dict)
    #: A multi-agent run's episode of one agent: its id and its policy's (None otherwise).
    agent_id: str | None = None
    policy_id: str | None = None


class Callbacks:
    """Hooks, each a no-op here. Override the ones you need; every argument is a keyword.

    | hook | runs on |
    | --- | --- |
    | ``on_algorithm_init(algorithm)`` | the driver (rank 0), once the workers are up |
    | ``on_episode_end(episode, worker)`` | each rollout rank, for each completed training episode |
    | ``on_sample_end(worker, batch, metrics)`` | each rollout rank, after each sample call |
    | ``on_learn_on_batch(learner, batch, result)`` | each learner rank, after each training call |
    | ``on_train_result(algorithm, result)`` | the driver, after each iteration |
    | ``on_checkpoint(algorithm, checkpoint)`` | the driver, after each checkpoint is written |

    In local mode every hook runs in the one process. Offline algorithms (BC, MARWIL) sample
    only to evaluate: their rollout hooks see evaluation episodes' ends not at all, and
    ``on_sample_end`` is not called; ``on_learn_on_batch`` sees each training call's last
    minibatch. Replay algorithms call ``on_sample_end`` with ``batch`` None (their steps go to
    replay shards) and ``on_learn_on_batch`` with the last replay minibatch.
    """

    def on_algorithm_init(self, *, algorithm: Any) -> None:
        """The run is set up: ``algorithm`` is its driver side (the ``Trainer``: config, worker
        groups)."""

    def on_episode_end(self, *, episode: Episode, worker: Any) -> None:
        """A training episode ended on ``worker`` (a RolloutWorker); set
        ``episode.custom_metrics[name] = value`` to report a metric."""

    def on_sample_end(self, *, worker: Any, batch: dict[str, Any] | None,
                      metrics: dict[str, Any]) -> None:
        """``worker`` sampled ``batch`` (NumPy arrays, one row per step; None for replay
        algorithms) and reports ``metrics`` (env steps, episode returns) to the driver."""

    def on_learn_on_batch(self, *, learner: Any, batch: dict[str, Any],
                          result: dict[str, Any]) -> None:
        """``learner`` trained on ``batch`` (a dict of arrays or tensors); ``result`` holds its
        statistics for this call, before they are averaged over learners."""

    def on_train_result(self, *, algorithm: Any, result: dict[str, Any]) -> None:
        """An iteration ended with ``result``, the progress row; keys added to it go to
        progress.csv (a key first added later gets a column from then on), result.json and
        TensorBoard."""

    def on_checkpoint(self, *, algorithm: Any, checkpoint: str) -> None:
        """A checkpoint of the whole run was written to the directory ``checkpoint``."""


def callbacks_class(spec: str) -> type[Callbacks]:
    """The class ``spec`` ("module:Class") names; ConfigError saying what is wrong if none."""
    cls = load_object(spec, "callbacks", "module:Class")
    if not (isinstance(cls, type) and issubclass(cls, Callbacks)):
        raise ConfigError(f"callbacks {spec!r}: {spec.partition(':')[2]} is not a subclass of "
                          f"mpirl.Callbacks")
    return cls


def make_callbacks(spec: str) -> Callbacks | None:
    """An instance of the class ``spec`` names, for this rank; None when ``spec`` is empty. A
    constructor that raises is the user's to fix: a ConfigError saying so (on a worker rank the
    driver reports it naming the rank, see ``mpirl.execution.trainer.spawn_error``)."""
    if not spec:
        return None
    cls = callbacks_class(spec)
    try:
        return cls()
    except Exception as error:  # noqa: BLE001 - any user error, reported by name
        raise ConfigError(
            f"callbacks {spec!r}: {cls.__name__}() raised {type(error).__name__}: {error}. "
            f"mpirl calls {cls.__name__}() with no arguments on every rank that runs a hook "
            f"(the driver, rollout and learner ranks): make its __init__ succeed there"
        ) from None


def invoke(callbacks: Callbacks | None, hook: str, where: str, **kwargs: Any) -> None:
    """Run ``callbacks.<hook>(**kwargs)``; an exception becomes a CallbackError naming the hook
    and ``where`` it ran, which the driver reports as one line."""
    if callbacks is None:
        return
    try:
        getattr(callbacks, hook)(**kwargs)
    except Exception as error:  # noqa: BLE001 - any user error, reported by name
        raise CallbackError(f"callbacks: {type(callbacks).__name__}.{hook} raised "
                            f"{type(error).__name__}: {error} ({where})") from None
