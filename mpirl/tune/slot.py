"""A trial slot: ``--ranks-per-trial`` ranks on a sub-communicator that run one trial segment
after another, each an ordinary ``mpirl train`` run on that communicator.

What crosses ranks, on COMM_WORLD, between the controller (world rank 0) and each slot's
leader (the slot's rank 0, which is the driver of every run in the slot):

* controller -> leader: a task (``TASK``): run a segment, send the trial's newest checkpoint to
  other leaders, receive one, or quit;
* leader -> controller: the outcome (``RESULT``): exit code and the segment's last row;
* leader -> leader: PBT's exploit, a whole checkpoint (``STATE``), point to point;
* controller -> leader: a stop request while a segment runs (``STOP``), as if the leader had
  received SIGUSR2 itself: the segment checkpoints and ends with exit code 75.

Inside the slot the leader broadcasts each segment task to the other ranks; the segment's own
runtime then does what every run does (the restored state reaches the workers by the usual
broadcast from the trial's driver). Every wait polls and sleeps, so idle ranks leave the cores
to the trials that run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI

from mpirl.errors import EXIT_FAILURE, MpirlError
from mpirl.jobs.checkpoint import MANIFEST, CheckpointStore
from mpirl.jobs.run_dir import PARAMS_FILE
from mpirl.runtime import signals as stop_signals
from mpirl.runtime.waiting import Backoff

TASK, RESULT, STATE, STOP = 7101, 7102, 7103, 7104
#: The file in a trial's directory that its segments' output goes to.
TRIAL_LOG = "output.log"
#: The environment variable that names the trial a slot's processes run.
TRIAL_VARIABLE = "MPIRL_TUNE_TRIAL"


def _idle_backoff() -> Backoff:
    """Polls of an idle rank: sleeps from 0.1 ms doubling to 10 ms, no spinning (a blocking MPI
    wait would keep a core busy on a machine with more ranks than cores)."""
    return Backoff(spin_s=0.0, min_sleep_s=1e-4, max_sleep_s=0.01)


def wait_request(request: MPI.Request) -> Any:
    """Complete a non-blocking mpi4py request without spinning; its message, if it carries one."""
    backoff = _idle_backoff()
    while True:
        done, message = request.test()
        if done:
            return message
        backoff.sleep()


def wait_message(comm: MPI.Comm, source: int, tag: int,
                 idle: Callable[[], None] | None = None) -> int:
    """Wait without spinning until a message from ``source`` (MPI.ANY_SOURCE allowed) can be
    received; its source. ``idle()`` runs between polls."""
    status = MPI.Status()
    backoff = _idle_backoff()
    while not comm.iprobe(source=source, tag=tag, status=status):
        if idle is not None:
            idle()
        backoff.sleep()
    return status.Get_source()


def recv_object(comm: MPI.Comm, source: int, tag: int) -> Any:
    """A pickled message from ``source`` (MPI.ANY_SOURCE allowed), waiting without spinning."""
    return comm.recv(source=wait_message(comm, source, tag), tag=tag)


def send_object(comm: MPI.Comm, message: Any, dest: int, tag: int) -> None:
    wait_request(comm.isend(message, dest=dest, tag=tag))


def serve_slot(world: MPI.Comm, slot: MPI.Comm) -> int:
    """Every rank of a slot: run the controller's tasks until it says quit; return the job's
    exit code it gives."""
    leader = slot.Get_rank() == 0
    while True:
        if leader:
            task = recv_object(world, 0, TASK)
            while task["kind"] in ("send_state", "receive_state"):
                send_object(world, _transfer(world, task), 0, RESULT)
                task = recv_object(world, 0, TASK)
            for member in range(1, slot.Get_size()):
                send_object(slot, task, member, TASK)
        else:
            task = recv_object(slot, 0, TASK)
        if task["kind"] == "quit":
            return task["code"]
        outcome = run_segment(world, slot, task)
        if leader:
            send_object(world, outcome, 0, RESULT)


def run_segment(world: MPI.Comm, slot: MPI.Comm, task: dict[str, Any]) -> dict[str, Any]:
    """One ``mpirl train`` run of a trial on ``slot``: to the segment's stop, from the trial's
    newest checkpoint if it has run before. Its output goes to the trial's ``output.log``."""
    from mpirl.commands.train import make_request, train

    run_dir = Path(task["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    # The trial's processes know which trial they run (for users' envs and callbacks).
    os.environ[TRIAL_VARIABLE] = task["trial"]
    resume = (run_dir / PARAMS_FILE).is_file()
    code, row, error = EXIT_FAILURE, None, None
    watcher = _StopWatcher(world) if slot.Get_rank() == 0 else None
    with open(run_dir / TRIAL_LOG, "a", buffering=1, encoding="utf-8") as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} (world rank "
              f"{world.Get_rank()}): segment to {task['stop']}, config {task['varying']}"
              + (" (resuming)" if resume else ""), flush=True)
        try:
            request = make_request(task["algo"], task["env"], task["env_module"],
                                   dict(task["config"]), dict(task["stop"]), task["seed"],
                                   None if resume else str(run_dir),
                                   str(run_dir) if resume else None, "off")
            code = train(request, comm=slot)
            row = request.final_row
        except MpirlError as error_:
            print(f"mpirl: error: {error_}", flush=True)
            code, error = error_.exit_code, str(error_)
        except Exception:  # noqa: BLE001 - a trial's failure must not end the population
            error = traceback.format_exc()
            print(error, flush=True)
        finally:
            if watcher is not None:
                watcher.stop()
            # run() leaves SIGUSR1/2 ignored once a run is over; the next segment needs them.
            stop_signals.install()
    if code != 0 and error is None:
        error = _log_tail(run_dir / TRIAL_LOG)
    return {"trial": task["trial"], "code": code, "row": _summary(row), "error": error}


def _summary(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """The numbers of a row (what the controller ranks and records)."""
    if row is None:
        return None
    return {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _log_tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _StopWatcher:
    """On a slot leader while a segment runs: a stop request from the controller is taken as a
    stop signal of this process (the trial's driver checks for one every iteration)."""

    def __init__(self, world: MPI.Comm) -> None:
        self.world = world
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mpirl-tune-stop", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.1):
            if self.world.iprobe(source=0, tag=STOP):
                self.world.recv(source=0, tag=STOP)
                stop_signals.request_stop()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _transfer(world: MPI.Comm, task: dict[str, Any]) -> dict[str, Any]:
    """PBT's exploit on a leader: send the trial's newest checkpoint to the leaders in
    ``task["to"]``, or put the one from ``task["from"]`` in place as the trial's newest."""
    store = CheckpointStore(task["run_dir"])
    if task["kind"] == "send_state":
        found = store.newest_valid()
        message = None
        if found is not None:
            path, manifest = found
            files = {p.name: p.read_bytes() for p in path.iterdir()
                     if p.is_file() and p.name != MANIFEST}
            message = {"manifest": manifest, "files": files}
        requests = [world.isend(message, dest=rank, tag=STATE) for rank in task["to"]]
        for request in requests:
            wait_request(request)
        return {"ok": message is not None,
                "iteration": None if message is None else message["manifest"]["iteration"]}
    message = recv_object(world, task["from"], STATE)
    if message is None:
        return {"ok": False, "iteration": None}
    # The loser's own checkpoints go: its run continues from the winner's state alone.
    shutil.rmtree(store.root, ignore_errors=True)
    manifest = message["manifest"]
    tmp = store.begin(manifest["iteration"])
    for name, data in message["files"].items():
        (tmp / name).write_bytes(data)
    store.commit(tmp, manifest)
    return {"ok": True, "iteration": manifest["iteration"]}

