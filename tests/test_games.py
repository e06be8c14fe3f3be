"""The game adapter (mpirl.algorithms.alphazero.games) and board symmetries
(mpirl.algorithms.alphazero.symmetries): PettingZoo and OpenSpiel give the same tic-tac-toe, clones
are independent, unsearchable games are refused with messages that say why, and symmetries map
observations, masks and moves consistently."""

from __future__ import annotations

import sys
import threading
import types

import gymnasium as gym
import numpy as np
import pytest
from conftest import OS_C4, OS_TTT, PZ_C4, PZ_TTT
from mpirl.algorithms.alphazero.games import load_game
from mpirl.algorithms.alphazero.players import MinimaxPlayer
from mpirl.algorithms.alphazero.symmetries import symmetries

from mpirl.errors import EXIT_USAGE, ConfigError

pytest.importorskip("pyspiel")
pytest.importorskip("pettingzoo")

ALL = (PZ_TTT, PZ_C4, OS_TTT, OS_C4)


def _pz_to_openspiel(action: int) -> int:
    # PettingZoo numbers tic-tac-toe's cells down the columns, OpenSpiel along the rows.
    return 3 * (action % 3) + action // 3


@pytest.mark.parametrize("game_id", ALL)
def test_interface(game_id):
    game = load_game(game_id)
    state = game.new_initial_state()
    assert game.name == game_id
    assert state.current_player() == 0 and not state.is_terminal()
    observation, mask = state.observation(), state.legal_action_mask()
    assert observation.dtype == np.float32 and observation.shape == game.observation_shape
    assert mask.dtype == bool and mask.shape == (game.num_actions,) and mask.all()
    assert state.returns().tolist() == [0.0, 0.0]
    state.apply(0)
    assert state.current_player() == 1
    with pytest.raises(ValueError, match="illegal"):
        state.apply(game.num_actions)


def test_pettingzoo_observation_is_the_movers():
    """PettingZoo's convention: plane 0 holds the mover's own marks."""
    state = load_game(PZ_TTT).new_initial_state()
    state.apply(4)  # player 0 takes the centre
    observation = state.observation()
    assert observation[1, 1].tolist() == [0.0, 1.0]  # player 1 to move: the centre is theirs
    state.apply(0)
    assert state.observation()[1, 1].tolist() == [1.0, 0.0]


def test_pettingzoo_and_openspiel_tictactoe_agree_on_random_games():
    pz, spiel = load_game(PZ_TTT), load_game(OS_TTT)
    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(150):
        a, b = pz.new_initial_state(), spiel.new_initial_state()
        while not a.is_terminal():
            assert not b.is_terminal() and a.current_player() == b.current_player()
            legal = np.flatnonzero(a.legal_action_mask())
            assert sorted(map(_pz_to_openspiel, legal)) == \
                np.flatnonzero(b.legal_action_mask()).tolist()
            action = int(rng.choice(legal))
            a.apply(action)
            b.apply(_pz_to_openspiel(action))
        assert b.is_terminal()
        assert a.returns().tolist() == b.returns().tolist()
        outcomes.add(tuple(a.returns().tolist()))
    assert outcomes == {(1.0, -1.0), (-1.0, 1.0), (0.0, 0.0)}


@pytest.mark.parametrize("game_id", ALL)
def test_clones_are_independent(game_id):
    game = load_game(game_id)
    state = game.new_initial_state()
    state.apply(0)
    state.apply(1)
    copy = state.clone()
    assert np.array_equal(copy.observation(), state.observation())
    assert copy.key() == state.key() and copy.current_player() == state.current_player()
    before = state.observation().copy()
    copy.apply(2)
    assert np.array_equal(state.observation(), before) and copy.key() != state.key()
    state.apply(3)
    assert not np.array_equal(copy.observation(), state.observation())


