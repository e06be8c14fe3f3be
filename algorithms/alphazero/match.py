"""``mpirl evaluate`` of an AlphaZero checkpoint, and ``mpirl play``: the module's ``MATCHES``.

One process, no MPI: the agent is the checkpoint's network (learner 0's, or with ``gating`` the
best one), searching ``simulations`` times a move (by default the run's
``evaluation_simulations``) without noise, the most visited move (0: its raw policy, the most
probable legal move). ``evaluate_match`` plays it against a reference player
(``players.make_player``'s specs) for N games, half of them moving first; ``play_in_terminal``
lets a person play it. The command line (``mpirl.commands.match``) finds the checkpoint and
reaches these through ``CheckpointMatches``, which the algorithm module makes with its
``Config`` and ``model_spec``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from mpirl.algorithms.alphazero.games import (
    Game,
    GameState,
    OpenSpielState,
    game_spaces,
    load_game,
)
from mpirl.algorithms.alphazero.network import TorchEvaluator
from mpirl.algorithms.alphazero.players import Player, make_player, network_player, play_match
from mpirl.algorithms.alphazero.self_play_worker import search_config

from mpirl.config.parse import build
from mpirl.errors import ConfigError
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.state_files import read_state_file


@dataclass
class GameAgent:
    """A game checkpoint's network, ready to play."""

    checkpoint: Path
    manifest: dict[str, Any]
    game: Game
    evaluate: TorchEvaluator
    config: Any

    def player(self, simulations: int, rng: np.random.Generator) -> Player:
        """Search with ``simulations`` a move as the run's evaluation searches (its self-play
        search, PUCT unless ``gumbel`` and ``evaluation_gumbel``; no noise), or the raw policy
        for 0."""
        if simulations < 0:
            raise ConfigError(f"--simulations must be 0 (the raw policy) or more, not "
                              f"{simulations}")
        config = self.config
        search = replace(search_config(config), gumbel=config.gumbel and config.evaluation_gumbel)
        return network_player(self.game, self.evaluate, search, simulations, rng, name="agent")


class CheckpointMatches:
    """AlphaZero's ``MATCHES``: its checkpoints against reference players
    (``mpirl evaluate --opponent``) and a person (``mpirl play``)."""

    def __init__(self, config_class: type, model_spec: Callable[..., Any]) -> None:
        self.config_class = config_class
        self.model_spec = model_spec

    def load_agent(self, checkpoint: Path, manifest: dict[str, Any]) -> GameAgent:
        """The network of ``checkpoint`` (a checkpoint folder, with its manifest)."""
        # Search evaluates one position at a time: torch's default threads only contend (a
        # forward took 100x longer beside other work on 2 cores).
        torch.set_num_threads(1)
        config = build(self.config_class, manifest["config"])
        saved = manifest["env"]
        game = load_game(saved["env_id"], saved.get("env_config"))
        observation_space, action_space = game_spaces(game)
        model = build_torch_model(self.model_spec(observation_space, action_space, config))
        model.set_flat_weights(checkpoint_network(checkpoint, manifest, config))
        model.eval()
        return GameAgent(checkpoint, manifest, game, TorchEvaluator(model), config)

    def evaluate(self, checkpoint: Path, manifest: dict[str, Any], opponent: str, games: int,
                 simulations: int | None, seed: int) -> dict[str, Any]:
        return evaluate_match(self.load_agent(checkpoint, manifest), opponent, games,
                              simulations, seed)

    def describe(self, summary: dict[str, Any]) -> str:
        return match_line(summary)

    def play(self, checkpoint: Path, manifest: dict[str, Any], simulations: int | None,
             first: bool, seed: int, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout
             ) -> int:
        return play_in_terminal(self.load_agent(checkpoint, manifest), simulations, first,
                                seed, stdin, stdout)


def checkpoint_network(checkpoint: Path, manifest: dict[str, Any], config: Any) -> np.ndarray:
    """The flat weights the checkpoint's run plays with: with ``gating``, the best network
    (the driver's), else learner 0's newest."""
    files = manifest["files"]
    if config.gating:
        best = read_state_file(checkpoint / "driver.pkl", files["driver.pkl"])["plan"].get("best")
        if best is not None:
            return np.asarray(best, np.float32)
    return read_state_file(checkpoint / "learner_0.pkl", files["learner_0.pkl"])["weights"]


