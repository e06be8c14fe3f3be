"""AlphaZero against OpenSpiel's Python AlphaZero (issue 38): self-play positions per second,
strength on an MCTS ladder after equal wall time, and weak scaling over rollout ranks.

    python benchmarks/alphazero.py [--games tic_tac_toe,connect_four] [--train-seconds S]
        [--ladder mcts:100,mcts:1000] [--ladder-games N] [--scaling-ranks 1,2,4]
        [--peers mpirl,openspiel] [--json PATH] [--quick]
    python benchmarks/alphazero.py --tic-tac-toe-seeds 0-4 [--runs-dir DIR] [--json PATH]
        [--markdown PATH] [--quick]

``--tic-tac-toe-seeds`` is a mode of its own (README's row "AlphaZero on tic-tac-toe, the
docs' command, then ``mpirl evaluate``'s defaults"): for each seed, docs/alphazero.md's
training command as written, ``--seed S`` added (``mpiexec -n 3 mpirl train --algo AlphaZero
--env openspiel/tic_tac_toe --run-dir RUN --stop '{"training_iteration": 60}'``), then ``mpirl
evaluate RUN --opponent OPPONENT --json`` with every other option at its default (100 games,
half moving first; the run's ``evaluation_simulations``, 100) against minimax, minimax:traps
and random, one seed after the other. It reports each seed's wins/draws/losses (JSON, and a
markdown table) and whether the docs' bar holds: no loss to either perfect player, at least 90%
wins against random. ``--quick`` runs the same commands with the caps the docs' test uses
(``MPIRL_MAX_ITERATIONS=1``, ``MPIRL_MAX_GAMES=2`` in their environment): the code path in
seconds, no figure.

For each game, one after the other on the same machine:

* mpirl: ``mpiexec -n 1+R mpirl train --algo AlphaZero --env openspiel/<game>`` (the learner in
  the driver's process, R rollout ranks) stopped by ``time_total_s``;
* OpenSpiel: ``open_spiel.python.algorithms.alpha_zero.alpha_zero(config)`` with ``actors`` R and
  no evaluators (one process per actor, plus its learner), stopped by SIGINT (its own clean exit)
  the same number of seconds after its learner's first checkpoint. Its positions are counted from
  the ``Game N: ... Actions: ...`` lines its actors log (one position per move).

Both play with the same simulations per move, c_puct (OpenSpiel's ``uct_c``, the same PUCT
rule), temperature moves, batch size, learning rate and weight decay, and the same network:
OpenSpiel's ``resnet`` with ``nn_width`` = ``channels`` and ``nn_depth`` = ``blocks``, mpirl's
value head as wide as ``nn_width`` (OpenSpiel's policy head has one more dense layer of
``nn_width``). Every process computes on one thread (torch_threads 1; XLA single-threaded).
OpenSpiel's replay (``replay_buffer_size`` 2048, reuse 8) is made small enough that it learns
every 256 positions within the budget; its default 2**13 / 4 would learn once in 2048.

Positions/s is end to end: positions played over the training wall time, training included (the
OpenSpiel actors never stop for it; mpirl's self-play stops while its learner trains). mpirl's
self-play-only rate (its ``positions_per_s`` column) is given too.

The ladder: each trained agent searches with its own network (mpirl's batched MCTS, OpenSpiel's
``MCTSBot`` with its ``AlphaZeroEvaluator``, both with the training simulations and no noise) and
plays ``--ladder-games`` games against each ``mcts:N`` of
``mpirl.algorithms.alphazero.players`` (UCT with random rollouts), half of them first; the two
agents' matches run at the same time, one process each.

Weak scaling: mpirl alone on ``--scaling-game``, 1, 2, 4 rollout ranks of ``games_per_worker``
games each; the self-play rate per rank relative to one rank. The mean inference batch (leaf
evaluations per network call) is measured in-process on one SelfPlay of ``games_per_worker``
games, by counting the evaluator's calls (mpirl has no column for it). Policy lag: the mean of the
run's ``policy_lag_mean`` column (the age, in weights versions, of the positions trained on: the
replay window's age, since each iteration's self-play uses the newest weights).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from harness import (
    MPI_ENV,
    THREAD_ENV,
    BenchError,
    add_peers_option,
    attempt,
    emit,
    end_session,
    fmt,
    mpiexec_command,
    print_problems,
    print_table,
    ratio,
    run_main,
    run_metadata,
    run_process,
    session_cpu_s,
    skipped,
    tail,
    write_report,
)

SCRIPT = Path(__file__).resolve()
MPIRL = str(Path(sys.executable).parent / "mpirl")
PEERS = ("mpirl", "openspiel")
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
#: Per game: simulations per move, residual channels (OpenSpiel's nn_width), blocks (nn_depth).
NETWORKS = {"tic_tac_toe": {"simulations": 25, "channels": 16, "blocks": 1},
            "connect_four": {"simulations": 25, "channels": 32, "blocks": 2}}
GAMES_PER_WORKER = 32
C_PUCT = 1.25
LR = 3e-3
WEIGHT_DECAY = 1e-4
TRAIN_BATCH = 128
TEMPERATURE_MOVES = 2
GAME_LINE = re.compile(r"^\[([^\]]+)\] Game \d+: Returns: [^;]*; Actions:(.*)$")
STAMP = re.compile(r"^\[([^\]]+)\]")


@dataclass
class Plan:
    games: tuple[str, ...]
    train_seconds: dict[str, float]
    rollout_ranks: int
    ladder: tuple[str, ...]
    ladder_games: int
    scaling_game: str
    scaling_ranks: tuple[int, ...]
    scaling_seconds: float
    batch_seconds: float


# --- watching a run ------------------------------------------------------------------------------


def watch(proc: subprocess.Popen, positions: Any, until: float | None = None,
          interval: float = 1.0) -> list[tuple[float, float, int]]:
    """(wall, CPU seconds of the session, positions so far) every ``interval`` s until the
    program exits, or until ``until`` (a ``time.perf_counter()``)."""
    samples = []
    while proc.poll() is None and (until is None or time.perf_counter() < until):
        samples.append((time.perf_counter(), session_cpu_s(proc.pid), positions()))
        time.sleep(interval)
    return samples


def steady_rates(samples: list[tuple[float, float, int]]) -> dict[str, Any]:
    """Positions per wall second and per CPU second (all the run's processes) from the first
    sample with positions to the last: start-up and shutdown left out, on both sides alike.
    ``cores_used`` is the CPU seconds per wall second the run got."""
    for i in range(1, len(samples)):  # a process has ended: its CPU time left the sum
        if samples[i][1] < samples[i - 1][1]:
            samples = samples[:i]
            break
    played = [s for s in samples if s[2] > 0]
    if played:  # up to the first sample with the final count
        played = played[:next(i for i, s in enumerate(played) if s[2] == played[-1][2]) + 1]
    if len(played) < 2 or played[-1][2] == played[0][2]:
        return {"steady_positions_per_s": None, "positions_per_cpu_s": None, "cores_used": None}
    (t0, c0, p0), (t1, c1, p1) = played[0], played[-1]
    return {"steady_positions_per_s": (p1 - p0) / (t1 - t0),
            "positions_per_cpu_s": (p1 - p0) / (c1 - c0) if c1 > c0 else None,
            "cores_used": (c1 - c0) / (t1 - t0), "steady_window_s": t1 - t0}


# --- mpirl --------------------------------------------------------------------------------------


def mpirl_config(game: str) -> dict[str, Any]:
    net = NETWORKS[game]
    return {"games_per_worker": GAMES_PER_WORKER, "simulations": net["simulations"],
            "channels": net["channels"], "blocks": net["blocks"],
            "value_hidden": net["channels"], "c_puct": C_PUCT, "lr": LR,
            "weight_decay": WEIGHT_DECAY, "train_batch_size": TRAIN_BATCH,
            "temperature_moves": TEMPERATURE_MOVES, "evaluation_interval": 10 ** 9,
            "evaluation_opponents": "random"}


def train_mpirl(game: str, seconds: float, ranks: int, run_dir: Path) -> dict[str, Any]:
    """One ``mpirl train`` run; its positions and rates from progress.csv."""
    command = mpiexec_command(
        1 + ranks, MPIRL, "train", "--algo", "AlphaZero", "--env", f"openspiel/{game}",
        "--config", json.dumps(mpirl_config(game)), "--stop",
        json.dumps({"time_total_s": seconds}), "--seed", "0", "--run-dir", str(run_dir),
        "--progress", "off")
    name = f"mpirl train {game} ({ranks} rollout ranks)"
    run_dir.mkdir(parents=True, exist_ok=True)
    progress = run_dir / "progress.csv"

    def positions() -> int:
        try:
            return int(progress.read_text().strip().splitlines()[-1].split(",")[1])
        except (OSError, IndexError, ValueError):
            return 0

    load = os.getloadavg()[0]
    launch = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.out", "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **MPI_ENV, **THREAD_ENV},
                                start_new_session=True)
    try:
        samples = watch(proc, positions, until=launch + seconds + 240)
        if proc.poll() is None:
            raise BenchError(f"{name}: not finished within {seconds + 240:g} s; killed")
    finally:
        end_session(proc)
    if proc.returncode:
        raise BenchError(f"{name}: exited with code {proc.returncode}:\n"
                         f"{tail((run_dir.parent / f'{run_dir.name}.out').read_text())}")
    wall = time.perf_counter() - launch
    with open(run_dir / "progress.csv") as stream:
        rows = list(csv.DictReader(stream))
    if not rows:
        raise BenchError(f"mpirl {game}: no progress rows")
    last = rows[-1]
    seconds_total = float(last["time_total_s"])
    totals = [int(row["timesteps_total"]) for row in rows]
    steps = list(zip([b - a for a, b in zip([0, *totals[:-1]], totals, strict=True)], rows,
                     strict=True))
    steady = steps[1:] or steps  # the first iteration's self-play includes torch's warm-up
    play_s = sum(n / float(row["positions_per_s"]) for n, row in steady)
    return {"command": " ".join(command), "rollout_ranks": ranks,
            "positions": int(last["timesteps_total"]),
            "games": int(last["episodes_total"]), "iterations": len(rows),
            "train_seconds": seconds_total, "launch_to_exit_s": wall,
            "positions_per_s": int(last["timesteps_total"]) / seconds_total,
            **steady_rates(samples), "loadavg_1min_at_start": load,
            "self_play_positions_per_s": sum(n for n, _ in steady) / play_s if play_s else None,
            "game_length_mean": float(last["game_length_mean"]),
            "policy_lag_mean": mean_of_numbers(row["policy_lag_mean"] for row in rows),
            "sgd_steps": int(float(last["sgd_steps_total"])), "run_dir": str(run_dir)}


def mean_of_numbers(values) -> float | None:
    """The mean of the values that are numbers (a column is nan before its first value)."""
    numbers = [float(v) for v in values if v not in ("", "nan") and float(v) == float(v)]
    return sum(numbers) / len(numbers) if numbers else None


# --- OpenSpiel ----------------------------------------------------------------------------------


def openspiel_spec(game: str, actors: int, path: Path) -> dict[str, Any]:
    net = NETWORKS[game]
    return {"game": game, "path": str(path), "learning_rate": LR, "weight_decay": WEIGHT_DECAY,
            "decouple_weight_decay": True, "train_batch_size": TRAIN_BATCH,
            "replay_buffer_size": 2048, "replay_buffer_reuse": 8, "max_steps": 0,
            "checkpoint_freq": 10 ** 9, "actors": actors, "evaluators": 0,
            "evaluation_window": 50, "eval_levels": 7, "uct_c": C_PUCT,
            "max_simulations": net["simulations"], "policy_alpha": 1.0, "policy_epsilon": 0.25,
            "temperature": 1.0, "temperature_drop": TEMPERATURE_MOVES, "nn_model": "resnet",
            "nn_width": net["channels"], "nn_depth": net["blocks"], "observation_shape": None,
            "output_size": None, "quiet": True, "verbose": False, "nn_api_version": "nnx"}


def role_openspiel(spec: dict[str, Any]) -> int:
    """OpenSpiel's AlphaZero in this process (its actors are processes it spawns)."""
    try:
        from open_spiel.python.algorithms.alpha_zero import alpha_zero
    except ImportError as error:
        print(f"OpenSpiel's AlphaZero needs jax and flax ({error}): pip install -e "
              f"'.[openspiel,bench]'", file=sys.stderr)
        return 1
    alpha_zero.alpha_zero(alpha_zero.Config(**spec))
    return 0


def openspiel_env() -> dict[str, str]:
    return {**os.environ, **MPI_ENV, **THREAD_ENV, "XLA_FLAGS": XLA_ONE_THREAD,
            "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}


def stamp(line: str) -> datetime | None:
    found = STAMP.match(line)
    return datetime.fromisoformat(found.group(1)) if found else None


def actor_positions(path: Path, end: datetime | None = None) -> tuple[int, int]:
    """Positions (moves) and games in the games OpenSpiel's actors logged (by ``end``)."""
    positions = games = 0
    for log in sorted(path.glob("log-actor-*.txt")):
        for line in log.read_text().splitlines():
            found = GAME_LINE.match(line)
            if found and (end is None or datetime.fromisoformat(found.group(1)) <= end):
                positions += len(found.group(2).split())
                games += 1
    return positions, games


def train_openspiel(game: str, seconds: float, actors: int, path: Path) -> dict[str, Any]:
    """OpenSpiel's AlphaZero for ``seconds`` after its learner's first checkpoint; positions
    counted from its actors' logs."""
    path.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), "--role", "openspiel", "--spec",
               json.dumps(openspiel_spec(game, actors, path))]
    output = path / "stdout.txt"
    load = os.getloadavg()[0]
    launch = time.perf_counter()
    with open(output, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env=openspiel_env(), start_new_session=True)
    learner_log = path / "log-learner.txt"
    try:
        start = None
        deadline = time.perf_counter() + 180
        while start is None:
            if proc.poll() is not None:
                raise BenchError(f"OpenSpiel {game}: exited with code {proc.returncode} before "
                                 f"training:\n{tail(output.read_text())}")
            if time.perf_counter() > deadline:
                raise BenchError(f"OpenSpiel {game}: no first checkpoint within 180 s")
            time.sleep(0.2)
            if learner_log.exists():
                start = next((stamp(line) for line in learner_log.read_text().splitlines()
                              if "Initial checkpoint" in line), None)
        startup_s = time.perf_counter() - launch
        left = (start + timedelta(seconds=seconds) - datetime.now()).total_seconds()
        samples = watch(proc, lambda: actor_positions(path)[0],
                        until=time.perf_counter() + max(0.0, left))
        proc.send_signal(signal.SIGINT)  # alpha_zero's own stop: actors end their game, exit
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    finally:
        end_session(proc)
    positions, games = actor_positions(path, start + timedelta(seconds=seconds))
    steps = [json.loads(line) for line in (path / "learner.jsonl").read_text().splitlines()
             ] if (path / "learner.jsonl").exists() else []
    return {"command": " ".join(command[:4]) + " '<spec>'", "spec": openspiel_spec(
                game, actors, path), "actors": actors, "positions": positions, "games": games,
            "train_seconds": seconds, "startup_s": startup_s,
            "launch_to_exit_s": time.perf_counter() - launch,
            "positions_per_s": positions / seconds, **steady_rates(samples),
            "loadavg_1min_at_start": load,
            "game_length_mean": positions / games if games else None,
            "learn_steps": len(steps), "path": str(path)}


