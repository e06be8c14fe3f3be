"""Model-based RL (issue 39): env steps and wall time to a return threshold, PETS and MBPO against
mpirl's SAC and Stable-Baselines3's SAC; PETS's planning throughput over rollout ranks.

    python benchmarks/model_based.py [--task pendulum|inverted-pendulum|half-cheetah]
        [--algos PETS,MBPO,SAC,SB3-SAC] [--seeds 0,1,2,3,4] [--eval-every STEPS]
        [--eval-episodes N] [--caps ALGO=STEPS,...] [--throughput-ranks 1,2,4]
        [--throughput-seconds S] [--json PATH] [--quick]

**Steps to the threshold** (``--task pendulum``: a mean of -200 on Pendulum-v1). Every run
evaluates every ``--eval-every`` env steps (Pendulum: PETS every 400, the others every 200):
``--eval-episodes`` episodes with deterministic actions (PETS: the first action of CEM's final
mean; SAC: the actor's mean; SB3: ``predict(..., deterministic=True)``), on envs of the
evaluation's own, reset with the same seeds for every algorithm and every evaluation of a seed
(``play_episodes``). A run's steps to the threshold are those of its first evaluation whose
mean reaches it; its time to the threshold is its *training* time up to then, evaluations left
out (start-up too: mpirl's ``time_total_s`` starts once the ranks are up). Each run also reports
its wall time from launch to the threshold (start-up and evaluations included) and the CPU
seconds of all its processes by then. A run that reaches the algorithm's step cap first is
reported with ``reached: false``. The runs go one at a time, seeds interleaved (seed 0 of every
algorithm, then seed 1 ...), so that drift in the machine's load hits every algorithm alike.

* mpirl's algorithms (PETS, MBPO, SAC): ``mpiexec -n R mpirl train --algo A`` with the
  algorithm's defaults and their documented layouts (``RANKS``: PETS and MBPO 3 ranks, two
  rollout ranks and the learner in the driver; SAC 2 ranks, one rollout rank with one env and
  the replay and learner in the driver). The evaluations come from ``EvaluateEvery``, a
  ``Callbacks`` class of this file named by the ``callbacks`` key: after the iteration that
  crosses the next multiple of ``--eval-every`` (SAC's iterations are 64 steps: its evaluations
  fall at 256, 448, 640 ...), the driver loads learner 0's weights into a model of its own and
  plays the episodes, and adds ``bench_eval_return_mean`` and its timing to the progress row.
  The same code path for every mpirl algorithm, whether or not it has evaluation keys of its own
  (SAC has none); unlike PETS's ``evaluation_interval``, the rollout ranks' training episodes
  go on undisturbed. The orchestrator reads progress.csv every second and ends the run at the
  threshold.
* Stable-Baselines3's SAC: this script with ``--role sb3``, rl-baselines3-zoo's Pendulum-v1
  settings (``MlpPolicy``, learning_rate 1e-3, every other setting SB3's default: 256x256, batch
  256, buffer 1M, 100 random steps, one gradient step per env step, no gSDE), torch on one thread,
  ``learn`` in chunks of ``--eval-every`` steps (its episodes go on from one to the next) and
  the same evaluation between them.

**Planning throughput** (``--throughput-ranks``): ``mpiexec -n N`` of this script with ``--role
plan``; every rank builds PETS's planner with its defaults (untrained: planning costs the same
whatever the weights) for Pendulum-v1 and plans actions for ``num_envs_per_worker`` envs at
once for ``--throughput-seconds``, as a rollout rank plans each step. Reported: planned actions
per second over all ranks, and per CPU second.

``--task inverted-pendulum`` (InvertedPendulum-v5) and ``--task half-cheetah`` (HalfCheetah-v5)
run MBPO and SAC to a fixed step budget without a threshold, and report the evaluations' means
at equal env steps. They need MuJoCo (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    MPI_ENV,
    THREAD_ENV,
    BenchError,
    attempt,
    emit,
    end_session,
    fmt,
    mpiexec_command,
    not_installed,
    print_table,
    ratio,
    run_main,
    run_metadata,
    run_role,
    session_cpu_s,
    tail,
    write_report,
)

from mpirl.workers.callbacks import Callbacks

SCRIPT = Path(__file__).resolve()
MPIRL = str(Path(sys.executable).parent / "mpirl")
MPIRL_ALGOS = ("PETS", "MBPO", "SAC")
ALGOS = (*MPIRL_ALGOS, "SB3-SAC")
#: Ranks of each mpirl algorithm's documented layout (see the module's docstring).
RANKS = {"PETS": 3, "MBPO": 3, "SAC": 2}
EVAL_EVERY_ENV = "MPIRL_BENCH_EVAL_EVERY"
EVAL_EPISODES_ENV = "MPIRL_BENCH_EVAL_EPISODES"
EVAL_SEED_ENV = "MPIRL_BENCH_EVAL_SEED"
EVAL_COLUMN = "bench_eval_return_mean"
POLL_S = 1.0


@dataclass(frozen=True)
class Task:
    env: str
    threshold: float | None
    """The return whose first evaluation ends a run; None runs every algorithm to its cap."""
    eval_every: dict[str, int]
    """Per algorithm, env steps between evaluations."""
    caps: dict[str, int]
    algos: tuple[str, ...]
    seeds: tuple[int, ...]
    mpirl_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per algorithm, keys added to its defaults (only the quick mode's cheaper planning)."""


