"""``mpirl evaluate`` of a board-game checkpoint (AlphaZero), and ``mpirl play``.

One process, no MPI: the agent is learner 0's network from the checkpoint, searching
``simulations`` times a move (by default the run's ``evaluation_simulations``) without noise,
the most visited move (0: its raw policy, the most probable legal move).
``evaluate_match`` plays it against a reference player (``mpirl.search.players.make_player``'s
specs) for N games, half of them moving first; ``play_in_terminal`` lets a person play it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from mpirl.commands.evaluate import find_checkpoint
from mpirl.config.parse import build
from mpirl.envs.games import Game, GameState, OpenSpielState, game_spaces, load_game
from mpirl.errors import ConfigError
from mpirl.execution.contract import load_algorithm, plays_games
from mpirl.models.alphazero import TorchEvaluator
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.state_files import read_state_file
from mpirl.search.players import Player, make_player, network_player, play_match
from mpirl.workers.alphazero_workers import search_config


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


def is_game_checkpoint(manifest: dict[str, Any]) -> bool:
    """Whether the checkpoint's algorithm plays board games."""
    return plays_games(load_algorithm(manifest["algo"]))


def wants_match(path: str | Path, opponent: str | None, warn=None) -> bool:
    """Whether ``mpirl evaluate PATH`` plays matches: for a board-game checkpoint, or whenever
    ``--opponent`` is given (a checkpoint of another kind is then refused by ``load_agent``)."""
    if opponent is not None:
        return True
    if Path(path).is_file():  # an exported policy: gymnasium episodes
        return False
    return is_game_checkpoint(find_checkpoint(path, warn)[1])


def load_agent(path: str | Path, warn=None) -> GameAgent:
    """The network of a board-game checkpoint (or a run directory's newest); ConfigError for
    a checkpoint of another kind of run."""
    checkpoint, manifest = find_checkpoint(path, warn)
    if not is_game_checkpoint(manifest):
        raise ConfigError(f"{checkpoint} is a {manifest['algo']} checkpoint of "
                          f"{manifest['env']['env_id']}, not of a board game: --opponent and "
                          f"mpirl play are for AlphaZero's checkpoints; evaluate it with "
                          f"--episodes")
    # Search evaluates one position at a time: torch's default threads only contend (a forward
    # took 100x longer beside other work on 2 cores).
    torch.set_num_threads(1)
    module = load_algorithm(manifest["algo"])
    config = build(module.Config, manifest["config"])
    saved = manifest["env"]
    game = load_game(saved["env_id"], saved.get("env_config"))
    observation_space, action_space = game_spaces(game)
    model = build_torch_model(module.model_spec(observation_space, action_space, config))
    model.set_flat_weights(checkpoint_network(checkpoint, manifest, config))
    model.eval()
    return GameAgent(checkpoint, manifest, game, TorchEvaluator(model), config)


def checkpoint_network(checkpoint: Path, manifest: dict[str, Any], config: Any) -> np.ndarray:
    """The flat weights the checkpoint's run plays with: with ``gating``, the best network
    (the driver's), else learner 0's newest."""
    files = manifest["files"]
    if getattr(config, "gating", False):
        best = read_state_file(checkpoint / "driver.pkl", files["driver.pkl"])["plan"].get("best")
        if best is not None:
            return np.asarray(best, np.float32)
    return read_state_file(checkpoint / "learner_0.pkl", files["learner_0.pkl"])["weights"]


def evaluate_match(path: str | Path, opponent: str, games: int, simulations: int | None = None,
                   seed: int = 0, warn=None) -> dict[str, Any]:
    """Play ``games`` games of the checkpoint's agent against ``opponent``, half moving first;
    the counts from the agent's side. ``simulations`` None searches as the run's evaluation
    (``evaluation_simulations``)."""
    if games < 1:
        raise ConfigError(f"--games must be at least 1, got {games}")
    agent = load_agent(path, warn)
    simulations = agent.config.evaluation_simulations if simulations is None else simulations
    rng = np.random.default_rng(seed)
    player = agent.player(simulations, rng)
    result = play_match(agent.game, player, make_player(opponent, agent.game, rng), games, rng)
    return {**result.as_dict(), "win_rate": result.wins / games,
            "draw_rate": result.draws / games, "loss_rate": result.losses / games,
            "opponent": opponent, "simulations": simulations, "seed": seed,
            "checkpoint": str(agent.checkpoint), "algo": agent.manifest["algo"],
            "env": agent.manifest["env"]["env_id"], "iteration": agent.manifest["iteration"]}


def match_report(summary: dict[str, Any], as_json: bool = False) -> str:
    """One line for the terminal, or the JSON object."""
    if as_json:
        return json.dumps(summary)
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


def play_in_terminal(path: str | Path, simulations: int | None = None, first: bool = True,
                     seed: int = 0, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
                     warn=None) -> int:
    """A person against the checkpoint's agent, by move numbers on ``stdin``; 0 at the end of
    a game, 1 if the person quits (q or end of input) first."""
    agent = load_agent(path, warn)
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