# --- the ladder ---------------------------------------------------------------------------------


class OpenSpielPlayer:
    """OpenSpiel's trained AlphaZero as an mpirl Player: its MCTSBot with its evaluator on the
    pyspiel state under mpirl's GameState."""

    name = "openspiel"

    def __init__(self, path: Path, simulations: int) -> None:
        import pyspiel
        from open_spiel.python.algorithms import mcts
        from open_spiel.python.algorithms.alpha_zero import evaluator as evaluator_lib
        from open_spiel.python.algorithms.alpha_zero import utils

        config = json.loads((path / "config.json").read_text())
        game = pyspiel.load_game(config["game"])
        model = utils.api_selector(config["nn_api_version"]).Model.build_model(
            config["nn_model"], config["observation_shape"], config["output_size"],
            config["nn_width"], config["nn_depth"], config["weight_decay"],
            config["learning_rate"], str(path),
            decouple_weight_decay=config["decouple_weight_decay"])
        self.checkpoint = -1 if (path / "checkpoint--1").exists() else 0
        model.load_checkpoint(self.checkpoint)
        self._bot = mcts.MCTSBot(game, config["uct_c"], simulations,
                                 evaluator_lib.AlphaZeroEvaluator(game, model), solve=False,
                                 dirichlet_noise=None,
                                 child_selection_fn=mcts.SearchNode.puct_value,
                                 dont_return_chance_node=True)

    def act(self, state: Any) -> int:
        return int(self._bot.step(state._state))


