"""``python -m mpirl.envs.solver --include | --source | --fortran``: the path a solver's build
needs (the folder of mpirl_solver.h, mpirl_solver.c, or the Fortran module mpirl.f90)."""

from __future__ import annotations

import argparse
import sys

from mpirl.envs.solver import paths


def main(argv: list[str] | None = None) -> int:
    """Print the path each given flag asks for, one per line."""
    parser = argparse.ArgumentParser(
        prog="python -m mpirl.envs.solver",
        description="Print where mpirl's solver API is, for a solver's build: mpicc "
                    "-I$(python -m mpirl.envs.solver --include) solver.c "
                    "$(python -m mpirl.envs.solver --source)")
    for name, help_text in (("include", "the folder of mpirl_solver.h"),
                            ("source", "mpirl_solver.c, to compile into the solver"),
                            ("fortran", "mpirl.f90, the Fortran module over the C API")):
        parser.add_argument(f"--{name}", action="store_true", help=help_text)
    args = parser.parse_args(argv)
    wanted = [name for name in paths() if getattr(args, name)]
    if not wanted:
        parser.error("give --include, --source or --fortran")
    for name in wanted:
        print(paths()[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
