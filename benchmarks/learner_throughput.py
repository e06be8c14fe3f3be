"""A learner's throughput, in samples per second through SGD, on the CPU and on a GPU, and what
copying a sample batch onto the GPU costs from pageable and from pinned host memory.

    python benchmarks/learner_throughput.py --json benchmarks/learner_throughput.json
    python benchmarks/learner_throughput.py --quick --json /tmp/learner_throughput.json

One ``Learner`` in this process (no MPI launcher: the learner communicator is COMM_SELF) trains
on the batches PPO and IMPALA give it, with CartPole's MLP and with the Nature CNN on Atari-sized
frames (uint8, 4x84x84). The batches' keys and every column but the observations come from a
real ``RolloutWorker`` on CartPole; the frames are random. A sample is one row of the batch
(an env step), counted once per epoch: ``rows * epochs / seconds`` per ``train`` call, the median
of the timed calls after one untimed. Where CUDA is available the GPU learner is measured with
each ``BatchTransfer`` mode (pageable, the learner's default, and pinned), and the copy of each
batch alone: pageable, through reused pinned buffers, and pinned afresh for each batch.

The CPU learner uses ``--cpu-threads`` torch threads (default: every core this process may use),
not the one thread that ``torch_threads`` gives a learner by default: a learner with a node's
cores to itself is the fair comparison with a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    attempt,
    fmt,
    local_context,
    print_problems,
    print_table,
    run_main,
    run_metadata,
    write_report,
)

FRAME_SHAPE = (4, 84, 84)
"""An Atari observation as ``mpirl.envs.atari`` makes it: 4 stacked 84x84 grayscale frames."""
ATARI_ACTIONS = 6
FRAGMENT = 50
"""IMPALA's fragment length (its ``rollout_fragment_length`` default)."""


@dataclass(frozen=True)
class Case:
    """One learner workload: ``rows`` env steps per ``train`` call (IMPALA: ``rows / FRAGMENT``
    fragments), ``epochs`` passes of ``minibatches`` SGD steps."""

    algo: str
    image: bool
    rows: int
    epochs: int
    minibatches: int

    def module(self) -> Any:
        """The algorithm's module (``mpirl.algorithms.ppo`` or ``.impala``)."""
        from mpirl.algorithms import impala, ppo

        return ppo if self.algo == "ppo" else impala


FULL_CASES = {
    # PPO's CartPole defaults: 10 epochs of 256-row minibatches.
    "ppo_mlp": Case("ppo", False, 4096, 10, 16),
    # IMPALA's CartPole defaults: 800 steps (16 fragments) per update, one SGD step.
    "impala_mlp": Case("impala", False, 800, 1, 1),
    # PPO on Atari as RLlib's and SB3's examples run it: 4 epochs of 256-row minibatches.
    "ppo_cnn": Case("ppo", True, 2048, 4, 8),
    # IMPALA on Atari: 500 steps (10 fragments) per update, as RLlib's IMPALA default.
    "impala_cnn": Case("impala", True, 500, 1, 1),
}
QUICK_CASES = {
    "ppo_mlp": Case("ppo", False, 512, 2, 2),
    "impala_mlp": Case("impala", False, 200, 1, 1),
    "ppo_cnn": Case("ppo", True, 32, 1, 2),
    "impala_cnn": Case("impala", True, 50, 1, 1),
}


@dataclass(frozen=True)
class Plan:
    cases: dict[str, Case]
    timed_calls: int
    copy_repeats: int
    cpu_threads: int
    devices: tuple[str, ...]


