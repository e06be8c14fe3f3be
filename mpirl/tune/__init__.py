"""``mpirl tune``: populations of ordinary runs, nested in one MPI job.

World rank 0 is the population controller (``controller``); the other ranks form trial slots of
``--ranks-per-trial`` ranks on sub-communicators (``slot``), each running trial segments as
ordinary ``mpirl train`` runs on its communicator. Nothing in the algorithms knows it is nested.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mpi4py import MPI

from mpirl.errors import ConfigError, MpirlError
from mpirl.jobs.run_dir import default_run_dir
from mpirl.runtime import signals as stop_signals


def tune_main(args: argparse.Namespace) -> int:
    """Every rank: check the command line alike (the trials' train commands on world rank 0
    alone, which broadcasts their number or its error), split the world into slots, then control
    (world rank 0) or serve a slot; the job's exit code."""
    from mpirl.tune.request import STATE_FILE, check_world, make_tune_request
    from mpirl.tune.slot import serve_slot

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    request, state = make_tune_request(args, "")
    if not request.tune_dir:
        # Rank 0's clock names the directory, for every rank.
        name = default_run_dir(request.algo, request.env, prefix="tune-") if rank == 0 else None
        request.tune_dir = world.bcast(name, root=0)
    state_path = Path(request.tune_dir) / STATE_FILE
    if state is None and state_path.exists():
        raise ConfigError(f"{request.tune_dir} already holds a population ({STATE_FILE}); "
                          f"nothing was overwritten. Continue it with --resume "
                          f"{request.tune_dir}, or choose a new --run-dir.")
    # Checking each trial's train command imports torch and the algorithm; only the controller
    # needs the trials, so only it does that. The slots learn their number, or its error, and
    # import torch when they run their first trial: a bad command line is answered sooner.
    trials, outcome = [], None
    if rank == 0:
        try:
            from mpirl.tune.controller import new_trials, resumed_trials

            trials = (resumed_trials(state) if state is not None
                      else new_trials(request, request.trial_configs()))
            outcome = len(trials)
        except MpirlError as error:
            outcome = error
        except BaseException:  # not a user's mistake: the slots must not wait for ever
            world.bcast(MpirlError("the population controller failed; see its traceback"))
            raise
    outcome = world.bcast(outcome, root=0)
    if isinstance(outcome, MpirlError):
        raise outcome
    slots = check_world(request, world.Get_size(), outcome)
    stop_signals.install()
    per = request.ranks_per_trial
    slot_comm = world.Split(MPI.UNDEFINED if rank == 0 else (rank - 1) // per, key=rank)
    try:
        if rank == 0:
            from mpirl.tune.controller import Controller

            return Controller(world, request, trials, slots, state).run()
        return serve_slot(world, slot_comm)
    except MpirlError:
        raise  # the controller's own, after it let every slot go: one clear message
    except BaseException:  # noqa: BLE001 - the others would wait for this rank for ever
        import sys
        import traceback

        print(f"mpirl tune: world rank {rank} failed; ending the job.\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        world.Abort(1)
        raise
