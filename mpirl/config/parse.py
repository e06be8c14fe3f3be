"""Turning user input (JSON on the command line) into typed config dataclasses, with clear errors.

Every rank parses the same command line, so a bad key fails on every rank at once, before any
communication; only rank 0 prints the message.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from mpirl.config.fields import check_ranges
from mpirl.errors import ConfigError

__all__ = ["build", "positive_int_from_env"]

T = TypeVar("T")


def parse_json_object(text: str, flag: str) -> dict[str, Any]:
    """Parse ``text`` given to ``flag`` as a JSON object, or raise ConfigError saying why.
    ``@path`` reads the object from that file (for instance a tuned config from
    ``examples/tuned/``)."""
    source = text
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as error:
            raise ConfigError(f"{flag} {source}: cannot read {str(path)!r} "
                              f"({error.strerror or error}); give @ a JSON file's path, "
                              f"or the JSON object itself") from None
        source = f"{path} (from {flag} @)"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{flag} is not valid JSON ({error.msg} at character {error.pos}): "
            f"{source if source != text else repr(text)}. "
            f"Example: {flag} '{{\"num_rollout_workers\": 2}}' or {flag} @tuned.json"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object like '{{\"key\": value}}', "
                          f"got {text!r}" + (f" in {source}" if source != text else ""))
    return value


#: Longest list of known keys an unknown-key error spells out; a longer one (a config's ~75
#: keys) would bury the did-you-mean, so the error points to where every key is described.
MAX_KEYS_LISTED = 12
#: Where every config key is described, with its default (generated from the code).
CONFIG_KEYS_DOC = "docs/config-keys.md"


def check_known_keys(given: Mapping[str, Any], known: list[str], what: str) -> None:
    """Raise ConfigError for the first key of ``given`` not in ``known``, naming close matches
    and the known keys (or, when they are many, where they are listed)."""
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            listed = (f"Known keys: {', '.join(sorted(known))}." if len(known) <= MAX_KEYS_LISTED
                      else f"Every {what} key is listed in {CONFIG_KEYS_DOC}.")
            raise ConfigError(f"unknown {what} key {key!r}.{hint} {listed}")


def split_by_dataclass(values: Mapping[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Split one flat dict of config keys among dataclasses; unknown keys are a ConfigError."""
    names = [[f.name for f in dataclasses.fields(cls)] for cls in classes]
    check_known_keys(values, [n for group in names for n in group], "config")
    return [{k: v for k, v in values.items() if k in group} for group in names]


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls(**values)`` with type errors and out-of-range numbers (``RANGES``) turned into
    ConfigError naming the key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    check_known_keys(values, list(fields), "config")
    check_ranges(cls, values)
    for key, value in values.items():
        default = fields[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
            isinstance(value, bool) or not isinstance(value, (int, float))
        ):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float):
            raise ConfigError(f"config key {key!r} must be a whole number, got {value!r}")
    # JSON has lists where the dataclasses keep tuples (hidden_sizes, say).
    values = {k: tuple(v) if isinstance(fields[k].default, tuple) and isinstance(v, list) else v
              for k, v in values.items()}
    return cls(**values)


def positive_int_from_env(name: str, what: str, environ: Mapping[str, str] = os.environ
                          ) -> int | None:
    """``$name`` as a positive integer, None when unset or empty; ConfigError naming ``what``
    (what the number counts) when it is anything else."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"${name} must be a positive integer ({what}), got {environ[name]!r}")
    return value
