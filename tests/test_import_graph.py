"""The layout: mpirl's subpackages form layers, none imports a higher one, and there are no cycles.

Every import counts: module level, inside functions (a lazy import is no way around a layer) and
under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Lowest first. A module may import its own layer and the ones below it, never one above.
LAYERS = ("errors", "config", "runtime", "report", "jobs", "envs", "models", "data", "workers",
          "execution", "algorithms", "top")
#: The modules on top: the commands and the public entry points.
TOP = {"commands", "cli", "api", "io", "testing", "__main__", "callbacks", "tune"}


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((REPO / "mpirl").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    for path in sorted((REPO / "algorithms").glob("*.py")):
        name = "mpirl.algorithms" if path.stem == "__init__" else f"mpirl.algorithms.{path.stem}"
        files[name] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """Module -> the mpirl modules it imports anywhere in its text."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target in files and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int:
    if module == "mpirl":
        return len(LAYERS) - 1
    top = module.split(".")[1]
    return LAYERS.index("top" if top in TOP else top)


def test_every_module_has_a_layer():
    unknown = [m for m in import_graph() if m != "mpirl" and m.split(".")[1] not in TOP
               and m.split(".")[1] not in LAYERS]
    assert not unknown, f"modules outside every layer (add them to LAYERS or TOP): {unknown}"


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    upward = [f"{m} ({LAYERS[layer_of(m)]}) imports {t} ({LAYERS[layer_of(t)]})"
              for m, targets in graph.items() if m != "mpirl" for t in sorted(targets)
              if t != "mpirl" and layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = {m: {t for t in ts if t != "mpirl"} for m, ts in import_graph().items()
             if m != "mpirl"}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_engine_imports_no_rl():
    graph = import_graph()
    rl = [f"{m} imports {t}" for m, ts in graph.items() if m.startswith("mpirl.runtime")
          for t in ts if not (t.startswith("mpirl.runtime") or t == "mpirl.errors")]
    assert not rl, "\n".join(rl)


def test_importing_the_engine_loads_neither_torch_nor_gymnasium():
    engine = sorted(m for m in module_files() if m.startswith("mpirl.runtime"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in engine)
            + "print(sorted(m for m in ('torch', 'gymnasium', 'h5py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {engine} loaded {out.stdout.strip()}"


@pytest.mark.parametrize("name", ["run", "Worker", "wait", "WorkerGroup", "Driver", "Layout",
                                  "RankContext", "RuntimeSettings", "MpirlError"])
def test_public_names_keep_working(name):
    out = subprocess.run([sys.executable, "-c", f"import mpirl; print(mpirl.{name}.__name__)"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == name, out.stderr


def test_the_cli_and_the_launch_supervisor_load_neither_torch_nor_mpi():
    # `mpirl --help`, argument errors and `mpirl launch` (which runs outside MPI) answer at once:
    # torch costs about 1 s to import, and mpi4py.MPI makes the process an MPI singleton.
    code = ("import sys\nimport mpirl.cli, mpirl.jobs.launch\n"
            "print(sorted(m for m in ('torch', 'tensorboardX', 'gymnasium', 'mpi4py.MPI')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing the CLI loaded {out.stdout.strip()}"
