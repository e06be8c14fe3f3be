"""The Python API: a whole training run in one call (``mpirl.train``), or one driven step by step
from a script (``mpirl.Algorithm``), as RLlib's ``algo.train()`` and SB3's ``model.learn()``.

Every rank runs the same script (``mpiexec -n N python script.py``, or plain ``python script.py``
for local mode). Rank 0 drives; the other ranks serve their workers inside these calls. Both write
the same run directory as ``mpirl train``: params.json, progress.csv, result.json, TensorBoard
events and checkpoints/.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpirl.errors import EXIT_FAILURE, EXIT_OK, ConfigError, MpirlError
from mpirl.jobs.checkpoint import CheckpointStore, verify
from mpirl.jobs.run_dir import RunLock, RunRecorder
from mpirl.runtime.driver import Driver, prepared_on_rank0, run
from mpirl.runtime.world import running_on

# The request's checks and the trainer import torch: rank 0 alone imports them (in
# prepared_on_rank0), as `mpirl train` does, so a rollout rank of a script acts in NumPy
# without torch (README: memory of a rollout rank).
if TYPE_CHECKING:
    from mpirl.commands.train import TrainRequest
    from mpirl.execution.trainer import Trainer


class RunFailed(MpirlError):
    """A run started through the Python API ended with a non-zero exit code."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"the run ended with exit code {exit_code}; rank 0 printed why")
        self.exit_code = exit_code

    def __reduce__(self):
        return (RunFailed, (self.exit_code,))


def _one_line_excepthook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    """An ``MpirlError`` that ends a script (an unknown config key, a run directory that holds
    a run) reads as one line, as it does from ``mpirl train``: the script's line that called
    mpirl, the error's class and its message, instead of a traceback through mpirl's insides.
    Every rank raises a ``ConfigError`` or ``RunFailed`` together, and rank 0 alone says it.
    The process then exits with the error's exit code (2 for bad input, 75 for a run that a
    signal stopped after its checkpoint: a job script can requeue on it), as ``mpirl.cli.entry``
    ends: exit handlers, MPI finalized, then no interpreter teardown."""
    if not isinstance(error, MpirlError) or _PREVIOUS_EXCEPTHOOK is not sys.__excepthook__:
        # Not mpirl's, or a hook of the user's own (IPython, a logger) decides.
        _PREVIOUS_EXCEPTHOOK(kind, error, trace)
        return
    if not isinstance(error, (ConfigError, RunFailed)) or MPI.COMM_WORLD.Get_rank() == 0:
        frames = [frame for frame in traceback.extract_tb(trace)
                  if not Path(frame.filename).resolve().is_relative_to(_PACKAGE)]
        where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
        print(f"{where}mpirl.{kind.__name__}: {error}", file=sys.stderr, flush=True)
    atexit._run_exitfuncs()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    os._exit(error.exit_code)


_PACKAGE = Path(__file__).resolve().parent
_PREVIOUS_EXCEPTHOOK = sys.excepthook
sys.excepthook = _one_line_excepthook


def _request(algo: str, env: str, config: dict[str, Any] | None, stop: dict[str, Any] | None,
             seed: int | None, run_dir: str | Path | None, callbacks: Any,
             env_module: str | None, resume: str | Path | None, progress: str | None
             ) -> TrainRequest:
    from mpirl.commands.train import make_request

    config = dict(config or {})
    if callbacks is not None:
        # A class travels as its import path: every rank imports it by name.
        config["callbacks"] = (callbacks if isinstance(callbacks, str)
                               else f"{callbacks.__module__}:{callbacks.__qualname__}")
    return make_request(algo, env, env_module, config, dict(stop or {}), seed,
                        None if run_dir is None else str(run_dir),
                        None if resume is None else str(resume), progress)


def train(algo: str, env: str, config: dict[str, Any] | None = None,
          stop: dict[str, Any] | None = None, seed: int | None = None,
          run_dir: str | Path | None = None, callbacks: Any = None, *,
          env_module: str | None = None, resume: str | Path | None = None,
          progress: str | None = None, comm: MPI.Comm | None = None) -> dict[str, Any] | None:
    """Train ``algo`` on ``env`` until a ``stop`` criterion is met; call it on every rank.

    ``algo`` is a built-in name (PPO) or the module of your own algorithm; ``config`` holds the
    same keys as ``--config``; ``stop`` the same criteria as ``--stop`` (default: 1,000,000 env
    steps); ``callbacks`` a ``mpirl.Callbacks`` subclass or ``"module:Class"``; ``resume`` a run
    directory to continue. Returns the last row (what result.json holds) on rank 0 and None on
    every other rank. Raises ``ConfigError`` on every rank for bad input, before anything
    starts, and ``RunFailed`` on every rank if the run fails or a stop signal ends it early (its
    ``exit_code`` is 75 then, 130 after Ctrl-C: resume it with ``resume=run_dir``). ``comm`` is
    the run's world (default: COMM_WORLD): call it on every rank of ``comm``, whose rank 0 drives
    and returns the row.
    """
    requests: list[TrainRequest] = []

    def prepare() -> tuple[Callable[[Driver], int], Any, Any]:
        from mpirl.commands.train import prepared

        requests.append(_request(algo, env, config, stop, seed, run_dir, callbacks, env_module,
                                 resume, progress))
        return prepared(requests[0])

    with running_on(comm):
        main, layout, settings = prepared_on_rank0(prepare)  # ConfigError on every rank
        code = run(main or _never_called, layout, settings, stop_signals_enabled=True)
    if code != EXIT_OK:
        raise RunFailed(code)
    return requests[0].final_row if requests else None


