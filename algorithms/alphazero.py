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
positions trained on). Every ``evaluation_interval`` iterations the
driver plays ``evaluation_games`` against each of ``evaluation_opponents`` (``eval_<opponent>_
win``/``draw``/``loss`` rates), with the raw policy or, with ``evaluation_simulations``, search.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mpirl.config.fields import AllreduceConfig, GameConfig, Range, above, at_least, within
from mpirl.envs.games import GameObservationSpace
from mpirl.errors import ConfigError
from mpirl.execution.contract import PlanState
from mpirl.execution.operators import broadcast_weights, rollouts_to_learners, train_one_step
from mpirl.execution.trainer import Trainer
from mpirl.models.alphazero import AlphaZeroNet, TorchEvaluator, alphazero_loss
from mpirl.models.alphazero_spec import AlphaZeroSpec
from mpirl.models.torch_model import build_torch_model
from mpirl.search.mcts import SearchConfig
from mpirl.search.players import Player, RawPolicyPlayer, SearchPlayer, make_player, play_match
from mpirl.workers.alphazero_workers import AlphaZeroLearner, SelfPlayWorker
from mpirl.workers.env_spec import GameEnvSpec

ROLLOUT_WORKER = SelfPlayWorker
LEARNER = AlphaZeroLearner
RECURRENT = False  # positions are stored one by one


@dataclass
class Config(GameConfig, AllreduceConfig):
    """AlphaZero's settings. Defaults suit tic-tac-toe; every field is a ``--config`` key."""

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
    evaluation_interval: int = 5
    """Evaluate against the opponents every this many iterations."""
    evaluation_games: int = 20
    """Games against each opponent per evaluation (half of them moving first)."""
    evaluation_opponents: str = "random,minimax"
    """Comma-separated players to evaluate against: random, minimax (small games only),
    mcts:N (UCT with random rollouts) or module:Class."""
    evaluation_simulations: int = 0
    """0 evaluates the raw policy (its most probable legal move); more searches with the
    network this many simulations a move, without noise."""

    ranges: ClassVar[dict[str, Range]] = {
        "games_per_worker": at_least(1), "simulations": at_least(1), "c_puct": above(0),
        "temperature_moves": at_least(0), "dirichlet_epsilon": within(0, 1),
        "channels": at_least(1), "blocks": at_least(0), "value_hidden": at_least(1),
        "weight_decay": at_least(0), "sgd_steps_per_iteration": at_least(0),
        "replay_capacity": at_least(1), "evaluation_games": at_least(1),
        "evaluation_simulations": at_least(0)}

    def opponents(self) -> list[str]:
        return [name.strip() for name in self.evaluation_opponents.split(",") if name.strip()]


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
    if not config.opponents():
        raise ConfigError('config key "evaluation_opponents" names no player; give e.g. '
                          '"random" or "random,minimax"')
    game = env.game()
    rng = np.random.default_rng(0)
    for name in config.opponents():
        try:  # a bad name, or a game too big for minimax
            make_player(name, game, rng)
        except ConfigError as error:
            raise ConfigError(f'config key "evaluation_opponents" = '
                              f'"{config.evaluation_opponents}": {error}') from None


def column(opponent: str) -> str:
    """``mcts:100`` -> ``mcts_100``: an opponent's name as part of a column name."""
    return re.sub(r"[^A-Za-z0-9]+", "_", opponent).strip("_")


class AlphaZeroState(PlanState):
    """The driver's evaluation: its copy of the network, opponents and latest results."""

    def __init__(self, trainer: Trainer) -> None:
        config = trainer.config
        self.game = trainer.env.game()
        self.model = build_torch_model(trainer.policy_spec)
        self.model.eval()
        self.rng = np.random.default_rng(config.seed + 99_991)
        self.opponents = config.opponents()
        self.latest = {f"eval_{column(name)}_{outcome}": math.nan
                       for name in self.opponents for outcome in ("win", "draw", "loss")}
        #: The weights version the rollout ranks hold: the learners' after the last update.
        self.weights_version = 0
        for learner in trainer.learners:
            learner.call("use_symmetries", trainer.env)

    def player(self, config: Config) -> Player:
        evaluate = TorchEvaluator(self.model)
        if config.evaluation_simulations:
            search = SearchConfig(simulations=config.evaluation_simulations,
                                  c_puct=config.c_puct, gumbel=config.gumbel)
            return SearchPlayer(self.game, evaluate, search, self.rng)
        return RawPolicyPlayer(evaluate)

    def evaluate(self, trainer: Trainer) -> None:
        config = trainer.config
        self.model.set_flat_weights(trainer.learners[0].call("get_weights"))
        player = self.player(config)
        for name in self.opponents:
            result = play_match(self.game, player, make_player(name, self.game, self.rng),
                                config.evaluation_games, self.rng)
            for outcome, count in (("win", result.wins), ("draw", result.draws),
                                   ("loss", result.losses)):
                self.latest[f"eval_{column(name)}_{outcome}"] = count / result.games

    def get_state(self) -> dict[str, Any]:
        return {"latest": dict(self.latest), "rng": self.rng.bit_generator.state,
                "weights_version": self.weights_version}

    def set_state(self, state: dict[str, Any]) -> None:
        self.weights_version = state.get("weights_version", 0)
        if "latest" in state:
            self.latest.update({k: v for k, v in state["latest"].items() if k in self.latest})
            self.rng.bit_generator.state = state["rng"]


def setup(trainer: Trainer) -> AlphaZeroState:
    """The driver's evaluator; the learners learn the game's symmetries."""
    return AlphaZeroState(trainer)


def training_step(trainer: Trainer, state: AlphaZeroState) -> dict[str, float]:
    """One iteration: self-play on every rollout rank, its positions straight into the
    learners' replay shards, data-parallel SGD, the new weights to every rollout rank; an
    evaluation every ``evaluation_interval`` iterations."""
    config = trainer.config
    start = time.perf_counter()
    samples = rollouts_to_learners(trainer.rollouts, trainer.learners, "play",
                                   config.games_per_worker, state.weights_version)
    play_s = time.perf_counter() - start
    trainer.count(samples)
    stats = train_one_step(trainer.learners, samples,
                           sgd_steps=config.sgd_steps_per_iteration,
                           batch_size=config.train_batch_size // len(trainer.learners),
                           min_replay=config.train_batch_size)
    state.weights_version = int(stats["weights_version"])
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
        state.evaluate(trainer)
    return row | state.latest