def mpirl_player(run_dir: Path, game: Any, simulations: int, rng: Any) -> Any:
    """The run's newest checkpoint searching with its network (no noise)."""
    from mpirl.algorithms.alphazero.games import game_spaces
    from mpirl.algorithms.alphazero.mcts import MCTSConfig
    from mpirl.algorithms.alphazero.network import TorchEvaluator
    from mpirl.algorithms.alphazero.players import SearchPlayer

    from mpirl.commands.evaluate import find_checkpoint
    from mpirl.config.parse import build
    from mpirl.execution.contract import load_algorithm
    from mpirl.models.torch_model import build_torch_model
    from mpirl.runtime.state_files import read_state_file

    checkpoint, manifest = find_checkpoint(run_dir)
    module = load_algorithm(manifest["algo"])
    config = build(module.Config, manifest["config"])
    model = build_torch_model(module.model_spec(*game_spaces(game), config))
    model.set_flat_weights(read_state_file(checkpoint / "learner_0.pkl",
                                           manifest["files"]["learner_0.pkl"])["weights"])
    model.eval()
    search = MCTSConfig(simulations=simulations, c_puct=config.c_puct)
    return SearchPlayer(game, TorchEvaluator(model), search, rng, name="mpirl")


def role_ladder(spec: dict[str, Any]) -> int:
    """One trained agent against each opponent of the ladder; emits the results."""
    import numpy as np
    import torch
    from mpirl.algorithms.alphazero.games import load_game
    from mpirl.algorithms.alphazero.players import make_player, play_match

    torch.set_num_threads(1)
    game = load_game(f"openspiel/{spec['game']}", {})
    rng = np.random.default_rng(spec["seed"])
    simulations = NETWORKS[spec["game"]]["simulations"]
    if spec["side"] == "mpirl":
        agent = mpirl_player(Path(spec["path"]), game, simulations, rng)
        checkpoint = None
    else:
        agent = OpenSpielPlayer(Path(spec["path"]), simulations)
        checkpoint = agent.checkpoint
    results = {}
    for opponent in spec["ladder"]:
        start = time.perf_counter()
        result = play_match(game, agent, make_player(opponent, game, rng), spec["games"], rng)
        results[opponent] = {**result.as_dict(), "score": (result.wins + 0.5 * result.draws)
                             / result.games, "seconds": time.perf_counter() - start}
        print(f"progress: {spec['side']} {spec['game']} vs {opponent}: {results[opponent]}",
              file=sys.stderr, flush=True)
    emit({"results": results, "openspiel_checkpoint": checkpoint})
    return 0