def evaluate_match(agent: GameAgent, opponent: str, games: int, simulations: int | None = None,
                   seed: int = 0) -> dict[str, Any]:
    """Play ``games`` games of ``agent`` against ``opponent``, half moving first; the counts
    from the agent's side. ``simulations`` None searches as the run's evaluation
    (``evaluation_simulations``)."""
    simulations = agent.config.evaluation_simulations if simulations is None else simulations
    rng = np.random.default_rng(seed)
    player = agent.player(simulations, rng)
    result = play_match(agent.game, player, make_player(opponent, agent.game, rng), games, rng)
    return {**result.as_dict(), "win_rate": result.wins / games,
            "draw_rate": result.draws / games, "loss_rate": result.losses / games,
            "opponent": opponent, "simulations": simulations, "seed": seed,
            "checkpoint": str(agent.checkpoint), "algo": agent.manifest["algo"],
            "env": agent.manifest["env"]["env_id"], "iteration": agent.manifest["iteration"]}


def match_line(summary: dict[str, Any]) -> str:
    """One line for the terminal of ``evaluate_match``'s summary."""
    how = (f"search of {summary['simulations']} simulations a move" if summary["simulations"]
           else "raw policy")
    forfeits = []
    if summary["forfeits"]:
        forfeits.append(f"{summary['forfeits']} lost by an illegal move")
    if summary["opponent_forfeits"]:
        forfeits.append(f"{summary['opponent_forfeits']} won by the opponent's illegal move")
    extra = f" ({'; '.join(forfeits)})" if forfeits else ""
    return (f"{summary['algo']} on {summary['env']}, {Path(summary['checkpoint']).name} "
            f"(iteration {summary['iteration']}, {how}) against {summary['opponent']}: "
            f"{summary['games']} games, half moving first: {summary['wins']} wins, "
            f"{summary['draws']} draws, {summary['losses']} losses{extra}")


def show(state: GameState, human: int) -> str:
    """The position as text: OpenSpiel's own drawing, or a PettingZoo board's planes with
    ``Y`` for the person's stones and ``A`` for the agent's."""
    if isinstance(state, OpenSpielState):  # OpenSpiel states draw themselves
        return str(state)
    planes = state.observation()
    if planes.ndim != 3 or planes.shape[-1] < 2:
        return f"observation {np.array2string(planes, threshold=64)}"
    # PettingZoo's classic boards: plane 0 is the mover's stones, plane 1 the other's.
    mover_is_human = state.current_player() == human
    mine, theirs = ("Y", "A") if mover_is_human else ("A", "Y")
    rows = []
    for row in range(planes.shape[0]):
        rows.append(" ".join(mine if planes[row, col, 0] else theirs if planes[row, col, 1]
                             else "." for col in range(planes.shape[1])))
    return "\n".join(rows)


def play_in_terminal(agent: GameAgent, simulations: int | None = None, first: bool = True,
                     seed: int = 0, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout
                     ) -> int:
    """A person against ``agent``, by move numbers on ``stdin``; 0 at the end of a game, 1 if
    the person quits (q or end of input) first."""
    simulations = agent.config.evaluation_simulations if simulations is None else simulations
    bot = agent.player(simulations, np.random.default_rng(seed))
    human = 0 if first else 1
    state = agent.game.new_initial_state()

    def say(text: str) -> None:
        print(text, file=stdout, flush=True)

    say(f"{agent.game.name}: you are player {human + 1} "
        f"({'first' if first else 'second'}); the agent searches "
        f"{simulations} simulations a move. Moves are numbers; q quits.")
    while not state.is_terminal():
        say(show(state, human))
        legal = np.flatnonzero(state.legal_action_mask()).tolist()
        if state.current_player() != human:
            move = bot.act(state.clone())
            say(f"agent plays {move}")
            state.apply(move)
            continue
        move = None
        while move is None:
            names = " ".join(f"{move}" if state.move_name(move) == str(move)
                             else f"{move}={state.move_name(move)}" for move in legal)
            print(f"your move ({names}): ", end="", file=stdout, flush=True)
            line = stdin.readline()
            if not line or line.strip().lower() in ("q", "quit"):
                say("\ngame abandoned")
                return 1
            try:
                move = int(line.strip())
            except ValueError:
                move = None
            if move not in legal:
                say(f"{line.strip()!r} is not a legal move; legal: {' '.join(map(str, legal))}")
                move = None
        state.apply(move)
    say(show(state, human))
    outcome = state.returns()[human]
    say("you win" if outcome > 0 else "you lose" if outcome < 0 else "draw")
    return 0