class Algorithm:
    """A run driven step by step from a script: ``build``, then ``train()`` one iteration at a
    time, ``save()``, ``restore()``, ``compute_actions()``, and ``stop()`` at the end.

    Only rank 0 gets an ``Algorithm``: on every other rank ``build`` serves the driver's calls
    until rank 0 stops the run, then ends the process with the run's exit code, so the rest of
    the script runs on rank 0 alone. The driver itself runs in a thread of rank 0's process that
    makes every MPI call; stop signals end the process (use ``mpirl.train`` or ``mpirl train``
    for checkpoint-on-signal).
    """

    def __init__(self, request: TrainRequest, comm: MPI.Comm | None = None) -> None:
        # Use Algorithm.build: it also serves the workers on the other ranks.
        self.request = request
        self._comm = comm
        self._calls: queue.Queue = queue.Queue()
        self._answers: queue.Queue = queue.Queue()
        self._exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="mpirl-driver", daemon=True)
        self._policies: dict[str, Any] = {}  # policy id ("" for a single-agent run) -> model
        self._thread.start()
        ready = self._answer()
        if isinstance(ready, BaseException):
            self._thread.join()
            raise ready
        atexit.register(self.stop)  # a script that forgets stop() still ends its workers

    @classmethod
    def build(cls, algo: str, env: str, config: dict[str, Any] | None = None,
              seed: int | None = None, run_dir: str | Path | None = None, callbacks: Any = None,
              *, env_module: str | None = None, resume: str | Path | None = None,
              comm: MPI.Comm | None = None) -> Algorithm:
        """Start a run (or continue ``resume``, a run directory) on every rank (of ``comm``,
        the run's world: default COMM_WORLD); see the class docstring for what happens on ranks
        other than 0."""
        def prepare() -> tuple[TrainRequest, Any, Any]:
            request = _request(algo, env, config, None, seed, run_dir, callbacks, env_module,
                               resume, "off")
            return request, request.layout, request.settings

        with running_on(comm) as world:
            request, layout, settings = prepared_on_rank0(prepare)  # rank 0's request
        # Out of the block first: the run (in the driver thread on rank 0) sets the run's
        # communicator for as long as it lasts, and no other block may put it back meanwhile.
        if request is not None:
            return cls(request, world)
        # A worker rank: serve until the driver ends the run, then end with it.
        raise SystemExit(run(_never_called, layout, settings, comm=world))

    # What runs in the driver thread.

    def _run(self) -> None:
        try:
            self._exit_code = run(self._serve, self.request.layout, self.request.settings,
                                  comm=self._comm)
        except BaseException as error:  # noqa: BLE001 (the caller raises it)
            self._exit_code = getattr(error, "exit_code", EXIT_FAILURE)
            self._answers.put(error)

    def _serve(self, driver: Driver) -> int:
        from mpirl.commands.train import open_recorder, restore_newest, run_params

        request = self.request
        try:
            lock = RunLock(request.run_dir)
            lock.acquire()
        except BaseException as error:  # noqa: BLE001 (the caller raises it)
            self._answers.put(error)
            return getattr(error, "exit_code", EXIT_FAILURE)
        try:
            try:
                trainer = request.build_trainer(driver)
                store = CheckpointStore(request.run_dir, request.checkpoints.keep_checkpoints)
                resumed = restore_newest(trainer, store, request) if request.resume else None
                recorder = open_recorder(request, run_params(request, driver, trainer),
                                         resumed is not None, trainer)
            except BaseException as error:  # noqa: BLE001 (the caller raises it)
                self._answers.put(error)
                return getattr(error, "exit_code", EXIT_FAILURE)
            self._answers.put(None)
            with recorder:
                while (call := self._calls.get()) is not None:
                    try:
                        self._answers.put((True, call(trainer, store, recorder)))
                    except BaseException as error:  # noqa: BLE001 (the caller raises it)
                        self._answers.put((False, error))
                trainer.finish_dumps()
        finally:
            lock.release()
        return EXIT_OK

    def _call(self, fn: Callable[[Trainer, CheckpointStore, RunRecorder], Any]) -> Any:
        if self._exit_code is not None or not self._thread.is_alive():
            raise MpirlError("this Algorithm has been stopped; build a new one")
        self._calls.put(fn)
        ok, value = self._answer()
        if not ok:
            raise value
        return value

    def _answer(self) -> Any:
        # The driver thread ends early only if the run fails (a lost rank, say): never wait
        # for an answer that cannot come.
        while True:
            try:
                return self._answers.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._answers.empty():
                    raise RunFailed(self._exit_code or EXIT_FAILURE) from None

    # The user's side.

    @property
    def run_dir(self) -> Path:
        return self.request.run_dir

    def train(self) -> dict[str, Any]:
        """Run one iteration; return its row, which also goes to progress.csv and TensorBoard."""
        def step(trainer: Trainer, store: CheckpointStore, recorder: RunRecorder) -> dict:
            row = trainer.train()
            recorder.record(row, trainer.histograms)
            return row

        return self._call(step)

    def save(self) -> Path:
        """Write a checkpoint into the run directory's checkpoints/; return its path."""
        replay = self.request.checkpoints.checkpoint_replay

        def save(trainer: Trainer, store: CheckpointStore, recorder: RunRecorder) -> Path:
            recorder.sync()  # the rows a resume from this checkpoint keeps are on disk
            return trainer.save_checkpoint(store, replay)

        return self._call(save)

    def restore(self, checkpoint: str | Path | None = None) -> Path:
        """Load ``checkpoint`` (a checkpoint directory; default: the run's newest valid one)
        into the driver and every worker; return its path."""
        def load(trainer: Trainer, store: CheckpointStore, _: RunRecorder) -> Path:
            if checkpoint is None:
                found = store.newest_valid()
                if found is None:
                    raise MpirlError(f"{self.run_dir} has no checkpoint to restore")
                path, manifest = found
            else:
                path, manifest = Path(checkpoint), verify(checkpoint)
            trainer.restore(path, manifest)
            return path

        return self._call(load)

    def compute_actions(self, observations: Any, explore: bool = False,
                        policy_id: str | None = None) -> np.ndarray:
        """Actions of learner 0's current policy for a batch of observations (one per row), as
        the environment takes them; ``explore`` samples instead of taking the most likely. In a
        multi-agent run, ``policy_id`` says whose (it may be left out when there is one policy);
        a frozen policy's weights come from rollout worker 0."""
        from mpirl.execution.multiagent import MultiAgentTrainer
        from mpirl.models.torch_model import build_torch_model

        def act(trainer: Trainer, *_: Any) -> np.ndarray:
            trainer.settle()  # a learner in a call that spans iterations takes no other
            if isinstance(trainer, MultiAgentTrainer):
                try:
                    plan = trainer.setup.policy(policy_id)
                except ConfigError as error:
                    raise MpirlError(f"{error}; give policy_id") from None
                if plan.scripted:
                    raise MpirlError(f"policy {plan.policy_id!r} is scripted "
                                     f"({plan.policy_class}); call its compute_actions yourself")
                policy_trainer = trainer.trainers.get(plan.policy_id)
                spec = plan.model
                obs_filter = None if policy_trainer is None else policy_trainer.obs_filter
                weights = (policy_trainer.learners[0].call_async("get_weights").result()
                           if policy_trainer is not None else
                           trainer.rollouts[0].call("get_policy_weights")[plan.policy_id])
            else:
                if policy_id is not None:
                    raise MpirlError("policy_id is for multi-agent runs; this run has one policy")
                spec, obs_filter = trainer.policy_spec, trainer.obs_filter
                weights = trainer.learners[0].call_async("get_weights").result()
            key = policy_id or ""
            if key not in self._policies:
                self._policies[key] = build_torch_model(spec)
            policy = self._policies[key]
            policy.set_flat_weights(weights)
            batch = np.asarray(observations)
            if obs_filter is not None:
                batch = obs_filter.normalize(batch)
            if getattr(policy, "recurrent", False):
                raise MpirlError("compute_actions keeps no recurrent state between calls; a "
                                 "use_lstm policy plays through mpirl evaluate, or step(obs, "
                                 "state) on the policy exported with mpirl export")
            actions = policy.act(batch, deterministic=not explore)[0]
            return policy.env_actions(actions)

        return self._call(act)

    def compute_single_action(self, observation: Any, explore: bool = False,
                              policy_id: str | None = None) -> Any:
        """``compute_actions`` for one observation."""
        return self.compute_actions(np.asarray(observation)[None], explore, policy_id)[0]

    @property
    def config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.request.config)

    def stop(self) -> int:
        """End the run on every rank (the workers' processes exit); return its exit code."""
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()
        atexit.unregister(self.stop)
        return self._exit_code if self._exit_code is not None else EXIT_OK

    def __enter__(self) -> Algorithm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _never_called(driver: Driver) -> int:
    raise AssertionError("the driver function runs on rank 0 only")

