"""Atari throughput: mpirl IMPALA against RLlib IMPALA on Breakout, and gymnasium vector envs
against EnvPool on a rollout rank.

    python benchmarks/atari.py --json /tmp/atari.json [--quick] [--peers mpirl,rllib]

Two measurements, each program run alone, one after another, by this same file or ``mpirl``:

* IMPALA: sampling and learning together on ``ALE/Breakout-v5``, in env frames (agent steps x the
  frame skip of 4) trained on per second of wall time, counted from the end of a warm-up to the
  end of a fixed training budget (so start-up, imports and the first, slow iterations are left
  out). The warm-up starts at the first iteration that counted any steps: RLlib's env runners
  deliver none for their first 20-30 s here, and that dead time is left out of its rate too.
  mpirl: ``mpiexec -n 3 mpirl train --algo IMPALA`` with its defaults (2 rollout ranks of 8 envs,
  Nature CNN, 84x84 grayscale, frame skip 4 with max-pooling, a stack of 4); its rows come from
  the run's progress.csv. RLlib 2.60 (new API stack): this script with ``--role rllib``,
  ``IMPALAConfig`` with 2 env runners of 8 envs, Breakout wrapped by RLlib's own
  ``wrap_atari_for_new_api_stack`` (84x84 grayscale, frame skip 4 with max-pooling, a stack of
  4, no-op starts; it also ends an episode per life and presses FIRE on reset, and feeds float
  frames), the Nature CNN as ``conv_filters`` (the 512-unit dense layer as a 7x7 convolution over
  the last 7x7 maps, which is the same layer) shared by the policy and value heads, and mpirl's
  fragment length (50) and batch size (800); its rows come from its result dicts.
* Vector envs: one ``RolloutWorker`` in this process, as a rollout rank builds it, 8 envs of
  Breakout, once with ``env_backend`` gymnasium (``SyncVectorEnv`` of the wrapped ALE envs) and
  once with envpool (EnvPool's C++ pool, one thread). ``random``: the worker's vector env stepped
  with random actions, no policy; ``policy``: ``RolloutWorker.sample`` as IMPALA calls it
  (fragments of 50 steps), the Nature CNN choosing every action on one torch thread. Frames per
  second of one rank; the median of timed blocks after a warm-up.

Every process gets ``OMP_NUM_THREADS=1``. On a 2-core machine the 3 IMPALA processes of either
peer share the cores, so the ratio between peers is the figure to read, not the rates.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    PROGRESS_PREFIX,
    THREAD_ENV,
    BenchError,
    add_peers_option,
    attempt,
    emit,
    fmt,
    local_context,
    mpiexec_command,
    not_installed,
    print_problems,
    print_table,
    ratio,
    run_metadata,
    run_process,
    run_role,
    skipped,
    tail,
    timed_rates,
    write_report,
)

SCRIPT = Path(__file__).resolve()
MPIRL = Path(sys.executable).parent / "mpirl"
PEERS = ("mpirl", "rllib")

ENV_ID = "ALE/Breakout-v5"
FRAME_SKIP = 4
"""Env frames per agent step, for both peers: mpirl's default ``atari_frame_skip``, and RLlib's
``MaxAndSkipEnv`` as set up here."""
MPIRL_RANKS = 3
"""The driver (learner) and 2 rollout ranks."""
NUM_ENVS = 8
"""Envs per rollout rank or env runner: mpirl IMPALA's default ``num_envs_per_worker``."""
FRAGMENT = 50
"""Steps per env per sample call: mpirl IMPALA's default ``rollout_fragment_length``."""
TRAIN_BATCH = 800
"""Env steps per learner update: mpirl IMPALA's default ``train_batch_size``."""
SEED = 0

RLLIB_ENV_RUNNERS = 2
#: The Nature CNN; the last "convolution" is its 512-unit dense layer over the 64x7x7 maps.
NATURE_CONV_FILTERS = [[32, 8, 4, "valid"], [64, 4, 2, "valid"], [64, 3, 1, "valid"],
                       [512, 7, 1, "valid"]]
