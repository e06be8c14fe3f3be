"""Batched MCTS (mpirl.algorithms.alphazero.mcts): finds wins and blocks with a uniform evaluator,
Gumbel's root search wins with 8 simulations, one evaluator call per simulation step over all
searching games, subtree reuse, noise and temperature, and search that commutes with board
symmetries."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import OS_C4, OS_TTT, PZ_C4, PZ_TTT
from mpirl.algorithms.alphazero.games import load_game
from mpirl.algorithms.alphazero.mcts import BatchedMCTS, MCTSConfig, _considered_visits
from mpirl.algorithms.alphazero.symmetries import symmetries

from mpirl.errors import ConfigError

pytest.importorskip("pyspiel")
pytest.importorskip("pettingzoo")



def uniform(observations, masks):
    return masks.astype(np.float32), np.zeros(len(masks), np.float32)


class CountingEvaluator:
    """The uniform evaluator, recording each call's batch size."""

    def __init__(self):
        self.batches = []

    def __call__(self, observations, masks):
        assert observations.shape[0] == masks.shape[0]
        self.batches.append(len(masks))
        return uniform(observations, masks)


def _ttt_cell(game_id: str, row: int, column: int) -> int:
    # OpenSpiel numbers tic-tac-toe's cells along the rows, PettingZoo down the columns.
    return 3 * row + column if game_id.startswith("openspiel/") else 3 * column + row


def _position(game_id: str, moves):
    game = load_game(game_id)
    state = game.new_initial_state()
    for move in moves:
        state.apply(_ttt_cell(game_id, *move) if "tic" in game_id else move)
    return game, state


def _best_move(game, state, config, seed=0):
    mcts = BatchedMCTS(game, uniform, config, num_slots=1, rng=np.random.default_rng(seed))
    mcts.reset(0, state, ply=100)
    return mcts.search([0])


# X (player 0) holds (0,0), (0,1); O holds (1,0), (1,1): X wins at (0,2).
TTT_WIN = [(0, 0), (1, 0), (0, 1), (1, 1)]
# X holds (0,0), (0,1); O holds (1,1) and must block at (0,2).
TTT_BLOCK = [(0, 0), (1, 1), (0, 1)]
# Player 0 holds the bottom of columns 0-2 (player 1 sits on 0 and 1, and 6): 0 wins at 3.
C4_WIN = [0, 0, 1, 1, 2, 6]
# The same threat, player 1 to move: it must block at 3.
C4_BLOCK = [0, 0, 1, 1, 2]


@pytest.mark.parametrize("game_id, moves, expected", [
    (OS_TTT, TTT_WIN, (0, 2)), (PZ_TTT, TTT_WIN, (0, 2)),
    (OS_TTT, TTT_BLOCK, (0, 2)), (PZ_TTT, TTT_BLOCK, (0, 2)),
    (OS_C4, C4_WIN, 3), (PZ_C4, C4_WIN, 3), (OS_C4, C4_BLOCK, 3), (PZ_C4, C4_BLOCK, 3),
])
def test_puct_finds_wins_and_blocks(game_id, moves, expected):
    game, state = _position(game_id, moves)
    result = _best_move(game, state, MCTSConfig(simulations=400, root_noise=False))
    target = _ttt_cell(game_id, *expected) if isinstance(expected, tuple) else expected
    assert result.actions[0] == target
    assert result.visit_counts[0].argmax() == target
    assert result.visit_counts[0][~state.legal_action_mask()].sum() == 0
    assert result.policies[0].sum() == pytest.approx(1.0)
    if moves in (TTT_WIN, C4_WIN):
        assert result.root_values[0] > 0.5  # the mover's view: winning


@pytest.mark.parametrize("game_id, moves, expected", [
    (OS_TTT, TTT_WIN, (0, 2)), (PZ_TTT, TTT_WIN, (0, 2)), (OS_C4, C4_WIN, 3),
])
@pytest.mark.parametrize("seed", range(4))
def test_gumbel_with_8_simulations_plays_the_win(game_id, moves, expected, seed):
    game, state = _position(game_id, moves)
    config = MCTSConfig(simulations=8, gumbel=True, root_noise=True)
    result = _best_move(game, state, config, seed)
    target = _ttt_cell(game_id, *expected) if isinstance(expected, tuple) else expected
    assert result.actions[0] == target
    assert result.policies[0].argmax() == target
    assert result.policies[0][~state.legal_action_mask()].sum() == 0
    assert result.policies[0].sum() == pytest.approx(1.0)
    assert result.visit_counts[0].sum() == 8


