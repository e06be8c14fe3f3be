"""AlphaZero with the defaults a user gets (issue 47): every game docs/alphazero.md lists starts
and trains with no config (Connect Four's default evaluation has no minimax, which cannot solve
it), the live line shows the evaluation's win/draw/loss rates, evaluation searches with its own
simulations (not self-play's 16) without noise, and a game whose package is missing is refused
with one line that names the package first."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import mpi_env

pytest.importorskip("pyspiel")
pytest.importorskip("pettingzoo")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "alphazero.md"


def listed_games() -> list[str]:
    """The game ids the Games section of docs/alphazero.md names (in backticks)."""
    section = DOCS.read_text().split("## Games", 1)[1].split("\n## ", 1)[0]
    return sorted({name for name in re.findall(r"`([^`]+)`", section)
                   if name.startswith(("openspiel/", "pettingzoo.")) and "<" not in name})


def test_every_listed_game_trains_with_the_defaults(tmp_path):
    """One iteration of each game with no config, in one local-mode process (one import of
    torch for all): before the fix Connect Four was refused at start, its default evaluation
    naming minimax, which cannot solve it. The live line of each names the evaluation."""
    games = listed_games()
    assert {"openspiel/tic_tac_toe", "openspiel/connect_four", "pettingzoo.classic.tictactoe_v3",
            "pettingzoo.classic.connect_four_v3"} <= set(games), games
    script = textwrap.dedent(f"""
        import mpirl
        for i, game in enumerate({games!r}):
            row = mpirl.train("AlphaZero", game, stop={{"training_iteration": 1}},
                              run_dir={str(tmp_path)!r} + f"/run{{i}}", progress="plain")
            print("trained", game, row["timesteps_total"], flush=True)
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=mpi_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    for game in games:
        assert re.search(rf"^trained {re.escape(game)} [1-9]", proc.stdout, re.M), proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter 1/1")]
    assert len(lines) == len(games), proc.stdout
    for line in lines:
        assert "eval random w/d/l -/-/-" in line and "return" not in line, line
    assert sum("eval minimax w/d/l" in line for line in lines) == 2, lines  # the tic-tac-toes
