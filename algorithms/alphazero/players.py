"""Reference players to evaluate against, the ``--opponent`` spec that names one, and matches.

A player's ``act(state)`` returns a legal move for the player to move in ``state`` (a
``GameState`` it may play on: it gets a copy). ``make_player`` reads a spec:

* ``random``: a uniformly random legal move;
* ``mcts:N``: plain UCT search with random rollouts and N simulations per move;
* ``minimax``: exact negamax with alpha-beta and a transposition table, for games small enough to
  solve (tic-tac-toe); it picks at random among the optimal moves;
* ``minimax:traps``: as perfect, but among the optimal moves it prefers those that leave the
  opponent the most losing replies (a fork, two lines threatened at once, leaves only losing
  ones), at random among those;
* ``module:Class``: a user's class, built with no arguments, whose ``act(observation,
  action_mask)`` sees what the agent sees (``GameState.observation()`` and the legal mask).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import numpy as np
from mpirl.algorithms.alphazero.games import Game, GameState
from mpirl.algorithms.alphazero.mcts import BatchedMCTS, Evaluator, MCTSConfig

from mpirl.config.imports import load_object
from mpirl.errors import ConfigError

__all__ = ["make_player", "reference_opponents"]

#: The forms of an opponent spec, for messages.
SPEC_FORMS = ("random, mcts:N (N simulations, e.g. mcts:100), minimax, minimax:traps, or "
              "module:Class")
#: Above this Knuth estimate of its game tree a game is too large for minimax.
MAX_TREE_ESTIMATE = 1e8


class Player(Protocol):
    """Chooses moves. ``name`` appears in results and warnings."""

    name: str

    def act(self, state: GameState) -> int:
        """A legal move for the player to move in ``state``."""


class IllegalMoveWarning(UserWarning):
    """A player returned an illegal move in a match and forfeited that game."""


class RandomPlayer:
    """A uniformly random legal move."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.name = "random"
        self._rng = rng

    def act(self, state: GameState) -> int:
        return int(self._rng.choice(np.flatnonzero(state.legal_action_mask())))


class _UCTNode:
    __slots__ = ("state", "mover", "children", "untried", "visits", "value_sum")

    def __init__(self, state: GameState, mover: int, rng: np.random.Generator) -> None:
        self.state = state
        self.mover = mover  # who moved into this node; value_sum is from their side
        self.children: dict[int, _UCTNode] = {}
        self.untried = ([] if state.is_terminal()
                        else rng.permutation(np.flatnonzero(state.legal_action_mask())).tolist())
        self.visits = 0
        self.value_sum = 0.0


class UCTPlayer:
    """Plain MCTS: UCB1 selection (``exploration`` is its constant), one new node per
    simulation, a random rollout to the end, and the most visited move (ties at random)."""

    def __init__(self, simulations: int, rng: np.random.Generator,
                 exploration: float = math.sqrt(2)) -> None:
        if simulations < 1:
            raise ConfigError(f"mcts:{simulations}: the number of simulations must be at least 1")
        self.name = f"mcts:{simulations}"
        self.simulations = simulations
        self.exploration = exploration
        self._rng = rng

    def act(self, state: GameState) -> int:
        rng = self._rng
        root = _UCTNode(state.clone(), -1, rng)
        for _ in range(self.simulations):
            node, path = root, [root]
            while not node.untried and node.children:
                node = self._best_child(node)
                path.append(node)
            if node.untried:
                action = node.untried.pop()
                child_state = node.state.clone()
                mover = child_state.current_player()
                child_state.apply(action)
                child = _UCTNode(child_state, mover, rng)
                node.children[action] = child
                node, path = child, path + [child]
            outcome = self._rollout(node.state)
            for visited in path:
                visited.visits += 1
                if visited.mover >= 0:
                    visited.value_sum += float(outcome[visited.mover])
        most = max(child.visits for child in root.children.values())
        best = [a for a, child in root.children.items() if child.visits == most]
        return int(best[0] if len(best) == 1 else rng.choice(best))

    def _best_child(self, node: _UCTNode) -> _UCTNode:
        log_visits = math.log(node.visits)
        return max(node.children.values(),
                   key=lambda c: c.value_sum / c.visits
                   + self.exploration * math.sqrt(log_visits / c.visits))

    def _rollout(self, state: GameState) -> np.ndarray:
        if state.is_terminal():
            return state.returns()
        state = state.clone()
        while not state.is_terminal():
            state.apply(int(self._rng.choice(np.flatnonzero(state.legal_action_mask()))))
        return state.returns()