def test_sequential_halving_schedule():
    schedule = _considered_visits(4, 16)
    # 2 phases: 4 actions x 2 visits, then the best 2 share the rest.
    assert schedule == (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5)
    assert _considered_visits(1, 3) == (0, 1, 2)
    assert _considered_visits(16, 8) == (0,) * 8


@pytest.mark.parametrize("gumbel", [False, True])
def test_one_evaluator_call_per_simulation_step_over_searching_games(gumbel):
    game = load_game(OS_C4)
    evaluator = CountingEvaluator()
    config = MCTSConfig(simulations=12, gumbel=gumbel)
    mcts = BatchedMCTS(game, evaluator, config, num_slots=6, rng=np.random.default_rng(0))
    for slot in range(6):
        mcts.reset(slot, game.new_initial_state())
    mcts.search(range(6))
    assert evaluator.batches == [6] * 13  # the roots, then one call per simulation
    evaluator.batches.clear()
    searching = [0, 2, 5]
    result = mcts.search(searching)
    assert evaluator.batches == [3] * 12  # roots already expanded
    assert result.actions.shape == (3,) and result.policies.shape == (3, 7)


def test_terminal_leaves_need_no_evaluation():
    """Near the end of a game most leaves are terminal: batches shrink, visits still count."""
    game, state = _position(OS_TTT, [(0, 0), (1, 0), (0, 1), (1, 1), (2, 2), (0, 2), (2, 0)])
    evaluator = CountingEvaluator()
    mcts = BatchedMCTS(game, evaluator, MCTSConfig(simulations=30), num_slots=1,
                       rng=np.random.default_rng(0))
    mcts.reset(0, state)
    result = mcts.search([0])
    assert len(evaluator.batches) < 31 and set(evaluator.batches) <= {1}
    assert result.visit_counts.sum() == 30


def test_subtree_is_reused_after_a_move():
    game = load_game(OS_C4)
    config = MCTSConfig(simulations=64, root_noise=False)
    mcts = BatchedMCTS(game, uniform, config, num_slots=2, rng=np.random.default_rng(0))
    mcts.reset(0, game.new_initial_state())
    mcts.reset(1, game.new_initial_state())
    result = mcts.search([0, 1])
    action = int(result.actions[0])
    kept = int(result.visit_counts[0][action]) - 1  # the child's own expansion is no edge
    mcts.advance(0, action)
    mcts.advance(1, 6)
    assert mcts.root_state(0).current_player() == 1
    again = mcts.search([0, 1])
    assert again.visit_counts[0].sum() == kept + 64
    assert again.visit_counts[1].sum() >= 64


def test_no_reuse_when_disabled():
    game = load_game(OS_C4)
    config = MCTSConfig(simulations=32, reuse_tree=False)
    mcts = BatchedMCTS(game, uniform, config, num_slots=1, rng=np.random.default_rng(0))
    mcts.reset(0, game.new_initial_state())
    mcts.advance(0, int(mcts.search([0]).actions[0]))
    assert mcts.search([0]).visit_counts.sum() == 32


@pytest.mark.parametrize("game_id", [OS_C4, PZ_TTT])
@pytest.mark.parametrize("gumbel", [False, True])
def test_self_play_to_the_end(game_id, gumbel):
    """Whole games on reused, growing trees; every move legal, every game ends."""
    game = load_game(game_id)
    config = MCTSConfig(simulations=40, gumbel=gumbel, temperature_moves=4)
    mcts = BatchedMCTS(game, uniform, config, num_slots=4, rng=np.random.default_rng(3))
    for slot in range(4):
        mcts.reset(slot, game.new_initial_state())
    playing, plies = list(range(4)), 0
    while playing:
        result = mcts.search(playing)
        assert np.allclose(result.policies.sum(axis=1), 1.0)
        for slot, action, policy in zip(playing, result.actions, result.policies, strict=True):
            assert mcts.root_state(slot).legal_action_mask()[action] and policy[action] > 0
            mcts.advance(slot, action)
        playing = [s for s in playing if not mcts.root_state(s).is_terminal()]
        plies += 1
    assert plies <= game.num_actions * 6
    with pytest.raises(ValueError, match="end of their games"):
        mcts.search([0])