TASKS = {
    # PETS's evaluations plan every action of 10 episodes (2,000 CEM plans): one cost about as
    # much as 1,400 env steps of its training here, hence every 400 steps; SAC's are cheap.
    "pendulum": Task("Pendulum-v1", -200.0, {"PETS": 400, "MBPO": 200, "SAC": 200,
                                             "SB3-SAC": 200},
                     {"PETS": 4_000, "MBPO": 4_000, "SAC": 30_000, "SB3-SAC": 30_000},
                     ("PETS", "MBPO", "SAC", "SB3-SAC"), (0, 1, 2, 3, 4)),
    "inverted-pendulum": Task("InvertedPendulum-v5", None, dict.fromkeys(ALGOS, 1_000),
                              {"MBPO": 15_000, "SAC": 15_000, "SB3-SAC": 15_000},
                              ("MBPO", "SAC"), (0, 1, 2)),
    "half-cheetah": Task("HalfCheetah-v5", None, dict.fromkeys(ALGOS, 5_000),
                         {"MBPO": 100_000, "SAC": 100_000, "SB3-SAC": 100_000},
                         ("MBPO", "SAC"), (0,)),
}
#: Small enough for a test: one seed, one evaluation of one episode, a cheap planner, one
#: rollout rank for every mpirl algorithm (QUICK_RANKS).
QUICK = Task("Pendulum-v1", -200.0, dict.fromkeys(ALGOS, 200), dict.fromkeys(ALGOS, 200),
             ("PETS", "SAC"), (0,),
             {"PETS": {"planning_horizon": 5, "cem_population": 20, "cem_iterations": 2}})
QUICK_RANKS = dict.fromkeys(MPIRL_ALGOS, 2)
QUICK_EVAL_EPISODES = 1


@dataclass
class Plan:
    task: str
    env: str
    threshold: float | None
    algos: tuple[str, ...]
    seeds: tuple[int, ...]
    eval_every: dict[str, int]
    eval_episodes: int
    caps: dict[str, int]
    ranks: dict[str, int]
    mpirl_config: dict[str, dict[str, Any]]
    throughput_ranks: tuple[int, ...]
    throughput_seconds: float


# --- in the mpirl runs: the evaluations ---------------------------------------------------------