def test_pettingzoo_clone_keeps_the_position():
    """A plain deepcopy of a PettingZoo env (EzPickle) is a fresh game; the clone is not."""
    state = load_game(PZ_C4).new_initial_state()
    for action in (3, 3, 4):
        state.apply(action)
    copy = state.clone()
    assert copy.observation().sum() == 3
    # What the env shares inside itself, the copy shares inside itself (and not with it).
    env, copied = state._env, copy._env
    assert copied._agent_selector.agent_order is copied.agents
    assert env._agent_selector.agent_order is env.agents and copied.agents is not env.agents


@pytest.mark.parametrize("game_id, reason", [
    ("openspiel/kuhn_poker", "not a perfect-information game"),
    ("openspiel/catch", "1 player"),
    ("openspiel/matrix_rps", "move simultaneously"),
    ("openspiel/backgammon", "chance events"),
    ("pettingzoo.classic.rps_v2", "act simultaneously"),
])
def test_unsearchable_games_are_refused(game_id, reason):
    with pytest.raises(ConfigError, match=reason) as caught:
        load_game(game_id)
    assert caught.value.exit_code == EXIT_USAGE
    assert game_id in str(caught.value) or "AlphaZero" in str(caught.value)


def test_unknown_openspiel_name_says_how_to_list_names():
    with pytest.raises(ConfigError) as caught:
        load_game("openspiel/connect_fuor")
    message = str(caught.value)
    assert "connect_four" in message and "pyspiel.registered_names()" in message


def test_unimportable_module_is_refused():
    with pytest.raises(ConfigError, match="mpirl\\[games\\]"):
        load_game("no_such_package.tictactoe")


def test_openspiel_parameters():
    game = load_game("openspiel/connect_four", {"rows": 5, "columns": 6})
    assert game.num_actions == 6 and game.observation_shape == (3, 5, 6)


class _MaskFreeEnv:
    """A two-agent AEC env module stand-in with no action mask in its observations."""

    metadata = {"is_parallelizable": False}
    possible_agents = ["a", "b"]

    @property
    def unwrapped(self):
        return self

    def reset(self, seed=None, options=None):
        pass

    def observation_space(self, agent):
        return gym.spaces.Box(0, 1, (3,))

    def action_space(self, agent):
        return gym.spaces.Discrete(3)


def _install(monkeypatch, name, factory):
    module = types.ModuleType(name)
    module.env = factory
    monkeypatch.setitem(sys.modules, name, module)


def test_game_without_action_mask_is_refused(monkeypatch):
    _install(monkeypatch, "mask_free_game", _MaskFreeEnv)
    with pytest.raises(ConfigError, match="no action mask"):
        load_game("mask_free_game")


class _TwoMoveGame:
    """A PettingZoo-like AEC game of two moves whose outcome and flaws a test chooses."""

    metadata = {"is_parallelizable": False}

    def __init__(self, agents=("a", "b"), outcome=(1.0, -1.0), lock=False):
        self.possible_agents = list(agents)
        self._outcome = outcome
        if lock:
            self.lock = threading.Lock()  # cannot be copied

    @property
    def unwrapped(self):
        return self

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        self.agent_selection = self.agents[0]
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self.moves = 0

    def observation_space(self, agent):
        return gym.spaces.Dict({"observation": gym.spaces.Box(0, 2, (1,)),
                                "action_mask": gym.spaces.Box(0, 1, (2,), np.int8)})

    def action_space(self, agent):
        return gym.spaces.Discrete(2)

    def observe(self, agent):
        return {"observation": np.array([self.moves]), "action_mask": np.ones(2, np.int8)}

    def step(self, action):
        self.moves += 1
        index = (self.agents.index(self.agent_selection) + 1) % len(self.agents)
        self.agent_selection = self.agents[index]
        if self.moves == 2:
            self.terminations = dict.fromkeys(self.agents, True)
            self.rewards = dict(zip(self.agents, self._outcome, strict=False))


@pytest.mark.parametrize("flaw, message", [
    ({"agents": ("solo",)}, "1 agent"),
    ({"agents": ("a", "b", "c")}, "3 agent"),
    ({"outcome": (1.0, 1.0)}, "not zero-sum"),
    ({"lock": True}, "cannot be cloned"),
])
def test_flawed_pettingzoo_games_are_refused(monkeypatch, flaw, message):
    _install(monkeypatch, "flawed_game", lambda: _TwoMoveGame(**flaw))
    with pytest.raises(ConfigError, match=message):
        load_game("flawed_game")


