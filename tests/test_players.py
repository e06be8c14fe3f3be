"""Reference players and matches (mpirl.algorithms.alphazero.players): minimax is perfect and
varied, mcts:N beats random, specs parse with clear errors, and a match alternates sides and
forfeits an illegal move with a warning that names the player."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from conftest import OS_C4, OS_TTT, PZ_TTT
from mpirl.algorithms.alphazero.games import load_game
from mpirl.algorithms.alphazero.mcts import MCTSConfig
from mpirl.algorithms.alphazero.players import (
    IllegalMoveWarning,
    MinimaxPlayer,
    ObservationPlayer,
    RandomPlayer,
    SearchPlayer,
    UCTPlayer,
    make_player,
    play_match,
    reference_opponents,
)

from mpirl.errors import ConfigError

pytest.importorskip("pyspiel")
pytest.importorskip("pettingzoo")



@pytest.mark.parametrize("game_id, games", [(OS_TTT, 300), (PZ_TTT, 60)])
def test_minimax_never_loses_to_random_and_draws_itself(game_id, games):
    game = load_game(game_id)
    rng = np.random.default_rng(0)
    minimax = make_player("minimax", game, rng)
    against_random = play_match(game, minimax, RandomPlayer(rng), games, rng)
    assert against_random.losses == 0 and against_random.wins > 0.7 * games
    assert against_random.wins + against_random.draws + against_random.losses == games
    itself = play_match(game, minimax, MinimaxPlayer(game, np.random.default_rng(1)), 30, rng)
    assert itself.draws == 30


def test_minimax_picks_at_random_among_optimal_moves():
    game = load_game(OS_TTT)
    player = MinimaxPlayer(game, np.random.default_rng(0))
    start = game.new_initial_state()
    assert player.value(start) == 0.0
    assert set(player.move_values(start).values()) == {0.0}  # every first move draws
    assert len({player.act(start) for _ in range(40)}) >= 5
    state = game.new_initial_state()
    for action in (0, 3, 1, 4):  # X can win at 2
        state.apply(action)
    assert {player.act(state) for _ in range(10)} == {2}


def test_minimax_refuses_large_games_at_once():
    with pytest.raises(ConfigError, match="too large to solve.*mcts:N"):
        make_player("minimax", load_game(OS_C4), np.random.default_rng(0))


def test_mcts_200_beats_random():
    game = load_game(OS_TTT)
    rng = np.random.default_rng(0)
    result = play_match(game, make_player("mcts:200", game, rng), RandomPlayer(rng), 100, rng)
    assert result.wins >= 90


def test_uct_takes_a_win_in_connect_four():
    game = load_game(OS_C4)
    state = game.new_initial_state()
    for action in (0, 0, 1, 1, 2, 6):
        state.apply(action)
    assert UCTPlayer(200, np.random.default_rng(0)).act(state) == 3


def test_search_player_with_a_uniform_evaluator():
    game = load_game(OS_TTT)

    def uniform(observations, masks):
        return masks.astype(np.float32), np.zeros(len(masks), np.float32)

    rng = np.random.default_rng(0)
    player = SearchPlayer(game, uniform, MCTSConfig(simulations=300), rng)
    result = play_match(game, player, RandomPlayer(rng), 20, rng)
    # A value of 0 everywhere sees only the game's ends (300 simulations miss some early
    # forks), yet it wins most games; the position it is given is searched without noise.
    assert result.wins >= 15 and result.losses <= 2


class FirstLegal:
    """A user's player in the module:Class form."""

    def __init__(self):
        self.seen = []

    def act(self, observation, action_mask):
        self.seen.append(observation)
        return int(np.flatnonzero(action_mask)[0])


class NeedsArguments:
    def __init__(self, depth):
        self.depth = depth


class NoAct:
    pass


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("user_players")
    module.FirstLegal, module.NeedsArguments, module.NoAct = FirstLegal, NeedsArguments, NoAct
    monkeypatch.setitem(sys.modules, "user_players", module)
    return module


def test_specs(user_module):
    game = load_game(OS_TTT)
    rng = np.random.default_rng(0)
    assert isinstance(make_player("random", game, rng), RandomPlayer)
    uct = make_player("mcts:100", game, rng)
    assert isinstance(uct, UCTPlayer) and uct.simulations == 100 and uct.name == "mcts:100"
    assert isinstance(make_player("minimax", game, rng), MinimaxPlayer)
    user = make_player("user_players:FirstLegal", game, rng)
    assert isinstance(user, ObservationPlayer) and user.name == "user_players:FirstLegal"
    state = game.new_initial_state()
    state.apply(0)
    assert user.act(state) == 1
    assert np.array_equal(user._player.seen[0], state.observation())