def ladders(game: str, paths: dict[str, Path], plan: Plan) -> dict[str, Any]:
    """Both agents' ladders at once, one process each."""
    procs = {}
    for side, path in paths.items():
        spec = {"side": side, "path": str(path), "game": game, "ladder": list(plan.ladder),
                "games": plan.ladder_games, "seed": 7}
        command = [sys.executable, str(SCRIPT), "--role", "ladder", "--spec", json.dumps(spec)]
        procs[side] = (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=openspiel_env(), start_new_session=True),
                       time.perf_counter())
    out = {}
    for side, (proc, started) in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=3600)
        except subprocess.TimeoutExpired:
            end_session(proc)
            out[side] = {"error": "ladder: no result within 3600 s"}
            continue
        lines = [line for line in stdout.splitlines() if line.startswith("BENCH_RESULT ")]
        if proc.returncode or not lines:
            out[side] = {"error": f"ladder exited with code {proc.returncode}:\n"
                                  f"{tail(stderr or stdout)}"}
        else:
            out[side] = {**json.loads(lines[-1][len("BENCH_RESULT "):]),
                         "seconds": time.perf_counter() - started}
    return out


# --- inference batch ----------------------------------------------------------------------------


def role_batch(spec: dict[str, Any]) -> int:
    """Leaf evaluations per network call in one SelfPlay of ``games_per_worker`` games (an
    untrained network of the run's size), and its positions/s in this one process."""
    import numpy as np
    import torch
    from mpirl.algorithms.alphazero.alphazero import Config, model_spec
    from mpirl.algorithms.alphazero.games import game_spaces, load_game
    from mpirl.algorithms.alphazero.network import TorchEvaluator
    from mpirl.algorithms.alphazero.self_play import SelfPlay
    from mpirl.algorithms.alphazero.self_play_worker import search_config

    from mpirl.config.parse import build
    from mpirl.models.torch_model import build_torch_model

    torch.set_num_threads(1)
    config = build(Config, mpirl_config(spec["game"]))
    game = load_game(f"openspiel/{spec['game']}", {})
    model = build_torch_model(model_spec(*game_spaces(game), config))
    model.eval()
    evaluate = TorchEvaluator(model)
    sizes: list[int] = []

    def counted(observations, masks):
        sizes.append(len(observations))
        return evaluate(observations, masks)

    play = SelfPlay(game, counted, search_config(config), config.games_per_worker,
                    np.random.default_rng(0))
    positions = 0
    start = time.perf_counter()
    while time.perf_counter() - start < spec["seconds"]:
        positions += len(play.play(config.games_per_worker))
    elapsed = time.perf_counter() - start
    emit({"games_per_worker": config.games_per_worker, "evaluator_calls": len(sizes),
          "mean_batch": float(np.mean(sizes)) if sizes else None,
          "max_batch": max(sizes, default=0), "positions_per_s": positions / elapsed})
    return 0