def test_root_noise_and_temperature_explore():
    game = load_game(OS_TTT)
    state = game.new_initial_state()
    chosen = set()
    for seed in range(12):
        mcts = BatchedMCTS(game, uniform, MCTSConfig(simulations=20, temperature_moves=3),
                           num_slots=1, rng=np.random.default_rng(seed))
        mcts.reset(0, state)
        chosen.add(int(mcts.search([0]).actions[0]))
    assert len(chosen) >= 4
    # Without noise the search is deterministic; past the temperature moves the most visited
    # move is played (ties broken at random).
    greedy = [_best_move(game, state, MCTSConfig(simulations=20, root_noise=False), seed)
              for seed in range(5)]
    for result in greedy:
        assert np.array_equal(result.visit_counts, greedy[0].visit_counts)
        counts = result.visit_counts[0]
        assert counts[result.actions[0]] == counts.max()


def test_bad_settings_and_evaluators_are_refused():
    with pytest.raises(ConfigError, match="simulations"):
        MCTSConfig(simulations=0)
    with pytest.raises(ConfigError, match="dirichlet_epsilon"):
        MCTSConfig(dirichlet_epsilon=1.5)
    game = load_game(OS_TTT)

    def wrong_shape(observations, masks):
        return np.ones((len(masks), 3)), np.zeros(len(masks))

    mcts = BatchedMCTS(game, wrong_shape, MCTSConfig(simulations=2), 1, np.random.default_rng())
    mcts.reset(0, game.new_initial_state())
    with pytest.raises(ValueError, match="evaluate returned priors"):
        mcts.search([0])


def _equivariant_evaluator(game):
    """An evaluator that commutes with the game's symmetries and has no ties: a random linear
    map, averaged over the symmetry group."""
    found = symmetries(game)
    size = int(np.prod(game.observation_shape))
    weights = np.random.default_rng(7).normal(size=(size, game.num_actions + 1))

    def evaluate(observations, masks):
        logits = np.zeros((len(masks), game.num_actions))
        values = np.zeros(len(masks))
        for symmetry in found:
            out = symmetry.observations(observations).reshape(len(masks), -1) @ weights
            logits += symmetry.inverse_actions(out[:, :-1])
            values += out[:, -1]
        priors = np.exp(logits / len(found))
        return priors.astype(np.float32), np.tanh(values / len(found)).astype(np.float32)

    return evaluate


@pytest.mark.parametrize("game_id, moves", [(OS_TTT, [(0, 1), (2, 2)]),
                                            (PZ_TTT, [(0, 1), (2, 2)]), (OS_C4, [1, 2, 2])])
@pytest.mark.parametrize("gumbel", [False, True])
def test_search_commutes_with_symmetries(game_id, moves, gumbel):
    """A position mapped by a symmetry gets the mapped visit counts and policy."""
    game, state = _position(game_id, moves)
    evaluate = _equivariant_evaluator(game)
    config = MCTSConfig(simulations=60, root_noise=False, gumbel=gumbel)
    moves = [(_ttt_cell(game_id, *m) if "tic" in game_id else m) for m in moves]
    for symmetry in symmetries(game)[1:]:
        mapped = game.new_initial_state()
        for move in moves:
            mapped.apply(symmetry.action(move))
        results = []
        for position in (state, mapped):
            mcts = BatchedMCTS(game, evaluate, config, 1, np.random.default_rng(0))
            mcts.reset(0, position, ply=100)
            results.append(mcts.search([0]))
        assert np.array_equal(symmetry.actions(results[0].visit_counts[0]),
                              results[1].visit_counts[0])
        assert np.allclose(symmetry.actions(results[0].policies[0]), results[1].policies[0],
                           atol=1e-5)
