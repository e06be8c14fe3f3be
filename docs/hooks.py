"""MkDocs hook: replaces ``<!-- config-keys: NAME -->`` in a page by the table of NAME's keys,
read from the dataclass's field docstrings, so the docs cannot drift from the code.

NAME is an algorithm (PPO, ..., or a plug-in module), or one of the settings in ``SETTINGS``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

MARKER = re.compile(r"<!-- config-keys: ([\w.]+) -->")

#: Settings that are not an algorithm's, by the name a page uses.
SETTINGS = {
    "layout": ("mpirl.runtime.layout", "Layout"),
    "runtime": ("mpirl.runtime.driver", "RuntimeSettings"),
    "checkpoints": ("mpirl.jobs.checkpoint", "CheckpointSettings"),
    "dumps": ("mpirl.data.dump_writer", "DumpSettings"),
}


def config_class(name: str) -> type:
    import importlib

    if name in SETTINGS:
        module, cls = SETTINGS[name]
        return getattr(importlib.import_module(module), cls)
    from mpirl.execution.contract import load_algorithm

    return load_algorithm(name).Config


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def keys_table(name: str) -> str:
    """A Markdown table of ``name``'s keys: key, default, meaning."""
    from mpirl.config.fields import field_docs

    cls = config_class(name)
    docs = field_docs(cls)
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for field in dataclasses.fields(cls):
        default = _default(field)
        shown = json.dumps(list(default) if isinstance(default, tuple) else default)
        meaning = " ".join(docs.get(field.name, "").split()).replace("|", "\\|")
        lines.append(f"| `{field.name}` | `{shown}` | {meaning} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(lambda match: keys_table(match.group(1)), markdown)
