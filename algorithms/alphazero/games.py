"""Two-player board games for search: one interface over PettingZoo classic games and OpenSpiel.

A game id is either a PettingZoo module (``pettingzoo.classic.tictactoe_v3``) or an OpenSpiel
name written ``openspiel/<game>`` (``openspiel/connect_four``, parameters included:
``openspiel/connect_four(rows=5)``); the slash keeps it apart from ``module:Class`` ids.

Search only needs what AlphaZero's papers assume: two players who move in turns, see the whole
state, and end with opposite outcomes; a mask of legal moves; and a copy of a state to play
ahead on. A game lacking any of these is refused here, with a ConfigError, before anything runs.

Player ids are 0 and 1 (the first mover is 0). ``observation()`` is what the player to move
sees: PettingZoo's ``observation`` field of that agent (its own planes first), or OpenSpiel's
observation tensor for the current player, as float32 either way.
"""

from __future__ import annotations

import copy
import difflib
import importlib
from abc import ABC, abstractmethod
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.errors import ConfigError, MissingPackage

__all__ = ["GameObservationSpace"]

#: The prefix that names an OpenSpiel game.
OPENSPIEL_PREFIX = "openspiel/"


class GameState(ABC):
    """One position of a game: who moves, what they may do and see, and the outcome at the end."""

    @abstractmethod
    def current_player(self) -> int:
        """The player to move, 0 or 1 (meaningless once terminal)."""

    @abstractmethod
    def legal_action_mask(self) -> np.ndarray:
        """Bool array of size ``num_actions``: True where the move is legal."""

    @abstractmethod
    def observation(self) -> np.ndarray:
        """Float32 array of ``observation_shape``, from the perspective of the player to move."""

    @abstractmethod
    def observation_for(self, player: int) -> np.ndarray:
        """``observation()`` as ``player`` sees the position, whoever is to move (the end of a
        game included, where nobody is)."""

    @abstractmethod
    def apply(self, action: int) -> None:
        """Play ``action`` for the player to move (ValueError if it is illegal)."""

    @abstractmethod
    def is_terminal(self) -> bool:
        """True once the game is over."""

    @abstractmethod
    def returns(self) -> np.ndarray:
        """The outcome per player, float32 [2]: +1 win, -1 loss, 0 draw (zeros before the end)."""

    @abstractmethod
    def clone(self) -> GameState:
        """An independent copy: playing on it leaves this state as it is."""

    @abstractmethod
    def key(self) -> bytes | str:
        """A hashable summary that tells positions apart (for transposition tables)."""

    def move_name(self, action: int) -> str:
        """How a person reads ``action`` for the player to move (its number unless the game
        names its moves)."""
        return str(action)

    @abstractmethod
    def history(self) -> list[int]:
        """The moves played from the initial state to here: ``Game.state_from_history`` of
        them is this position (how checkpoints store a game in play)."""


class Game(ABC):
    """A two-player, zero-sum, perfect-information, turn-based game with action masks."""

    #: The id it was loaded from.
    name: str
    #: Size of the action space (legal masks and policies have this length).
    num_actions: int
    #: Shape of ``GameState.observation()``.
    observation_shape: tuple[int, ...]

    @abstractmethod
    def new_initial_state(self) -> GameState:
        """A fresh game, first player to move."""

    def state_from_history(self, moves: list[int]) -> GameState:
        """The position after ``moves`` from the initial state (ValueError on an illegal one)."""
        state = self.new_initial_state()
        for move in moves:
            state.apply(int(move))
        return state


class GameObservationSpace(gym.spaces.Box):
    """The observation space of a game's positions (float32 of ``observation_shape``), which
    also names the game (``game_id``): a model spec tells from it whether board planes come
    channels last (PettingZoo) or first (OpenSpiel)."""

    def __init__(self, game_id: str, shape: tuple[int, ...]) -> None:
        super().__init__(-np.inf, np.inf, shape, np.float32)
        self.game_id = game_id

    @property
    def channels_last(self) -> bool:
        return not self.game_id.startswith(OPENSPIEL_PREFIX)


def game_spaces(game: Game) -> tuple[GameObservationSpace, gym.spaces.Discrete]:
    """What a plan's ``model_spec`` is given for ``game``: its positions' observation space and
    its actions (legal or not)."""
    return (GameObservationSpace(game.name, tuple(game.observation_shape)),
            gym.spaces.Discrete(game.num_actions))