# --- tic-tac-toe: the docs' command, then mpirl evaluate's defaults -------------------------------

#: docs/alphazero.md's first block: its training command (RUN and the seed filled in) and the
#: opponents of README's row. tests/test_benchmarks.py checks that the page still says it.
DOCS_TRAIN = ("mpirl", "train", "--algo", "AlphaZero", "--env", "openspiel/tic_tac_toe",
              "--run-dir", "{run}", "--stop", '{"training_iteration": 60}')
DOCS_RANKS = 3
TTT_OPPONENTS = ("minimax", "minimax:traps", "random")
#: The docs' bar: no loss in 100 games to a perfect player, at least 90% wins against random.
PERFECT = ("minimax", "minimax:traps")
RANDOM_WIN_RATE = 0.9
#: ``--quick``: the docs' test's caps on training iterations and games (same commands).
QUICK_CAPS = {"MPIRL_MAX_ITERATIONS": "1", "MPIRL_MAX_GAMES": "2"}


def seeds_of(text: str) -> tuple[int, ...]:
    """``0-4`` or ``0,2,5`` (or both: ``0-2,7``) as seeds, in order, each once."""
    seeds: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            first, _, last = part.partition("-")
            span = range(int(first), int(last if last else first) + 1)
            if not span:
                raise ValueError
            seeds += [seed for seed in span if seed not in seeds]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of seeds such as 0-4 or 0,2,5") from None
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed")
    return tuple(seeds)


def docs_train_command(run_dir: Path, seed: int) -> list[str]:
    """The docs' training command for ``seed``, under ``mpiexec -n 3``."""
    args = [str(run_dir) if arg == "{run}" else arg for arg in DOCS_TRAIN]
    return mpiexec_command(DOCS_RANKS, MPIRL, *args[1:], "--seed", str(seed))


def tic_tac_toe_seed(seed: int, run_dir: Path, caps: dict[str, str]) -> dict[str, Any]:
    """One seed: the docs' training run, then ``mpirl evaluate`` against each opponent."""
    command = docs_train_command(run_dir, seed)
    trained = run_process(command, f"seed {seed}: mpirl train", timeout_s=7200,
                          extra_env=caps)
    with open(run_dir / "progress.csv") as stream:
        last = list(csv.DictReader(stream))[-1]
    entry: dict[str, Any] = {
        "seed": seed, "train_command": " ".join(command), "train_wall_s": trained.wall_s,
        "iterations": int(last["iteration"]), "timesteps_total": int(last["timesteps_total"]),
        "time_total_s": float(last["time_total_s"]), "evaluate": {}}
    for opponent in TTT_OPPONENTS:
        evaluate = [MPIRL, "evaluate", str(run_dir), "--opponent", opponent, "--json"]
        finished = run_process(evaluate, f"seed {seed}: mpirl evaluate --opponent {opponent}",
                               timeout_s=3600, extra_env=caps)
        entry["evaluate"][opponent] = {**json.loads(finished.stdout),
                                       "command": " ".join(evaluate), "wall_s": finished.wall_s}
    return entry


