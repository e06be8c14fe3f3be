"""The layout: mpirl's subpackages form layers, none imports a higher one, and there are no cycles.

Every import counts: module level, inside functions (a lazy import is no way around a layer) and
under ``TYPE_CHECKING``; so does ``importlib.import_module`` called with a literal module name
(``importlib.import_module("mpirl.models.policy")``, or ``import_module`` imported from
importlib), which is an import statement by another name.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Lowest first. A module may import its own layer and the ones below it, never one above.
LAYERS = ("errors", "config", "runtime", "report", "jobs", "envs", "search", "models", "data",
          "workers", "execution", "algorithms", "top")
#: The modules on top: the commands and the public entry points.
TOP = {"commands", "cli", "api", "io", "testing", "__main__", "callbacks", "tune"}


def module_files(root: Path = REPO) -> dict[str, Path]:
    files = {}
    for path in sorted((root / "mpirl").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    # algorithms/ is installed as mpirl.algorithms; a family's folder is a package in it.
    for path in sorted((root / "algorithms").rglob("*.py")):
        parts = path.relative_to(root / "algorithms").with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(("mpirl", "algorithms", *parts))] = path
    return files


def imported_names(source: str, package: str) -> set[str]:
    """Every module name ``source`` (a module of ``package``) imports: its import statements,
    and its calls of ``importlib.import_module`` with a literal name. A name computed at run
    time (``load_algorithm``'s user-given module, ``import_module(ALGORITHMS[name])``) is no
    edge: the graph is of what the code itself names, and a literal that is only data (the
    module paths in ``ALGORITHMS``, ``mpirl._EXPORTS``) imports nothing until some code passes it
    on, which the reader sees at that call."""
    tree = ast.parse(source)
    # The names under which this module reaches importlib and its import_module.
    importlib_names, import_module_names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            importlib_names |= {a.asname or a.name for a in node.names if a.name == "importlib"}
        elif isinstance(node, ast.ImportFrom) and node.module == "importlib" and not node.level:
            import_module_names |= {a.asname or a.name for a in node.names
                                    if a.name == "import_module"}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Call) and _calls_import_module(node.func, importlib_names,
                                                                 import_module_names):
            name = _literal(node.args[0] if node.args else None)
            if name is None:
                continue
            if name.startswith("."):  # relative to the package argument, or to this package
                anchor = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "package"), None)
                name = importlib.util.resolve_name(name, _literal(anchor) or package)
            names.add(name)
    return names


def _calls_import_module(func: ast.expr, importlib_names: set[str],
                         import_module_names: set[str]) -> bool:
    if isinstance(func, ast.Attribute):
        return (func.attr == "import_module" and isinstance(func.value, ast.Name)
                and func.value.id in importlib_names)
    return isinstance(func, ast.Name) and func.id in import_module_names


def _literal(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the mpirl modules it imports anywhere in its text."""
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        graph[name] = {target for target in imported_names(path.read_text(), package)
                       if target in files and target != name}
    return graph


def layer_of(module: str) -> int:
    if module == "mpirl":
        return len(LAYERS) - 1
    top = module.split(".")[1]
    return LAYERS.index("top" if top in TOP else top)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a higher layer, as a line."""
    return [f"{m} ({LAYERS[layer_of(m)]}) imports {t} ({LAYERS[layer_of(t)]})"
            for m, targets in graph.items() if m != "mpirl" for t in sorted(targets)
            if t != "mpirl" and layer_of(t) > layer_of(m)]


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle a depth-first walk of ``graph`` meets, as ``a -> b -> a``."""
    graph = {m: {t for t in ts if t != "mpirl"} for m, ts in graph.items() if m != "mpirl"}
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
    return cycles


def test_every_module_has_a_layer():
    unknown = [m for m in import_graph() if m != "mpirl" and m.split(".")[1] not in TOP
               and m.split(".")[1] not in LAYERS]
    assert not unknown, f"modules outside every layer (add them to LAYERS or TOP): {unknown}"


def test_no_module_imports_a_higher_layer():
    upward = upward_imports(import_graph())
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _tree(root: Path, sources: dict[str, str]) -> Path:
    for name, text in sources.items():
        path = root.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_import_module_with_a_literal_name_is_an_import(tmp_path):
    """The three cycles that hid in models/ behind ``importlib.import_module("mpirl....")`` are
    found, however import_module is reached; a layer is crossed the same way. Names computed at
    run time, and module paths kept as data, are no edges (see ``imported_names``)."""
    root = _tree(tmp_path, {
        "mpirl.__init__": "",
        "mpirl.models.__init__": "",
        "mpirl.models.spec": ("import importlib\n\ndef build():\n"
                              "    return importlib.import_module('mpirl.models.network')\n"),
        "mpirl.models.network": "from mpirl.models.spec import build\n",
        "mpirl.models.q_spec": ("from importlib import import_module as load\n\ndef build():\n"
                                "    return load('.q_network', 'mpirl.models')\n"),
        "mpirl.models.q_network": "import mpirl.models.q_spec\n",
        "mpirl.models.rules": ("import importlib as il\n"
                               "NETWORK = il.import_module('.search', package=__package__)\n"),
        "mpirl.models.search": "from mpirl.models import rules\n",
        "mpirl.runtime.__init__": "",
        "mpirl.runtime.engine": ("import importlib\n"
                                 "MODELS = {'spec': 'mpirl.models.spec'}\n"
                                 "def load(name):\n"
                                 "    importlib.import_module(MODELS[name])\n"
                                 "    importlib.import_module(name)\n"
                                 "    return importlib.import_module('mpirl.models.search')\n"),
        "mpirl.runtime.plain": "import importlib\nPATHS = ['mpirl.models.spec']\n",
    })
    graph = import_graph(root)
    assert graph["mpirl.models.spec"] == {"mpirl.models.network"}
    assert graph["mpirl.models.q_spec"] == {"mpirl.models.q_network"}
    assert graph["mpirl.models.rules"] == {"mpirl.models.search"}
    assert graph["mpirl.runtime.engine"] == {"mpirl.models.search"}
    assert graph["mpirl.runtime.plain"] == set()
    assert sorted(import_cycles(graph)) == [
        "mpirl.models.network -> mpirl.models.spec -> mpirl.models.network",
        "mpirl.models.q_network -> mpirl.models.q_spec -> mpirl.models.q_network",
        "mpirl.models.rules -> mpirl.models.search -> mpirl.models.rules"]
    assert upward_imports(graph) == [
        "mpirl.runtime.engine (runtime) imports mpirl.models.search (models)"]


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
