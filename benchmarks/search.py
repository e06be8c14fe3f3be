"""Batched MCTS's simulations per second (AlphaZero's groundwork, issue 38): whole games of
self-play searched with a uniform evaluator (no network), many games at once against one game at
a time, for tic-tac-toe and Connect Four from PettingZoo and from OpenSpiel.

    python benchmarks/search.py [--seconds 5] [--json PATH] [--quick]

Each case plays games to their end for about ``--seconds`` (whole moves; finished games restart)
in this process, one case after the other. A simulation is one leaf reached in one game's tree;
the figure counts every game's simulations. The uniform evaluator isolates the search and the
games' own cost (cloning and stepping states): a network's forward adds to it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from harness import print_table, run_main, run_metadata, write_report
from mpirl.algorithms.alphazero.games import load_game
from mpirl.algorithms.alphazero.mcts import MCTSConfig
from mpirl.algorithms.alphazero.self_play import SelfPlay
from mpirl.algorithms.alphazero.spec import uniform_evaluate

GAMES = ("openspiel/tic_tac_toe", "pettingzoo.classic.tictactoe_v3", "openspiel/connect_four",
         "pettingzoo.classic.connect_four_v3")
#: (games searched at once, simulations per move).
SHAPES = ((64, 50), (1, 100))


@dataclass
class Plan:
    seconds: float


def measure(env_id: str, games: int, simulations: int, gumbel: bool, plan: Plan) -> dict:
    """Simulations/s and moves/s of SelfPlay over ``games`` games with a uniform evaluator."""
    game = load_game(env_id, {})
    config = MCTSConfig(simulations=simulations, gumbel=gumbel)
    play = SelfPlay(game, uniform_evaluate, config, games, np.random.default_rng(0))
    moves = 0
    started = time.perf_counter()
    while time.perf_counter() - started < plan.seconds:
        finished = play.step()
        moves += games
        del finished
    elapsed = time.perf_counter() - started
    return {"game": env_id, "games_at_once": games, "simulations": simulations, "gumbel": gumbel,
            "moves_per_s": moves / elapsed, "simulations_per_s": moves * simulations / elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per case")
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--quick", action="store_true", help="0.3 s per case, OpenSpiel only")
    args = parser.parse_args()
    plan = Plan(0.3 if args.quick else args.seconds)
    games = GAMES[::2] if args.quick else GAMES
    cases = [measure(env_id, at_once, sims, False, plan) for env_id in games
             for at_once, sims in SHAPES]
    cases += [measure(env_id, 64, 50, True, plan) for env_id in games]
    rows = [["game", "games at once", "simulations", "root", "simulations/s", "moves/s"]]
    rows += [[c["game"], str(c["games_at_once"]), str(c["simulations"]),
              "Gumbel" if c["gumbel"] else "PUCT", f"{c['simulations_per_s']:,.0f}",
              f"{c['moves_per_s']:,.0f}"] for c in cases]
    print_table(rows)
    write_report({"metadata": run_metadata(args.quick, plan, ["numpy", "open-spiel",
                                                                  "pettingzoo"]),
                  "cases": cases}, None if args.json is None else Path(args.json))
    return 0


if __name__ == "__main__":
    run_main(main)