class EvaluateEvery(Callbacks):
    """On the driver: after the iteration that crosses the next multiple of
    ``$MPIRL_BENCH_EVAL_EVERY`` env steps, learner 0's weights go into a copy of the model in the
    driver's process, which plays ``$MPIRL_BENCH_EVAL_EPISODES`` episodes with deterministic
    actions on envs of its own (``play_episodes``), from the same start states every time. The
    mean return, and the seconds of evaluation before this one (to take out of
    ``time_total_s``), go into the progress row. Only the weights cross ranks."""

    def __init__(self) -> None:
        self.every = int(os.environ.get(EVAL_EVERY_ENV, "0"))
        self.episodes = int(os.environ.get(EVAL_EPISODES_ENV, "10"))
        self.seed_base = int(os.environ.get(EVAL_SEED_ENV, "0"))
        self.next_at = self.every
        self.eval_s_total = 0.0
        self.policy: Any = None
        self.envs: list[Any] = []

    def on_algorithm_init(self, *, algorithm: Any) -> None:
        from mpirl.models.torch_model import build_torch_model

        self.envs = [algorithm.env.make() for _ in range(self.episodes)]
        spaces = self.envs[0].observation_space, self.envs[0].action_space
        self.policy = build_torch_model(algorithm.module.model_spec(*spaces, algorithm.config))

    def on_train_result(self, *, algorithm: Any, result: dict[str, Any]) -> None:
        mean, took = math.nan, 0.0
        if self.every and result["timesteps_total"] >= self.next_at:
            start = time.monotonic()
            self.policy.set_flat_weights(algorithm.learners[0].call("get_weights"))
            mean = statistics.fmean(play_episodes(
                lambda obs: self.policy.env_actions(self.policy.act(obs, True)[0]), self.envs,
                self.seed_base))
            took = time.monotonic() - start
            while self.next_at <= result["timesteps_total"]:
                self.next_at += self.every
        # Every row gets the columns, so that progress.csv has them from its header on.
        result[EVAL_COLUMN] = mean
        result["bench_eval_s"] = took
        result["bench_eval_s_before"] = self.eval_s_total
        self.eval_s_total += took


def play_episodes(act: Any, envs: Sequence[Any], seed_base: int) -> list[float]:
    """One episode in each of ``envs`` (reset with seeds ``seed_base + i``), stepped together:
    ``act`` maps a batch of observations to env actions. A finished env keeps its last
    observation in the batch (its actions are dropped), so that the batch never changes size
    (PETS warm-starts each plan from the last one of that size). The episodes' returns."""
    import numpy as np

    obs = [env.reset(seed=seed_base + i)[0] for i, env in enumerate(envs)]
    returns = [0.0] * len(envs)
    running = [True] * len(envs)
    while any(running):
        actions = act(np.stack(obs))
        for i, env in enumerate(envs):
            if running[i]:
                obs[i], reward, terminated, truncated, _ = env.step(actions[i])
                returns[i] += float(reward)
                running[i] = not (terminated or truncated)
    return returns


# --- in the orchestrator: one mpirl run ---------------------------------------------------------


def eval_seed_base(seed: int) -> int:
    """The evaluation envs' first reset seed for a run of ``seed``: the same start states for
    every algorithm and every evaluation of that seed, none shared with training."""
    return 1_000_000 + 1_000 * seed


def read_rows(progress: Path) -> list[dict[str, str]]:
    try:
        with open(progress, newline="") as file:
            return list(csv.DictReader(file))
    except OSError:
        return []


def number(row: dict[str, str], key: str) -> float:
    try:
        return float(row.get(key) or "nan")
    except ValueError:
        return math.nan


def evaluations_of(rows: list[dict[str, str]]) -> list[dict[str, float]]:
    """Each evaluation: env steps, mean return, training seconds by then (evaluations out)."""
    evaluations = []
    for row in rows:
        mean = number(row, EVAL_COLUMN)
        if not math.isnan(mean):
            train_s = number(row, "time_total_s") - number(row, "bench_eval_s_before")
            evaluations.append({"env_steps": int(number(row, "timesteps_total")),
                                "return_mean": mean, "train_s": train_s})
    return evaluations