def load_game(env_id: str, env_config: dict[str, Any] | None = None) -> Game:
    """The game ``env_id`` names: ``openspiel/<name>`` or a PettingZoo AEC module (its ``env()``
    is called with ``env_config``). ConfigError for anything search cannot play."""
    env_config = dict(env_config or {})
    if env_id.startswith(OPENSPIEL_PREFIX):
        game: Game = OpenSpielGame(env_id[len(OPENSPIEL_PREFIX):], env_config)
    else:
        game = PettingZooGame(env_id, env_config)
    check_game(game)
    return game


def check_game(game: Game, moves: int = 200) -> None:
    """Play one game of first-legal moves on clones, checking what search relies on: the clone
    is independent, every non-terminal state has a legal move, and the outcome is zero-sum."""
    state = game.new_initial_state()
    try:
        probe = state.clone()
    except Exception as error:  # noqa: BLE001 - any failure to copy means search cannot run
        raise ConfigError(f"game {game.name!r} cannot be cloned ({type(error).__name__}: "
                          f"{error}); search needs a copy of a state") from None
    before = state.observation().copy()
    for _ in range(moves):
        if probe.is_terminal():
            break
        legal = np.flatnonzero(probe.legal_action_mask())
        if legal.size == 0:
            raise ConfigError(f"game {game.name!r} has a non-terminal state with no legal move")
        probe.apply(int(legal[-1]))
    if not np.array_equal(state.observation(), before) or state.is_terminal():
        raise ConfigError(f"game {game.name!r} cannot be cloned: playing on a copy changed the "
                          f"original state")
    if probe.is_terminal() and abs(float(probe.returns().sum())) > 1e-6:
        raise ConfigError(f"game {game.name!r} is not zero-sum: a game ended with returns "
                          f"{probe.returns().tolist()}; AlphaZero's search needs opposite "
                          f"outcomes for the two players")


# --- OpenSpiel ---------------------------------------------------------------------------------


class OpenSpielGame(Game):
    """An OpenSpiel game, loaded by name (``connect_four``) or with parameters
    (``connect_four(rows=5)``, or ``env_config`` as the parameters)."""

    def __init__(self, spec: str, parameters: dict[str, Any] | None = None) -> None:
        try:
            import pyspiel
        except ImportError:
            raise MissingPackage(f"{OPENSPIEL_PREFIX}{spec} needs OpenSpiel: pip install "
                                 f"'mpirl[openspiel]'") from None
        base = spec.partition("(")[0]
        self.name = OPENSPIEL_PREFIX + (spec if not parameters else base + "(" + ",".join(
            f"{key}={value}" for key, value in sorted(parameters.items())) + ")")
        if base not in pyspiel.registered_names():
            close = difflib.get_close_matches(base, pyspiel.registered_names(), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"OpenSpiel has no game {base!r}.{hint} The names are listed by python -c "
                f"\"import pyspiel; print(pyspiel.registered_names())\"; give one as "
                f"{OPENSPIEL_PREFIX}<name>")
        try:
            game = (pyspiel.load_game(spec, parameters) if parameters
                    else pyspiel.load_game(spec))
        except pyspiel.SpielError as error:
            raise ConfigError(f"OpenSpiel could not load {spec!r}: {error}") from None
        self._refuse_unsupported(game)
        self._game = game
        self.num_actions = game.num_distinct_actions()
        self.observation_shape = tuple(game.observation_tensor_shape())

    def _refuse_unsupported(self, game: Any) -> None:
        import pyspiel

        kind = game.get_type()
        why = None
        if game.num_players() != 2:
            why = f"it has {game.num_players()} player(s), and self-play needs two"
        elif kind.dynamics != pyspiel.GameType.Dynamics.SEQUENTIAL:
            why = "its players move simultaneously, and search needs turns"
        elif kind.information != pyspiel.GameType.Information.PERFECT_INFORMATION:
            why = "it is not a perfect-information game (players hide information)"
        elif kind.chance_mode != pyspiel.GameType.ChanceMode.DETERMINISTIC:
            why = "it has chance events, which this search does not model"
        elif kind.utility != pyspiel.GameType.Utility.ZERO_SUM:
            why = f"it is not zero-sum (its utility is {kind.utility.name})"
        elif not kind.provides_observation_tensor:
            why = "it gives no observation tensor for a network to read"
        if why:
            raise ConfigError(f"game {self.name!r} cannot be searched: {why}. AlphaZero plays "
                              f"two-player, zero-sum, perfect-information, turn-based games")

    def new_initial_state(self) -> OpenSpielState:
        return OpenSpielState(self._game.new_initial_state(), self.num_actions,
                              self.observation_shape)


