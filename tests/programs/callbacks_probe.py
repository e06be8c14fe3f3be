"""Callbacks for tests/test_callbacks.py: they log which hook ran on which rank, set custom
metrics, or raise where CALLBACK_RAISE (a hook name) says."""

import json
import os
import sys

import mpirl


def _rank(obj) -> int:
    context = getattr(obj, "context", None)
    return context.rank if context is not None else 0


class Probe(mpirl.Callbacks):
    def _log(self, hook: str, rank: int, **extra) -> None:
        if os.environ.get("CALLBACK_RAISE") == hook:
            raise ValueError("boom")
        directory = os.environ.get("PROBE_DIR")
        if directory:
            with open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a") as file:
                file.write(json.dumps({"hook": hook, "rank": rank, **extra}) + "\n")

    def on_algorithm_init(self, *, algorithm):
        self._log("on_algorithm_init", 0)

    def on_episode_end(self, *, episode, worker):
        episode.custom_metrics["length_copy"] = episode.length
        self._log("on_episode_end", _rank(worker), worker_index=episode.worker_index)

    def on_sample_end(self, *, worker, batch, metrics):
        # Replay algorithms' steps go to replay: no batch.
        self._log("on_sample_end", _rank(worker), rows=0 if batch is None else len(batch["obs"]),
                  torch_loaded="torch" in sys.modules, actor=type(worker.policy).__name__)

    def on_learn_on_batch(self, *, learner, batch, result):
        # A model-based learner's result is its ensemble's training: epochs, not SGD steps.
        self._log("on_learn_on_batch", _rank(learner), sgd_steps=result.get("sgd_steps"),
                  epochs=result.get("epochs"))

    def on_train_result(self, *, algorithm, result):
        result["iteration_twice"] = 2 * result["iteration"]
        self._log("on_train_result", 0)

    def on_checkpoint(self, *, algorithm, checkpoint):
        self._log("on_checkpoint", 0, checkpoint=checkpoint,
                  exists=os.path.isdir(checkpoint))


class NotCallbacks:
    pass


class Boom(Probe):
    """Its constructor raises on the world rank CALLBACK_INIT_RAISE names (every rank if unset)."""

    def __init__(self):
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        if os.environ.get("CALLBACK_INIT_RAISE", rank) == rank:
            raise RuntimeError("no licence server")


class LateMetric(mpirl.Callbacks):
    """Reports custom metric ``late`` (1.0) from its rank's third sample call on: a column that
    progress.csv does not have in its first rows."""

    def __init__(self):
        self.samples = 0

    def on_episode_end(self, *, episode, worker):
        if self.samples >= 2:
            episode.custom_metrics["late"] = 1.0

    def on_sample_end(self, *, worker, batch, metrics):
        self.samples += 1