def sample_batch(case: Case, seed: int = 0) -> dict[str, Any]:
    """A batch of ``case.rows`` steps as the learner receives it (IMPALA: fragments)."""
    import numpy as np

    from mpirl.workers.env_spec import EnvSpec
    from mpirl.workers.rollout import RolloutSettings, RolloutWorker

    module = case.module()
    config = module.Config()
    spec = EnvSpec("CartPole-v1")
    trajectories = case.algo == "impala"
    num_envs, steps = ((case.rows // FRAGMENT, FRAGMENT) if trajectories
                       else (16, -(-case.rows // 16)))
    policy = module.model_spec(*spec.spaces(), config)
    worker = RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=num_envs, seed=seed, gamma=config.gamma,
        lam=getattr(config, "gae_lambda", 1.0)))
    batch = worker.sample(steps, form="fragments" if trajectories else "advantages")["batch"]
    if not trajectories:
        batch = {k: v[:case.rows] for k, v in batch.items()}
    if case.image:
        rng = np.random.default_rng(seed)
        for key in ("obs", "bootstrap_obs"):
            if key in batch:
                lead = batch[key].shape[:-1]
                batch[key] = rng.integers(0, 256, (*lead, *FRAME_SHAPE), dtype=np.uint8)
    return batch


def make_learner(case: Case, device: str, threads: int, transfer: str) -> Any:
    """A learner of ``case``'s algorithm and model on ``device``, alone in its communicator."""
    import gymnasium as gym
    import numpy as np

    from mpirl.workers.batch_transfer import BatchTransfer
    from mpirl.workers.env_spec import EnvSpec
    from mpirl.workers.learner import Learner, LearnerSettings

    module = case.module()
    config = module.Config()
    spaces = ((gym.spaces.Box(0, 255, FRAME_SHAPE, np.uint8), gym.spaces.Discrete(ATARI_ACTIONS))
              if case.image else EnvSpec("CartPole-v1").spaces())
    learner = Learner(local_context("learner", device), LearnerSettings(
        policy=module.model_spec(*spaces, config), loss=module.loss, loss_config=config,
        lr=config.lr, grad_clip=config.grad_clip, seed=0, torch_threads=threads))
    learner.transfer = BatchTransfer(device, transfer)
    return learner


def measure_training(case: Case, batch: dict[str, Any], device: str, threads: int,
                     transfer: str, timed_calls: int) -> dict[str, Any]:
    """Median seconds per ``train`` call and the samples per second it gives."""
    import torch

    learner = make_learner(case, device, threads, transfer)
    standardize = ("advantages",) if case.algo == "ppo" else ()
    rows = len(batch["logp"])  # a row of an IMPALA batch is a whole fragment

    def call() -> float:
        start = time.perf_counter()
        result = learner.train([], [batch], case.epochs, case.minibatches,
                               standardize=standardize)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        assert result["learner_samples"] == rows, result
        return seconds

    call()  # untimed: CUDA's kernels load and cuDNN picks its algorithms on the first
    times = [call() for _ in range(timed_calls)]
    seconds = statistics.median(times)
    return {"seconds_per_call": seconds, "samples_per_s": case.rows * case.epochs / seconds,
            "sgd_steps_per_s": case.epochs * case.minibatches / seconds,
            "seconds_per_call_each": times, "transfer": learner.transfer.mode,
            "pinned_mb": learner.transfer.pinned_bytes() / 2**20}


def measure_copies(batch: dict[str, Any], device: str, repeats: int) -> dict[str, Any]:
    """The host-to-device copy of ``batch`` alone, each way: median ms and GB/s."""
    import torch

    from mpirl.workers.batch_transfer import BatchTransfer

    nbytes = sum(v.nbytes for v in batch.values())
    ways = {
        "pageable": BatchTransfer(device, "pageable"),
        "pinned_reused": BatchTransfer(device, "pinned"),
        "pinned_fresh": lambda b: {k: torch.from_numpy(v).pin_memory().to(device,
                                                                            non_blocking=True)
                                   for k, v in b.items()},
    }
    result: dict[str, Any] = {"batch_mb": nbytes / 2**20}
    for name, copy in ways.items():
        copy(batch)  # untimed: buffers pinned, the copy engine warm
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            copy(batch)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        result[name] = {"ms": seconds * 1e3, "gb_per_s": nbytes / seconds / 1e9}
    return result


def measure_case(name: str, case: Case, plan: Plan) -> dict[str, Any]:
    """``case`` on each of the plan's devices (a GPU with each transfer mode), and its copy."""
    batch = sample_batch(case)
    entry: dict[str, Any] = {"case": case.__dict__,
                             "batch_mb": sum(v.nbytes for v in batch.values()) / 2**20}
    for device in plan.devices:
        modes = ("pageable",) if device == "cpu" else ("pageable", "pinned")
        for mode in modes:
            key = "cpu" if device == "cpu" else f"gpu_{mode}"
            threads = plan.cpu_threads if device == "cpu" else 1
            entry[key] = attempt(
                f"{name} on {device} ({mode} batches)",
                lambda d=device, m=mode, t=threads: measure_training(
                    case, batch, d, t, m, plan.timed_calls),
                lambda r: f"{r['samples_per_s']:,.0f} samples/s, "
                          f"{r['seconds_per_call'] * 1e3:.1f} ms per call")
        if device != "cpu":
            entry["copy"] = attempt(
                f"{name}: copying its {entry['batch_mb']:.1f} MB batch to {device}",
                lambda d=device: measure_copies(batch, d, plan.copy_repeats),
                lambda r: ", ".join(f"{w} {r[w]['gb_per_s']:.1f} GB/s"
                                    for w in ("pageable", "pinned_reused", "pinned_fresh")))
    pageable = entry.get("gpu_pageable", {}).get("samples_per_s")  # the learner's default
    pinned = entry.get("gpu_pinned", {}).get("samples_per_s")
    cpu_rate = entry.get("cpu", {}).get("samples_per_s")
    if pageable and cpu_rate:
        entry["gpu_over_cpu"] = pageable / cpu_rate
    if pinned and pageable:
        entry["pinned_over_pageable"] = pinned / pageable
    return entry


def cuda_device() -> tuple[str | None, str]:
    """``("cuda:0", its name)`` where CUDA works, else ``(None, why not)``."""
    import torch

    if not torch.cuda.is_available():
        return None, f"no CUDA device (torch {torch.__version__}, built for CUDA " \
                     f"{torch.version.cuda or 'none'})"
    return "cuda:0", torch.cuda.get_device_name(0)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batches, two timed calls")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--cpu-threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads of the CPU learner (default: the usable cores)")
    parser.add_argument("--no-cpu", action="store_true",
                        help="measure the GPU learner only (where the CPU one is known)")
    args = parser.parse_args()
    if args.cpu_threads < 1:
        parser.error(f"--cpu-threads must be at least 1, got {args.cpu_threads}")
    import torch

    cuda, gpu = cuda_device()
    print(f"GPU: {gpu}" if cuda else f"GPU: none, {gpu}: the CPU learner only", flush=True)
    devices = (() if args.no_cpu else ("cpu",)) + ((cuda,) if cuda else ())
    if not devices:
        print("error: --no-cpu with no GPU leaves nothing to measure", file=sys.stderr)
        return 1
    plan = Plan(QUICK_CASES if args.quick else FULL_CASES, 2 if args.quick else 5,
                5 if args.quick else 20, args.cpu_threads, devices)
    cases = {name: measure_case(name, case, plan) for name, case in plan.cases.items()}
    print_problems({f"{name} {key}": value for name, entry in cases.items()
                    for key, value in entry.items() if isinstance(value, dict)
                    and "error" in value})
    rows = [("case", "batch MB", f"CPU ({plan.cpu_threads} thr)", "GPU", "GPU/CPU",
             "GPU pinned", "copy pageable GB/s", "copy pinned GB/s")]
    for name, entry in cases.items():
        copy = entry.get("copy", {})
        rows.append((name, fmt(entry["batch_mb"], 1),
                     fmt(entry.get("cpu", {}).get("samples_per_s"), 0),
                     fmt(entry.get("gpu_pageable", {}).get("samples_per_s"), 0),
                     fmt(entry.get("gpu_over_cpu"), 1),
                     fmt(entry.get("gpu_pinned", {}).get("samples_per_s"), 0),
                     fmt(copy.get("pageable", {}).get("gb_per_s"), 1),
                     fmt(copy.get("pinned_reused", {}).get("gb_per_s"), 1)))
    print("learner samples per second through SGD:")
    print_table(rows)
    meta = run_metadata(args.quick, plan, ("torch", "numpy", "mpi4py"))
    meta["gpu"] = gpu if cuda else None
    meta["cuda"] = torch.version.cuda
    write_report({**meta, "cases": cases}, args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