_EXACT, _LOWER, _UPPER = 0, 1, 2


class MinimaxPlayer:
    """Perfect play by negamax with alpha-beta and a transposition table keyed by
    ``GameState.key()``; a random choice among the moves of optimal value.

    Games too large to solve are refused when the player is made: a Knuth estimate of the game
    tree (random playouts, product of branching factors) above ``max_tree_estimate``, or, while
    solving, more than ``max_positions`` positions searched.
    """

    def __init__(self, game: Game, rng: np.random.Generator,
                 max_tree_estimate: float = MAX_TREE_ESTIMATE,
                 max_positions: int = 2_000_000) -> None:
        self.name = "minimax"
        self._rng = rng
        self._game_name = game.name
        self._max_positions = max_positions
        self._table: dict[Any, tuple[float, int]] = {}
        self._positions = 0
        estimate = estimate_tree_size(game, np.random.default_rng(0))
        if estimate > max_tree_estimate:
            raise ConfigError(
                f"opponent minimax: {game.name!r} is too large to solve (its game tree is "
                f"about {estimate:.1e} positions, the limit {max_tree_estimate:.0e}); use "
                f"mcts:N instead")

    def act(self, state: GameState) -> int:
        return self._pick(self.optimal_moves(state))

    def optimal_moves(self, state: GameState) -> list[int]:
        """The legal moves of optimal value for the player to move."""
        values = self.move_values(state)
        best = max(values.values())
        return [a for a, v in values.items() if v == best]

    def _pick(self, moves: list[int]) -> int:
        return int(moves[0] if len(moves) == 1 else self._rng.choice(moves))

    def move_values(self, state: GameState) -> dict[int, float]:
        """Each legal move's exact value for the player to move."""
        me = state.current_player()
        values = {}
        for action in np.flatnonzero(state.legal_action_mask()).tolist():
            child = state.clone()
            child.apply(action)
            values[action] = self._child_value(child, me, -math.inf, math.inf)
        return values

    def value(self, state: GameState) -> float:
        """The exact value of ``state`` for its player to move."""
        return self._value(state, -math.inf, math.inf)

    def _child_value(self, child: GameState, me: int, alpha: float, beta: float) -> float:
        if child.is_terminal():
            return float(child.returns()[me])
        if child.current_player() == me:
            return self._value(child, alpha, beta)
        return -self._value(child, -beta, -alpha)

    def _value(self, state: GameState, alpha: float, beta: float) -> float:
        key = state.key()
        entry = self._table.get(key)
        if entry is not None:
            value, bound = entry
            if bound == _EXACT:
                return value
            if bound == _LOWER:
                alpha = max(alpha, value)
            else:
                beta = min(beta, value)
            if alpha >= beta:
                return value
        self._positions += 1
        if self._positions > self._max_positions:
            raise ConfigError(f"opponent minimax: {self._game_name!r} is too large to solve "
                              f"(over {self._max_positions} positions searched); use mcts:N")
        me, first_alpha, best = state.current_player(), alpha, -math.inf
        for action in np.flatnonzero(state.legal_action_mask()).tolist():
            child = state.clone()
            child.apply(action)
            best = max(best, self._child_value(child, me, alpha, beta))
            alpha = max(alpha, best)
            if alpha >= beta:
                break
        bound = _UPPER if best <= first_alpha else _LOWER if best >= beta else _EXACT
        self._table[key] = (best, bound)
        return best


