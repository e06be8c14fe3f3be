"""``mpirl tune``: populations of ordinary runs, nested in one MPI job.

The population spans the communicator the runtime gives it (``run_comm()``: COMM_WORLD unless a
caller nests it). Its rank 0 is the population controller (``controller``); the other ranks form
trial slots of ``--ranks-per-trial`` ranks on sub-communicators (``slot``), each running trial
segments as ordinary ``mpirl train`` runs on its communicator. They talk through
``population_link``. Nothing in the algorithms knows it is nested.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from mpi4py import MPI

from mpirl.config.parse import build
from mpirl.errors import ConfigError, MpirlError
from mpirl.jobs.run_dir import default_run_dir
from mpirl.runtime import signals as stop_signals
from mpirl.runtime.driver import RuntimeSettings
from mpirl.runtime.heartbeat import require_thread_multiple
from mpirl.runtime.ulfm import is_process_failure
from mpirl.runtime.world import run_comm


def tune_main(args: argparse.Namespace) -> int:
    """Every rank of the run's communicator: check the command line alike (the trials' train
    commands on rank 0 alone, which broadcasts their number or its error), split the ranks into
    slots, then control (rank 0) or serve a slot; the job's exit code."""
    from mpirl.tune.population_link import PopulationLink
    from mpirl.tune.request import STATE_FILE, check_world, make_tune_request
    from mpirl.tune.slot import serve_slot

    comm = run_comm()
    rank = comm.Get_rank()
    request, state = make_tune_request(args, "")
    if not request.tune_dir:
        # Rank 0's clock names the directory, for every rank.
        name = None
        if rank == 0:
            from mpirl.execution.contract import algorithm_name  # torch: rank 0's alone

            name = default_run_dir(algorithm_name(request.algo), request.env, prefix="tune-")
        request.tune_dir = comm.bcast(name, root=0)
    state_path = Path(request.tune_dir) / STATE_FILE
    if state is None and state_path.exists():
        raise ConfigError(f"{request.tune_dir} already holds a population ({STATE_FILE}); "
                          f"nothing was overwritten. Continue it with --resume "
                          f"{request.tune_dir}, or choose a new --run-dir.")
    # Checking each trial's train command imports torch and the algorithm; only the controller
    # needs the trials, so only it does that. The slots learn their number, or its error, and
    # import torch when they run their first trial: a bad command line is answered sooner.
    trials, outcome, max_iterations = [], None, None
    if rank == 0:
        try:
            from mpirl.execution.trainer import max_iterations_from_env
            from mpirl.tune.controller import new_trials, resumed_trials

            # Read where the trials are set: each trial's task carries it to its slot.
            max_iterations = max_iterations_from_env()
            trials = (resumed_trials(state) if state is not None
                      else new_trials(request, request.trial_configs()))
            outcome = len(trials)
        except MpirlError as error:
            outcome = error
        except BaseException:  # not a user's mistake: the slots must not wait for ever
            comm.bcast(MpirlError("the population controller failed; see its traceback"))
            raise
    outcome = comm.bcast(outcome, root=0)
    if isinstance(outcome, MpirlError):
        raise outcome
    slots = check_world(request, comm.Get_size(), outcome)
    stop_signals.install()
    per = request.ranks_per_trial
    slot_comm = comm.Split(MPI.UNDEFINED if rank == 0 else (rank - 1) // per, key=rank)
    # The population waits and watches as its trials' runs do (the trials' config keys checked
    # above): their heartbeat, and their task_timeout_s.
    require_thread_multiple()  # the heartbeat's thread, and the stop watcher's
    runtime_keys = {f.name for f in dataclasses.fields(RuntimeSettings)}
    link = PopulationLink(comm, per, build(RuntimeSettings, {
        k: v for k, v in request.config.items() if k in runtime_keys}))
    try:
        if rank == 0:
            from mpirl.tune.controller import Controller

            return Controller(link, request, trials, slots, state, max_iterations).run()
        return serve_slot(link, slot_comm)
    except BaseException as error:
        if rank == 0 and isinstance(error, MpirlError):
            raise  # the controller's own, after it let every slot go: one clear message
        if is_process_failure(error):
            # Under ULFM a wait on a dead rank raises here, racing the heartbeat's own report:
            # the same one line and exit code, no traceback.
            link.heartbeat.end_job_for_process_failure()
        import sys
        import traceback

        # The others would wait for this rank until its heartbeat fell silent.
        print(f"mpirl tune: rank {rank} of the population failed; ending the job.\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        comm.Abort(1)
        raise
    finally:
        link.close()