@pytest.mark.parametrize("spec, message", [
    ("mcts:0", "positive whole number"), ("mcts:ten", "positive whole number"),
    ("mcts", "positive whole number"), ("alphabeta", "random, mcts:N"),
    ("no_such_module_x:Player", "no module named"),
    ("user_players:Missing", "has no class Missing"),
    ("user_players:NeedsArguments", "no arguments"),
    ("user_players:NoAct", "no act"),
])
def test_bad_specs_are_refused(user_module, spec, message):
    with pytest.raises(ConfigError, match=message):
        make_player(spec, load_game(OS_TTT), np.random.default_rng(0))


class Recorder:
    """Plays first-legal moves and records which seat it had in each game."""

    def __init__(self, name):
        self.name = name
        self.first = []

    def act(self, state):
        if state.legal_action_mask().sum() == 9:
            self.first.append(True)
        elif state.legal_action_mask().sum() == 8:
            self.first.append(False)
        return int(np.flatnonzero(state.legal_action_mask())[0])


@pytest.mark.parametrize("games", [10, 7])
def test_match_gives_each_side_half_the_first_moves(games):
    game = load_game(OS_TTT)
    a, b = Recorder("a"), Recorder("b")
    result = play_match(game, a, b, games, np.random.default_rng(0))
    assert a.first.count(True) == (games + 1) // 2 and len(a.first) == games
    assert result.games == games == result.wins + result.draws + result.losses
    # First-legal against first-legal: the first mover always wins (down the left column).
    assert result.wins == (games + 1) // 2 and result.losses == games // 2


class Cheater:
    name = "cheater"

    def act(self, state):
        return 99


def test_illegal_move_forfeits_with_a_warning_naming_the_player():
    game = load_game(OS_TTT)
    rng = np.random.default_rng(0)
    with pytest.warns(IllegalMoveWarning, match="player cheater returned the illegal move 99"):
        result = play_match(game, RandomPlayer(rng), Cheater(), 4, rng)
    assert result.wins == 4 and result.opponent_forfeits == 4 and result.forfeits == 0
    with pytest.warns(IllegalMoveWarning):
        result = play_match(game, Cheater(), RandomPlayer(rng), 2, rng)
    assert result.losses == 2 and result.forfeits == 2
    assert result.as_dict() == {"games": 2, "wins": 0, "draws": 0, "losses": 2, "forfeits": 2,
                                "opponent_forfeits": 0}


def test_the_trap_setter_and_minimax_never_lose_to_each_other_and_vary_their_moves():
    """The two perfect opponents of issue 47's bar: minimax at random among optimal moves, and
    minimax:traps, which among them prefers moves that leave the most losing replies (forks).
    Both are perfect (only draws between them), each varies its games, and the trap-setter
    forks where it can and beats random play more often than plain minimax."""
    game = load_game(OS_TTT)
    minimax = make_player("minimax", game, np.random.default_rng(0))
    traps = make_player("minimax:traps", game, np.random.default_rng(1))
    assert traps.name == "minimax:traps"
    rng = np.random.default_rng(2)
    assert play_match(game, traps, minimax, 20, rng).draws == 20
    assert play_match(game, traps, traps, 6, rng).draws == 6

    # They vary: the trap-setter's first moves are corners (7 of O's 8 replies lose), all four.
    first = game.new_initial_state()
    assert {traps.act(first.clone()) for _ in range(40)} == {0, 2, 6, 8}
    assert len({minimax.act(first.clone()) for _ in range(40)}) >= 5
    # Against random play the traps pay: more wins than plain minimax in the same games.
    plain = play_match(game, minimax, RandomPlayer(np.random.default_rng(3)), 200,
                       np.random.default_rng(4))
    trapping = play_match(game, traps, RandomPlayer(np.random.default_rng(3)), 200,
                          np.random.default_rng(4))
    assert plain.losses == trapping.losses == 0
    assert trapping.wins > plain.wins, (trapping, plain)


def test_default_opponents_follow_what_the_game_allows():
    assert reference_opponents(load_game(OS_TTT)) == ["random", "minimax"]
    assert reference_opponents(load_game(PZ_TTT)) == ["random", "minimax"]
    assert reference_opponents(load_game(OS_C4)) == ["random"]  # too large to solve
