"""``"module:Name"`` settings: the user's environment, model, callbacks or policy, named by
where it lives, and imported on each rank that needs it.

Nothing crosses ranks: each rank imports the module itself, so it must be importable on every
rank (installed, or on ``PYTHONPATH``). A mistake is one ConfigError that says what was given,
what is wrong with it and what would be right.
"""

from __future__ import annotations

import importlib
from typing import Any

from mpirl.errors import ConfigError

__all__ = ["load_object"]


def load_object(spec: str, key: str, form: str = "module:Name") -> Any:
    """The object ``spec`` names: ``"package.module:Name"``, or ``"package.module:Class.attr"``
    for an attribute of an attribute. ``key`` is the setting it came from and ``form`` how that
    setting is written (``"module:Class"``, ``"module:function"``), both for the messages.

    A module that is found but raises something other than an import error while it is imported
    is a bug in that module, not a setting: its own traceback goes up unchanged.
    """
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise ConfigError(f"{key} {spec!r}: give it as {form!r}: the module's import path, a "
                          f"colon, then the name in that module")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(f"{key} {spec!r}: no module named {missing!r} (it must be "
                              f"importable on every rank: installed, or on PYTHONPATH)") from None
        raise ConfigError(f"{key} {spec!r}: module {module_name} was found, but it imports "
                          f"{missing!r}, which is not installed here") from None
    except ImportError as error:
        raise ConfigError(f"{key} {spec!r}: module {module_name} could not be imported: "
                          f"{error}") from None
    found: Any = module
    for part in name.split("."):
        found = getattr(found, part, _MISSING)
        if found is _MISSING:
            raise ConfigError(f"{key} {spec!r}: module {module_name} has no {_noun(form)} "
                              f"{name}")
    return found


_MISSING = object()


def _noun(form: str) -> str:
    """What the name after the colon of ``form`` stands for: class, function or attribute."""
    named = form.partition(":")[2].lower()
    return next((noun for noun in ("class", "function") if noun in named), "attribute")
