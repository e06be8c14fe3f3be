"""The ``mpirl`` command. Every rank runs it; only rank 0 prints."""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import sys

from mpirl.config.parse import build, parse_json_object, split_by_dataclass
from mpirl.errors import ConfigError, LaunchError, MpirlError
from mpirl.jobs import launch, slurm
from mpirl.report.progress import PROGRESS_MODES
from mpirl.runtime.layout import Layout


def _parser() -> argparse.ArgumentParser:
    # No abbreviations (--run for --run-dir): launch and slurm read options by their exact
    # spelling, and must see what mpirl will. Every subcommand's parser is made by parser_class.
    parser = argparse.ArgumentParser(
        prog="mpirl",
        description="Distributed reinforcement learning on MPI. Launch with mpiexec or srun; "
                    "rank 0 drives, the other ranks are rollout, replay and learner workers.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND",
        parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False),
    )
    doctor = commands.add_parser(
        "doctor", help="check that every rank starts, answers and moves data; print the layout",
    )
    doctor.add_argument(
        "--config", default="{}", metavar="JSON",
        help='layout and runtime keys, e.g. \'{"num_learners": 1, "num_replay_shards": 0}\'',
    )
    doctor.add_argument("--pings", type=int, default=200, help="round trips timed per worker")

    train = commands.add_parser(
        "train", help="train an algorithm on an environment (run it under mpiexec or srun)",
        description="Train until any --stop criterion is met (exit code 0). Rank 0 shows "
                    "progress and writes params.json, progress.csv, result.json, TensorBoard "
                    "events and checkpoints/ to the run directory. SIGUSR1, SIGUSR2 or SIGTERM "
                    "on any rank writes a checkpoint and exits with code 75: resume with "
                    "--resume RUN_DIR.",
    )
    train.add_argument("--algo", help="PPO, A2C, IMPALA, A3C, DQN, APEX, SAC, BC or MARWIL")
    train.add_argument("--env", help="a gymnasium id such as CartPole-v1, or module:ClassName")
    train.add_argument("--env-module", help="import this module first (it registers the env id)")
    train.add_argument("--config", default="{}", metavar="JSON",
                       help='algorithm, layout and runtime keys, e.g. \'{"num_learners": 2}\'')
    train.add_argument("--stop", default="{}", metavar="JSON",
                       help='stop criteria, any one ends the run, e.g. \'{"episode_return_mean": '
                            '475, "timesteps_total": 200000}\' (default: 1,000,000 steps)')
    train.add_argument("--seed", type=int, help="base seed (overrides the config's seed)")
    train.add_argument("--run-dir", help="where results go (default: runs/ALGO-ENV-TIME)")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue RUN_DIR from its newest valid checkpoint; --algo, --env and "
                            "--config come from its params.json (--config and --stop given here "
                            "override them)")
    train.add_argument("--dump-trajectories", metavar="DIR",
                       help="every rollout rank writes the episodes it completes to DIR (HDF5, "
                            "Minari's layout; read with mpirl.open_dataset or minari); the config "
                            "key dump_trajectories")
    train.add_argument("--progress", choices=PROGRESS_MODES,
                       help="how rank 0 shows progress: live (a redrawn bar), plain (one line "
                            "per iteration), off, or auto: live only when mpiexec's output (or "
                            "mpirl's, without mpiexec) is a terminal, plain lines when it goes "
                            "to a file (default: $MPIRL_PROGRESS, else auto)")

    inspect = commands.add_parser(
        "inspect", help="summarize a trajectory dump: episodes, steps, returns, spaces, files",
        description="Run without mpiexec. PATH is a dump directory (--dump-trajectories), its "
                    "main_data.hdf5, or one per-rank file.",
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--plot", metavar="PNG", help="draw the return distribution to PNG")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")

    evaluate = commands.add_parser(
        "evaluate", help="run a checkpoint's policy for some episodes and print its returns",
        description="Run without mpiexec. CHECKPOINT is a checkpoint directory, or a run "
                    "directory (its newest valid checkpoint is used).",
    )
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT")
    evaluate.add_argument("--episodes", type=int, default=10, help="episodes to run (10)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the first episode")
    evaluate.add_argument("--stochastic", action="store_true",
                          help="sample actions instead of taking the most likely one")
    evaluate.add_argument("--render-video", metavar="DIR",
                          help="write one MP4 per episode to DIR (needs mpirl[video])")
    evaluate.add_argument("--json", action="store_true", help="print the statistics as JSON")
    evaluate.add_argument("--env", help="run on this environment instead of the one trained on")
    evaluate.add_argument("--env-module", help="import this module first (it registers --env)")

    export = commands.add_parser(
        "export", help="write a checkpoint's policy as plain arrays (.npz), safe to share",
        description="Run without mpiexec. CHECKPOINT is a checkpoint directory, or a run "
                    "directory (its newest valid checkpoint is used). The file holds learner 0's "
                    "weights per named tensor, the observation statistics and a JSON header; "
                    "mpirl evaluate FILE runs it without unpickling anything.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT")
    export.add_argument("-o", "--output", metavar="FILE",
                        help="where to write (default: ALGO-ENV-ITERATION.npz here)")
    export.add_argument("--format", choices=["npz"], default="npz",
                        help="npz: NumPy arrays, read with allow_pickle=False (the only format)")

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

    plot = commands.add_parser("plot", help="plot return curves of one or more run directories")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("-o", "--output", default="curve.png", help="PNG file to write")
    return parser


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
    try:
        if args.command == "doctor":
            from mpirl.runtime.doctor import run_doctor
            from mpirl.runtime.driver import RuntimeSettings, run

            layout_keys, runtime_keys = split_by_dataclass(
                parse_json_object(args.config, "--config"), Layout, RuntimeSettings
            )
            layout = build(Layout, layout_keys)
            settings = build(RuntimeSettings, runtime_keys)
            if args.pings < 1:  # the median of no round trips failed after every rank started
                raise ConfigError(f"--pings must be >= 1, got {args.pings}")
            return run(lambda driver: run_doctor(driver, pings=args.pings), layout, settings)
        if args.command == "train":
            from mpirl.commands.train import make_request, train

            config = parse_json_object(args.config, "--config")
            if args.dump_trajectories is not None:
                config["dump_trajectories"] = args.dump_trajectories
            request = make_request(
                args.algo, args.env, args.env_module, config,
                parse_json_object(args.stop, "--stop"),
                args.seed, args.run_dir, args.resume, args.progress,
            )
            return train(request)
        if args.command == "evaluate":
            from mpirl.commands.evaluate import evaluate, report

            result = evaluate(args.checkpoint, args.episodes, args.seed, args.stochastic,
                              args.render_video, warn=lambda m: _print_on_rank0(f"mpirl: {m}"),
                              env_id=args.env, env_module=args.env_module)
            print(report(result, args.json), flush=True)
            return 0
        if args.command == "export":
            from mpirl.commands.evaluate import find_checkpoint
            from mpirl.commands.export import export_checkpoint

            checkpoint, manifest = find_checkpoint(
                args.checkpoint, warn=lambda m: _print_on_rank0(f"mpirl: {m}"))
            output = args.output or (f"{manifest['algo']}-{manifest['env']['env_id']}-"
                                     f"{manifest['iteration']:06d}.npz").replace(":", "_")
            _print_on_rank0(f"wrote {export_checkpoint(checkpoint, manifest, output)} "
                            f"(from {checkpoint})")
            return 0
        if args.command == "plot":
            from mpirl.report.plot import plot_runs

            _print_on_rank0(f"wrote {plot_runs(args.run_dirs, args.output)}")
            return 0
    except LaunchError as error:
        # Every task may be a rank 0 of its own here (singletons): Slurm's task 0 speaks.
        if error.speaker:
            print(f"mpirl: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except MpirlError as error:
        _print_on_rank0(f"mpirl: error: {error}")
        return error.exit_code
    raise AssertionError(f"unhandled command {args.command}")


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


def _print_on_rank0(message: str) -> None:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def entry() -> None:
    """The ``mpirl`` console script: ``main``, then an exit that skips the interpreter's teardown.

    Freeing torch's modules one by one took 1.6-2 s per rank after the run had ended (measured
    on 2 cores), and a job's ranks share its cores: the job only ends when the slowest is done.
    By the time ``main`` returns every file is closed; Python's exit handlers still run (logging,
    joining child processes) and MPI is finalized (mpi4py does that from C at teardown, so it is
    called here), then the process ends at once. An exception escaping ``main`` takes the
    ordinary path, so its traceback is printed as usual.
    """
    code = main()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