def test_a_sound_pettingzoo_like_game_loads(monkeypatch):
    _install(monkeypatch, "sound_game", _TwoMoveGame)
    game = load_game("sound_game")
    state = game.new_initial_state()
    state.apply(1)
    state.apply(0)
    assert state.is_terminal() and state.returns().tolist() == [1.0, -1.0]


# --- symmetries --------------------------------------------------------------------------------


@pytest.mark.parametrize("game_id, count", [(PZ_TTT, 8), (OS_TTT, 8), (PZ_C4, 2), (OS_C4, 2)])
def test_symmetries_map_positions_to_positions(game_id, count):
    """Playing the mapped moves gives the mapped observation and mask, at every ply."""
    game = load_game(game_id)
    found = symmetries(game)
    assert len(found) == count and found[0].name == "identity"
    assert len({s.action_source.tobytes() for s in found}) == count
    rng = np.random.default_rng(1)
    for symmetry in found:
        state, mapped = game.new_initial_state(), game.new_initial_state()
        while not state.is_terminal():
            assert np.array_equal(symmetry.observations(state.observation()),
                                  mapped.observation())
            assert np.array_equal(symmetry.actions(state.legal_action_mask()),
                                  mapped.legal_action_mask())
            action = int(rng.choice(np.flatnonzero(state.legal_action_mask())))
            state.apply(action)
            mapped.apply(symmetry.action(action))
        assert mapped.is_terminal() and state.returns().tolist() == mapped.returns().tolist()


def test_symmetries_map_batches_and_invert():
    game = load_game(PZ_TTT)
    rng = np.random.default_rng(2)
    observations = rng.integers(0, 2, (5, 3, 3, 2)).astype(np.float32)
    masks = rng.integers(0, 2, (5, 9)).astype(bool)
    policies = rng.dirichlet(np.ones(9), 5).astype(np.float32)
    for symmetry in symmetries(game):
        obs, mask, policy = symmetry.apply(observations, masks, policies)
        for i in range(5):  # the batch maps as each sample does
            assert np.array_equal(obs[i], symmetry.observations(observations[i]))
        assert np.allclose(policy.sum(axis=1), 1.0)
        assert np.array_equal(symmetry.inverse_actions(mask), masks)
        assert np.array_equal(symmetry.inverse_actions(policy), policies)


def test_symmetric_positions_have_mapped_move_values():
    """Exact values of every move (minimax) map with the symmetry: the policy target's map is
    the game's."""
    game = load_game(OS_TTT)
    solver = MinimaxPlayer(game, np.random.default_rng(0))
    for symmetry in symmetries(game):
        state, mapped = game.new_initial_state(), game.new_initial_state()
        for action in (0, 5):
            state.apply(action)
            mapped.apply(symmetry.action(action))
        values = np.full(9, np.nan)
        for action, value in solver.move_values(state).items():
            values[action] = value
        mapped_values = np.full(9, np.nan)
        for action, value in solver.move_values(mapped).items():
            mapped_values[action] = value
        assert np.array_equal(symmetry.actions(values), mapped_values, equal_nan=True)


def test_connect_four_of_other_sizes_mirrors_its_columns():
    game = load_game("openspiel/connect_four", {"rows": 5, "columns": 5})
    assert game.name == "openspiel/connect_four(columns=5,rows=5)"
    mirror = symmetries(game)[1]
    assert mirror.action_source.tolist() == [4, 3, 2, 1, 0]
    state, mapped = game.new_initial_state(), game.new_initial_state()
    state.apply(0)
    mapped.apply(mirror.action(0))
    assert np.array_equal(mirror.observations(state.observation()), mapped.observation())


def test_other_games_have_the_identity_only():
    game = load_game("openspiel/breakthrough")
    found = symmetries(game)
    assert [s.name for s in found] == ["identity"]
    assert np.array_equal(found[0].action_source, np.arange(game.num_actions))
