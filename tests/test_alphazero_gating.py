"""AlphaZero's matches on the rollout ranks and its gating (issue 38): the driver splits a match
over the rollout workers (``split_match``), each plays its share (``SelfPlayWorker.
play_matches``) with an rng of the driver's seeding, and with ``gating`` a candidate replaces the
best network only if it scores at least ``gating_threshold`` (wins plus half the draws)."""

from __future__ import annotations

import json
import math
import socket
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import OS_TTT
from mpi4py import MPI
from mpirl.algorithms.alphazero.alphazero import AlphaZeroState, Config, split_match, training_step
from mpirl.algorithms.alphazero.game_env import GameEnvSpec
from mpirl.algorithms.alphazero.self_play_worker import MatchShare, SelfPlaySettings, SelfPlayWorker
from mpirl.algorithms.alphazero.spec import alphazero_spec
from test_train import rows, train

from mpirl.commands.evaluate import find_checkpoint
from mpirl.runtime.core import RankContext
from mpirl.runtime.layout import Layout
from mpirl.runtime.state_files import read_state_file

pytest.importorskip("pyspiel")


@pytest.mark.parametrize("games, workers", [(1, 1), (20, 2), (21, 2), (7, 3), (2, 5), (40, 7)])
def test_split_match_covers_the_games_and_moves_first_in_half(games, workers):
    shares = split_match(games, workers)
    assert len(shares) == workers
    assert sum(count for count, _ in shares) == games
    assert sum(first for _, first in shares) == (games + 1) // 2
    assert all(0 <= first <= count for count, first in shares)
    assert max(c for c, _ in shares) - min(c for c, _ in shares) <= 1


def self_play_worker(game_id: str = OS_TTT) -> SelfPlayWorker:
    env = GameEnvSpec(game_id)
    config = Config(simulations=4, games_per_worker=2)
    settings = SelfPlaySettings.from_config(
        config, env=env, policy=alphazero_spec(env.game(), channels=8, blocks=1,
                                               value_hidden=8))
    context = RankContext(0, "rollout", 0, 1, Layout().resolve(1), None, MPI.COMM_SELF, None,
                          socket.gethostname(), "cpu")
    return SelfPlayWorker(context, settings)


def test_a_worker_plays_its_share_reproducibly_and_leaves_self_play_alone():
    worker = self_play_worker()
    weights = worker.get_weights()
    rng_state = worker.rng.bit_generator.state
    shares = [MatchShare(opponent="random", games=6, first=3, seed=11),
              MatchShare(opponent=weights * 0.5, games=4, first=2, seed=12, simulations=4,
                         weights=weights, opening_moves=2)]
    first = worker.play_matches(shares)
    assert worker.play_matches(shares) == first
    for share, result in zip(shares, first, strict=True):
        assert result["games"] == share.games
        assert result["wins"] + result["draws"] + result["losses"] == share.games
    assert np.array_equal(worker.get_weights(), weights)
    assert worker.rng.bit_generator.state == rng_state