class TrapPlayer(MinimaxPlayer):
    """Perfect play that sets traps: among the optimal moves, those after which the most of the
    opponent's replies lose (by exact value), at random among them. In tic-tac-toe that is a
    fork (two lines threatened: every reply loses) before a single threat, and a threat before
    a quiet move: the opponent that an agent which only learned to draw itself would fall for."""

    def __init__(self, game: Game, rng: np.random.Generator) -> None:
        super().__init__(game, rng)
        self.name = "minimax:traps"

    def act(self, state: GameState) -> int:
        optimal = self.optimal_moves(state)
        if len(optimal) == 1:
            return optimal[0]
        me = state.current_player()
        traps = {action: self._losing_replies(state, action, me) for action in optimal}
        most = max(traps.values())
        return self._pick([action for action in optimal if traps[action] == most])

    def _losing_replies(self, state: GameState, action: int, me: int) -> int:
        """How many of the opponent's replies to ``action`` lose for them."""
        child = state.clone()
        child.apply(action)
        if child.is_terminal() or child.current_player() == me:
            return 0
        values = self.move_values(child)
        return sum(value < 0 for value in values.values())


def solvable(game: Game) -> bool:
    """Whether ``game`` is small enough for minimax (its Knuth estimate within
    ``MAX_TREE_ESTIMATE``; the same for every call: the estimate's playouts are seeded)."""
    return estimate_tree_size(game, np.random.default_rng(0)) <= MAX_TREE_ESTIMATE


def reference_opponents(game: Game) -> list[str]:
    """The opponents an evaluation of ``game`` plays by default: random, and minimax where the
    game can be solved; a larger game (Connect Four) gets random only, as UCT with random
    rollouts (mcts:N) costs more than a default evaluation should."""
    return ["random", "minimax"] if solvable(game) else ["random"]


def estimate_tree_size(game: Game, rng: np.random.Generator, playouts: int = 32,
                       max_depth: int = 500) -> float:
    """Knuth's estimate of the number of nodes in the game tree: the mean over random playouts
    of the sum, over depths, of the product of branching factors so far."""
    total = 0.0
    for _ in range(playouts):
        state, width, nodes = game.new_initial_state(), 1.0, 1.0
        for _ in range(max_depth):
            if state.is_terminal():
                break
            legal = np.flatnonzero(state.legal_action_mask())
            width *= legal.size
            nodes += width
            state.apply(int(rng.choice(legal)))
        else:
            return math.inf
        total += nodes
    return total / playouts


class SearchPlayer:
    """Batched MCTS as a player: one search per move with the given evaluator (a network's, or a
    uniform one), no root noise, the most visited move."""

    def __init__(self, game: Game, evaluate: Evaluator, config: MCTSConfig,
                 rng: np.random.Generator, name: str = "search") -> None:
        self.name = name
        self._search = BatchedMCTS(game, evaluate, replace(config, root_noise=False),
                                   num_slots=1, rng=rng)

    def act(self, state: GameState) -> int:
        self._search.reset(0, state, ply=1 << 30)  # past the temperature schedule: argmax
        return int(self._search.search([0]).actions[0])


class ObservationPlayer:
    """A user's player that sees observations: ``act(observation, action_mask) -> action``."""

    def __init__(self, player: Any, name: str) -> None:
        if not callable(getattr(player, "act", None)):
            raise ConfigError(f"opponent {name}: {type(player).__name__} has no "
                              f"act(observation, action_mask) method")
        self.name = name
        self._player = player

    def act(self, state: GameState) -> int:
        return self._player.act(state.observation(), state.legal_action_mask())


def make_player(spec: str, game: Game, rng: np.random.Generator) -> Player:
    """The player ``spec`` names (see the module docstring); ConfigError for a bad spec."""
    spec = spec.strip()
    if spec == "random":
        return RandomPlayer(rng)
    if spec == "minimax":
        return MinimaxPlayer(game, rng)
    if spec == "minimax:traps":
        return TrapPlayer(game, rng)
    if spec.startswith("mcts:") or spec == "mcts":
        count = spec.partition(":")[2]
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"opponent {spec!r}: mcts needs a positive whole number of "
                              f"simulations, as in mcts:100")
        return UCTPlayer(int(count), rng)
    if ":" in spec:
        target = load_object(spec, "opponent", "module:Class")
        if isinstance(target, type):
            try:
                target = target()
            except TypeError as error:
                raise ConfigError(f"opponent {spec!r}: the class must be built with no "
                                  f"arguments ({error})") from None
        return ObservationPlayer(target, spec)
    raise ConfigError(f"opponent {spec!r} is not a player; give {SPEC_FORMS}")


