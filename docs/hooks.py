"""The generated parts of docs/*.md, and the MkDocs hook that keeps the site current.

A page marks each generated block with a start and an end marker::

    <!-- config-keys: PPO -->
    | key | default | meaning |
    ...
    <!-- end config-keys -->

``config-keys: NAME`` is the table of NAME's keys (an algorithm, a plug-in module, or one of
``SETTINGS``), read from the dataclass's field docstrings; ``extras`` is the table of setup.py's
extras. The blocks are committed, so the pages read right on any code host: ``make docs-tables``
(``python docs/hooks.py``) rewrites them in place, and tests/test_docs.py fails while one is stale.
When the site is built, the hook puts in fresh tables and drops the markers, so the site cannot
drift from the code either.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
SETUP = DOCS.parent / "setup.py"

#: A start marker of a key table (tests/test_docs.py finds the tables by it).
MARKER = re.compile(r"<!-- config-keys: ([\w.]+) -->")
#: A whole generated block: start marker, body, end marker.
BLOCK = re.compile(r"<!-- (?P<kind>config-keys|extras)(?:: (?P<name>[\w.]+))? -->\n"
                   r"(?P<body>.*?)<!-- end (?P=kind) -->", re.S)

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


def extras() -> dict[str, tuple[str, list[str]]]:
    """setup.py's ``EXTRAS`` literal (name -> (what it is for, requirements)), read without
    running setup.py."""
    tree = ast.parse(SETUP.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "EXTRAS"
                                                for target in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{SETUP} has no EXTRAS literal")


def extras_table() -> str:
    """A Markdown table of the extras: name, what it is for, what it installs."""
    lines = ["| extra | for | installs |", "| --- | --- | --- |"]
    for name, (purpose, requirements) in extras().items():
        installed = ", ".join(f"`{requirement}`" for requirement in requirements)
        lines.append(f"| `{name}` | {purpose} | {installed} |")
    return "\n".join(lines)


def generated(kind: str, name: str | None) -> str:
    return keys_table(name) if kind == "config-keys" else extras_table()


def fill(markdown: str, *, keep_markers: bool = True) -> str:
    """``markdown`` with every generated block made afresh; without its markers (the site's
    HTML would carry them as comments) unless ``keep_markers``."""

    def block(match: re.Match) -> str:
        body = generated(match["kind"], match["name"])
        if not keep_markers:
            return body + "\n"
        # Blank lines around the table: some Markdown renderers take a table that touches an
        # HTML comment for part of the comment's block.
        start = match.group(0).partition("\n")[0]
        return f"{start}\n\n{body}\n\n<!-- end {match['kind']} -->"

    return BLOCK.sub(block, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return fill(markdown, keep_markers=False)


def write_pages() -> list[Path]:
    """Rewrite the generated blocks of every page in docs/; returns the pages that changed."""
    changed = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        new = fill(text)
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


if __name__ == "__main__":
    pages = write_pages()
    print("updated: " + ", ".join(page.name for page in pages) if pages
          else "docs/*.md: every generated table is current")
