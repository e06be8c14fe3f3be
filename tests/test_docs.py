"""The docs: the README stays a five-minute read whose links resolve, every config key is in the
generated tables, and the MkDocs site builds with --strict."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpirl.execution.contract import ALGORITHMS

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
sys.path.insert(0, str(DOCS))
import hooks  # noqa: E402  (docs/hooks.py, the MkDocs hook that generates the key tables)


def test_the_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text) < 12_000, f"README.md is {len(text)} characters; the limit is 12,000"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README links to {target}, which does not exist"
    assert "make run" in text and "make test" in text


def markers() -> list[tuple[Path, str]]:
    return [(page, name) for page in sorted(DOCS.glob("*.md"))
            for name in hooks.MARKER.findall(page.read_text())]


@pytest.mark.parametrize("name", [*ALGORITHMS, *hooks.SETTINGS])
def test_every_key_is_in_the_generated_tables(name):
    pages = [page for page, marked in markers() if marked == name]
    assert pages, f"no docs page has <!-- config-keys: {name} -->"
    table = hooks.keys_table(name)
    for field in dataclasses.fields(hooks.config_class(name)):
        row = next((line for line in table.splitlines() if line.startswith(f"| `{field.name}`")),
                   None)
        assert row is not None, f"{name}: {field.name} is missing from its table"
        assert row.rsplit("|", 2)[1].strip(), f"{name}: {field.name} has no description"


def test_the_generated_tables_in_the_pages_are_current():
    """The key tables and the extras are committed in docs/*.md (readable on any code host);
    make docs-tables rewrites them."""
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        starts = len(re.findall(r"<!-- (?:config-keys: [\w.]+|extras) -->", text))
        assert starts == len(hooks.BLOCK.findall(text)), (
            f"docs/{page.name}: a generated block has no end marker (<!-- end config-keys --> "
            "or <!-- end extras -->)")
        assert hooks.fill(text) == text, f"docs/{page.name} is stale: run make docs-tables"


def test_every_extra_is_in_the_install_page():
    text = (DOCS / "install.md").read_text()
    for name in hooks.extras():
        assert f"| `{name}` |" in text, f"the extra {name} is not in docs/install.md"


def test_the_dev_extra_holds_every_extra_but_the_mpi_ones_and_the_peers():
    """install.md says so: make test runs every test, none skipped for a missing extra."""
    extras = {name: set(requirements) for name, (_, requirements) in hooks.extras().items()}
    for name, requirements in extras.items():
        if name not in ("openmpi", "mpich", "bench", "dev"):
            assert requirements <= extras["dev"], f"dev lacks {requirements - extras['dev']}"


def test_every_docs_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {page.name for page in DOCS.glob("*.md")}
    assert pages == set(re.findall(r"^\s+- [^:]+: (\S+\.md)$", nav, re.M))


def test_the_home_page_links_every_docs_page():
    """The site's nav lists every page, but a reader of docs/index.md on GitHub (or in an editor)
    sees only its links: alphazero.md, atari.md and models.md were not among them."""
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", (DOCS / "index.md").read_text()))
    assert {page.name for page in DOCS.glob("*.md")} - {"index.md"} - linked == set()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install 'mpirl[docs]')")
def test_the_site_builds_strict_with_every_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                           str(tmp_path / "site")], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    html = (tmp_path / "site" / "config-keys" / "index.html").read_text()
    assert "<!-- config-keys" not in html and "<!-- end" not in html  # markers dropped
    for name in [*ALGORITHMS, *hooks.SETTINGS]:
        for field in dataclasses.fields(hooks.config_class(name)):
            assert f"<code>{field.name}</code>" in html, f"{name}.{field.name} not in the site"


#: How the prose writes an algorithm whose registry key is not its usual name.
PROSE_NAMES = {"APEX": "Ape-X"}


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/python-api.md",
                                  "docs/algorithms.md"])
def test_every_built_in_algorithm_is_named_where_newcomers_look(page):
    """The pages that list the algorithms name every one in the registry, so a new algorithm
    cannot be left out of them (train --help is checked in test_cli_abbrev)."""
    text = " ".join((REPO / page).read_text().split())
    missing = [name for name in ALGORITHMS if name not in text and
               PROSE_NAMES.get(name, name) not in text]
    assert not missing, f"{page} does not name {missing}"
