"""A trial slot: ``--ranks-per-trial`` ranks on a sub-communicator that run one trial segment
after another, each an ordinary ``mpirl train`` run on that communicator.

The leader (the slot's rank 0, the driver of every run in the slot) takes its tasks from the
controller and passes each on to the other ranks of the slot; the messages and how long each
wait may last are ``mpirl.tune.population_link``'s. A stop request from the controller while a
segment runs is taken as if the leader had received SIGUSR2 itself: the segment checkpoints and
ends with exit code 75. The segment's own runtime does what every run does (the restored state
reaches the workers by the usual broadcast from the trial's driver).
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from mpi4py import MPI

from mpirl.errors import EXIT_FAILURE, MpirlError, TaskTimeout, no_room_cause
from mpirl.jobs.checkpoint import LATEST, MANIFEST, CheckpointStore
from mpirl.jobs.run_dir import PARAMS_FILE
from mpirl.report.output_log import OUTPUT_LOG, OutputLog
from mpirl.runtime import signals as stop_signals
from mpirl.runtime.dispatch import CHECKPOINT, RESULT, STOP_TRIAL, TASK
from mpirl.runtime.transport import Channel
from mpirl.tune.population_link import CONTROLLER, PopulationLink, receive

#: The file in a trial's directory that its segments' output goes to: a run's own.
TRIAL_LOG = OUTPUT_LOG
#: The environment variable that names the trial a slot's processes run.
TRIAL_VARIABLE = "MPIRL_TUNE_TRIAL"


def serve_slot(link: PopulationLink, slot: MPI.Comm) -> int:
    """Every rank of a slot: run the controller's tasks until it says quit; return the job's
    exit code it gives. Collective over ``slot``."""
    leader = slot.Get_rank() == 0
    members = list(range(1, slot.Get_size()))
    slot_channel = Channel(slot)  # the leader's word to the rest of its slot
    while True:
        if leader:
            task, _ = link.receive(CONTROLLER, TASK, "task", waits_for_a_trial=True)
            while task["kind"] in ("send_state", "receive_state"):
                link.isend(_transfer(link, task), CONTROLLER, RESULT)
                task, _ = link.receive(CONTROLLER, TASK, "task", waits_for_a_trial=True)
            slot_channel.isend_many(task, members, TASK)
        else:
            # The leader's next word comes when the controller's does: no deadline but the
            # heartbeat's (a leader that dies ends the job from the controller).
            task, _ = receive(slot_channel, 0, TASK, None, "task from the slot's leader")
        if task["kind"] == "quit":
            if leader and not slot_channel.flush(timeout=link.timeout_s):
                raise TaskTimeout(f"mpirl tune: the rest of the slot did not take the quit "
                                  f"within {link.timeout_s:g} s (task_timeout_s)")
            return task["code"]
        outcome = run_segment(link, slot, task)
        if leader:
            link.isend(outcome, CONTROLLER, RESULT)


def run_segment(link: PopulationLink, slot: MPI.Comm, task: dict[str, Any]) -> dict[str, Any]:
    """One ``mpirl train`` run of a trial on ``slot``: to the segment's stop, from the trial's
    newest checkpoint if it has run before. Its output goes to the trial's ``output.log``."""
    from mpirl.commands.train import make_request, train

    run_dir = Path(task["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    # The trial's processes know which trial they run (for users' envs and callbacks).
    os.environ[TRIAL_VARIABLE] = task["trial"]
    resume = (run_dir / PARAMS_FILE).is_file()
    code, row, error, no_room = EXIT_FAILURE, None, None, None
    watcher = _StopWatcher(link) if slot.Get_rank() == 0 else None
    with OutputLog(run_dir, echo=False):
        print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} (population rank "
              f"{link.rank}): segment to {task['stop']}, config {task['varying']}"
              + (" (resuming)" if resume else ""), flush=True)
        try:
            request = make_request(task["algo"], task["env"], task["env_module"],
                                   dict(task["config"]), dict(task["stop"]), task["seed"],
                                   None if resume else str(run_dir),
                                   str(run_dir) if resume else None, "off",
                                   task.get("max_iterations"))
            code = train(request, comm=slot)
            row, no_room = request.final_row, request.no_room
        except MpirlError as error_:
            print(f"mpirl: error: {error_}", flush=True)
            code, error = error_.exit_code, str(error_)
            no_room = no_room_cause(error_)
        except Exception as error_:  # noqa: BLE001 - a trial's failure must not end the population
            error = traceback.format_exc()
            print(error, flush=True)
            no_room = no_room_cause(error_)
        finally:
            if watcher is not None:
                watcher.stop()
            # run() leaves SIGUSR1/2 ignored once a run is over; the next segment needs them.
            stop_signals.install()
    if code != 0 and error is None:
        error = _log_tail(run_dir / TRIAL_LOG)
    # A full disk is not the trial's failure: the controller ends the population on it.
    return {"trial": task["trial"], "code": code, "row": _summary(row), "error": error,
            "no_room": no_room}


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

    def __init__(self, link: PopulationLink) -> None:
        # This thread alone uses the link while the segment runs on the main thread.
        self.link = link
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mpirl-tune-stop", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.1):
            if self.link.poll(CONTROLLER, STOP_TRIAL) is not None:
                stop_signals.request_stop()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _transfer(link: PopulationLink, task: dict[str, Any]) -> dict[str, Any]:
    """PBT's exploit on a leader: send the trial's newest checkpoint to the leaders in
    ``task["to"]``, or put the one from ``task["from"]`` in place as the trial's newest."""
    store = CheckpointStore(task["run_dir"])
    if task["kind"] == "send_state":
        found = store.newest_valid()
        message = None
        if found is not None:
            path, manifest = found
            # Out of band: each file travels as raw frames, not inside one pickle.
            files = {p.name: pickle.PickleBuffer(p.read_bytes()) for p in path.iterdir()
                     if p.is_file() and p.name != MANIFEST}
            message = {"manifest": manifest, "files": files}
        link.isend_many(message, list(task["to"]), CHECKPOINT)
        link.flush(f"{task['run_dir']}'s checkpoint")
        return {"ok": message is not None,
                "iteration": None if message is None else message["manifest"]["iteration"]}
    message, _ = link.receive(task["from"], CHECKPOINT, "checkpoint")
    if message is None:
        return {"ok": False, "iteration": None}
    manifest = message["manifest"]
    tmp = store.begin(manifest["iteration"])
    try:
        for name, data in message["files"].items():
            (tmp / name).write_bytes(data)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if (no_room := no_room_cause(error)) is None:
            raise
        # Written aside first: on a full disk the loser keeps its own state, as a loser with
        # nothing to copy does, and the controller ends the population with the one line.
        return {"ok": False, "iteration": None, "no_room": no_room}
    # The winner's state goes in place first (``latest`` names it, whatever its iteration), then
    # the loser's own checkpoints go: a kill at any point leaves ``latest`` naming a whole one.
    final = store.commit(tmp, manifest)
    for entry in store.root.iterdir():
        if entry.is_dir() and entry != final:
            shutil.rmtree(entry)
        elif not entry.is_dir() and entry.name != LATEST:
            entry.unlink()
    return {"ok": True, "iteration": manifest["iteration"]}