def first_reaching(evaluations: list[dict[str, float]], threshold: float | None
                   ) -> dict[str, float] | None:
    if threshold is None:
        return None
    return next((e for e in evaluations if e["return_mean"] >= threshold), None)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_mpirl(algo: str, seed: int, plan: Plan, quick: bool) -> dict[str, Any]:
    """``mpirl train`` until its first evaluation at the threshold (then ended) or its cap."""
    cap = plan.caps[algo]
    config = {"callbacks": f"{SCRIPT.stem}:{EvaluateEvery.__name__}",
              **plan.mpirl_config.get(algo, {})}
    name = f"mpirl {algo} seed {seed}"
    with tempfile.TemporaryDirectory(prefix="mpirl-model-based-") as tmp:
        run_dir = Path(tmp) / "run"
        command = mpiexec_command(
            plan.ranks[algo], MPIRL, "train", "--algo", algo, "--env", plan.env, "--seed",
            str(seed), "--config", json.dumps(config), "--stop",
            json.dumps({"timesteps_total": cap}), "--run-dir", str(run_dir), "--progress", "off")
        env = {**os.environ, **MPI_ENV, **THREAD_ENV,
               # Every rank imports this file for the callback.
               "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPT.parent),
                                                           os.environ.get("PYTHONPATH")])),
               EVAL_EVERY_ENV: str(plan.eval_every[algo]),
               EVAL_EPISODES_ENV: str(plan.eval_episodes),
               EVAL_SEED_ENV: str(eval_seed_base(seed))}
        timeout_s = 120.0 if quick else 3_600.0
        cpu_before = children_cpu_s()
        log_path = Path(tmp) / "out.log"
        launch = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        reached, cpu_s = None, 0.0
        try:
            while True:
                exited = proc.poll() is not None
                # Sampled just before the rows are read: a run ended at the threshold reports
                # its processes' CPU at about the moment the threshold was seen.
                cpu_s = session_cpu_s(proc.pid) if not exited else cpu_s
                evaluations = evaluations_of(read_rows(run_dir / "progress.csv"))
                reached = first_reaching(evaluations, plan.threshold)
                if exited or reached is not None:
                    break
                if time.perf_counter() - launch > timeout_s:
                    raise BenchError(f"{name}: not finished within {timeout_s:g} s; killed")
                time.sleep(POLL_S)
            wall_s = time.perf_counter() - launch
        finally:
            end_session(proc)
        if proc.returncode not in (0, None) and reached is None:
            raise BenchError(f"{name}: exited with code {proc.returncode}:\n"
                             f"{tail(log_path.read_text())}")
        if reached is None:  # ran to its cap and exited: its processes were all reaped
            cpu_s = children_cpu_s() - cpu_before
        if not evaluations:
            raise BenchError(f"{name}: no evaluation in progress.csv:\n"
                             f"{tail(log_path.read_text())}")
    return run_entry(evaluations, reached, plan.threshold, wall_s, cpu_s, cap)


def run_entry(evaluations: list[dict[str, float]], reached: dict[str, float] | None,
              threshold: float | None, wall_s: float, cpu_s: float, cap: int) -> dict[str, Any]:
    """One run's report entry."""
    entry: dict[str, Any] = {
        "reached": reached is not None, "env_steps": None, "train_s": None,
        "wall_s": wall_s, "cpu_s": cpu_s, "cap": cap,
        "final_return_mean": evaluations[-1]["return_mean"] if evaluations else None,
        "evaluations": evaluations}
    if reached is not None:
        entry.update(env_steps=reached["env_steps"], train_s=reached["train_s"],
                     return_mean=reached["return_mean"])
    elif threshold is not None:
        entry["not_reached"] = (f"no evaluation reached {threshold:g} within {cap:,} env steps")
    return entry


# --- Stable-Baselines3's SAC (--role sb3) --------------------------------------------------------


