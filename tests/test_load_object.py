"""``mpirl.config.imports.load_object``: the one loader of ``"module:Name"`` settings, and the
one-line message for each way a setting can be wrong."""

from __future__ import annotations

import collections
import json
import sys

import pytest

from mpirl.config.imports import load_object
from mpirl.errors import ConfigError


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Modules of a user's own on sys.path: one that imports a package that is not installed,
    one that imports a name its dependency lacks, one whose own code fails."""
    (tmp_path / "needs_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "imports_a_missing_name.py").write_text("from json import no_such_name\n")
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('a bug in the module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("needs_missing_dep", "imports_a_missing_name", "raises_on_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_loads_a_name_and_a_dotted_attribute():
    assert load_object("json:dumps", "k") is json.dumps
    assert load_object("collections:OrderedDict.fromkeys", "k") == \
        collections.OrderedDict.fromkeys


@pytest.mark.parametrize(("spec", "form", "message"), [
    ("json", "module:Class", "callbacks 'json': give it as 'module:Class': the module's import "
                             "path, a colon, then the name in that module"),
    ("json:", "module:Name", "callbacks 'json:': give it as 'module:Name'"),
    (":dumps", "module:function", "callbacks ':dumps': give it as 'module:function'"),
    ("no_such_module_xyz:Probe", "module:Class",
     "callbacks 'no_such_module_xyz:Probe': no module named 'no_such_module_xyz' (it must be "
     "importable on every rank: installed, or on PYTHONPATH)"),
    ("json.no_such_part:Probe", "module:Class",
     "callbacks 'json.no_such_part:Probe': no module named 'json.no_such_part'"),
    ("needs_missing_dep:Probe", "module:Class",
     "callbacks 'needs_missing_dep:Probe': module needs_missing_dep was found, but it imports "
     "'no_such_dependency_xyz', which is not installed here"),
    ("imports_a_missing_name:Probe", "module:Class",
     "callbacks 'imports_a_missing_name:Probe': module imports_a_missing_name could not be "
     "imported: cannot import name 'no_such_name' from 'json'"),
    ("json:Probe", "module:Class", "callbacks 'json:Probe': module json has no class Probe"),
    ("json:probe", "module:function",
     "callbacks 'json:probe': module json has no function probe"),
    ("json:JSONDecoder.nope", "module:Name",
     "callbacks 'json:JSONDecoder.nope': module json has no attribute JSONDecoder.nope"),
])
def test_each_mistake_is_one_line_that_says_what_is_wrong(user_modules, spec, form, message):
    with pytest.raises(ConfigError) as error:
        load_object(spec, "callbacks", form)
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)
    # No chained import error under it: the message is all the user sees.
    assert error.value.__cause__ is None
    assert error.value.__context__ is None or error.value.__suppress_context__


def test_a_module_whose_own_code_fails_keeps_its_traceback(user_modules):
    # Not a mistake in the setting but a bug in the module: the error itself says where.
    with pytest.raises(RuntimeError, match="a bug in the module"):
        load_object("raises_on_import:Probe", "callbacks")