def bar_met(entry: dict[str, Any]) -> bool | None:
    """The docs' bar for one seed; None where a match is missing."""
    matches = entry.get("evaluate", {})
    if any(opponent not in matches for opponent in TTT_OPPONENTS):
        return None
    return (all(matches[p]["losses"] == 0 for p in PERFECT)
            and matches["random"]["win_rate"] >= RANDOM_WIN_RATE)


def tic_tac_toe_markdown(seeds: dict[str, dict[str, Any]]) -> str:
    """RESULTS.md's table: wins/draws/losses from the agent's side per seed and opponent."""
    lines = ["| seed | " + " | ".join(TTT_OPPONENTS) + " | bar met |",
             "| --- |" + " --- |" * (len(TTT_OPPONENTS) + 1)]
    for seed, entry in seeds.items():
        if "error" in entry:
            lines.append(f"| {seed} | " + " | ".join(["-"] * len(TTT_OPPONENTS))
                         + f" | error: {entry['error'].splitlines()[0]} |")
            continue
        cells = []
        for opponent in TTT_OPPONENTS:
            r = entry["evaluate"][opponent]
            cells.append(f"{r['wins']}/{r['draws']}/{r['losses']}")
        lines.append(f"| {seed} | " + " | ".join(cells) + f" | {fmt(bar_met(entry), 0)} |")
    return "\n".join(lines) + "\n"


def tic_tac_toe_seeds(seeds: tuple[int, ...], runs_dir: Path, quick: bool) -> dict[str, Any]:
    """Every seed, one after the other: their entries and the summary over them."""
    caps = QUICK_CAPS if quick else {}
    entries = {str(seed): attempt(
        f"seed {seed}: the docs' command, then mpirl evaluate",
        lambda seed=seed: tic_tac_toe_seed(seed, runs_dir / f"seed{seed}", caps),
        lambda r: ", ".join(f"{o} {m['wins']}/{m['draws']}/{m['losses']}"
                            for o, m in r["evaluate"].items())) for seed in seeds}
    done = [e for e in entries.values() if "error" not in e]
    summary: dict[str, Any] = {
        "seeds": len(seeds), "completed": len(done),
        "bar_met": sum(bool(bar_met(e)) for e in done),
        "losses_to_perfect_max": max((e["evaluate"][p]["losses"] for e in done for p in PERFECT),
                                     default=None),
        "random_win_rate_range": [min(e["evaluate"]["random"]["win_rate"] for e in done),
                                  max(e["evaluate"]["random"]["win_rate"] for e in done)]
        if done else None}
    return {"caps": caps, "runs_dir": str(runs_dir), "seeds": entries, "summary": summary,
            "markdown": tic_tac_toe_markdown(entries)}


# --- the orchestrator ---------------------------------------------------------------------------


def compare_game(game: str, plan: Plan, peers: tuple[str, ...], tmp: Path) -> dict[str, Any]:
    seconds = plan.train_seconds[game]
    entry: dict[str, Any] = {"network": NETWORKS[game], "train_seconds": seconds}
    entry["mpirl"] = attempt(
        f"mpirl {game} ({seconds:g} s)",
        lambda: train_mpirl(game, seconds, plan.rollout_ranks, tmp / f"mpirl-{game}"),
        lambda r: f"{r['positions']} positions, {r['positions_per_s']:,.1f}/s")
    entry["openspiel"] = attempt(
        f"openspiel {game} ({seconds:g} s)",
        lambda: train_openspiel(game, seconds, plan.rollout_ranks, tmp / f"openspiel-{game}"),
        lambda r: f"{r['positions']} positions, {r['positions_per_s']:,.1f}/s"
    ) if "openspiel" in peers else skipped()
    for key in ("positions_per_s", "steady_positions_per_s", "positions_per_cpu_s"):
        entry[f"speedup_{key}"] = ratio(entry["mpirl"].get(key), entry["openspiel"].get(key))
    paths = {side: Path(entry[side]["run_dir" if side == "mpirl" else "path"])
             for side in peers if "positions" in entry[side]}
    if paths and plan.ladder:
        print(f"running the ladder for {game}: {', '.join(plan.ladder)}", flush=True)
        for side, result in ladders(game, paths, plan).items():
            entry[side]["ladder"] = result
    return entry