RLLIB_MIN_ITERATION_S = 5.0
"""RLlib IMPALA's iterations last at least 10 s by default; mpirl's take about 5 s on Breakout
here, and shorter ones give the warm-up cut a finer grain."""
ENV_BACKENDS = ("gymnasium", "envpool")


@dataclass(frozen=True)
class Plan:
    """How long each program measures; ``--quick`` scales it down."""

    train_s: float
    """Training budget of each IMPALA run, after start-up."""
    warmup_s: float
    """Training time left out at the start of each IMPALA run."""
    env_warmup_s: float
    env_block_s: float
    env_reps: int
    timeout_s: float
    """Wall-clock limit of any one process."""


FULL = Plan(train_s=90.0, warmup_s=20.0, env_warmup_s=2.0, env_block_s=5.0, env_reps=3,
            timeout_s=400.0)
QUICK = Plan(train_s=30.0, warmup_s=10.0, env_warmup_s=1.0, env_block_s=2.0, env_reps=2,
             timeout_s=240.0)


def window_rate(rows: list[tuple[float, int]], warmup_s: float) -> dict[str, Any]:
    """Env frames per second between the first row ``warmup_s`` or more after the first row
    that counted any steps, and the last row; ``rows`` are (training seconds, agent steps so
    far). Counting the warm-up from the first steps leaves out RLlib's first iterations, in
    which its env runners are still starting and nothing is sampled."""
    first = next((t for t, steps in rows if steps > 0), None)
    if first is None:
        raise BenchError(f"no steps at all: {rows}")
    after = [row for row in rows if row[0] >= first + warmup_s]
    if len(after) < 2:
        raise BenchError(f"fewer than 2 iterations after the {warmup_s:g} s warm-up: {rows}")
    (t0, s0), (t1, s1) = after[0], after[-1]
    return {"frames_per_s": (s1 - s0) * FRAME_SKIP / (t1 - t0),
            "agent_steps_per_s": (s1 - s0) / (t1 - t0), "window_s": t1 - t0,
            "window_agent_steps": s1 - s0, "agent_steps_total": rows[-1][1],
            "train_s": rows[-1][0], "first_steps_at_s": first, "iterations": len(rows)}


# The measured programs other than mpirl (which is its own command), one per --role.


def role_rllib(plan: Plan, backend: str) -> int:
    """RLlib IMPALA on Breakout for ``plan.train_s`` seconds after its first sampled steps; its
    steps per iteration."""
    started = time.perf_counter()
    try:
        import ale_py
        import cv2  # noqa: F401  (RLlib's WarpFrame resizes with it, in the env runners)
        import gymnasium as gym
        import ray
        from ray import tune
        from ray.rllib.algorithms.impala import IMPALAConfig
        from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
        from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack
    except ImportError as error:
        return not_installed("RLlib, ale-py or opencv-python-headless", error)

    def make_env(env_config: dict[str, Any]) -> gym.Env:
        gym.register_envs(ale_py)  # in each env runner: the ALE ids are registered on import
        # The ALE skips no frames: MaxAndSkipEnv does, with max-pooling, as mpirl's MaxAndSkip.
        env = gym.make(ENV_ID, frameskip=1, full_action_space=False, **env_config)
        return wrap_atari_for_new_api_stack(env, dim=84, frameskip=FRAME_SKIP, framestack=4)

    tune.register_env("mpirl-bench-breakout", make_env)
    # The learner is an actor that reserves a CPU of its own: 2 env runners and it need 3.
    ray.init(num_cpus=RLLIB_ENV_RUNNERS + 1, include_dashboard=False, log_to_driver=False)
    try:
        config = (IMPALAConfig()
                  .environment("mpirl-bench-breakout", clip_rewards=True)
                  .env_runners(num_env_runners=RLLIB_ENV_RUNNERS,
                               num_envs_per_env_runner=NUM_ENVS,
                               rollout_fragment_length=FRAGMENT)
                  .training(train_batch_size_per_learner=TRAIN_BATCH, lr=5e-4,
                            entropy_coeff=0.01, grad_clip=40.0)
                  .rl_module(model_config=DefaultModelConfig(
                      conv_filters=NATURE_CONV_FILTERS, conv_activation="relu",
                      head_fcnet_hiddens=[], vf_share_layers=True))
                  .reporting(min_time_s_per_iteration=RLLIB_MIN_ITERATION_S)
                  .debugging(seed=SEED))
        algo = config.build_algo()
        built = time.perf_counter()
        sampled: list[tuple[float, int]] = []
        trained: list[tuple[float, int]] = []
        # The budget runs from the first sampled steps: RLlib's env runners take tens of seconds
        # to deliver any, and mpirl's budget (time_total_s) has no such dead time in it.
        first_steps_at: float | None = None
        while first_steps_at is None or time.perf_counter() - first_steps_at < plan.train_s:
            result = algo.train()
            elapsed = time.perf_counter() - built
            runners = result.get("env_runners", {})
            steps = int(result.get("num_env_steps_sampled_lifetime")
                        or runners.get("num_env_steps_sampled_lifetime", 0))
            learned = int(result.get("learners", {}).get("__all_modules__", {})
                          .get("num_env_steps_trained_lifetime", 0))
            if steps > 0 and first_steps_at is None:
                first_steps_at = time.perf_counter()
            sampled.append((elapsed, steps))
            trained.append((elapsed, learned))
            print(f"{PROGRESS_PREFIX}rllib {elapsed:.0f} s: {steps} sampled, {learned} trained",
                  file=sys.stderr, flush=True)
        algo.stop()
        emit({"startup_s": built - started, "sampled": sampled, "trained": trained,
              "episode_return_mean": runners.get("episode_return_mean")})
    finally:
        ray.shutdown()
    return 0


