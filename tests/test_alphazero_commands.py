"""``mpirl evaluate --opponent`` and ``mpirl play`` on an AlphaZero checkpoint (issue 38): counts
from the agent's side, JSON, a user's player that cheats forfeits, a person's moves on stdin, and
each bad input refused in one line."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
from conftest import OS_TTT, cli_in_process, mpi_env
from mpirl.algorithms.alphazero.alphazero import Config
from test_train import MPIRL

from mpirl.commands.match import evaluate_match

pytest.importorskip("pyspiel")

QUICK = {"games_per_worker": 8, "sgd_steps_per_iteration": 8, "train_batch_size": 32,
         "evaluation_interval": 100, "simulations": 8}


def mpirl(*args, stdin=None, env=None, timeout=120):
    return subprocess.run([*MPIRL, *args], capture_output=True, text=True, input=stdin,
                          timeout=timeout, env=env or mpi_env())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("alphazero") / "run"
    proc = mpirl("train", "--algo", "AlphaZero", "--env", OS_TTT, "--config",
                 json.dumps(QUICK), "--stop", '{"training_iteration": 3}', "--run-dir",
                 str(path))
    assert proc.returncode == 0, proc.stderr
    return path


def test_evaluate_against_an_opponent_prints_counts_and_json(run_dir):
    proc = mpirl("evaluate", str(run_dir), "--opponent", "minimax", "--games", "6", "--json",
                 "--simulations", "4")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["games"] == 6 == summary["wins"] + summary["draws"] + summary["losses"]
    assert summary["wins"] == 0  # nobody beats minimax at tic-tac-toe
    assert (summary["opponent"], summary["simulations"], summary["iteration"]) == \
        ("minimax", 4, 3)

    # Without --simulations the agent searches as the run's evaluation does (issue 47), not
    # with self-play's 8 (or the raw policy): in process, to keep it cheap.
    default = evaluate_match(run_dir, "random", 2)
    assert default["simulations"] == Config().evaluation_simulations == 100, default

    runs = [mpirl("evaluate", str(run_dir), "--games", "4", "--simulations", "0")
            for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert "raw policy) against random: 4 games, half moving first:" in runs[0].stdout
    assert runs[0].stdout == runs[1].stdout  # the same seed, the same games


def test_a_user_player_that_moves_illegally_forfeits_with_a_warning(run_dir, tmp_path):
    (tmp_path / "cheater.py").write_text(textwrap.dedent("""
        class Cheater:
            def act(self, observation, action_mask):
                return int((~action_mask).argmax()) if not action_mask.all() else 0
    """))
    env = {**mpi_env(), "PYTHONPATH": str(tmp_path)}
    proc = mpirl("evaluate", str(run_dir), "--opponent", "cheater:Cheater", "--games", "4",
                 "--json", "--simulations", "0", env=env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    # Moving first, the cheater's first move is legal (an empty board); after that it cheats.
    assert summary["opponent_forfeits"] == 4 == summary["wins"], summary
    assert "player cheater:Cheater returned the illegal move" in proc.stderr


BAD_MATCH_INPUT = [
    (["--opponent", "nobody"], "is not a player"),
    (["--opponent", "mcts:-3"], "mcts needs a positive whole number"),
    (["--opponent", "mcts:0"], "mcts needs a positive whole number"),
    (["--games", "0"], "--games must be at least 1"),
    (["--simulations", "-1"], "--simulations must be 0"),
]


def test_bad_match_input_exits_2_in_one_line(run_dir):
    """One refusal end to end, through the console script."""
    args, message = BAD_MATCH_INPUT[0]
    proc = mpirl("evaluate", str(run_dir), *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", BAD_MATCH_INPUT)
def test_bad_match_input_is_refused_in_one_line(run_dir, capsys, args, message):
    """Each refusal, the CLI's main called in process (the same code path, no interpreter
    start-up per case)."""
    code, stderr = cli_in_process(capsys, "evaluate", str(run_dir), *args)
    assert code == 2, stderr
    assert message in stderr and "Traceback" not in stderr, stderr


def test_an_opponent_for_a_gymnasium_checkpoint_is_refused(tmp_path, capsys):
    run = tmp_path / "ppo"
    proc = mpirl("train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run),
                 "--stop", '{"training_iteration": 1}')
    assert proc.returncode == 0, proc.stderr
    proc = mpirl("evaluate", str(run), "--opponent", "random")
    assert proc.returncode == 2 and "not of a board game" in proc.stderr, proc.stderr
    code, stderr = cli_in_process(capsys, "play", str(run))  # the same check, in process
    assert code == 2 and "not of a board game" in stderr, stderr


def test_play_in_the_terminal(run_dir):
    # Every cell in turn: illegal or malformed lines are refused and asked again.
    moves = "x\n" + "\n".join(str(cell) for cell in range(9)) * 3 + "\n"
    proc = mpirl("play", str(run_dir), "--simulations", "2", stdin=moves)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "'x' is not a legal move" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] in ("you win", "you lose", "draw")
    assert "agent plays" in proc.stdout

    proc = mpirl("play", str(run_dir), "--second", stdin="q\n")
    assert proc.returncode == 1 and "game abandoned" in proc.stdout
    assert proc.stdout.count("agent plays") == 1  # the agent opened


def test_a_gating_runs_checkpoint_plays_its_best_network(tmp_path):
    import pickle

    import numpy as np
    from mpirl.algorithms.alphazero.alphazero import MATCHES

    from mpirl.commands.evaluate import find_checkpoint

    run = tmp_path / "gated"
    # Gating and evaluation search 4 simulations a move, not the default 100: whatever the
    # gating at 2 decided, iteration 3 trained after it, so best and newest differ.
    config = {**QUICK, "gating": True, "gating_games": 4, "evaluation_interval": 2,
              "evaluation_games": 2, "evaluation_simulations": 4}
    proc = mpirl("train", "--algo", "AlphaZero", "--env", OS_TTT, "--config",
                 json.dumps(config), "--stop", '{"training_iteration": 3}', "--run-dir",
                 str(run))
    assert proc.returncode == 0, proc.stderr
    checkpoint = run / "checkpoints" / "checkpoint_000003"
    with open(checkpoint / "driver.pkl", "rb") as file:
        best = pickle.load(file)["plan"]["best"]
    with open(checkpoint / "learner_0.pkl", "rb") as file:
        newest = pickle.load(file)["weights"]
    assert not np.array_equal(best, newest)  # iteration 3 trained after the gating at 2
    agent = MATCHES.load_agent(*find_checkpoint(run))
    played = agent.evaluate.model.get_flat_weights()
    assert np.array_equal(played, best)