def scaling(plan: Plan, tmp: Path, measured: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``measured``: runs already made of the scaling game for its seconds, by rollout ranks
    (the quick mode's comparison run), taken as they are rather than run again."""
    runs = {}
    for ranks in plan.scaling_ranks:
        if ranks in measured:
            runs[str(ranks)] = {k: v for k, v in measured[ranks].items() if k != "ladder"}
            continue
        runs[str(ranks)] = attempt(
            f"mpirl {plan.scaling_game} with {ranks} rollout rank(s)",
            lambda ranks=ranks: train_mpirl(plan.scaling_game, plan.scaling_seconds, ranks,
                                            tmp / f"scale-{ranks}"),
            lambda r: f"self-play {r['self_play_positions_per_s']:,.1f} positions/s")
    base = runs.get("1", {}).get("self_play_positions_per_s")
    for ranks, run in runs.items():
        rate = run.get("self_play_positions_per_s")
        run["per_rank"] = rate / int(ranks) if rate else None
        run["efficiency"] = ratio(run["per_rank"], base)
        run["cpu_efficiency"] = ratio(run.get("positions_per_cpu_s"),
                                      runs.get("1", {}).get("positions_per_cpu_s"))
    batch = attempt("mean inference batch", lambda: run_process(
        [sys.executable, str(SCRIPT), "--role", "batch", "--spec",
         json.dumps({"game": plan.scaling_game, "seconds": plan.batch_seconds})],
        "batch", timeout_s=plan.batch_seconds + 120, want_result=True).result)
    return {"game": plan.scaling_game, "seconds": plan.scaling_seconds, "cores": os.cpu_count(),
            "runs": runs, "inference_batch": batch,
            "policy_lag": {"column": "policy_lag_mean",
                           "mean": {ranks: run.get("policy_lag_mean")
                                    for ranks, run in runs.items()},
                           "note": "the mean over iterations of policy_lag_mean: the age, in "
                                   "weights versions, of the positions trained on"}}


def print_report(report: dict[str, Any]) -> None:
    rows = [["game", "side", "positions", "pos/s", "steady pos/s", "pos/CPU-s", "cores used",
             "self-play-only pos/s"]]
    for game, entry in report["games"].items():
        for side in PEERS:
            r = entry[side]
            rows.append([game, side, fmt(r.get("positions"), 0), fmt(r.get("positions_per_s"), 1),
                         fmt(r.get("steady_positions_per_s"), 1),
                         fmt(r.get("positions_per_cpu_s"), 1), fmt(r.get("cores_used"), 2),
                         fmt(r.get("self_play_positions_per_s"), 1)])
        rows.append([game, "mpirl/OpenSpiel", "", fmt(entry["speedup_positions_per_s"], 1),
                     fmt(entry["speedup_steady_positions_per_s"], 1),
                     fmt(entry["speedup_positions_per_cpu_s"], 1), "", ""])
    print_table(rows)
    rows = [["game", "agent", "opponent", "W/D/L", "score"]]
    for game, entry in report["games"].items():
        for side in PEERS:
            for opponent, r in entry[side].get("ladder", {}).get("results", {}).items():
                rows.append([game, side, opponent, f"{r['wins']}/{r['draws']}/{r['losses']}",
                             fmt(r["score"], 2)])
    if len(rows) > 1:
        print_table(rows)
    scale = report["scaling"]
    rows = [["rollout ranks", "self-play pos/s", "per rank", "efficiency", "end-to-end pos/s",
             "cores used", "pos/CPU-s", "CPU efficiency"]]
    for ranks, run in scale["runs"].items():
        rows.append([ranks, fmt(run.get("self_play_positions_per_s"), 1),
                     fmt(run.get("per_rank"), 1), fmt(run.get("efficiency"), 2),
                     fmt(run.get("positions_per_s"), 1), fmt(run.get("cores_used"), 2),
                     fmt(run.get("positions_per_cpu_s"), 1), fmt(run.get("cpu_efficiency"), 2)])
    print_table(rows)
    batch = scale["inference_batch"]
    print(f"mean inference batch: {fmt(batch.get('mean_batch'), 1)} of "
          f"{batch.get('games_per_worker')} games")
    print_problems({f"{g} {side}": e[side] for g, e in report["games"].items() for side in PEERS})


def csv_of(text: str, kind: type = str) -> tuple:
    return tuple(kind(x.strip()) for x in text.split(",") if x.strip())


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("openspiel", "ladder", "batch"), default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=json.loads, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--games", type=csv_of, default=("tic_tac_toe", "connect_four"),
                        help="OpenSpiel games, comma-separated")
    parser.add_argument("--train-seconds", type=lambda t: csv_of(t, float), default=(),
                        metavar="S[,S]",
                        help="training wall time per game (default 90 for tic_tac_toe, 180 for "
                             "connect_four)")
    parser.add_argument("--rollout-ranks", type=int, default=2,
                        help="mpirl's rollout ranks and OpenSpiel's actors")
    parser.add_argument("--ladder", type=csv_of, default=("mcts:100", "mcts:1000"))
    parser.add_argument("--ladder-games", type=int, default=10, help="per opponent")
    parser.add_argument("--scaling-game", default="connect_four")
    parser.add_argument("--scaling-ranks", type=lambda t: csv_of(t, int), default=(1, 2, 4))
    parser.add_argument("--scaling-seconds", type=float, default=60.0)
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="tic-tac-toe only, seconds of training on 1 rollout rank (the "
                             "scaling's only point), a ladder of mcts:10; with "
                             "--tic-tac-toe-seeds: 1 iteration and 2 games a match")
    parser.add_argument("--tic-tac-toe-seeds", type=seeds_of, default=None, metavar="SEEDS",
                        help="instead of the comparison: docs/alphazero.md's training command "
                             "for each seed (0-4, or 0,2,5), then mpirl evaluate's defaults "
                             "against minimax, minimax:traps and random")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="with --tic-tac-toe-seeds: keep the runs here (seed<S> each; "
                             "default a temporary directory, removed)")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="with --tic-tac-toe-seeds: write the table here too")
    add_peers_option(parser, PEERS)
    args = parser.parse_args()
    if args.role == "openspiel":
        return role_openspiel(args.spec)
    if args.role == "ladder":
        return role_ladder(args.spec)
    if args.role == "batch":
        return role_batch(args.spec)
    if args.tic_tac_toe_seeds is not None:
        return main_tic_tac_toe(args)
    if args.runs_dir is not None or args.markdown is not None:
        parser.error("--runs-dir and --markdown go with --tic-tac-toe-seeds")
    unknown = [g for g in args.games if g not in NETWORKS]
    if unknown:
        parser.error(f"unknown game(s) {', '.join(unknown)}; choose from {','.join(NETWORKS)}")
    if args.quick:
        # 2 s of training: at least one iteration (the stop is checked after each), and every
        # figure computed, which is all --quick is for. The scaling's one point is the
        # comparison's run (below): no launch of its own; more rank counts are the same code.
        plan = Plan(games=("tic_tac_toe",), train_seconds={"tic_tac_toe": 2.0},
                    rollout_ranks=1, ladder=("mcts:10",), ladder_games=2,
                    scaling_game="tic_tac_toe", scaling_ranks=(1,), scaling_seconds=2.0,
                    batch_seconds=1.0)
    else:
        default = {"tic_tac_toe": 90.0, "connect_four": 180.0}
        given = args.train_seconds
        seconds = {g: (given[i] if i < len(given) else given[-1]) if given else default[g]
                   for i, g in enumerate(args.games)}
        plan = Plan(games=args.games, train_seconds=seconds, rollout_ranks=args.rollout_ranks,
                    ladder=args.ladder, ladder_games=args.ladder_games,
                    scaling_game=args.scaling_game, scaling_ranks=args.scaling_ranks,
                    scaling_seconds=args.scaling_seconds, batch_seconds=10.0)
    metadata = run_metadata(args.quick, plan, ["torch", "numpy", "open-spiel", "jax", "jaxlib",
                                               "flax"])
    with tempfile.TemporaryDirectory(prefix="az-bench-") as name:
        tmp = Path(name)
        games = {game: compare_game(game, plan, args.peers, tmp) for game in plan.games}
        # Quick: the comparison's mpirl run is the scaling's run of as many rollout ranks (the
        # same game, config and seconds): one launch fewer.
        compared = games.get(plan.scaling_game, {}).get("mpirl", {})
        measured = ({plan.rollout_ranks: compared} if args.quick and "positions" in compared
                    and plan.train_seconds[plan.scaling_game] == plan.scaling_seconds else {})
        report = {"metadata": metadata, "games": games,
                  "scaling": scaling(plan, tmp, measured)}
    print_report(report)
    write_report(report, None if args.json is None else Path(args.json))
    return 0