class FakeWorker:
    """A rollout handle whose matches end as ``outcome`` says: per share, the counts of
    ``outcome(share)``; it records the shares and the weights it is given."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome
        self.shares: list[MatchShare] = []
        self.weights = None

    def call_async(self, method, *args):
        if method == "play_matches":
            self.shares += args[0]
            value = [self.outcome(share) for share in args[0]]
        else:
            assert method == "set_weights"
            self.weights, value = args[0], None
        return SimpleNamespace(result=lambda: value)


class FakeGroup(list):
    def call(self, method, *args):
        return [worker.call_async(method, *args).result() for worker in self]


def fake_trainer(outcome, workers: int = 2):
    learner_weights = {"w": np.zeros(3, np.float32)}

    class Learner:
        def call(self, method, *args):
            return learner_weights["w"].copy() if method == "get_weights" else None

    config = Config(gating=True, gating_games=20, evaluation_opponents="random")
    trainer = SimpleNamespace(config=config, learners=[Learner()], env=None, iteration=4,
                              rollouts=FakeGroup(FakeWorker(outcome) for _ in range(workers)))
    return trainer, learner_weights


def counts(wins: int, draws: int):
    """Of every 20 games, ``wins`` won and ``draws`` drawn; a share gets its part."""
    def outcome(share):
        w, d = wins * share.games // 20, draws * share.games // 20
        return {"games": share.games, "wins": w, "draws": d, "losses": share.games - w - d}
    return outcome


def test_a_candidate_that_loses_is_rejected_and_self_play_keeps_the_best():
    trainer, learner = fake_trainer(counts(wins=4, draws=4))
    state = AlphaZeroState(trainer)
    best = state.best.copy()
    learner["w"] = np.ones(3, np.float32)  # the learner moved on: the candidate
    state.gate(trainer)
    assert state.latest["gating_score"] == pytest.approx(0.3)
    assert state.latest["gating_accepted"] == 0 and state.latest["best_version"] == 0
    assert np.array_equal(state.best, best)
    shares = [share for worker in trainer.rollouts for share in worker.shares]
    assert sum(share.games for share in shares) == 20
    assert sum(share.first for share in shares) == 10
    assert all(np.array_equal(share.weights, learner["w"]) for share in shares)
    assert all(np.array_equal(share.opponent, best) for share in shares)
    assert all(worker.weights is None for worker in trainer.rollouts)  # nothing delivered


@pytest.mark.parametrize("wins, draws, accepted", [(10, 2, True), (10, 1, False),
                                                   (11, 0, True), (6, 10, True),
                                                   (5, 10, False)])
def test_a_candidate_needs_55_percent_with_draws_as_half(wins, draws, accepted):
    trainer, learner = fake_trainer(counts(wins, draws), workers=1)
    state = AlphaZeroState(trainer)
    learner["w"] = np.full(3, 2.0, np.float32)
    state.gate(trainer)
    assert state.latest["gating_score"] == pytest.approx((wins + draws / 2) / 20)
    assert state.latest["gating_accepted"] == int(accepted)
    assert state.latest["best_version"] == (5 if accepted else 0)  # iteration 5's candidate
    assert np.array_equal(state.best, learner["w"]) == accepted
    delivered = trainer.rollouts[0].weights
    assert (delivered is not None and np.array_equal(delivered, learner["w"])) == accepted
    # The best network is in the plan's checkpoint, and comes back from it.
    restored = AlphaZeroState(fake_trainer(counts(0, 0))[0])
    restored.set_state(state.get_state())
    assert np.array_equal(restored.best, state.best) and restored.deliver_best
    assert restored.latest == state.latest


def test_a_run_resumed_with_gating_from_a_checkpoint_without_it_starts_from_the_learner():
    trainer, learner = fake_trainer(counts(0, 0))
    state = AlphaZeroState(trainer)
    state.set_state({"latest": {}, "rng": state.rng.bit_generator.state})
    learner["w"] = np.full(3, 5.0, np.float32)  # the restored learner's weights
    state.deliver(trainer)
    assert np.array_equal(state.best, learner["w"])
    assert all(np.array_equal(w.weights, learner["w"]) for w in trainer.rollouts)


def test_self_play_gets_the_best_weights_after_a_restore():
    trainer, _ = fake_trainer(counts(0, 0))
    state = AlphaZeroState(trainer)
    assert state.deliver_best and math.isnan(state.latest["gating_score"])
    state.deliver(trainer)
    assert not state.deliver_best
    assert all(np.array_equal(w.weights, state.best) for w in trainer.rollouts)
    assert callable(training_step)


def test_gating_through_the_cli_on_tic_tac_toe(tmp_path):
    """Gating every 2 iterations with 20 games; the columns agree with one another, and the
    rollout ranks' checkpointed (self-play) weights are the driver's best network. The
    evaluation beside it (every 2 iterations, 2 games per opponent: only its columns are
    checked) does not change the gating: each match's seeds come from the driver's rng, one per
    rollout rank whatever the number of games.

    Gating and evaluation games search 16 simulations a move (``evaluation_simulations``; the
    default 100 made the 80 gating games most of the test's CPU: 28-33 CPU-s, 15 now). At 16,
    seeds 0-4 (this run's command, 2026-11-29) each accepted a candidate: best_version 6, 6, 6,
    8, 8; gating scores at 2/4/6/8 of 0.45/0.5/0.775/0.475, 0.625/0.45/0.55/0.475,
    0.475/0.675/0.6/0.35, 0.475/0.5/0.625/0.55 and 0.325/0.55/0.325/0.65."""
    config = {"gating": True, "gating_games": 20, "evaluation_interval": 2,
              "evaluation_games": 2, "games_per_worker": 8, "sgd_steps_per_iteration": 10,
              "simulations": 8, "evaluation_simulations": 16}
    _, run_dir, _ = train(3, tmp_path, "--algo", "AlphaZero", "--env", OS_TTT, "--seed", "0",
                          "--config", json.dumps(config), "--stop",
                          '{"training_iteration": 8}', timeout=150)
    progress = rows(run_dir)
    version = 0
    for row in progress:
        iteration = int(row["iteration"])
        if iteration % 2:
            continue
        score, accepted = float(row["gating_score"]), int(row["gating_accepted"])
        assert (score * 20) % 0.5 == 0 and 0 <= score <= 1, row
        assert accepted == (score >= 0.55), row
        if accepted:
            version = iteration
        assert int(row["best_version"]) == version, row
        assert row["eval_random_win"] != "nan"
    assert math.isnan(float(progress[0]["gating_score"]))
    assert version > 0  # the trained candidate beat the untrained network at least once
    checkpoint, manifest = find_checkpoint(run_dir)
    files = manifest["files"]
    best = read_state_file(checkpoint / "driver.pkl", files["driver.pkl"])["plan"]["best"]
    learner = read_state_file(checkpoint / "learner_0.pkl", files["learner_0.pkl"])["weights"]
    for name in ("rollout_0.pkl", "rollout_1.pkl"):
        assert np.array_equal(read_state_file(checkpoint / name, files[name])["weights"], best)
    assert np.array_equal(learner, best) == (int(progress[-1]["gating_accepted"]) == 1)


class FirstLegal:
    name = "first legal"

    def act(self, state):
        return int(np.flatnonzero(state.legal_action_mask())[0])


def test_play_match_moves_first_as_often_as_told():
    """Two players taking the first legal square: the one moving first wins (on the 2-4-6
    diagonal), so A's wins count the games A moved first in."""
    from mpirl.algorithms.alphazero.games import load_game
    from mpirl.algorithms.alphazero.players import play_match
    game = load_game(OS_TTT)
    rng = np.random.default_rng(0)
    for first in (0, 3, 7):
        result = play_match(game, FirstLegal(), FirstLegal(), 7, rng, first=first)
        assert (result.wins, result.losses) == (first, 7 - first)
    assert play_match(game, FirstLegal(), FirstLegal(), 7, rng).wins == 4
    opened = play_match(game, FirstLegal(), FirstLegal(), 20, rng, opening_moves=3)
    assert opened.wins + opened.draws + opened.losses == 20 and opened.wins < 20
    with pytest.raises(Exception, match="first must be between"):
        play_match(game, FirstLegal(), FirstLegal(), 4, rng, first=5)
