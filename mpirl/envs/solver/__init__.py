"""The C API a solver program links to couple itself to an mpirl run (MPMD), and its Fortran
module: ``mpirl_solver.h``, ``mpirl_solver.c`` and ``mpirl.f90``, installed with the package.
``python -m mpirl.envs.solver --include | --source | --fortran`` prints where they are::

    mpicc -I$(python -m mpirl.envs.solver --include) solver.c \\
        $(python -m mpirl.envs.solver --source) -o solver
"""

from __future__ import annotations

from pathlib import Path

#: The folder of the three files.
SOLVER_DIR = Path(__file__).resolve().parent
HEADER = SOLVER_DIR / "mpirl_solver.h"
SOURCE = SOLVER_DIR / "mpirl_solver.c"
FORTRAN_MODULE = SOLVER_DIR / "mpirl.f90"


def paths() -> dict[str, Path]:
    """What each flag of ``python -m mpirl.envs.solver`` prints."""
    return {"include": SOLVER_DIR, "source": SOURCE, "fortran": FORTRAN_MODULE}