def sb3_role(args: argparse.Namespace) -> int:
    """SB3's SAC, trained in chunks of ``--chunk`` steps with an evaluation after each,
    until the threshold or the cap; emits the same entry as an mpirl run."""
    try:
        import gymnasium as gym
        import torch
        from stable_baselines3 import SAC
    except ImportError as error:
        return not_installed("stable-baselines3", error)
    torch.set_num_threads(1)
    launch_cpu = time.process_time()
    env = gym.make(args.env)
    eval_envs = [gym.make(args.env) for _ in range(args.eval_episodes)]
    # rl-baselines3-zoo's hyperparams/sac.yml for Pendulum-v1; everything else SB3's default.
    model = SAC("MlpPolicy", env, learning_rate=1e-3, seed=args.seed, device="cpu", verbose=0)
    evaluations, reached, train_s = [], None, 0.0
    while model.num_timesteps < args.cap and reached is None:
        start = time.perf_counter()
        model.learn(args.chunk, reset_num_timesteps=False)
        train_s += time.perf_counter() - start
        returns = play_episodes(lambda obs: model.predict(obs, deterministic=True)[0],
                                eval_envs, eval_seed_base(args.seed))
        evaluations.append({"env_steps": model.num_timesteps,
                            "return_mean": float(statistics.fmean(returns)),
                            "train_s": train_s})
        print(f"progress: {evaluations[-1]}", file=sys.stderr, flush=True)
        reached = first_reaching(evaluations, args.threshold)
    emit({"evaluations": evaluations, "reached": reached,
          "process_cpu_s": time.process_time() - launch_cpu})
    return 0


def run_sb3(seed: int, plan: Plan, quick: bool) -> dict[str, Any]:
    cap = plan.caps["SB3-SAC"]
    threshold = [] if plan.threshold is None else ["--threshold", str(plan.threshold)]
    cpu_before = children_cpu_s()
    finished = run_role(SCRIPT, "sb3", quick, ["--env", plan.env, "--seed", str(seed), "--cap",
                                                str(cap), "--chunk",
                                                str(plan.eval_every["SB3-SAC"]),
                                                "--eval-episodes", str(plan.eval_episodes),
                                                *threshold],
                        name=f"SB3 SAC seed {seed}", timeout_s=120 if quick else 3_600)
    result = finished.result
    return run_entry(result["evaluations"], result["reached"], plan.threshold, finished.wall_s,
                     children_cpu_s() - cpu_before, cap)


# --- planning throughput (--role plan, under mpiexec) -------------------------------------------


def plan_role(args: argparse.Namespace) -> int:
    """Every rank plans for PETS's ``num_envs_per_worker`` envs for ``--seconds``; rank 0 emits
    the sum of the ranks' rates. Each rank's action count and times cross to rank 0."""
    import gymnasium as gym
    import numpy as np
    import torch
    from mpi4py import MPI
    from mpirl.algorithms.model_based import pets

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    env = gym.make(args.env)
    config = pets.Config()
    planner = pets.model_spec(env.observation_space, env.action_space, config).build()
    rng = np.random.default_rng(comm.rank)
    obs = np.stack([env.observation_space.sample() for _ in range(config.num_envs_per_worker)])
    planner.plan(obs, rng, deterministic=False)  # the first call builds what later ones reuse
    comm.Barrier()
    actions, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < args.seconds:
        planner.plan(obs, rng, deterministic=False)
        actions += len(obs)
    mine = (actions, time.perf_counter() - start, time.process_time() - cpu_start)
    every = comm.gather(mine, root=0)
    if comm.rank == 0:
        emit({"ranks": comm.size, "num_envs_per_worker": config.num_envs_per_worker,
              "actions_per_s": sum(a / w for a, w, _ in every),
              "actions_per_s_per_rank": [a / w for a, w, _ in every],
              "actions_per_cpu_s": sum(a for a, _, _ in every) / sum(c for _, _, c in every),
              "seconds_per_planned_step": statistics.fmean(w / (a / len(obs))
                                                           for a, w, _ in every)})
    return 0