@dataclass
class MatchResult:
    """A match's outcome from player A's side."""

    games: int
    wins: int
    draws: int
    losses: int
    forfeits: int
    """Games A lost by an illegal move (counted in losses)."""
    opponent_forfeits: int
    """Games B lost by an illegal move (counted in wins)."""

    @property
    def win_rate(self) -> float:
        return self.wins / self.games if self.games else 0.0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def play_match(game: Game, player_a: Player, player_b: Player, games: int,
               rng: np.random.Generator, first: int | None = None,
               opening_moves: int = 0) -> MatchResult:
    """Play ``games`` games, A moving first in ``first`` of them (default half, the extra one
    when odd), in an order ``rng`` shuffles so that no player can count on the alternation. The
    first ``opening_moves`` plies of each game are uniformly random legal moves (drawn from
    ``rng``), so that two deterministic players do not repeat the same two games. A player whose
    move is illegal forfeits that game, with an ``IllegalMoveWarning`` naming it."""
    if games < 1:
        raise ConfigError(f"games must be at least 1, not {games}")
    first = (games + 1) // 2 if first is None else first
    if not 0 <= first <= games:
        raise ConfigError(f"first must be between 0 and games ({games}), not {first}")
    a_first = np.arange(games) < first
    rng.shuffle(a_first)
    wins = draws = losses = forfeits = opponent_forfeits = 0
    for number, first in enumerate(a_first.tolist()):
        seats = (player_a, player_b) if first else (player_b, player_a)
        a_seat = 0 if first else 1
        state = game.new_initial_state()
        forfeited_seat = None
        for _ in range(opening_moves):
            if state.is_terminal():
                break
            state.apply(int(rng.choice(np.flatnonzero(state.legal_action_mask()))))
        while not state.is_terminal():
            mover = state.current_player()
            action = seats[mover].act(state.clone())
            if not _is_legal(action, state):
                warnings.warn(f"player {seats[mover].name} returned the illegal move {action!r} "
                              f"in game {number + 1} of {games} of {game.name}; it forfeits "
                              f"that game", IllegalMoveWarning, stacklevel=2)
                forfeited_seat = mover
                break
            state.apply(int(action))
        if forfeited_seat is not None:
            a_lost = forfeited_seat == a_seat
            outcome = -1.0 if a_lost else 1.0
            forfeits += a_lost
            opponent_forfeits += not a_lost
        else:
            outcome = float(state.returns()[a_seat])
        wins += outcome > 0
        draws += outcome == 0
        losses += outcome < 0
    return MatchResult(games=games, wins=wins, draws=draws, losses=losses, forfeits=forfeits,
                       opponent_forfeits=opponent_forfeits)


def _is_legal(action: Any, state: GameState) -> bool:
    try:
        index = int(action)
    except (TypeError, ValueError):
        return False
    mask = state.legal_action_mask()
    return index == action and 0 <= index < mask.size and bool(mask[index])


def network_player(game: Game, evaluate: Evaluator, search: MCTSConfig, simulations: int,
                   rng: np.random.Generator, name: str = "search") -> Player:
    """A network as a player: ``search`` with ``simulations`` a move and no root noise, or its
    raw policy for 0 simulations."""
    if not simulations:
        return RawPolicyPlayer(evaluate)
    return SearchPlayer(game, evaluate, replace(search, simulations=simulations), rng, name=name)


class RawPolicyPlayer:
    """The network's most probable legal move, without search: what it learned by itself."""

    name = "raw policy"

    def __init__(self, evaluate: Evaluator) -> None:
        self._evaluate = evaluate

    def act(self, state: GameState) -> int:
        priors, _ = self._evaluate(state.observation()[None], state.legal_action_mask()[None])
        return int(priors[0].argmax())
