"""AlphaZero: self-play with batched MCTS on the rollout ranks, a policy-value network trained on
the positions (Silver et al. 2018), for two-player board games (``--env openspiel/<name>`` or a
PettingZoo classic module such as ``pettingzoo.classic.tictactoe_v3``).

Each iteration every rollout rank plays its ``games_per_worker`` games in parallel, batching the
leaf evaluations of all their trees into one torch forward (torch runs on the rollout ranks for
this algorithm), until that many games have ended. Rollout rank i sends their positions, stamped
with the weights version that played them, straight to learner i mod L over the data plane
(``rollouts_to_learners``; in the answer only where the learner is in the driver's process:
``num_learners`` 0, or local mode); the driver gets counts and game results. Each learner keeps
the newest positions it got in a FIFO shard of its own (``replay_capacity`` split over the
learners), takes ``sgd_steps_per_iteration`` AdamW steps on symmetry-augmented minibatches of
``alphazero_loss`` from its shard (``train_batch_size`` split over them), with the gradient
averaged over the learners each step, so all hold the same weights, and learner 0 broadcasts the
new weights version (``weights_version``; ``policy_lag_mean`` is the mean age in versions of the
positions trained on). Every ``evaluation_interval`` iterations ``evaluation_games`` are
played against each of ``evaluation_opponents`` (``eval_<opponent>_
win``/``draw``/``loss`` rates, the live line's columns), the network searching
``evaluation_simulations`` a move without noise (0: its raw policy).
The driver only splits the matches: the rollout ranks play them (``SelfPlayWorker.
play_matches``), each its share, half of the games moving first, with rngs the driver seeds.

With ``gating`` (AlphaGo Zero's evaluator) the driver keeps a best network apart from the
learner's newest: self-play uses the best one's weights (the learner's are not broadcast), and
every ``evaluation_interval`` iterations the learner's newest, the candidate, plays
``gating_games`` against the best on the rollout ranks. It becomes the best, and self-play's
network, only if it scores at least ``gating_threshold`` (55%), a draw counting as half a win
(``gating_score``, ``gating_accepted`` and ``best_version``: the iteration whose candidate is
the best, 0 for the first network). The evaluation then measures the best network. The best
weights are in the driver's checkpoint.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from mpirl.algorithms.alphazero.game_env import GameEnvSpec, game_env_spec
from mpirl.algorithms.alphazero.games import GameObservationSpace
from mpirl.algorithms.alphazero.learner import AlphaZeroLearner
from mpirl.algorithms.alphazero.match import CheckpointMatches
from mpirl.algorithms.alphazero.network import AlphaZeroNet, alphazero_loss
from mpirl.algorithms.alphazero.operators import rollouts_to_learners, train_on_positions
from mpirl.algorithms.alphazero.players import make_player, reference_opponents
from mpirl.algorithms.alphazero.self_play_worker import MatchShare, SelfPlayWorker
from mpirl.algorithms.alphazero.spec import AlphaZeroSpec

from mpirl.config.fields import AllreduceConfig, CommonConfig, Range, above, at_least, within
from mpirl.errors import ConfigError, RankLost
from mpirl.execution.contract import PlanState
from mpirl.execution.operators import broadcast_weights
from mpirl.execution.trainer import Trainer

ROLLOUT_WORKER = SelfPlayWorker
LEARNER = AlphaZeroLearner
RECURRENT = False  # positions are stored one by one
#: ``--env`` is a board game (``openspiel/<name>`` or a PettingZoo classic module).
env_spec = game_env_spec


@dataclass
class Config(CommonConfig, AllreduceConfig):
    """AlphaZero's settings. Defaults suit tic-tac-toe; every field is a ``--config`` key.
    ``--env`` is a game (``openspiel/<name>`` or a PettingZoo classic module), loaded by
    ``games.load_game`` on every rank that plays it, not a gymnasium env."""

    num_envs_per_worker: int = 1
    """Not used: a rollout rank's games in play are the algorithm's own key."""

    # Self-play and search
    games_per_worker: int = 32
    """Games each rollout rank plays at once (searched together); each iteration it plays
    until this many have ended."""
    simulations: int = 16
    """MCTS simulations per move in self-play."""
    c_puct: float = 1.25
    """Exploration weight of the prior in PUCT."""
    gumbel: bool = False
    """Gumbel AlphaZero's root search (sequential halving) instead of PUCT with Dirichlet
    noise."""
    temperature_moves: int = 2
    """Plies at the start of each self-play game whose move is sampled from the visit counts;
    later moves are the most visited (PUCT only)."""
    dirichlet_epsilon: float = 0.25
    """Weight of the Dirichlet noise in the root's priors (PUCT)."""

    # Network
    channels: int = 16
    """Width of the residual tower (board planes)."""
    blocks: int = 1
    """Residual blocks after the stem (board planes)."""
    value_hidden: int = 32
    """Width of the value head's hidden layer."""
    hidden_sizes: tuple[int, ...] = (128, 128)
    """The MLP trunk's widths, for games whose observations are not board planes."""

    # Optimization
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 1e-4
    """AdamW's decoupled weight decay (AlphaZero's L2 term)."""
    grad_clip: float = 0.0
    """Global gradient-norm clip; 0 turns it off."""
    train_batch_size: int = 128
    """Positions per SGD step (each under a random symmetry of the game), over all learners:
    each draws its equal share from its own replay shard."""
    sgd_steps_per_iteration: int = 40
    """SGD steps after each iteration's self-play."""
    replay_capacity: int = 20_000
    """Positions kept for training: the newest (a FIFO window on each learner, which keeps its
    share of this many)."""

    # Evaluation
    evaluation_interval: int = 20
    """Evaluate against the opponents every this many iterations. Evaluation games search
    (``evaluation_simulations``) one position at a time: on tic-tac-toe 20 games against each
    of two opponents cost each of two rollout ranks about 9 s of CPU (measured on a busy
    2-core machine), a third of what 60 iterations of self-play and training take."""
    evaluation_games: int = 20
    """Games against each opponent per evaluation (half of them moving first)."""
    evaluation_opponents: str = "auto"
    """Comma-separated players to evaluate against: random, minimax (small games only),
    minimax:traps (perfect, and setting traps), mcts:N (UCT with random rollouts) or
    module:Class. "auto": random, and minimax where the game is small enough to solve."""
    evaluation_simulations: int = 100
    """The network's search in evaluation and gating games, and in ``mpirl evaluate`` and
    ``mpirl play`` unless ``--simulations`` says otherwise: this many simulations a move,
    without root noise, the most visited move. 0 plays the raw policy (its most probable legal
    move). Self-play's 16 are too few to play well: on tic-tac-toe they lost 2-3 of 100 games
    to minimax where 64 and more lost none (benchmarks/RESULTS.md)."""
    evaluation_gumbel: bool = False
    """With ``gumbel``, search evaluation and gating games with Gumbel's root search too; by
    default they search with PUCT (the most visited move), which measured stronger at 32
    simulations: on a Gumbel run's tic-tac-toe network (seed 2, 40 iterations), 4 losses in 20
    games to minimax with Gumbel's search, none with PUCT's (nor with the raw policy)."""

    # Gating
    gating: bool = False
    """Keep a best network apart from the learner's newest: self-play uses the best one's
    weights, and every ``evaluation_interval`` iterations the newest (the candidate) plays
    ``gating_games`` against it on the rollout ranks; it becomes the best only if it scores at
    least ``gating_threshold`` (AlphaGo Zero's rule)."""
    gating_threshold: float = 0.55
    """The candidate's score needed to replace the best network: wins plus half the draws,
    over the games (AlphaGo Zero's 55%)."""
    gating_games: int = 40
    """Games of each gating match (half with the candidate moving first)."""
    gating_opening_moves: int = 2
    """Uniformly random plies at the start of each gating game: two networks without search
    noise play deterministically, and would otherwise repeat the same two games."""

    ranges: ClassVar[dict[str, Range]] = {
        "games_per_worker": at_least(1), "simulations": at_least(1), "c_puct": above(0),
        "temperature_moves": at_least(0), "dirichlet_epsilon": within(0, 1),
        "channels": at_least(1), "blocks": at_least(0), "value_hidden": at_least(1),
        "weight_decay": at_least(0), "sgd_steps_per_iteration": at_least(0),
        "replay_capacity": at_least(1), "evaluation_games": at_least(1),
        "evaluation_simulations": at_least(0), "gating_threshold": within(0, 1),
        "gating_games": at_least(1), "gating_opening_moves": at_least(0)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.multiagent:
            raise ConfigError("config key 'multiagent' is not for AlphaZero: both players of "
                              "its self-play are the one network")

    def samples_per_iteration(self, rollout_slots: int) -> int:
        """The SGD batch (``train_batch_size``), not env steps: self-play counts games."""
        return self.train_batch_size

    def opponents(self, env: GameEnvSpec) -> list[str]:
        """The players the evaluations of a run on ``env`` play against
        (``evaluation_opponents``; the game is loaded only for "auto")."""
        if self.evaluation_opponents.strip() == "auto":
            return reference_opponents(env.game())
        return [name.strip() for name in self.evaluation_opponents.split(",") if name.strip()]

    def live_columns(self, env: Any) -> list[tuple[str, tuple[str, ...]]] | None:
        """The live line shows the latest evaluation's win/draw/loss rates against each
        opponent: self-play's returns (the first player's outcome) say nothing of strength."""
        return [(f"eval {name} w/d/l", tuple(f"eval_{column(name)}_{outcome}"
                                             for outcome in ("win", "draw", "loss")))
                for name in self.opponents(env)]


def model_spec(observation_space: Any, action_space: Any, config: Config) -> AlphaZeroSpec:
    """The network for the game's positions; board planes' order from where the game comes
    from (``GameObservationSpace.channels_last``)."""
    if not isinstance(observation_space, GameObservationSpace):
        raise ConfigError(f"AlphaZero's network is for board games' positions, not "
                          f"{observation_space}: give --env openspiel/<name> or a PettingZoo "
                          f"classic module")
    return AlphaZeroSpec(observation_shape=tuple(observation_space.shape),
                         num_actions=int(action_space.n),
                         channels_last=observation_space.channels_last,
                         channels=config.channels, blocks=config.blocks,
                         hidden_sizes=tuple(config.hidden_sizes),
                         value_hidden=config.value_hidden)


#: ``mpirl evaluate --opponent`` and ``mpirl play`` play its checkpoints.
MATCHES = CheckpointMatches(Config, model_spec)


def loss(model: AlphaZeroNet, batch: dict[str, Any], config: Config):
    """Policy cross-entropy plus value squared error (``alphazero_loss``)."""
    return alphazero_loss(model, batch)


def check_config(config: Config, env: Any) -> None:
    if not isinstance(env, GameEnvSpec):
        raise ConfigError("AlphaZero plays two-player board games: give --env "
                          "openspiel/<name> or a PettingZoo classic module")
    learners = max(config.num_learners, 1)
    if config.train_batch_size % learners:
        below = config.train_batch_size // learners * learners
        raise ConfigError(
            f'config key "train_batch_size" = {config.train_batch_size} does not split evenly '
            f'over {learners} learners (each takes an equal share of every SGD step): give a '
            f'multiple of {learners}, such as {below or learners} or {below + learners}')
    if not config.opponents(env):
        raise ConfigError('config key "evaluation_opponents" names no player; give e.g. '
                          '"random", "random,minimax" or "auto"')
    game, rng = env.game(), np.random.default_rng(0)
    for name in config.opponents(env):
        try:  # a bad name, or a game too big for minimax
            make_player(name, game, rng)
        except ConfigError as error:
            raise ConfigError(f'config key "evaluation_opponents" = '
                              f'"{config.evaluation_opponents}": {error}') from None


def column(opponent: str) -> str:
    """``mcts:100`` -> ``mcts_100``: an opponent's name as part of a column name."""
    return re.sub(r"[^A-Za-z0-9]+", "_", opponent).strip("_")


def search_fields(config: Config) -> dict[str, Any]:
    """How the networks of evaluation and gating games choose moves (``MatchShare``)."""
    return {"simulations": config.evaluation_simulations,
            "gumbel": config.gumbel and config.evaluation_gumbel}


def split_match(games: int, workers: int) -> list[tuple[int, int]]:
    """``games`` games over ``workers`` workers as (games, games moving first) per worker: game
    j goes to worker j mod ``workers``, and the first half of them (the extra one when odd) are
    those the network moves first in, so that the whole match is half and half."""
    first = (games + 1) // 2
    return [(len(range(i, games, workers)), len(range(i, first, workers)))
            for i in range(workers)]


class AlphaZeroState(PlanState):
    """The driver's evaluation and gating: the matches it hands to the rollout ranks, the
    latest results, and with ``gating`` the best network (its weights and version)."""

    def __init__(self, trainer: Trainer) -> None:
        config = trainer.config
        self.rng = np.random.default_rng(config.seed + 99_991)
        self.opponents = config.opponents(trainer.env)
        self.latest = {f"eval_{column(name)}_{outcome}": math.nan
                       for name in self.opponents for outcome in ("win", "draw", "loss")}
        #: The weights version the rollout ranks hold: the learners' after the last update,
        #: or with gating the best network's.
        self.weights_version = 0
        #: The learners' weights version after the last update.
        self.learner_version = 0
        if config.gating:
            self.latest |= {"gating_score": math.nan, "gating_accepted": math.nan,
                            "best_version": 0}
        #: The best network's weights (with gating): the learner's first ones to begin with.
        self.best = trainer.learners[0].call("get_weights") if config.gating else None
        #: Whether the rollout ranks must be given ``best`` before they next play (after a
        #: restore, the trainer gives them the learner's weights).
        self.deliver_best = self.gating = config.gating
        for learner in trainer.learners:
            learner.call("use_symmetries", trainer.env)

    def play(self, trainer: Trainer, matches: list[tuple[Any, int, dict[str, Any]]]
             ) -> list[dict[str, int]]:
        """Play ``matches`` (opponent, games, MatchShare's other fields) on the rollout ranks,
        each split over all of them; the summed counts of each match, from the network's side.
        Each share's seed comes from the driver's rng, so a seed's run is reproducible."""
        workers = list(trainer.rollouts)
        shares: list[list[tuple[int, MatchShare]]] = [[] for _ in workers]
        for m, (opponent, games, fields) in enumerate(matches):
            for i, (count, first) in enumerate(split_match(games, len(workers))):
                seed = int(self.rng.integers(2**63))
                if count:
                    shares[i].append((m, MatchShare(opponent=opponent, games=count,
                                                    first=first, seed=seed, **fields)))
        futures = [(i, worker.call_async("play_matches", [share for _, share in shares[i]]))
                   for i, worker in enumerate(workers) if shares[i]]
        totals = [dict.fromkeys(("games", "wins", "draws", "losses"), 0) for _ in matches]
        for i, future in futures:
            try:
                results = future.result()
            except RankLost:  # survived under ULFM: its share of the games is not counted
                continue
            for (m, _), result in zip(shares[i], results, strict=True):
                for key in totals[m]:
                    totals[m][key] += result[key]
        return totals

    def evaluate(self, trainer: Trainer) -> None:
        """Play ``evaluation_games`` against each opponent with the rollout ranks' network
        (the learner's newest, or with gating the best); the win/draw/loss rates."""
        config = trainer.config
        matches = [(name, config.evaluation_games, search_fields(config))
                   for name in self.opponents]
        for name, result in zip(self.opponents, self.play(trainer, matches), strict=True):
            for outcome, count in (("win", result["wins"]), ("draw", result["draws"]),
                                   ("loss", result["losses"])):
                self.latest[f"eval_{column(name)}_{outcome}"] = (
                    count / result["games"] if result["games"] else math.nan)

    def gate(self, trainer: Trainer) -> None:
        """The learner's newest weights (the candidate) against the best network; the
        candidate becomes the best, and the rollout ranks' self-play network, if it scores
        (wins plus half the draws, over the games) at least ``gating_threshold``."""
        config = trainer.config
        candidate = trainer.learners[0].call("get_weights")
        fields = {**search_fields(config), "weights": candidate,
                  "opening_moves": config.gating_opening_moves}
        result, = self.play(trainer, [(self.best, config.gating_games, fields)])
        if not result["games"]:  # every share's rank was lost: no decision
            return
        score = (result["wins"] + 0.5 * result["draws"]) / result["games"]
        accepted = score >= config.gating_threshold
        if accepted:
            self.best = candidate
            self.weights_version = self.learner_version
            self.latest["best_version"] = trainer.iteration + 1
            self.deliver(trainer)
        self.latest["gating_score"] = score
        self.latest["gating_accepted"] = int(accepted)

    def deliver(self, trainer: Trainer) -> None:
        """Give every rollout rank the best network's weights for self-play (the learner's,
        for a run resumed with gating from a checkpoint without it)."""
        if self.best is None:
            self.best = trainer.learners[0].call("get_weights")
        trainer.rollouts.call("set_weights", self.best)
        self.deliver_best = False

    def get_state(self) -> dict[str, Any]:
        return {"latest": dict(self.latest), "rng": self.rng.bit_generator.state,
                "weights_version": self.weights_version,
                "learner_version": self.learner_version, "best": self.best}

    def set_state(self, state: dict[str, Any]) -> None:
        self.weights_version = state.get("weights_version", 0)
        self.learner_version = state.get("learner_version", self.weights_version)
        if "latest" in state:
            self.latest.update({k: v for k, v in state["latest"].items() if k in self.latest})
            self.rng.bit_generator.state = state["rng"]
        if self.gating:
            self.best = state.get("best")  # None: the restored learner's, when delivered
            self.deliver_best = True


def setup(trainer: Trainer) -> AlphaZeroState:
    """The driver's evaluator; the learners learn the game's symmetries."""
    return AlphaZeroState(trainer)


def training_step(trainer: Trainer, state: AlphaZeroState) -> dict[str, float]:
    """One iteration: self-play on every rollout rank, its positions straight into the
    learners' replay shards, data-parallel SGD, the new weights to every rollout rank (with
    gating, the best network's instead, when it changes); gating and an evaluation every
    ``evaluation_interval`` iterations."""
    config = trainer.config
    if state.deliver_best:
        state.deliver(trainer)
    start = time.perf_counter()
    samples = rollouts_to_learners(trainer.rollouts, trainer.learners, "play",
                                   config.games_per_worker, state.weights_version)
    play_s = time.perf_counter() - start
    trainer.count(samples)
    stats = train_on_positions(trainer.learners, samples,
                               sgd_steps=config.sgd_steps_per_iteration,
                               batch_size=config.train_batch_size // len(trainer.learners),
                               min_replay=config.train_batch_size)
    state.learner_version = int(stats["weights_version"])
    if not config.gating:  # with gating, self-play keeps the best network (state.gate)
        state.weights_version = state.learner_version
        broadcast_weights(trainer.learners, trainer.rollouts)
    games = len(samples.episode_lengths)
    returns = np.asarray(samples.episode_returns)
    row = {"positions_per_s": samples.env_steps / max(play_s, 1e-9),
           "games_this_iter": games,
           "game_length_mean": float(np.mean(samples.episode_lengths)) if games else math.nan,
           "first_player_win_rate": float((returns > 0).mean()) if games else math.nan,
           "draw_rate": float((returns == 0).mean()) if games else math.nan,
           **{k: stats.get(k, math.nan) for k in ("policy_loss", "value_loss",
                                                   "policy_entropy", "loss")},
           **{k: int(stats[k]) for k in ("sgd_steps", "sgd_steps_total", "replay_size",
                                         "weights_version")},
           "policy_lag_mean": stats["policy_lag_mean"]}
    if (trainer.iteration + 1) % config.evaluation_interval == 0:
        if config.gating:
            state.gate(trainer)
        state.evaluate(trainer)
    return row | state.latest