def throughput(plan: Plan, quick: bool) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for ranks in plan.throughput_ranks:
        runs[str(ranks)] = attempt(
            f"planning throughput, {ranks} rank(s)",
            lambda ranks=ranks: run_role(SCRIPT, "plan", quick,
                                         ["--env", "Pendulum-v1", "--seconds",
                                          str(plan.throughput_seconds)],
                                         ranks=ranks, timeout_s=300).result,
            lambda r: f"{r['actions_per_s']:.1f} actions/s, {r['actions_per_cpu_s']:.1f} "
                      f"per CPU-s")
    one = runs.get(str(min(plan.throughput_ranks)), {}).get("actions_per_s")
    for entry in runs.values():
        if "error" not in entry:
            entry["speedup_vs_fewest_ranks"] = ratio(entry["actions_per_s"], one)
    cores = len(os.sched_getaffinity(0))
    return {"runs": runs, "cores": cores,
            "note": f"{cores} cores: above {cores} ranks the cores are oversubscribed"}


# --- the report ---------------------------------------------------------------------------------


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: dict[str, dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """Per algorithm: seeds that reached the threshold, the median env steps and training
    seconds over all seeds (a seed that did not reach it counts as infinitely many, so the
    median is None when half or more did not)."""
    summary = {}
    for algo, per_seed in runs.items():
        entries = [per_seed.get(str(s), {}) for s in seeds]
        done = [e for e in entries if "reached" in e]
        reached = [e for e in done if e["reached"]]
        # Seeds that did not reach it sort above every seed that did.
        steps = sorted(e["env_steps"] if e["reached"] else math.inf for e in done)
        train = sorted(e["train_s"] if e["reached"] else math.inf for e in done)
        wall = sorted(e["wall_s"] if e["reached"] else math.inf for e in done)
        cpu = sorted(e["cpu_s"] if e["reached"] else math.inf for e in done)

        def finite_median(values: list[float]) -> float | None:
            value = median_or_none(values)
            return None if value is None or math.isinf(value) else value

        summary[algo] = {"runs": len(done), "reached": len(reached),
                         "median_env_steps": finite_median(steps),
                         "median_train_s": finite_median(train),
                         "median_wall_s": finite_median(wall),
                         "median_cpu_s": finite_median(cpu),
                         "all_reached": len(done) > 0 and len(reached) == len(done)}
    return summary


def comparisons(summary: dict[str, Any]) -> dict[str, Any]:
    """Each model-based algorithm against each SAC: the ratios of the medians, and the issue's
    targets (steps at most 1/3 of SAC's, training time at most 1.5x)."""
    out = {}
    for model_based in ("PETS", "MBPO"):
        for sac in ("SAC", "SB3-SAC"):
            if model_based not in summary or sac not in summary:
                continue
            a, b = summary[model_based], summary[sac]
            steps = ratio(a["median_env_steps"], b["median_env_steps"])
            train = ratio(a["median_train_s"], b["median_train_s"])
            cpu = ratio(a["median_cpu_s"], b["median_cpu_s"])
            out[f"{model_based}_vs_{sac}"] = {
                "env_steps_ratio": steps, "train_s_ratio": train, "cpu_s_ratio": cpu,
                "steps_target_met": None if steps is None else steps <= 1 / 3,
                "time_target_met": None if train is None else train <= 1.5}
    return out


def at_equal_steps(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per algorithm, env steps -> the mean over seeds of the evaluation there."""
    table: dict[str, dict[str, float]] = {}
    for algo, per_seed in runs.items():
        by_steps: dict[int, list[float]] = {}
        for entry in per_seed.values():
            for evaluation in entry.get("evaluations", []):
                by_steps.setdefault(evaluation["env_steps"], []).append(evaluation["return_mean"])
        table[algo] = {str(s): statistics.fmean(v) for s, v in sorted(by_steps.items())}
    return table


def outcome(entry: dict[str, Any], threshold: float | None) -> str:
    if threshold is None:
        return f"ran to {entry['evaluations'][-1]['env_steps']:,} env steps"
    return f"reached {threshold:g}" if entry["reached"] else f"did not reach {threshold:g}"


def describe(entry: dict[str, Any], threshold: float | None) -> str:
    """A run's console line."""
    at = (f"{fmt(entry['env_steps'], 0)} env steps, {fmt(entry['train_s'], 1)} s training, "
          if entry["reached"] else "")
    return (f"{outcome(entry, threshold)}: {at}{entry['wall_s']:.1f} s wall, "
            f"{entry['cpu_s']:.1f} CPU-s; last evaluation {fmt(entry['final_return_mean'], 1)}")


def print_runs(runs: dict[str, dict[str, Any]], seeds: Sequence[int]) -> None:
    rows = [["algo", "seed", "reached", "env steps", "train s", "wall s", "CPU s", "return"]]
    for algo, per_seed in runs.items():
        for seed in seeds:
            e = per_seed.get(str(seed), {})
            if "error" in e:
                rows.append([algo, str(seed), "error", "-", "-", "-", "-", "-"])
                continue
            rows.append([algo, str(seed), fmt(e.get("reached"), 0), fmt(e.get("env_steps"), 0),
                         fmt(e.get("train_s"), 1), fmt(e.get("wall_s"), 1),
                         fmt(e.get("cpu_s"), 1),
                         fmt(e.get("return_mean", e.get("final_return_mean")), 1)])
    print_table(rows)


# --- main -----------------------------------------------------------------------------------------


def parse_list(text: str, kind: type) -> tuple[Any, ...]:
    try:
        return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of {kind.__name__}: "
                                         f"{text!r}") from None


def parse_algos(text: str) -> tuple[str, ...]:
    algos = parse_list(text, str)
    unknown = [a for a in algos if a not in ALGOS]
    if unknown or not algos:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {', '.join(unknown) or '(none)'};"
                                         f" choose from {','.join(ALGOS)}")
    return algos


