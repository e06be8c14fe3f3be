"""Replay: memory per stored transition, insert/sample throughput, and Ape-X sampling scaling.

    python benchmarks/replay.py --json benchmarks/replay.json [--quick]

* ``replay_bytes_overhead``: bytes the buffer holds (every array, the sum tree included) per
  stored transition, divided by the raw bytes of one transition's own arrays: its observation,
  action, reward and termination flag. (The next observation is the following row's, so a buffer
  that stored it again would be near 2x for image observations.) CartPole-v1 (4 float32) and an
  84x84x4 uint8 frame stack, uniform and prioritized, filled to capacity with episodes of
  random length, some ending by a time limit (their final observations take a row each).
* ``throughput``: rows inserted per second (chunks of 64 steps x 8 envs) and transitions sampled
  per second (minibatches of 64, 3-step returns), uniform vs prioritized, plus priority updates.
* ``apex_scaling``: ``mpirl train --algo APEX`` with 1, 2 and 3 rollout ranks (2 replay shards,
  1 learner, sampling not throttled) for a fixed number of env steps: env steps stored per second
  while the learner trains, and the learner's SGD steps per second (``--quick``: 1 rollout
  rank, 4,000 env steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from harness import BenchError, attempt, mpiexec_command, run_metadata, run_process, write_report

from mpirl.data.replay_buffer import OBS_ONLY, ReplayBuffer, ReplaySettings

MPIRL = Path(sys.executable).parent / "mpirl"
ACTIONS = gym.spaces.Discrete(4)
OBSERVATIONS = {
    "cartpole": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
    "atari_84x84x4": gym.spaces.Box(0, 255, (84, 84, 4), np.uint8),
}


@dataclass(frozen=True)
class Plan:
    """How much the run does; ``--quick`` scales it down."""

    apex_env_steps: int
    apex_rollout_ranks: tuple[int, ...]


FULL = Plan(40_000, (1, 2, 3))
QUICK = Plan(4_000, (1,))


def raw_transition_bytes(space: gym.Space) -> int:
    """One observation, one action, a float32 reward and a one-byte termination flag."""
    return int(np.prod(space.shape)) * space.dtype.itemsize + ACTIONS.dtype.itemsize + 4 + 1


def fill(buffer: ReplayBuffer, space: gym.Space, rng: np.random.Generator, streams: int,
         steps: int = 64) -> None:
    """Fill ``buffer`` with chunks of random steps; episodes end every ~200 steps, one in four
    by a time limit."""
    while buffer.written.min() < buffer.length:
        shape = (steps, streams)
        obs = rng.integers(0, 255, (*shape, *space.shape)).astype(space.dtype)
        ends = rng.random(shape) < 1 / 200
        truncated = ends & (rng.random(shape) < 0.25)
        buffer.add(np.arange(streams), obs, rng.integers(0, 4, shape),
                   rng.random(shape).astype(np.float32), ends & ~truncated, truncated,
                   obs[truncated])


def measure_memory(quick: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {}
    for name, space in OBSERVATIONS.items():
        capacity = (20_000 if quick else 100_000) if name == "cartpole" else \
            (2_000 if quick else 10_000)
        entry = {"raw_bytes_per_transition": raw_transition_bytes(space), "capacity": capacity}
        for kind in ("uniform", "prioritized"):
            buffer = ReplayBuffer(capacity, 8, space, ACTIONS,
                                  ReplaySettings(prioritized=kind == "prioritized"))
            fill(buffer, space, rng, 8)
            transitions = int(np.count_nonzero((buffer.flags & OBS_ONLY) == 0))
            per = buffer.nbytes() / transitions
            entry[kind] = {"bytes_per_transition": per,
                           "ratio": per / entry["raw_bytes_per_transition"],
                           "observation_only_rows": len(buffer) - transitions}
        report[name] = entry
    return report


def measure_throughput(quick: bool) -> dict[str, Any]:
    space = OBSERVATIONS["cartpole"]
    rng = np.random.default_rng(1)
    seconds = 0.2 if quick else 2.0
    report: dict[str, Any] = {}
    for kind in ("uniform", "prioritized"):
        buffer = ReplayBuffer(100_000, 8, space, ACTIONS,
                              ReplaySettings(prioritized=kind == "prioritized", n_step=3))
        shape = (64, 8)
        obs = rng.standard_normal((*shape, 4)).astype(np.float32)
        actions, rewards = rng.integers(0, 4, shape), np.ones(shape, np.float32)
        ends = rng.random(shape) < 1 / 200
        rows, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            rows += buffer.add(np.arange(8), obs, actions, rewards, ends, ends & False, obs[:0])
        insert = rows / (time.perf_counter() - start)
        sampled, updated, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch = buffer.sample(64)
            sampled += 64
            if kind == "prioritized":
                updated += buffer.update_priorities(batch["indices"], batch["generations"],
                                                    rng.random(64))
        elapsed = time.perf_counter() - start
        report[kind] = {"insert_rows_per_s": insert, "sample_transitions_per_s": sampled / elapsed,
                        "priority_updates_per_s": updated / elapsed if updated else None}
    return report


def measure_apex(rollouts: int, env_steps: int, timeout_s: float) -> dict[str, Any]:
    """One Ape-X run with ``rollouts`` rollout ranks; its throughput from result.json."""
    config = {"num_rollout_workers": rollouts, "num_replay_shards": 2, "num_learners": 1,
              "throttle_sampling": False, "min_env_steps_per_iteration": 2_000}
    with tempfile.TemporaryDirectory(prefix="mpirl-apex-") as tmp:
        run_dir = Path(tmp) / "run"
        command = mpiexec_command(
            1 + rollouts + 3, str(MPIRL), "train", "--algo", "APEX", "--env", "CartPole-v1",
            "--config", json.dumps(config), "--stop", json.dumps({"timesteps_total": env_steps}),
            "--run-dir", str(run_dir))
        wall = run_process(command, f"apex {rollouts} rollout ranks", timeout_s,
                           {"CI": "true"}).wall_s
        try:
            result = json.loads((run_dir / "result.json").read_text())
        except OSError as error:
            raise BenchError(f"apex {rollouts}: no result.json ({error})") from None
    seconds = float(result["time_total_s"])
    return {"rollout_ranks": rollouts, "env_steps": result["timesteps_total"],
            "train_s": seconds, "wall_s": wall,
            "env_steps_per_s": result["timesteps_total"] / seconds,
            "sgd_steps": result["sgd_steps_total"],
            "sgd_steps_per_s": result["sgd_steps_total"] / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--quick", action="store_true", help="small buffers, short Ape-X runs")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    plan = QUICK if args.quick else FULL
    meta = run_metadata(args.quick, plan, ("mpirl", "numpy", "torch"))
    memory = measure_memory(args.quick)
    throughput = measure_throughput(args.quick)
    scaling = {str(n): attempt(f"apex, {n} rollout rank(s)", lambda n=n: measure_apex(
        n, plan.apex_env_steps, 300.0), lambda r: f"{r['env_steps_per_s']:,.0f} env steps/s, "
        f"{r['sgd_steps_per_s']:,.0f} SGD steps/s") for n in plan.apex_rollout_ranks}
    meta["wall_s"] = time.perf_counter() - started
    report = {
        "meta": meta,
        "replay_bytes_overhead": {name: {kind: entry[kind]["ratio"]
                                         for kind in ("uniform", "prioritized")}
                                  for name, entry in memory.items()},
        "memory": memory, "throughput": throughput, "apex_scaling": scaling,
    }
    write_report(report, args.json)
    for name, ratios in report["replay_bytes_overhead"].items():
        print(f"{name}: stored / raw bytes per transition: uniform {ratios['uniform']:.3f}, "
              f"prioritized {ratios['prioritized']:.3f}")
    for kind, entry in throughput.items():
        print(f"{kind}: insert {entry['insert_rows_per_s']:,.0f} rows/s, sample "
              f"{entry['sample_transitions_per_s']:,.0f} transitions/s")
    if args.json is not None:
        print(f"wrote {args.json}")
    return 1 if any("error" in entry for entry in scaling.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
