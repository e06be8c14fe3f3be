"""The built-in algorithms are written as a user's plug-in is (docs/plugins.md): every name that
``algorithms/`` imports from mpirl is published, in the ``__all__`` of the module it comes from
or of a package above it that re-exports the same object. A name outside that is mpirl's
internals, which may change without notice: a built-in that needs one shows what the public API
lacks. The modules checked are whatever ``algorithms/`` imports today."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALGORITHMS = REPO / "algorithms"


def imported_names() -> list[tuple[str, str, str]]:
    """(file, module, name) for each ``from mpirl.X import NAME`` in algorithms/, the
    algorithms' imports of each other left out (a family's own modules)."""
    found = []
    for path in sorted(ALGORITHMS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == "mpirl"
                    and not node.module.startswith("mpirl.algorithms")):
                found += [(str(path.relative_to(REPO)), node.module, alias.name)
                          for alias in node.names]
    return found


def published(module_name: str, name: str) -> bool:
    """Whether ``name``, as ``module_name`` has it, is in the ``__all__`` of that module or of
    a package above it (the same object)."""
    module = importlib.import_module(module_name)
    value = getattr(module, name)
    parts = module_name.split(".")
    for depth in range(len(parts), 0, -1):
        package = importlib.import_module(".".join(parts[:depth]))
        if name in getattr(package, "__all__", ()) and getattr(package, name, None) is value:
            return True
    return False


def test_the_builtins_import_only_published_names():
    names = imported_names()
    assert names, "no imports from mpirl found under algorithms/"
    unpublished = sorted({f"{module}.{name} (in {file})" for file, module, name in names
                          if not published(module, name)})
    assert not unpublished, ("algorithms/ imports names no __all__ publishes; add them to their "
                             "module's __all__ (or stop using them):\n  "
                             + "\n  ".join(unpublished))