def _breakout_worker(backend: str) -> Any:
    """A RolloutWorker of mpirl IMPALA's defaults on Breakout, in this process (world size 1)."""
    import dataclasses

    from mpirl.algorithms import impala

    from mpirl.config.fields import CommonConfig
    from mpirl.workers.env_spec import env_spec_for
    from mpirl.workers.rollout import RolloutSettings, RolloutWorker

    config = impala.Config(num_envs_per_worker=NUM_ENVS)
    spec = env_spec_for(ENV_ID, None, {**dataclasses.asdict(CommonConfig()),
                                       "env_backend": backend})
    policy = impala.model_spec(*spec.spaces(), config)
    return RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=NUM_ENVS, seed=SEED, gamma=config.gamma))


def measure_rate(step_block: Callable[[], int], plan: Plan) -> dict[str, Any]:
    """Env frames per second of ``step_block`` (which returns agent steps done): the median of
    ``env_reps`` timed blocks of at least ``env_block_s`` after ``env_warmup_s`` untimed."""
    rates = [rate * FRAME_SKIP for rate in timed_rates(step_block, plan.env_warmup_s,
                                                       plan.env_block_s, plan.env_reps)]
    return {"frames_per_s": statistics.median(rates), "frames_per_s_per_block": rates}


def role_envs(plan: Plan, backend: str) -> int:
    """One rollout rank's vector env on ``backend``: random actions, then the policy acting."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    worker = _breakout_worker(backend)
    envs = worker.envs
    rng = np.random.default_rng(SEED)
    actions = envs.single_action_space.n

    def random_block() -> int:
        for _ in range(FRAGMENT):
            envs.step(rng.integers(actions, size=NUM_ENVS))
        return FRAGMENT * NUM_ENVS

    envs_only = measure_rate(random_block, plan)
    # What an IMPALA rollout rank does per request, minus sending the fragment.
    acting = measure_rate(lambda: worker.sample(FRAGMENT, form="fragments")["env_steps"], plan)
    emit({"backend": backend, "vector_env": type(envs).__name__, "random": envs_only,
          "policy": acting})
    envs.close()
    return 0


ROLES: dict[str, Callable[[Plan, str], int]] = {"rllib": role_rllib, "envs": role_envs}


# The orchestrator.


def run_mpirl(plan: Plan) -> dict[str, Any]:
    """mpirl IMPALA with its defaults for ``plan.train_s`` seconds of training."""
    with tempfile.TemporaryDirectory(prefix="mpirl-atari-") as tmp:
        run_dir = Path(tmp) / "run"
        command = mpiexec_command(
            MPIRL_RANKS, str(MPIRL), "train", "--algo", "IMPALA", "--env", ENV_ID,
            "--stop", json.dumps({"time_total_s": plan.train_s}), "--run-dir", str(run_dir),
            "--seed", str(SEED))
        wall, out, err, _ = run_process(command, "mpirl IMPALA", plan.timeout_s, {"CI": "true"})
        try:
            with (run_dir / "progress.csv").open() as file:
                rows = list(csv.DictReader(file))
            params = json.loads((run_dir / "params.json").read_text())
        except OSError as error:
            raise BenchError(f"mpirl IMPALA: no progress.csv ({error}):\n"
                             f"{tail(err) or tail(out)}") from None
    steps = [(float(r["time_total_s"]), int(r["timesteps_total"])) for r in rows]
    result = window_rate(steps, plan.warmup_s)
    result.update(wall_s=wall, startup_and_shutdown_s=wall - result["train_s"],
                  episode_return_mean=float(rows[-1]["episode_return_mean"]),
                  config=params.get("config"))
    return result


def run_rllib(plan: Plan, quick: bool) -> dict[str, Any]:
    """RLlib IMPALA for ``plan.train_s`` seconds after its first samples; rates from its trained
    and its sampled steps."""
    finished = run_role(SCRIPT, "rllib", quick, name="rllib IMPALA", timeout_s=plan.timeout_s)
    raw = finished.result
    # Frames trained on, as mpirl's timesteps_total counts them; the sampled rate beside it.
    result = window_rate([tuple(row) for row in raw["trained"]], plan.warmup_s)
    sampled = window_rate([tuple(row) for row in raw["sampled"]], plan.warmup_s)
    result.update(sampled_frames_per_s=sampled["frames_per_s"],
                  sampled_agent_steps_total=sampled["agent_steps_total"],
                  first_sampled_at_s=sampled["first_steps_at_s"])
    result.update(wall_s=finished.wall_s, startup_s=raw["startup_s"],
                  episode_return_mean=raw["episode_return_mean"])
    return result


def run_envs(backend: str, plan: Plan, quick: bool) -> dict[str, Any]:
    """The vector-env program on ``backend``."""
    return run_role(SCRIPT, "envs", quick, ("--backend", backend), name=f"envs {backend}",
                    timeout_s=plan.timeout_s).result


def describe_training(result: dict[str, Any]) -> str:
    """One IMPALA run on the console."""
    return (f"{result['frames_per_s']:,.0f} env frames/s over {result['window_s']:.0f} s, "
            f"{result['agent_steps_total']:,} agent steps in {result['train_s']:.0f} s")


def describe_envs(result: dict[str, Any]) -> str:
    """One backend on the console."""
    return (f"{result['vector_env']}: random {result['random']['frames_per_s']:,.0f}, "
            f"policy {result['policy']['frames_per_s']:,.0f} frames/s")


def orchestrate(plan: Plan, quick: bool, json_path: Path | None,
                peers: tuple[str, ...]) -> int:
    """Both IMPALA peers, then both env backends; write the JSON report, print a table."""
    started = time.perf_counter()
    packages = ("mpirl", "mpi4py", "torch", "gymnasium", "numpy", "ale-py", "envpool", "ray")
    meta = {**run_metadata(quick, plan, packages), "thread_env": THREAD_ENV, "env": ENV_ID,
            "frame_skip": FRAME_SKIP, "num_envs_per_rank": NUM_ENVS}
    meta["settings"] = {
        "mpirl": {"ranks": MPIRL_RANKS, "algo": "IMPALA", "config": "defaults"},
        "rllib": {"num_env_runners": RLLIB_ENV_RUNNERS, "num_envs_per_env_runner": NUM_ENVS,
                  "rollout_fragment_length": FRAGMENT,
                  "train_batch_size_per_learner": TRAIN_BATCH,
                  "conv_filters": NATURE_CONV_FILTERS, "head_fcnet_hiddens": [],
                  "vf_share_layers": True, "env": "wrap_atari_for_new_api_stack(dim=84, "
                  "frameskip=4, framestack=4), clip_rewards=True",
                  "min_time_s_per_iteration": RLLIB_MIN_ITERATION_S},
    }
    report: dict[str, Any] = {"meta": meta}
    report["mpirl_impala"] = attempt("mpirl IMPALA", lambda: run_mpirl(plan), describe_training)
    effective = report["mpirl_impala"].pop("config", None)
    if effective is not None:
        meta["settings"]["mpirl"]["effective_config"] = effective
    # Ray after mpirl: whatever it leaves behind is cleared before the env programs run.
    report["rllib_impala"] = (attempt("RLlib IMPALA", lambda: run_rllib(plan, quick),
                                      describe_training) if "rllib" in peers else skipped())
    report["impala_speedup_vs_rllib"] = ratio(report["mpirl_impala"].get("frames_per_s"),
                                              report["rllib_impala"].get("frames_per_s"))
    for backend in ENV_BACKENDS:
        report[f"envs_{backend}"] = attempt(f"envs {backend}", lambda b=backend: run_envs(
            b, plan, quick), describe_envs)
    for mode in ("random", "policy"):
        report[f"envpool_speedup_{mode}"] = ratio(
            report["envs_envpool"].get(mode, {}).get("frames_per_s"),
            report["envs_gymnasium"].get(mode, {}).get("frames_per_s"))
    meta["wall_s"] = time.perf_counter() - started
    write_report(report, json_path)
    print_summary(report)
    if json_path is not None:
        print(f"wrote {json_path}")
    return 1 if any("error" in report[k] for k in ("mpirl_impala", "envs_gymnasium")) else 0


def print_summary(report: dict[str, Any]) -> None:
    """A small table for people; the JSON holds everything."""
    meta = report["meta"]
    print(f"\natari benchmark ({'quick' if meta['quick'] else 'full'}): {ENV_ID}, frame skip "
          f"{FRAME_SKIP}, on {meta['hostname']}, {meta['cpu_count']} CPUs, "
          f"{meta['wall_s']:.0f} s in all")
    rows = [("IMPALA, 2 rollout workers", "env frames/s", "agent steps", "train s")]
    for key, label in (("mpirl_impala", "mpirl"), ("rllib_impala", "RLlib 2.60")):
        entry = report[key]
        rows.append((label, fmt(entry.get("frames_per_s"), 0),
                     fmt(entry.get("agent_steps_total"), 0), fmt(entry.get("train_s"), 0)))
    print_table(rows)
    print(f"mpirl IMPALA is {fmt(report['impala_speedup_vs_rllib'], 2)}x RLlib's frames/s")
    rows = [("one rollout rank, 8 envs", "random actions", "policy acting")]
    for backend in ENV_BACKENDS:
        entry = report[f"envs_{backend}"]
        rows.append((backend, fmt(entry.get("random", {}).get("frames_per_s"), 0),
                     fmt(entry.get("policy", {}).get("frames_per_s"), 0)))
    rows.append(("envpool / gymnasium", fmt(report["envpool_speedup_random"], 2),
                 fmt(report["envpool_speedup_policy"], 2)))
    print_table(rows)
    print_problems({key: report[key] for key in ("mpirl_impala", "rllib_impala",
                                                 "envs_gymnasium", "envs_envpool")})


def main(argv: list[str] | None = None) -> int:
    """Entry point for the orchestrator and for every measured program."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.train_s:g} s IMPALA runs, shorter env blocks (about 3 "
                        "minutes; full mode about 6)")
    add_peers_option(parser, PEERS)
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=ENV_BACKENDS, default="gymnasium",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.role is not None:
        return ROLES[args.role](plan, args.backend)
    return orchestrate(plan, args.quick, args.json, args.peers)


if __name__ == "__main__":
    sys.exit(main())
