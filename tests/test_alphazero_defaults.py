"""AlphaZero with the defaults a user gets (issue 47): every game docs/alphazero.md lists starts
and trains with no config (Connect Four's default evaluation has no minimax, which cannot solve
it), the live line shows the evaluation's win/draw/loss rates, evaluation searches with its own
simulations (not self-play's 16) without noise, and a game whose package is missing is refused
with one line that names the package first."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import mpi_env, train_refused_in_process

from mpirl.report.progress import ProgressDisplay

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
    # No gating by default: none of its columns (test_alphazero_cli's local-mode test has them).
    for i in range(len(games)):
        header = (tmp_path / f"run{i}" / "progress.csv").read_text().splitlines()[0].split(",")
        assert "sgd_steps_total" in header and not any("gating" in c for c in header), header


def test_the_live_line_shows_the_evaluation_not_the_self_play_return():
    """Which columns the line shows is the algorithm's config's (``live_columns``): AlphaZero's
    are its opponents' win/draw/loss rates; self-play's return (the first player's outcome) and
    game length are left out. Other algorithms keep return and length."""
    from mpirl.algorithms.alphazero.alphazero import Config
    from mpirl.algorithms.alphazero.game_env import GameEnvSpec
    from mpirl.algorithms.ppo import Config as PPOConfig

    columns = Config().live_columns(GameEnvSpec("openspiel/tic_tac_toe"))
    assert [label for label, _ in columns] == ["eval random w/d/l", "eval minimax w/d/l"]
    row = {"iteration": 10, "timesteps_total": 5000, "episode_return_mean": 0.3,
           "episode_len_mean": 8.3, "eval_random_win": 0.95, "eval_random_draw": 0.05,
           "eval_random_loss": 0.0, "eval_minimax_win": 0.0, "eval_minimax_draw": 1.0,
           "eval_minimax_loss": 0.0}
    out = io.StringIO()
    with ProgressDisplay("AlphaZero", mode="plain", stream=out, columns=columns,
                         stop={"training_iteration": 60}) as display:
        display.update(row)
    line = out.getvalue()
    assert "eval random w/d/l 0.95/0.05/0  eval minimax w/d/l 0/1/0" in line, line
    assert "return" not in line and "len " not in line, line

    assert PPOConfig().live_columns(None) is None
    out = io.StringIO()
    with ProgressDisplay("PPO", mode="plain", stream=out) as display:
        display.update(row)
    assert "return 0.3" in out.getvalue() and "len 8.3" in out.getvalue()


MISSING = [
    ("openspiel/tic_tac_toe",
     "openspiel/tic_tac_toe needs OpenSpiel: pip install 'mpirl[openspiel]'"),
    ("pettingzoo.classic.connect_four_v3",
     "pettingzoo.classic.connect_four_v3 needs PettingZoo: pip install 'mpirl[games]'"),
]


def test_a_missing_game_package_is_named_first(tmp_path):
    """``make run``'s venv has neither extra: the one line says which package and how to
    install it, first (it came last, after a sentence on what --env may be). OpenSpiel's case
    end to end, in a process of its own; PettingZoo's in this one (the next test)."""
    env, message = MISSING[0]
    script = textwrap.dedent(f"""
        import sys
        sys.modules["pyspiel"] = sys.modules["pettingzoo"] = None  # as if not installed
        from mpirl.cli import main
        sys.exit(main(["train", "--algo", "AlphaZero", "--env", {env!r},
                       "--run-dir", {str(tmp_path / "run")!r}]))
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=mpi_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"mpirl: error: {message}", proc.stderr


@pytest.mark.parametrize("env, message", MISSING)
def test_a_missing_game_package_is_named_first_in_process(tmp_path, capsys, monkeypatch, env,
                                                          message):
    """Each case through the CLI's main in pytest's process (the same refusal, without an
    interpreter's start-up and torch's import per case): every module of both packages,
    whatever this worker imported before, is made unimportable."""
    for name in [n for n in sys.modules if n.partition(".")[0] in ("pyspiel", "pettingzoo")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "pyspiel", None)
    monkeypatch.setitem(sys.modules, "pettingzoo", None)
    stderr = train_refused_in_process(tmp_path, capsys, "--algo", "AlphaZero", "--env", env)
    assert stderr.strip() == f"mpirl: error: {message}", stderr
