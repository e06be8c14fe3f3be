"""Batched Monte Carlo tree search for AlphaZero: many games searched at once, one evaluation.

Each simulation step walks every searched game's tree from its root to a leaf, then evaluates all
those leaves with ONE call of ``evaluate(observations [B, ...], masks [B, A]) -> (priors [B, A],
values [B])``: KataGo's lesson that more games, not parallel search within one tree, keep a
network busy. ``B`` is the number of games whose leaf needs a network (a leaf that ends the game
is scored by its outcome). Nothing here imports torch: the evaluator is the caller's.

Values are from the perspective of the player to move at the evaluated state; an edge's value
sum is kept from the perspective of the player who chooses it, so backing up negates it wherever
the other player moves.

Two root rules:

* PUCT (AlphaZero): ``argmax Q + c_puct * P * sqrt(1 + sum N) / (1 + N)``, Dirichlet noise on
  the root's priors (alpha = ``dirichlet_alpha_scale / legal moves``), the visit distribution as
  the policy target, and a move sampled from it for the first ``temperature_moves`` plies, then
  the most visited.
* Gumbel (Danihelka et al., 2022), for small budgets: sample the ``gumbel_actions`` best of
  ``gumbel + logits`` at the root, share the simulations out by sequential halving, play the
  survivor, and train towards ``softmax(logits + sigma(completed Q))``; inside the tree, the
  paper's deterministic rule ``argmax pi' - N / (1 + sum N)``.

Trees are arrays, one row of ``A`` edges per node, stacked over the game slots; after a move the
chosen child's subtree is kept (``advance``) and compacted to the front of its slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from mpirl.algorithms.alphazero.games import Game, GameState

from mpirl.errors import ConfigError

#: ``evaluate(observations [B, *obs_shape] float32, masks [B, A] bool) -> (priors [B, A],
#: values [B])``, values from the perspective of each state's player to move.
Evaluator = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class MCTSConfig:
    """How the search runs. Every field has an AlphaZero-like default."""

    simulations: int = 100
    """Simulations per move (per game)."""
    c_puct: float = 1.25
    """Exploration weight of the prior in PUCT."""
    dirichlet_alpha_scale: float = 10.0
    """Root noise alpha is this over the number of legal moves (10 gives chess's 0.3 and Go's
    0.03, AlphaZero's values)."""
    dirichlet_epsilon: float = 0.25
    """Weight of the Dirichlet noise in the root's priors."""
    root_noise: bool = True
    """Explore at the root: Dirichlet noise (PUCT) or Gumbel sampling. Off for evaluation."""
    temperature_moves: int = 10
    """Plies at the start of a game whose move is sampled from the visit counts (temperature 1);
    later moves are the most visited. PUCT only: Gumbel's sampling already explores."""
    reuse_tree: bool = True
    """Keep the chosen move's subtree for the next search."""
    gumbel: bool = False
    """Gumbel AlphaZero's root search (sequential halving) instead of PUCT with noise."""
    gumbel_actions: int = 16
    """Actions sampled at the root for sequential halving (m in the paper)."""
    gumbel_c_visit: float = 50.0
    """c_visit of sigma(q) = (c_visit + max N) * c_scale * q."""
    gumbel_c_scale: float = 0.1
    """c_scale of sigma(q); with Q scaled to [0, 1], 0.1 keeps the improved policy from being
    one-hot at small visit counts (mctx's default)."""

    def __post_init__(self) -> None:
        if self.simulations < 1:
            raise ConfigError(f"simulations must be at least 1, not {self.simulations}")
        if self.c_puct <= 0:
            raise ConfigError(f"c_puct must be positive, not {self.c_puct}")
        if not 0.0 <= self.dirichlet_epsilon <= 1.0:
            raise ConfigError(f"dirichlet_epsilon must be within [0, 1], not "
                              f"{self.dirichlet_epsilon}")
        if self.dirichlet_alpha_scale <= 0:
            raise ConfigError(f"dirichlet_alpha_scale must be positive, not "
                              f"{self.dirichlet_alpha_scale}")
        if self.gumbel_actions < 1:
            raise ConfigError(f"gumbel_actions must be at least 1, not {self.gumbel_actions}")
        if self.temperature_moves < 0:
            raise ConfigError(f"temperature_moves must be 0 or more, not "
                              f"{self.temperature_moves}")


@dataclass
class SearchResult:
    """What one search gives per searched slot, in the order the slots were given."""

    actions: np.ndarray
    """[S] int: the move to play (sampled, most visited, or Gumbel's survivor)."""
    policies: np.ndarray
    """[S, A] float32: the policy target (visit distribution, or Gumbel's improved policy)."""
    visit_counts: np.ndarray
    """[S, A] int: the root's visit counts, reused subtree included."""
    root_values: np.ndarray
    """[S] float32: the root's mean value for its player to move."""


class BatchedMCTS:
    """Trees for ``num_slots`` games, searched together.

    Loop::

        mcts = BatchedMCTS(game, evaluate, MCTSConfig(simulations=50), num_slots=64, rng=rng)
        for slot in range(64):
            mcts.reset(slot, game.new_initial_state())
        while playing:
            result = mcts.search(playing)          # evaluate() called 1 + 50 times
            for slot, action in zip(playing, result.actions):
                mcts.advance(slot, action)         # keeps the subtree below that move
                if mcts.root_state(slot).is_terminal(): ...
    """

    def __init__(self, game: Game, evaluate: Evaluator, config: MCTSConfig, num_slots: int,
                 rng: np.random.Generator) -> None:
        if num_slots < 1:
            raise ConfigError(f"num_slots must be at least 1, not {num_slots}")
        self.game = game
        self.config = config
        self._evaluate = evaluate
        self._rng = rng
        self._num_actions = game.num_actions
        self._allocate(num_slots, max(16, config.simulations + 2))
        self._states: list[list[GameState | None]] = [[] for _ in range(num_slots)]
        self._count = np.zeros(num_slots, np.int64)
        self._ply = np.zeros(num_slots, np.int64)

    # --- storage --------------------------------------------------------------------------------

    def _allocate(self, slots: int, capacity: int) -> None:
        actions = self._num_actions
        self._children = np.full((slots, capacity, actions), -1, np.int32)
        self._visits = np.zeros((slots, capacity, actions), np.float32)
        self._value_sum = np.zeros((slots, capacity, actions), np.float32)
        self._prior = np.zeros((slots, capacity, actions), np.float32)
        self._legal = np.zeros((slots, capacity, actions), bool)
        self._player = np.zeros((slots, capacity), np.int8)
        self._terminal = np.zeros((slots, capacity), bool)
        self._outcome0 = np.zeros((slots, capacity), np.float32)  # terminal value for player 0
        self._expanded = np.zeros((slots, capacity), bool)
        self._estimate = np.zeros((slots, capacity), np.float32)  # network value, mover's view

    def _grow(self) -> None:
        """Double every slot's node capacity."""
        old = {name: getattr(self, name) for name in self._NODE_ARRAYS}
        slots, capacity = self._children.shape[:2]
        self._allocate(slots, 2 * capacity)
        for name, array in old.items():
            getattr(self, name)[:, :capacity] = array

    _NODE_ARRAYS = ("_children", "_visits", "_value_sum", "_prior", "_legal", "_player",
                    "_terminal", "_outcome0", "_expanded", "_estimate")

    def _new_node(self, slot: int, state: GameState) -> int:
        node = int(self._count[slot])
        if node >= self._children.shape[1]:
            self._grow()
        self._count[slot] = node + 1
        self._children[slot, node] = -1
        self._visits[slot, node] = 0
        self._value_sum[slot, node] = 0
        self._expanded[slot, node] = False
        terminal = state.is_terminal()
        self._terminal[slot, node] = terminal
        if terminal:
            self._outcome0[slot, node] = state.returns()[0]
            self._player[slot, node] = 0
        else:
            self._player[slot, node] = state.current_player()
        states = self._states[slot]
        if node < len(states):
            states[node] = state
        else:
            states.append(state)
        return node

    # --- slots ----------------------------------------------------------------------------------

    def reset(self, slot: int, state: GameState, ply: int = 0) -> None:
        """Start searching from ``state`` (cloned) in ``slot``, ``ply`` moves into its game."""
        self._count[slot] = 0
        self._states[slot] = []
        self._new_node(slot, state.clone())
        self._ply[slot] = ply

    def root_state(self, slot: int) -> GameState:
        """The slot's current position (the search's own: clone it before playing on it)."""
        return self._states[slot][0]

    def advance(self, slot: int, action: int) -> None:
        """Play ``action`` at the slot's root (any player's move), keeping its searched subtree."""
        action = int(action)
        child = int(self._children[slot, 0, action])
        self._ply[slot] += 1
        if child >= 0 and self.config.reuse_tree:
            self._keep_subtree(slot, child)
            return
        state = self._states[slot][0].clone()
        state.apply(action)
        self._count[slot] = 0
        self._states[slot] = []
        self._new_node(slot, state)

    def _keep_subtree(self, slot: int, root: int) -> None:
        """Move the subtree under ``root`` to the front of the slot, breadth first."""
        order = [np.array([root])]
        frontier = order[0]
        while frontier.size:
            below = self._children[slot, frontier].ravel()
            frontier = below[below >= 0]
            order.append(frontier)
        old = np.concatenate(order)
        renumber = np.full(int(self._count[slot]), -1, np.int32)
        renumber[old] = np.arange(old.size, dtype=np.int32)
        for name in self._NODE_ARRAYS:
            array = getattr(self, name)
            array[slot, :old.size] = array[slot, old]
        children = self._children[slot, :old.size]
        children[...] = np.where(children >= 0, renumber[np.maximum(children, 0)], -1)
        states = self._states[slot]
        self._states[slot] = [states[i] for i in old.tolist()]
        self._count[slot] = old.size

    # --- checkpoints ----------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """Every slot's tree: the node arrays, and each root position as its move history. The
        other nodes' positions follow from their root and the edges, so the restored trees search
        exactly as these would (the rng is the caller's)."""
        used = max(1, int(self._count.max()))
        return {"arrays": {name: getattr(self, name)[:, :used].copy()
                           for name in self._NODE_ARRAYS},
                "count": self._count.copy(), "ply": self._ply.copy(),
                "roots": [states[0].history() if states else None for states in self._states]}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore ``get_state()``'s trees (the same number of slots and the same game)."""
        count = np.asarray(state["count"], np.int64)
        if count.shape != self._count.shape:
            raise ValueError(f"a checkpoint of {count.size} game slots cannot restore "
                             f"{self._count.size}")
        used = state["arrays"]["_children"].shape[1]
        self._allocate(len(count), max(self._children.shape[1], used))
        for name in self._NODE_ARRAYS:
            getattr(self, name)[:, :used] = state["arrays"][name]
        self._count[:] = count
        self._ply[:] = state["ply"]
        self._states = [self._rebuild(slot, moves) for slot, moves in enumerate(state["roots"])]

    def _rebuild(self, slot: int, root_moves: list[int] | None) -> list[GameState | None]:
        """The slot's node positions: the root's from its moves, each child's from its parent's
        by the edge's move."""
        if root_moves is None:
            return []
        states: list[GameState | None] = [None] * int(self._count[slot])
        states[0] = self.game.state_from_history(root_moves)
        frontier = [0]
        while frontier:
            below = []
            for node in frontier:
                children = self._children[slot, node]
                for action in np.flatnonzero(children >= 0).tolist():
                    child = int(children[action])
                    position = states[node].clone()
                    position.apply(action)
                    states[child] = position
                    below.append(child)
            frontier = below
        return states

    # --- search ---------------------------------------------------------------------------------

    def search(self, slots: Sequence[int]) -> SearchResult:
        """Run ``config.simulations`` simulations in each of ``slots`` (none terminal) and
        choose their moves. Calls ``evaluate`` once for the roots not yet expanded, then once per
        simulation step."""
        slots = np.asarray(slots, np.int64)
        if slots.size == 0:
            raise ValueError("search needs at least one slot")
        if np.unique(slots).size != slots.size:
            raise ValueError(f"slots repeat: {slots.tolist()}")
        if self._terminal[slots, 0].any():
            raise ValueError(f"slots {slots[self._terminal[slots, 0]].tolist()} are at the end "
                             f"of their games; reset them before searching")
        unexpanded = slots[~self._expanded[slots, 0]]
        if unexpanded.size:
            self._expand(unexpanded, np.zeros(unexpanded.size, np.int64))
        root = _RootSearch(self, slots)
        for step in range(self.config.simulations):
            self._simulate(slots, root, step)
        return root.result()

    def _simulate(self, slots: np.ndarray, root: _RootSearch, step: int) -> None:
        """One simulation in every slot: select down to a leaf, evaluate all leaves in one call,
        back up."""
        rows = np.arange(slots.size)
        node = np.zeros(slots.size, np.int64)
        leaf_value0 = np.zeros(slots.size, np.float32)  # the leaf's value for player 0
        path: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        new_rows, new_nodes = [], []
        active = rows
        while active.size:
            games, at = slots[active], node[active]
            if not path:
                action = root.select(step)
            else:
                action = self._select_interior(games, at)
            path.append((active, at, action))
            child = self._children[games, at, action].astype(np.int64)
            created = child < 0
            for i in np.flatnonzero(created):
                g, parent, a = int(games[i]), int(at[i]), int(action[i])
                state = self._states[g][parent].clone()
                state.apply(a)
                child[i] = self._new_node(g, state)
                self._children[g, parent, a] = child[i]
                if not self._terminal[g, child[i]]:
                    new_rows.append(int(active[i]))
                    new_nodes.append(int(child[i]))
            ends = self._terminal[games, child]
            leaf_value0[active[ends]] = self._outcome0[games[ends], child[ends]]
            going_on = ~(created | ends)
            node[active[going_on]] = child[going_on]
            active = active[going_on]
        if new_rows:
            evaluated = np.asarray(new_rows)
            values = self._expand(slots[evaluated], np.asarray(new_nodes))
            movers = self._player[slots[evaluated], new_nodes]
            leaf_value0[evaluated] = np.where(movers == 0, values, -values)
        for active, at, action in path:
            games = slots[active]
            sign = np.where(self._player[games, at] == 0, 1.0, -1.0).astype(np.float32)
            self._visits[games, at, action] += 1
            self._value_sum[games, at, action] += sign * leaf_value0[active]
        root.count(path[0][2])

    def _expand(self, games: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Evaluate these (game, node) states in one call; store priors; return their values."""
        states = [self._states[g][n] for g, n in zip(games.tolist(), nodes.tolist(), strict=True)]
        observations = np.stack([state.observation() for state in states])
        masks = np.stack([state.legal_action_mask() for state in states])
        priors, values = self._evaluate(observations, masks)
        priors = np.asarray(priors, np.float32)
        values = np.asarray(values, np.float32).reshape(-1)
        if priors.shape != masks.shape or values.shape != (len(states),):
            raise ValueError(f"evaluate returned priors {priors.shape} and values {values.shape} "
                             f"for {len(states)} states; expected {masks.shape} and "
                             f"({len(states)},)")
        self._prior[games, nodes] = _normalized_priors(priors, masks)
        self._legal[games, nodes] = masks
        self._estimate[games, nodes] = values
        self._expanded[games, nodes] = True
        return values

    def _select_interior(self, games: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        visits = self._visits[games, nodes]
        legal = self._legal[games, nodes]
        prior = self._prior[games, nodes]
        if self.config.gumbel:
            improved = _improved_policy(np.log(prior + 1e-30), visits,
                                        self._value_sum[games, nodes], prior,
                                        self._estimate[games, nodes], legal, self.config)
            score = improved - visits / (1.0 + visits.sum(axis=1, keepdims=True))
        else:
            score = _puct(visits, self._value_sum[games, nodes], prior, self.config.c_puct)
        return np.where(legal, score, -np.inf).argmax(axis=1)


class _RootSearch:
    """The root's part of one search: noisy priors (PUCT) or Gumbel's sampled actions and
    sequential halving, this search's visit counts, and the final choice."""

    def __init__(self, mcts: BatchedMCTS, slots: np.ndarray) -> None:
        self.mcts, self.slots, config = mcts, slots, mcts.config
        self.legal = mcts._legal[slots, 0].copy()
        self.prior = mcts._prior[slots, 0].copy()
        self.visits_here = np.zeros(self.legal.shape, np.int64)
        rng = mcts._rng
        if config.gumbel:
            self.logits = np.where(self.legal, np.log(self.prior + 1e-30), -np.inf)
            noise = (rng.gumbel(size=self.legal.shape) if config.root_noise
                     else np.zeros(self.legal.shape))
            self.gumbel = np.where(self.legal, noise, -np.inf)
            n_legal = self.legal.sum(axis=1)
            self.considered = np.minimum(config.gumbel_actions, n_legal)
            ranked = np.argsort(-(self.gumbel + self.logits), axis=1, kind="stable")
            rank = np.empty_like(ranked)
            np.put_along_axis(rank, ranked, np.arange(ranked.shape[1])[None], axis=1)
            self.sampled = rank < self.considered[:, None]
            # [S, simulations]: the visit count the root action of each simulation must have.
            self.targets = np.array([_considered_visits(int(m), config.simulations)
                                     for m in self.considered])
        elif config.root_noise and config.dirichlet_epsilon > 0:
            alpha = config.dirichlet_alpha_scale / self.legal.sum(axis=1, keepdims=True)
            draws = np.where(self.legal, rng.standard_gamma(np.broadcast_to(alpha,
                                                                            self.legal.shape)), 0)
            noise = draws / np.maximum(draws.sum(axis=1, keepdims=True), 1e-30)
            eps = config.dirichlet_epsilon
            self.prior = ((1 - eps) * self.prior + eps * noise).astype(np.float32)

    def _stats(self) -> tuple[np.ndarray, np.ndarray]:
        return self.mcts._visits[self.slots, 0], self.mcts._value_sum[self.slots, 0]

    def _gumbel_scores(self) -> np.ndarray:
        visits, value_sum = self._stats()
        sigma = _sigma_completed_q(visits, value_sum, self.mcts._prior[self.slots, 0],
                                   self.mcts._estimate[self.slots, 0], self.legal,
                                   self.mcts.config)
        return self.gumbel + self.logits + sigma

    def select(self, step: int) -> np.ndarray:
        if not self.mcts.config.gumbel:
            visits, value_sum = self._stats()
            score = _puct(visits, value_sum, self.prior, self.mcts.config.c_puct)
            return np.where(self.legal, score, -np.inf).argmax(axis=1)
        eligible = self.sampled & (self.visits_here == self.targets[:, step, None])
        # The schedule always leaves a survivor eligible; the fallback only guards the legality.
        eligible = np.where(eligible.any(axis=1, keepdims=True), eligible, self.sampled)
        return np.where(eligible, self._gumbel_scores(), -np.inf).argmax(axis=1)

    def count(self, actions: np.ndarray) -> None:
        self.visits_here[np.arange(actions.size), actions] += 1

    def result(self) -> SearchResult:
        mcts, config = self.mcts, self.mcts.config
        visits, value_sum = self._stats()
        estimate = mcts._estimate[self.slots, 0]
        root_values = (estimate + value_sum.sum(axis=1)) / (1.0 + visits.sum(axis=1))
        if config.gumbel:
            sampled_visits = np.where(self.sampled, self.visits_here, -1)
            survivors = sampled_visits == sampled_visits.max(axis=1, keepdims=True)
            actions = np.where(survivors, self._gumbel_scores(), -np.inf).argmax(axis=1)
            policies = _improved_policy(self.logits, visits, value_sum,
                                        mcts._prior[self.slots, 0], estimate, self.legal, config)
        else:
            policies = visits / np.maximum(visits.sum(axis=1, keepdims=True), 1)
            actions = np.empty(self.slots.size, np.int64)
            for i, slot in enumerate(self.slots):
                if mcts._ply[slot] < config.temperature_moves:
                    actions[i] = mcts._rng.choice(policies.shape[1], p=policies[i])
                else:
                    best = np.flatnonzero(visits[i] == visits[i].max())
                    actions[i] = best[0] if best.size == 1 else mcts._rng.choice(best)
        return SearchResult(actions=actions, policies=policies.astype(np.float32),
                            visit_counts=visits.astype(np.int64),
                            root_values=root_values.astype(np.float32))


def _puct(visits: np.ndarray, value_sum: np.ndarray, prior: np.ndarray,
          c_puct: float) -> np.ndarray:
    """AlphaZero's score per edge, [K, A]; an unvisited edge's Q is 0 (a draw)."""
    q = np.divide(value_sum, visits, out=np.zeros_like(value_sum), where=visits > 0)
    explore = c_puct * prior * np.sqrt(1.0 + visits.sum(axis=1, keepdims=True)) / (1.0 + visits)
    return q + explore


def _normalized_priors(priors: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """The evaluator's priors restricted to legal moves and summing to 1 (uniform if none)."""
    priors = np.where(masks, np.maximum(np.nan_to_num(priors, nan=0.0), 0.0), 0.0)
    total = priors.sum(axis=1, keepdims=True)
    uniform = masks / np.maximum(masks.sum(axis=1, keepdims=True), 1)
    return np.where(total > 0, priors / np.where(total > 0, total, 1), uniform)


def _sigma_completed_q(visits: np.ndarray, value_sum: np.ndarray, prior: np.ndarray,
                       estimate: np.ndarray, legal: np.ndarray, config: MCTSConfig) -> np.ndarray:
    """sigma(completed Q) per edge, [K, A]: visited edges' Q, the others' the mixed value
    estimate (network value and the prior-weighted Q of visited edges), scaled to [0, 1] over
    the legal edges, times (c_visit + max N) * c_scale."""
    visited = visits > 0
    q = np.divide(value_sum, visits, out=np.zeros_like(value_sum), where=visited)
    total = visits.sum(axis=1)
    visited_prior = np.where(visited, prior, 0).sum(axis=1)
    weighted_q = np.divide(np.where(visited, prior * q, 0).sum(axis=1), visited_prior,
                           out=np.zeros_like(total), where=visited_prior > 0)
    mixed = (estimate + total * weighted_q) / (1.0 + total)
    completed = np.where(visited, q, mixed[:, None])
    low = np.where(legal, completed, np.inf).min(axis=1, keepdims=True)
    high = np.where(legal, completed, -np.inf).max(axis=1, keepdims=True)
    scaled = (completed - low) / np.maximum(high - low, 1e-8)
    return (config.gumbel_c_visit + visits.max(axis=1, keepdims=True)) * config.gumbel_c_scale \
        * np.where(legal, scaled, 0.0)


def _improved_policy(logits: np.ndarray, visits: np.ndarray, value_sum: np.ndarray,
                     prior: np.ndarray, estimate: np.ndarray, legal: np.ndarray,
                     config: MCTSConfig) -> np.ndarray:
    """Gumbel AlphaZero's improved policy softmax(logits + sigma(completed Q)) over legal
    moves, [K, A]."""
    scores = np.where(legal, logits + _sigma_completed_q(visits, value_sum, prior, estimate,
                                                         legal, config), -np.inf)
    scores = scores - scores.max(axis=1, keepdims=True)
    weights = np.where(legal, np.exp(scores), 0.0)
    return weights / weights.sum(axis=1, keepdims=True)


@lru_cache(maxsize=256)
def _considered_visits(considered: int, simulations: int) -> tuple[int, ...]:
    """Sequential halving's schedule: at simulation k, the root action to visit is one of the
    survivors that has exactly this many visits so far. Each phase gives every survivor an equal
    share of ``simulations / phases`` (at least one visit), then keeps the better half."""
    if considered <= 1:
        return tuple(range(simulations))
    phases = math.ceil(math.log2(considered))
    schedule: list[int] = []
    visits = 0
    survivors = considered
    while len(schedule) < simulations:
        rounds = max(1, simulations // (phases * survivors))
        for _ in range(rounds):
            schedule.extend([visits] * survivors)
            visits += 1
        survivors = max(2, survivors // 2)
    return tuple(schedule[:simulations])