class OpenSpielState(GameState):
    """A pyspiel state; its own ``clone()`` copies it in C++."""

    __slots__ = ("_state", "_num_actions", "_shape")

    def __init__(self, state: Any, num_actions: int, shape: tuple[int, ...]) -> None:
        self._state = state
        self._num_actions = num_actions
        self._shape = shape

    def current_player(self) -> int:
        return self._state.current_player()

    def legal_action_mask(self) -> np.ndarray:
        return np.asarray(self._state.legal_actions_mask(), dtype=bool)[:self._num_actions]

    def observation(self) -> np.ndarray:
        return np.asarray(self._state.observation_tensor(), np.float32).reshape(self._shape)

    def observation_for(self, player: int) -> np.ndarray:
        return np.asarray(self._state.observation_tensor(int(player)),
                          np.float32).reshape(self._shape)

    def apply(self, action: int) -> None:
        action = int(action)
        if not (0 <= action < self._num_actions and self.legal_action_mask()[action]):
            raise ValueError(f"illegal move {action} in {self._state.get_game()}")
        self._state.apply_action(action)

    def is_terminal(self) -> bool:
        return self._state.is_terminal()

    def returns(self) -> np.ndarray:
        return np.asarray(self._state.returns(), np.float32)

    def clone(self) -> OpenSpielState:
        return OpenSpielState(self._state.clone(), self._num_actions, self._shape)

    def history(self) -> list[int]:
        return list(self._state.history())

    def move_name(self, action: int) -> str:
        return self._state.action_to_string(self._state.current_player(), int(action))

    def key(self) -> str:
        # OpenSpiel's string of a perfect-information state is the whole position.
        return f"{self._state.current_player()}|{self._state}"

    def __str__(self) -> str:
        return str(self._state)


# --- PettingZoo --------------------------------------------------------------------------------


#: Attributes of a PettingZoo env that no move changes; clones share them rather than copy them,
#: which makes a clone about 3x cheaper (spaces dominate the copy).
_SHARED_ATTRIBUTES = ("observation_spaces", "action_spaces", "metadata", "possible_agents",
                      "_ezpickle_args", "_ezpickle_kwargs", "screen", "clock")


class PettingZooGame(Game):
    """A PettingZoo AEC module's game (``pettingzoo.classic.connect_four_v3``). Each agent's
    observation space must be a Dict with ``observation`` and ``action_mask``, as PettingZoo's
    classic games give."""

    def __init__(self, module_name: str, env_config: dict[str, Any] | None = None) -> None:
        self.name = module_name
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            if (error.name or "").partition(".")[0] == "pettingzoo":
                raise MissingPackage(f"{module_name} needs PettingZoo: pip install "
                                     f"'mpirl[games]'") from None
            raise ConfigError(f"game {module_name!r} could not be imported ({error}); PettingZoo's "
                              f"classic games need pip install 'mpirl[games]', and OpenSpiel's "
                              f"are named {OPENSPIEL_PREFIX}<name>") from None
        if not callable(getattr(module, "env", None)):
            why = ("it has parallel_env() only: its agents move simultaneously"
                   if callable(getattr(module, "parallel_env", None)) else "it has no env()")
            raise ConfigError(f"game {module_name!r} cannot be searched: {why}; give a "
                              f"PettingZoo AEC module of a turn-based game")
        self._factory = module.env
        self._env_config = dict(env_config or {})
        env = self._make()
        agents = list(env.possible_agents)
        if len(agents) != 2:
            raise ConfigError(f"game {module_name!r} has {len(agents)} agent(s); AlphaZero's "
                              f"self-play needs a two-player game")
        if env.metadata.get("is_parallelizable", False):
            raise ConfigError(f"game {module_name!r} declares is_parallelizable: its agents act "
                              f"simultaneously, and search needs a game played in turns")
        space = env.observation_space(agents[0])
        inner = getattr(space, "spaces", None)
        if not isinstance(inner, dict) or "action_mask" not in inner or "observation" not in inner:
            raise ConfigError(f"game {module_name!r} gives no action mask: its observation space "
                              f"must be a Dict with 'observation' and 'action_mask', as "
                              f"PettingZoo's classic games have (it is {space})")
        action_space = env.action_space(agents[0])
        if not hasattr(action_space, "n"):
            raise ConfigError(f"game {module_name!r} needs a Discrete action space, not "
                              f"{action_space}")
        self.num_actions = int(action_space.n)
        self.observation_shape = tuple(inner["observation"].shape)

    def _make(self) -> Any:
        # The unwrapped env: mpirl checks legality itself, and PettingZoo's wrappers would double
        # the cost of every clone.
        env = self._factory(**self._env_config).unwrapped
        env.reset()
        return env

    def new_initial_state(self) -> PettingZooState:
        return PettingZooState(self._make(), self.num_actions)