def main_tic_tac_toe(args: argparse.Namespace) -> int:
    """``--tic-tac-toe-seeds``: the report, the table on stdout (and in ``--markdown``)."""
    metadata = run_metadata(args.quick, SeedsPlan(args.tic_tac_toe_seeds), ["torch", "numpy",
                                                                            "open-spiel"])
    if args.runs_dir is not None:
        args.runs_dir.mkdir(parents=True, exist_ok=True)
        result = tic_tac_toe_seeds(args.tic_tac_toe_seeds, args.runs_dir.resolve(), args.quick)
    else:
        with tempfile.TemporaryDirectory(prefix="az-ttt-") as name:
            result = tic_tac_toe_seeds(args.tic_tac_toe_seeds, Path(name), args.quick)
    report = {"metadata": metadata, "tic_tac_toe": result}
    print(result["markdown"], end="")
    summary = result["summary"]
    print(f"bar met (0 losses to {' and '.join(PERFECT)}, >= {RANDOM_WIN_RATE:.0%} wins against "
          f"random) on {summary['bar_met']} of {summary['seeds']} seeds")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(result["markdown"])
    write_report(report, None if args.json is None else Path(args.json))
    print_problems({f"seed {seed}": entry for seed, entry in result["seeds"].items()})
    return 0


@dataclass
class SeedsPlan:
    """What ``--tic-tac-toe-seeds`` runs (the report's ``metadata.plan``)."""

    seeds: tuple[int, ...]
    ranks: int = DOCS_RANKS
    train: tuple[str, ...] = DOCS_TRAIN
    opponents: tuple[str, ...] = TTT_OPPONENTS


if __name__ == "__main__":
    run_main(main)
