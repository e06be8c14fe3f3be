"""The ``mpirl`` command. Every rank runs it; only rank 0 prints."""

from __future__ import annotations

import argparse
import sys

from mpirl.config import build, parse_json_object, split_by_dataclass
from mpirl.errors import MpirlError
from mpirl.layout import Layout
from mpirl.runtime import RuntimeSettings, run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpirl",
        description="Distributed reinforcement learning on MPI. Launch with mpiexec or srun; "
                    "rank 0 drives, the other ranks are rollout, replay and learner workers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor", help="check that every rank starts, answers and moves data; print the layout",
    )
    doctor.add_argument(
        "--config", default="{}", metavar="JSON",
        help='layout and runtime keys, e.g. \'{"num_learners": 1, "num_replay_shards": 0}\'',
    )
    doctor.add_argument("--pings", type=int, default=200, help="round trips timed per worker")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "doctor":
            from mpirl.doctor import run_doctor

            layout_keys, runtime_keys = split_by_dataclass(
                parse_json_object(args.config, "--config"), Layout, RuntimeSettings
            )
            layout = build(Layout, layout_keys)
            settings = build(RuntimeSettings, runtime_keys)
            return run(lambda driver: run_doctor(driver, pings=args.pings), layout, settings)
    except MpirlError as error:
        _print_on_rank0(f"mpirl: error: {error}")
        return error.exit_code
    raise AssertionError(f"unhandled command {args.command}")


def _print_on_rank0(message: str) -> None:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