_PLAIN = (int, float, bool, str, bytes, type(None), np.integer, np.floating, np.bool_)


def _is_flat(value: Any) -> bool:
    """A list or dict of plain values, or a numeric array: ``.copy()`` copies it fully."""
    if type(value) is list:
        return all(isinstance(item, _PLAIN) for item in value)
    if type(value) is dict:
        return all(isinstance(item, _PLAIN) for item in value.values())
    return type(value) is np.ndarray and value.dtype != object


class PettingZooState(GameState):
    """A PettingZoo AEC env at some position.

    A plain ``copy.deepcopy`` of a PettingZoo env is wrong: envs are ``EzPickle``, whose pickle
    state is the constructor's arguments, so the "copy" is a fresh game. A clone copies the env's
    attributes instead and shares what no move changes (see ``_SHARED_ATTRIBUTES``); replaying the
    move history on a fresh env was measured 3-5x slower and grows with the game.
    """

    __slots__ = ("_env", "_num_actions", "_observed", "_history")

    def __init__(self, env: Any, num_actions: int, history: list[int] | None = None) -> None:
        self._env = env
        self._num_actions = num_actions
        self._observed: dict[str, Any] | None = None
        self._history = history if history is not None else []

    def _observe(self) -> dict[str, Any]:
        # Search asks for the mask and the observation of each new node; observe() builds both,
        # so one call per position serves them (apply() forgets it).
        if self._observed is None:
            self._observed = self._env.observe(self._env.agent_selection)
        return self._observed

    def current_player(self) -> int:
        return self._env.possible_agents.index(self._env.agent_selection)

    def legal_action_mask(self) -> np.ndarray:
        if self.is_terminal():
            return np.zeros(self._num_actions, bool)
        return np.array(self._observe()["action_mask"], bool)

    def observation(self) -> np.ndarray:
        return np.array(self._observe()["observation"], np.float32)

    def observation_for(self, player: int) -> np.ndarray:
        agent = self._env.possible_agents[int(player)]
        return np.array(self._env.observe(agent)["observation"], np.float32)

    def apply(self, action: int) -> None:
        action = int(action)
        mask = self.legal_action_mask()
        if not (0 <= action < self._num_actions and mask[action]):
            raise ValueError(f"illegal move {action} (legal: {np.flatnonzero(mask).tolist()})")
        self._observed = None
        self._env.step(action)
        self._history.append(action)

    def is_terminal(self) -> bool:
        env = self._env
        return not env.agents or all(env.terminations[a] or env.truncations[a] for a in env.agents)

    def returns(self) -> np.ndarray:
        # PettingZoo's classic games reward only the move that ends the game, so the last
        # step's rewards are the outcome.
        if not self.is_terminal():
            return np.zeros(2, np.float32)
        env = self._env
        return np.array([env.rewards.get(agent, 0.0) for agent in env.possible_agents],
                        np.float32)

    def clone(self) -> PettingZooState:
        env = self._env
        attributes = vars(env)
        memo: dict[int, Any] = {id(attributes[name]): attributes[name]
                                for name in _SHARED_ATTRIBUTES if name in attributes}
        copied = object.__new__(type(env))
        # Flat containers of plain values (the board, rewards, terminations) are copied in one
        # call and entered in the memo first, so that a deep copy of anything else that refers
        # to them (an agent selector holding the agents list) still shares the copy.
        deep = {}
        for name, value in attributes.items():
            if id(value) in memo:
                copied.__dict__[name] = memo[id(value)]
            elif _is_flat(value):
                copied.__dict__[name] = memo[id(value)] = value.copy()
            else:
                deep[name] = value
        for name, value in deep.items():
            copied.__dict__[name] = copy.deepcopy(value, memo)
        return PettingZooState(copied, self._num_actions, list(self._history))

    def history(self) -> list[int]:
        return list(self._history)

    def key(self) -> bytes:
        observation = self._observe()
        return (bytes([self.current_player()]) + np.asarray(observation["observation"]).tobytes()
                + np.asarray(observation["action_mask"]).tobytes())
