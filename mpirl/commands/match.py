"""``mpirl evaluate --opponent`` and ``mpirl play``: a checkpoint of an algorithm whose module
plays matches (its ``MATCHES``, AlphaZero's board games), in one process without MPI.

This finds the checkpoint and its algorithm; the games themselves are the module's
(``mpirl.execution.contract.Matches``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from mpirl.commands.evaluate import find_checkpoint
from mpirl.config.parse import positive_int_from_env
from mpirl.errors import ConfigError
from mpirl.execution.contract import Matches, load_algorithm, matches_of


def wants_match(path: str | Path, opponent: str | None, warn=None) -> bool:
    """Whether ``mpirl evaluate PATH`` plays matches: for a checkpoint of an algorithm that
    plays them, or whenever ``--opponent`` is given (a checkpoint of another kind is then
    refused by ``checkpoint_matches``)."""
    if opponent is not None:
        return True
    if Path(path).is_file():  # an exported policy: gymnasium episodes
        return False
    manifest = find_checkpoint(path, warn)[1]
    return matches_of(load_algorithm(manifest["algo"])) is not None


def checkpoint_matches(path: str | Path, warn=None
                       ) -> tuple[Matches, Path, dict[str, Any]]:
    """The matches of a checkpoint (or a run directory's newest), the checkpoint and its
    manifest; ConfigError for a checkpoint of an algorithm that plays none."""
    checkpoint, manifest = find_checkpoint(path, warn)
    matches = matches_of(load_algorithm(manifest["algo"]))
    if matches is None:
        raise ConfigError(f"{checkpoint} is a {manifest['algo']} checkpoint of "
                          f"{manifest['env']['env_id']}, not of a board game: --opponent and "
                          f"mpirl play are for AlphaZero's checkpoints; evaluate it with "
                          f"--episodes")
    return matches, checkpoint, manifest


#: The environment variable that caps the games of every board-game evaluation (``mpirl
#: evaluate --games``), as ``$MPIRL_MAX_ITERATIONS`` caps training: the docs' commands run as
#: written, in seconds.
MAX_GAMES_ENV = "MPIRL_MAX_GAMES"


def max_games_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """``$MPIRL_MAX_GAMES`` as a number of games, None when unset or empty; ConfigError when it
    is not a positive integer."""
    return positive_int_from_env(MAX_GAMES_ENV, "the most games an evaluation may play",
                                 environ)


def evaluate_match(path: str | Path, opponent: str, games: int, simulations: int | None = None,
                   seed: int = 0, warn=None) -> dict[str, Any]:
    """Play ``games`` games of the checkpoint's agent against ``opponent``, half moving first;
    the counts from the agent's side. ``simulations`` None searches as the run's evaluation."""
    if games < 1:
        raise ConfigError(f"--games must be at least 1, got {games}")
    cap = max_games_from_env()
    if cap is not None and cap < games:
        if warn is not None:
            warn(f"{MAX_GAMES_ENV}={cap}: this evaluation plays {cap} games, whatever --games "
                 "says")
        games = cap
    matches, checkpoint, manifest = checkpoint_matches(path, warn)
    return matches.evaluate(checkpoint, manifest, opponent, games, simulations, seed)


def match_report(summary: dict[str, Any], as_json: bool = False) -> str:
    """One line for the terminal (the algorithm's own), or the JSON object."""
    if as_json:
        return json.dumps(summary)
    return matches_of(load_algorithm(summary["algo"])).describe(summary)


def play_in_terminal(path: str | Path, simulations: int | None = None, first: bool = True,
                     seed: int = 0, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
                     warn=None) -> int:
    """A person against the checkpoint's agent in the terminal; the exit code."""
    matches, checkpoint, manifest = checkpoint_matches(path, warn)
    return matches.play(checkpoint, manifest, simulations, first, seed, stdin, stdout)
