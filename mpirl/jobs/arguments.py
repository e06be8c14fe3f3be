"""The grammar of the ``mpirl`` command: its subcommands and their options. The CLI parses with
it, and ``mpirl slurm`` checks a job's command with it on the login node, before the job queues.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
from collections.abc import Callable
from typing import Any

from mpirl import __version__
from mpirl.report.progress import PROGRESS_MODES

SCHEDULERS = ("fifo", "pbt")
SEARCHES = ("grid", "random")
TIME_ATTRS = ("training_iteration", "timesteps_total")
#: Train options that ``mpirl tune`` sets for each trial itself.
TUNE_OWNED = ("--run-dir", "--resume", "--dump-trajectories", "--progress")
#: ``mpirl train --help``'s last part: how to stop a run, its exit codes, its variables.
TRAIN_EPILOG = """\
stopping (a checkpoint at the iteration's end; --resume RUN_DIR continues):
  Ctrl-C            exit 130, also at a terminal running mpiexec (rank 0 takes
                    the Ctrl-C there, not mpiexec); a second Ctrl-C quits at once
  SIGUSR1, SIGUSR2  to mpiexec or to any rank, or SIGTERM to a rank: exit 75
  Ctrl-C under mpirl launch -- mpiexec -n N mpirl train ...: exit 75 too
  (kill -INT or -TERM of mpiexec's pid: mpiexec kills every rank within 0.5 s
  and exits 1; no checkpoint is sure)

exit codes:
  0  a --stop criterion was met       70   a rank was lost
  1  an exception on some rank        75   stopped on request after a checkpoint
  2  bad command line or config       130  stopped by Ctrl-C after a checkpoint

environment:
  MPIRL_MAX_ITERATIONS=N  stop after at most N training iterations, whatever
                          --stop says
  MPIRL_PROGRESS=MODE     the default of --progress
"""


class _KeepLineBreaks(argparse.HelpFormatter):
    """Wraps a description as usual, but prints text with line breaks of its own (an epilog's
    table) as written, as argparse.RawDescriptionHelpFormatter does."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with a did-you-mean on a mistyped choice (``mpirl trian``)."""

    def error(self, message: str):
        # argparse formats the value with repr and the choices as a comma-separated list of reprs.
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if found:
            choices = re.findall(r"'([^']*)'", found.group(2))
            close = difflib.get_close_matches(found.group(1), choices, n=1, cutoff=0.6)
            if close:
                message += f". Did you mean {close[0]!r}?"
        super().error(message)


def command_parser(add_job_commands: Callable[[Any], None] | None = None
                   ) -> argparse.ArgumentParser:
    """mpirl's command-line grammar. ``add_job_commands(subparsers)`` adds ``launch`` and
    ``slurm``, which define their own options (``mpirl.cli`` passes it; ``mpirl slurm`` checks a
    job's command with the grammar alone)."""
    # No abbreviations (--run for --run-dir): launch and slurm read options by their exact
    # spelling, and must see what mpirl will. Every subcommand's parser is made by parser_class.
    parser = _Parser(
        prog="mpirl",
        description="Distributed reinforcement learning on MPI. Launch with mpiexec or srun; "
                    "rank 0 drives, the other ranks are rollout, replay and learner workers.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"mpirl {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND",
        parser_class=functools.partial(_Parser, allow_abbrev=False),
    )
    _add_doctor(commands)
    _add_train(commands)
    _add_inspect(commands)
    _add_evaluate(commands)
    _add_play(commands)
    _add_export(commands)
    _add_tune(commands)
    if add_job_commands is not None:
        add_job_commands(commands)
    _add_plot(commands)
    return parser


def _add_doctor(commands: Any) -> None:
    doctor = commands.add_parser(
        "doctor", help="check that every rank starts, answers and moves data; print the layout",
    )
    doctor.add_argument(
        "--config", default="{}", metavar="JSON",
        help='layout and runtime keys, and learner_backend for the learners\' allreduce test, '
             'e.g. \'{"num_learners": 2, "learner_backend": "gloo"}\'',
    )
    doctor.add_argument("--pings", type=int, default=200, help="round trips timed per worker")


def _add_train(commands: Any) -> None:
    train = commands.add_parser(
        "train", help="train an algorithm on an environment (run it under mpiexec or srun)",
        description="Train until any --stop criterion is met (exit code 0). Rank 0 shows "
                    "progress and writes params.json, progress.csv, result.json, TensorBoard "
                    "events and checkpoints/ to the run directory. SIGUSR1, SIGUSR2 or SIGTERM "
                    "on any rank writes a checkpoint and exits with code 75: resume with "
                    "--resume RUN_DIR.",
        epilog=TRAIN_EPILOG, formatter_class=_KeepLineBreaks,
    )
    train.add_argument("--algo", help="PPO, A2C, IMPALA, A3C, DQN, APEX, SAC, BC, MARWIL, ES, "
                                      "ARS, AlphaZero, PETS or MBPO, or the module of your own "
                                      "algorithm (my_package.my_algo)")
    train.add_argument("--env", help="a gymnasium id such as CartPole-v1, or module:ClassName; "
                                     "for AlphaZero a board game: openspiel/<name> or a "
                                     "PettingZoo classic module")
    train.add_argument("--env-module", help="import this module first (it registers the env id)")
    train.add_argument("--config", default="{}", metavar="JSON",
                       help='algorithm, layout and runtime keys, e.g. \'{"num_learners": 2}\', '
                            'or @FILE.json (e.g. @examples/tuned/impala_breakout.json)')
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


def _add_inspect(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect", help="summarize a trajectory dump: episodes, steps, returns, spaces, files",
        description="Run without mpiexec. PATH is a dump directory (--dump-trajectories), its "
                    "main_data.hdf5, or one per-rank file.",
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--plot", metavar="PNG", help="draw the return distribution to PNG")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")


def _add_evaluate(commands: Any) -> None:
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
    games = evaluate.add_argument_group(
        "board games (AlphaZero's checkpoints)",
        "Play GAMES games against a reference player, half of them moving first, and print "
        "wins, draws and losses from the agent's side.")
    games.add_argument("--opponent", metavar="SPEC",
                       help="random (the default for a game checkpoint), mcts:N (UCT with random "
                            "rollouts, N simulations), minimax (small games), minimax:traps "
                            "(perfect, setting traps), or module:Class (act(observation, "
                            "action_mask) -> move)")
    games.add_argument("--games", type=int, default=100,
                       help="games to play (100; at most $MPIRL_MAX_GAMES where that is set)")
    games.add_argument("--simulations", type=int,
                       help="the agent's search simulations a move; 0 plays its raw policy "
                            "(default: the run's evaluation_simulations, 100 unless set)")


def _add_play(commands: Any) -> None:
    play = commands.add_parser(
        "play", help="play a board game against an AlphaZero checkpoint in the terminal",
        description="Run without mpiexec. CHECKPOINT is a checkpoint directory, or a run "
                    "directory (its newest valid checkpoint is used). Type move numbers; q "
                    "quits.")
    play.add_argument("checkpoint", metavar="CHECKPOINT")
    play.add_argument("--second", action="store_true", help="let the agent move first")
    play.add_argument("--simulations", type=int,
                      help="the agent's search simulations a move; 0 plays its raw policy "
                           "(default: the run's evaluation_simulations, 100 unless set)")
    play.add_argument("--seed", type=int, default=0, help="seed of the agent's search")


def _add_export(commands: Any) -> None:
    export = commands.add_parser(
        "export", help="write a checkpoint's policy as plain arrays (.npz), safe to share",
        description="Run without mpiexec. CHECKPOINT is a checkpoint directory, or a run "
                    "directory (its newest valid checkpoint is used). The file holds learner 0's "
                    "weights per named tensor, the observation statistics and a JSON header; "
                    "mpirl evaluate FILE runs it without unpickling anything.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT")
    export.add_argument("-o", "--output", metavar="FILE",
                        help="where to write (default: ALGO-ENV-ITERATION.npz in the run "
                             "directory)")
    export.add_argument("--format", choices=["npz"], default="npz",
                        help="npz: NumPy arrays, read with allow_pickle=False (the only format)")
    export.add_argument("--policy", metavar="ID",
                        help="a multi-agent checkpoint: the policy to export (needed when it "
                             "has several)")


def _add_plot(commands: Any) -> None:
    plot = commands.add_parser(
        "plot", help="plot return curves of one or more run directories",
        description="RUN_DIR is a run directory, or a folder that holds run directories (runs/, "
                    "a tune directory): every run below it is plotted.")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("-o", "--output",
                      help="PNG file to write (default: curve.png in RUN_DIR, or in the folder "
                           "that holds every RUN_DIR given)")


def _add_tune(commands: Any) -> None:
    """``mpirl tune``'s own options; the train command follows ``--``."""
    tune = commands.add_parser(
        "tune", help="run a population of trials: PBT, or a grid or random search",
        description="Run under mpiexec or srun: rank 0 is the population controller, and each "
                    "trial is an ordinary mpirl train run on --ranks-per-trial ranks of its own. "
                    "Options go before --, the train options every trial shares after it. The "
                    "tune directory holds trial_NNN/ run directories, tune.csv, pbt.jsonl and "
                    "result.json; SIGUSR1, SIGUSR2 or SIGTERM checkpoints every trial and exits "
                    "with code 75: continue with --resume TUNE_DIR.",
    )
    tune.add_argument("--scheduler", choices=SCHEDULERS, default="fifo",
                      help="fifo: run every trial to its --stop; pbt: Population-Based Training "
                           "(default fifo)")
    tune.add_argument("--population", type=int, default=4,
                      help="PBT: members, each on a slot of its own for the whole run (4)")
    tune.add_argument("--ranks-per-trial", type=int, default=2,
                      help="ranks of each trial: its driver and workers (2); the job needs 1 + "
                           "a multiple of it")
    tune.add_argument("--search", choices=SEARCHES, default="grid",
                      help="fifo: grid (every combination of the list values, other domains "
                           "drawn) or random draws (default grid)")
    tune.add_argument("--num-samples", type=int, default=1,
                      help="fifo: random draws, or repeats of the whole grid (1)")
    tune.add_argument("--space", metavar="JSON",
                      help='fifo: config keys to search, e.g. \'{"lr": [1e-4, 3e-4], '
                           '"ent_coef": {"uniform": [0, 0.01]}}\'')
    tune.add_argument("--mutations", metavar="JSON",
                      help="pbt: config keys to explore, same syntax as --space")
    tune.add_argument("--perturbation-interval", type=float, default=10,
                      help="pbt: exploit and explore every this many --time-attr units (10)")
    tune.add_argument("--time-attr", choices=TIME_ATTRS, default="training_iteration",
                      help="pbt: what --perturbation-interval counts (training_iteration)")
    tune.add_argument("--quantile-fraction", type=float, default=0.25,
                      help="pbt: the bottom fraction exploits the top fraction (0.25)")
    tune.add_argument("--resample-probability", type=float, default=0.25,
                      help="pbt: chance that explore draws a key afresh instead of perturbing "
                           "it (0.25)")
    tune.add_argument("--metric", default="episode_return_mean",
                      help="the progress.csv column that ranks trials (episode_return_mean)")
    tune.add_argument("--mode", choices=("max", "min"), default="max",
                      help="whether a higher or lower --metric is better (max)")
    tune.add_argument("--max-failures", type=int, default=0,
                      help="retries of a failed trial from its newest checkpoint (0)")
    tune.add_argument("--run-dir", help="the tune directory (default runs/tune-ALGO-ENV-TIME)")
    tune.add_argument("--resume", metavar="TUNE_DIR",
                      help="continue the population in TUNE_DIR: every unfinished trial from "
                           "its newest checkpoint")
    tune.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN ARGS",
                      help="the mpirl train options every trial shares: --algo, --env, "
                           "--config, --stop, --seed, --env-module")