def parse_caps(text: str) -> dict[str, int]:
    caps = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        algo, _, steps = part.partition("=")
        if algo not in ALGOS or not steps.isdigit() or int(steps) < 1:
            raise argparse.ArgumentTypeError(f"expected ALGO=STEPS with ALGO one of "
                                             f"{','.join(ALGOS)}; got {part!r}")
        caps[algo] = int(steps)
    return caps


def parse_config(text: str) -> tuple[str, dict[str, Any]]:
    algo, _, keys = text.partition("=")
    try:
        config = json.loads(keys)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: the keys are not JSON ({error})") from None
    if algo not in ALGOS or algo == "SB3-SAC" or not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected ALGO=JSON-object with ALGO one of mpirl's "
                                         f"{','.join(a for a in ALGOS if a != 'SB3-SAC')}; "
                                         f"got {text!r}")
    return algo, config


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="pendulum")
    p.add_argument("--algos", type=parse_algos, metavar="LIST",
                   help=f"comma-separated, of {','.join(ALGOS)} (default: the task's; "
                        f"pendulum: {','.join(TASKS['pendulum'].algos)})")
    p.add_argument("--seeds", type=lambda t: parse_list(t, int), metavar="LIST",
                   help="comma-separated seeds (default: the task's; pendulum 0-4); '' runs "
                        "the planning-throughput sweep alone")
    p.add_argument("--eval-every", type=parse_caps, default={}, metavar="ALGO=STEPS,...",
                   help="env steps between evaluations instead of the task's (pendulum: PETS "
                        "400, the others 200)")
    p.add_argument("--eval-episodes", type=positive_int, default=10, metavar="N")
    p.add_argument("--config", type=parse_config, action="append", default=[],
                   metavar="ALGO=JSON", help="keys added to an mpirl algorithm's defaults "
                   "(repeatable), e.g. MBPO='{\"sgd_steps_per_env_step\": 20}'")
    p.add_argument("--caps", type=parse_caps, default={}, metavar="ALGO=STEPS,...",
                   help="env-step caps instead of the task's")
    p.add_argument("--throughput-ranks", type=lambda t: parse_list(t, positive_int),
                   default=None, metavar="LIST",
                   help="rollout ranks of the planning-throughput sweep (default 1,2,4 with "
                        "--task pendulum; empty: none)")
    p.add_argument("--throughput-seconds", type=float, default=20.0, metavar="S")
    p.add_argument("--json", type=Path, metavar="PATH")
    p.add_argument("--quick", action="store_true",
                   help="a check that the script works: 1 seed, 200-step caps, cheap planning, "
                        "one rollout rank")
    # The measured programs' arguments.
    p.add_argument("--role", choices=["sb3", "plan"], help=argparse.SUPPRESS)
    p.add_argument("--env", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    p.add_argument("--threshold", type=float, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    return p


def make_plan(args: argparse.Namespace) -> Plan:
    task = QUICK if args.quick else TASKS[args.task]
    if args.quick and args.task != "pendulum":
        raise SystemExit("--quick runs the pendulum task only")
    throughput_ranks = args.throughput_ranks
    if throughput_ranks is None:
        throughput_ranks = ((1,) if args.quick else (1, 2, 4)) if args.task == "pendulum" else ()
    return Plan(task=args.task, env=task.env, threshold=task.threshold,
                algos=args.algos or task.algos,
                seeds=task.seeds if args.seeds is None else args.seeds,
                eval_every={**task.eval_every, **args.eval_every},
                eval_episodes=QUICK_EVAL_EPISODES if args.quick else args.eval_episodes,
                caps={**task.caps, **args.caps},
                ranks=dict(QUICK_RANKS if args.quick else RANKS),
                mpirl_config={algo: {**task.mpirl_config.get(algo, {}),
                                     **dict(args.config).get(algo, {})}
                              for algo in ALGOS},
                throughput_ranks=throughput_ranks,
                throughput_seconds=1.0 if args.quick else args.throughput_seconds)


def main() -> int:
    args = parser().parse_args()
    if args.role == "sb3":
        return sb3_role(args)
    if args.role == "plan":
        return plan_role(args)
    plan = make_plan(args)
    report: dict[str, Any] = {
        "metadata": run_metadata(args.quick, plan, ["mpirl", "torch", "gymnasium",
                                                    "stable-baselines3", "mujoco"]),
        "runs": {algo: {} for algo in plan.algos}}
    if plan.throughput_ranks:
        report["planning_throughput"] = throughput(plan, args.quick)
        write_report(report, args.json)
    # Seeds interleaved: every algorithm's seed 0, then every algorithm's seed 1, ...
    for seed in plan.seeds:
        for algo in plan.algos:
            def measure(algo: str = algo, seed: int = seed) -> dict[str, Any]:
                if algo == "SB3-SAC":
                    return run_sb3(seed, plan, args.quick)
                return run_mpirl(algo, seed, plan, args.quick)

            report["runs"][algo][str(seed)] = attempt(
                f"{algo} seed {seed} on {plan.env}", measure,
                lambda e: describe(e, plan.threshold))
            report["loadavg_now"] = os.getloadavg()
            # Written after every run: a long benchmark stopped early keeps what it measured.
            if plan.threshold is not None:
                report["summary"] = summarize(report["runs"], plan.seeds)
                report["comparisons"] = comparisons(report["summary"])
            report["return_at_equal_steps"] = at_equal_steps(report["runs"])
            write_report(report, args.json)
    if not plan.seeds:
        return 0
    print()
    print_runs(report["runs"], plan.seeds)
    if plan.threshold is not None:
        print(json.dumps({"summary": report["summary"], "comparisons": report["comparisons"]},
                         indent=1))
    return 0


if __name__ == "__main__":
    run_main(main)
