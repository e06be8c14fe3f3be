"""The ``mpirl`` command. Every rank runs it; only rank 0 prints."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from pathlib import Path
from typing import Any

from mpirl.config.parse import build, parse_json_object, split_by_dataclass
from mpirl.errors import ConfigError, LaunchError, MpirlError, SimulationStuck
from mpirl.jobs import launch, slurm
from mpirl.jobs.arguments import command_parser
from mpirl.runtime.layout import Layout, het_exit_delay


def _parser() -> argparse.ArgumentParser:
    return command_parser(add_job_commands)


def add_job_commands(commands: Any) -> None:
    """Add ``launch`` and ``slurm`` to the subparsers ``commands``."""
    launch.add_arguments(commands.add_parser(
        "launch", help="run a job command, and run it again with --resume after a failure",
        description="Run COMMAND (e.g. mpiexec -n 4 mpirl train ...) outside MPI; after a "
                    "failure, run it again with --resume RUN_DIR. Exit 0 and exit 2 are final; "
                    "SIGTERM, SIGUSR1, SIGUSR2, SIGINT and SIGHUP are forwarded and stop the "
                    "restarts.",
    ))

    slurm.add_arguments(commands.add_parser(
        "slurm", help="render a Slurm job script for an mpirl command, or submit it",
        description="Print a job script that runs COMMAND under srun (or mpiexec) with "
                    "checkpoint-and-requeue on SIGUSR2 before the time limit; with --submit, "
                    "sbatch it and print the job id. Run on a login node, without mpiexec. "
                    "Options go before --, the mpirl command after it.",
    ))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.command == "launch":
        return launch.main(args)  # outside MPI: nothing below may be imported for it
    if args.command == "slurm":
        return slurm.main(args, argv[argv.index("slurm") + 1:])  # outside MPI too
    if args.command == "inspect":
        return _inspect(args)  # outside MPI too
    joins = args.command in MPMD_COMMANDS and (
        args.command != "evaluate" or any(v in os.environ for v in LAUNCHER_VARIABLES))
    if args.command in ("train", "tune", "doctor") or joins:
        # MPI_Init on its own, before the command's imports (torch): startup.json times each.
        # Importing the run's world initializes MPI and marks the point. Under ULFM a rank lost
        # meanwhile would leave the others there for ever: a watcher ends them.
        from mpirl.runtime import init_watchdog

        watchdog = init_watchdog.start(_startup_timeout(_config_text(args)))
        from mpirl.runtime import startup, world  # noqa: F401

        if watchdog is not None:
            watchdog.done()
    code = 2
    stuck = False
    try:
        if joins:
            # Before anything uses COMM_WORLD: an MPMD launch's solver processes leave it here.
            from mpirl.runtime.apps import join_apps

            join_apps(_startup_timeout(_config_text(args)))
        code = _COMMANDS[args.command](args)
    except LaunchError as error:
        # Every task may be a rank 0 of its own here (singletons): Slurm's task 0 speaks.
        if error.speaker:
            print(f"mpirl: error: {error}", file=sys.stderr, flush=True)
        code = error.exit_code
    except MpirlError as error:
        _print_on_rank0(f"mpirl: error: {error}")
        code = error.exit_code
        stuck = isinstance(error, SimulationStuck)
    except Exception as error:
        if "mpi4py.MPI" in sys.modules:
            # Under ULFM a rank lost before the run's heartbeat watches (start-up) raises in
            # whichever MPI call meets it: one line and exit code 70, not a traceback per rank.
            from mpirl.runtime import startup
            from mpirl.runtime.ulfm import end_rank_on_process_failure

            started = "ranks_connected" in startup.marks()
            end_rank_on_process_failure(
                error, "while the job ran" if started else "while the job started")
        raise
    finally:
        if joins:
            # A run that ended before its env groups started (a config error, a LayoutError)
            # still owes the solvers an END, or they would wait for their setup forever.
            from mpirl.runtime.apps import end_solvers

            end_solvers(code)
    if stuck:
        # A stuck env group (mpirl evaluate's, driven from here) never reaches MPI_Finalize,
        # where this process would then wait for it: only an abort ends the job.
        from mpirl.runtime.heartbeat import abort_this_rank

        time.sleep(0.2)  # the launcher forwards the line above before its abort note
        abort_this_rank(code)
    return code


def _config_text(args: argparse.Namespace) -> str | None:
    """The command's ``--config`` value, also where ``mpirl tune`` passes it to its trials
    (after ``--``)."""
    trial_args = getattr(args, "train_args", None) or []
    for i, item in enumerate(trial_args):
        if item == "--config" and i + 1 < len(trial_args):
            return trial_args[i + 1]
        if item.startswith("--config="):
            return item.split("=", 1)[1]
    return getattr(args, "config", None)


def _startup_timeout(config_text: str | None) -> float:
    """``startup_timeout_s`` from a ``--config`` value, read on every rank before the config
    is checked (its errors come later, from rank 0's checks); else the run's default."""
    from mpirl.runtime.startup import DEFAULT_TIMEOUT_S

    try:
        value = parse_json_object(config_text or "{}", "--config").get("startup_timeout_s")
    except ConfigError:
        return DEFAULT_TIMEOUT_S
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return DEFAULT_TIMEOUT_S


def _doctor(args: argparse.Namespace) -> int:
    from mpirl.commands.doctor import LearnerCheck, doctor
    from mpirl.runtime import startup  # imported by main, with MPI
    from mpirl.runtime.driver import RuntimeSettings, run

    startup.mark("imports_done")
    config = parse_json_object(args.config, "--config")
    if "num_envs_per_worker" in config:  # the env groups per rollout rank, as train names it
        config["envs_per_rollout"] = config.pop("num_envs_per_worker")
    layout_keys, runtime_keys, learner_keys = split_by_dataclass(
        config, Layout, RuntimeSettings, LearnerCheck
    )
    layout = build(Layout, layout_keys)
    settings = build(RuntimeSettings, runtime_keys)
    learners = build(LearnerCheck, learner_keys)
    if args.pings < 1:  # the median of no round trips failed after every rank started
        raise ConfigError(f"--pings must be >= 1, got {args.pings}")
    return run(lambda driver: doctor(driver, args.pings, learners), layout, settings)


def _train(args: argparse.Namespace) -> int:
    from mpirl.runtime import startup  # imported by main, with MPI
    from mpirl.runtime.driver import run_prepared
    from mpirl.runtime.world import run_rank

    def prepare():
        # Rank 0 alone: the request's checks, and the imports they need (torch).
        from mpirl.commands.train import make_request, prepared
        from mpirl.execution.trainer import max_iterations_from_env

        startup.mark("imports_done")
        config = parse_json_object(args.config, "--config")
        if args.dump_trajectories is not None:
            config["dump_trajectories"] = args.dump_trajectories
        return prepared(make_request(
            args.algo, args.env, args.env_module, config,
            parse_json_object(args.stop, "--stop"),
            args.seed, args.run_dir, args.resume, args.progress,
            max_iterations_from_env(),
        ))

    if run_rank() != 0:
        # While rank 0 prepares, import what most worker ranks (rollout) will need:
        # otherwise they would start importing only when the driver spawns them.
        import mpirl.workers.rollout  # noqa: F401

        startup.mark("imports_done")
    return run_prepared(prepare, stop_signals_enabled=True)


def _tune(args: argparse.Namespace) -> int:
    from mpirl.runtime import startup  # imported by main, with MPI
    from mpirl.tune import tune_main

    startup.mark("imports_done")
    return tune_main(args)


def _evaluate(args: argparse.Namespace) -> int:
    from mpirl.commands.evaluate import evaluate, report
    from mpirl.commands.match import evaluate_match, match_report, wants_match

    warn = lambda m: _print_on_rank0(f"mpirl: {m}")  # noqa: E731
    if wants_match(args.checkpoint, args.opponent, warn):
        summary = evaluate_match(args.checkpoint, args.opponent or "random", args.games,
                                 args.simulations, args.seed, warn)
        print(match_report(summary, args.json), flush=True)
        return 0
    result = evaluate(args.checkpoint, args.episodes, args.seed, args.stochastic,
                      args.render_video, warn=lambda m: _print_on_rank0(f"mpirl: {m}"),
                      env_id=args.env, env_module=args.env_module)
    print(report(result, args.json), flush=True)
    return 0


def _play(args: argparse.Namespace) -> int:
    from mpirl.commands.match import play_in_terminal

    return play_in_terminal(args.checkpoint, args.simulations, not args.second,
                            args.seed, warn=lambda m: _print_on_rank0(f"mpirl: {m}"))


def _export(args: argparse.Namespace) -> int:
    from mpirl.commands.evaluate import find_checkpoint
    from mpirl.commands.export import default_output, export_checkpoint

    checkpoint, manifest = find_checkpoint(
        args.checkpoint, warn=lambda m: _print_on_rank0(f"mpirl: {m}"))
    output = args.output or default_output(checkpoint, manifest, args.policy)
    written = export_checkpoint(checkpoint, manifest, output, args.policy)
    _print_on_rank0(f"wrote {written} (from {checkpoint})", sys.stdout)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from mpirl.report.plot import plot_runs

    _print_on_rank0(f"wrote {plot_runs(args.run_dirs, args.output)}", sys.stdout)
    return 0


#: The commands that take part in an MPMD launch's start-up (``mpirl.runtime.apps``); evaluate
#: only under a launcher (run without one it needs no MPI).
MPMD_COMMANDS = ("train", "doctor", "evaluate")
#: Set by MPI launchers in their ranks' environment.
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")

#: The commands that run after MPI is up where they need it (launch, slurm and inspect run
#: outside MPI and are answered before).
_COMMANDS = {"doctor": _doctor, "train": _train, "tune": _tune, "evaluate": _evaluate,
             "play": _play, "export": _export, "plot": _plot}


def _inspect(args: argparse.Namespace) -> int:
    from mpirl.commands.inspect import plot_returns, report, summarize

    try:
        summary = summarize(args.path)
        print(report(summary, args.json), flush=True)
        if args.plot:
            print(f"wrote {plot_returns(summary, args.plot)}", file=sys.stderr, flush=True)
    except MpirlError as error:
        print(f"mpirl: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    return 0


def _print_on_rank0(message: str, stream: Any = None) -> None:
    """Print on rank 0: to stderr (warnings, errors) unless ``stream`` is given (a command's
    result goes to stdout, as evaluate's report does)."""
    from mpirl.runtime.world import run_rank

    if run_rank() == 0:
        print(message, file=sys.stderr if stream is None else stream, flush=True)


EXIT_FILE_ENV = "MPIRL_EXIT_FILE"
"""Set by the Slurm job script: world rank 0 writes its exit code to this file as it exits, so
the script can stop a job step that outlives its ranks (``templates/job.sbatch``)."""


def entry() -> None:
    """The ``mpirl`` console script: ``main``, then an exit that skips the interpreter's teardown.

    Freeing torch's modules one by one took 1.6-2 s per rank after the run had ended (measured
    on 2 cores), and a job's ranks share its cores: the job only ends when the slowest is done.
    By the time ``main`` returns every file is closed; Python's exit handlers still run (logging,
    joining child processes) and MPI is finalized (mpi4py does that from C at teardown, so it is
    called here), then the process ends at once, or, in a heterogeneous srun step of a Slurm
    before 24.11, seconds later per component index (``het_exit_delay``: that srun can hang
    when the components end at once). Under ``MPIRL_EXIT_FILE`` world rank 0 writes its exit
    code there last. An exception escaping ``main`` takes the ordinary path, so its traceback is
    printed as usual.
    """
    # This process's own: a run it starts (a tune trial) must not write it.
    exit_file = os.environ.pop(EXIT_FILE_ENV, None)
    code = main()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    size = 1
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        rank, size = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
        mpi.Finalize()
    if code and size > 1 and _agreed_code_command() and _open_mpi_parent() is not None:
        code = _rank_0_exits_last(code, rank)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    delay = het_exit_delay()
    if delay:
        time.sleep(delay)
    if exit_file and rank == 0:
        try:
            with open(exit_file, "w") as file:
                file.write(f"{code}\n")
        except OSError:  # the script then waits for the step as it always did
            pass
    os._exit(code)


#: Commands whose ranks all return the code rank 0 decided (the driver sends it to each).
AGREED_CODE_COMMANDS = ("train", "doctor")
#: The Open MPI processes that start ranks on a node (mpiexec execs prterun, same pid).
OPEN_MPI_PARENTS = ("prterun", "mpiexec", "mpirun", "prted")


def _agreed_code_command() -> bool:
    command = next((word for word in sys.argv[1:] if not word.startswith("-")), None)
    return command in AGREED_CODE_COMMANDS


def _open_mpi_parent() -> int | None:
    """The pid of this process's parent if it is Open MPI's launcher or node daemon."""
    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        return None
    return parent if name in OPEN_MPI_PARENTS else None


def _rank_0_exits_last(code: int, rank: int, wait_s: float = 3.0) -> int:
    """The exit code for a rank of a job that ends with ``code`` (not 0) under Open MPI.

    Open MPI's mpiexec follows any rank's non-zero exit with its 7-line "prterun detected that
    one or more processes exited with non-zero status" note, unless that rank is the job's last
    to end: then it exits with the code and says nothing (Open MPI 5.0.11, measured). Every rank
    has the code from rank 0 here, so the others exit 0 and rank 0 exits with the code once its
    node's other ranks are gone (at most ``wait_s``; ranks on other nodes are not waited for,
    and their job gets the note again)."""
    if rank != 0:
        return 0
    parent = _open_mpi_parent()
    deadline = time.monotonic() + wait_s
    while parent is not None and _children(parent) - {os.getpid()} and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    return code


def _children(parent: int) -> set[int]:
    """The pids of ``parent``'s children, zombies too (not reaped yet: not ended for Open MPI)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            pids.add(int(entry.name))
    return pids


if __name__ == "__main__":
    entry()
