"""Sampling throughput: environment steps per second of mpirl's rollout ranks, no training.

    python benchmarks/sampling.py --json /tmp/sampling.json [--quick]

CartPole-v1, ``NUM_ENVS`` environments per worker in a gymnasium ``SyncVectorEnv`` (same-step
autoreset), mpirl's default policy (separate 64x64 tanh actor and critic MLPs), torch with one
thread. Three programs, run one after another by this same file (``--role ROLE``; ``--quick``
runs raw and local in one process, and mpirl with 1 rollout rank only, its runs with and without
dumps one after the other in one ``mpiexec -n 2``):

* raw: the vector env and ``Policy.act`` in a tight loop in one plain process, with no mpirl
  code on the path: the ceiling.
* local: one ``RolloutWorker`` in-process (world size 1): the same loop plus what a rollout
  worker adds (trajectory columns, episode bookkeeping, GAE), without any messaging.
* mpirl: ``mpiexec -n 2`` and ``-n 3``, i.e. 1 and 2 rollout ranks. The driver calls
  ``parallel_rollouts`` over every rollout worker again and again; each worker samples
  ``ROLLOUT_FRAGMENT_LENGTH`` steps per environment and sends its batch over the data channel to
  the driver, which receives it (as the learner in the driver would) and drops it.

Each program warms up, then times ``reps`` blocks of about ``block_s`` seconds and reports the
median rate. ``efficiency`` is the per-rank rate with 1 rollout rank over the raw rate;
``efficiency_2`` the same with 2 rollout ranks (None with ``--quick``). On a machine with 2
cores, 2 rollout ranks and the driver share them, so ``efficiency_2`` also shows whatever else
runs on the machine.

``dump_efficiency``: the 1-rollout-rank rate with trajectory dumps on (``dump``: every completed
episode written to HDF5 by the rank's writer process) over the same run without them. The two
runs alternate ``DUMP_PAIRS`` times (once with ``--quick``) and the median of the pairs' ratios is
reported, so that a burst of load from elsewhere on a shared machine moves one pair, not the
figure. ``dump_inline_efficiency`` is one pair with the worker writing its file itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    attempt_role,
    emit,
    fmt,
    print_problems,
    print_table,
    ratio,
    run_metadata,
    timed_rates,
    write_report,
)

SCRIPT = Path(__file__).resolve()

#: MPIRL_SAMPLING_ENV measures another env (e.g. Pendulum-v1: 200-step episodes).
ENV_ID = os.environ.get("MPIRL_SAMPLING_ENV", "CartPole-v1")
NUM_ENVS = 32
ROLLOUT_FRAGMENT_LENGTH = 128
"""Steps per environment per sample call: 4096 env steps, long enough to amortize a dispatch."""
HIDDEN_SIZES = (64, 64)
SEED = 0
ROLLOUT_RANKS = (1, 2)
#: Alternating runs without and with trajectory dumps, for dump_efficiency.
DUMP_PAIRS = 3


@dataclass(frozen=True)
class Plan:
    """How long each program measures; ``--quick`` scales it down."""

    warmup_s: float
    block_s: float
    reps: int


FULL = Plan(warmup_s=2.0, block_s=3.0, reps=5)
QUICK = Plan(warmup_s=0.1, block_s=0.2, reps=2)


def measure_rate(step_block: Callable[[], int], plan: Plan) -> dict[str, Any]:
    """Env steps per second of ``step_block`` (which returns the steps it did): the median of
    ``reps`` timed blocks of at least ``block_s`` after ``warmup_s`` untimed."""
    rates = timed_rates(step_block, plan.warmup_s, plan.block_s, plan.reps)
    return {"steps_per_s": statistics.median(rates), "steps_per_s_per_block": rates}


def _policy_spec():
    from mpirl.models.policy import PolicySpec
    from mpirl.workers.env_spec import EnvSpec

    observation_space, action_space = EnvSpec(ENV_ID).spaces()
    return PolicySpec(observation_space, action_space, HIDDEN_SIZES)


def _rollout_settings(dump: Any = None) -> Any:
    """The settings of the measured rollout workers: PPO's GAE, no observation filter."""
    from mpirl.workers.env_spec import EnvSpec
    from mpirl.workers.rollout import RolloutSettings

    return RolloutSettings(env=EnvSpec(ENV_ID), policy=_policy_spec(), num_envs=NUM_ENVS,
                           seed=SEED, gamma=0.99, lam=0.95, dump=dump)


# The measured programs, one per --role.


def _raw_rate(plan: Plan) -> dict[str, Any]:
    import gymnasium as gym
    import torch

    from mpirl.models.torch_model import build_torch_model

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    policy = build_torch_model(_policy_spec())
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(ENV_ID) for _ in range(NUM_ENVS)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=SEED)

    def block() -> int:
        nonlocal obs
        for _ in range(ROLLOUT_FRAGMENT_LENGTH):
            actions, _, _ = policy.act(obs)
            obs, _, _, _, _ = envs.step(policy.env_actions(actions))
        return ROLLOUT_FRAGMENT_LENGTH * NUM_ENVS

    return measure_rate(block, plan)


def role_raw(plan: Plan) -> int:
    """The vector env and the policy's action sampling in a plain loop."""
    emit(_raw_rate(plan))
    return 0


def _local_rate(plan: Plan) -> dict[str, Any]:
    import mpirl
    from mpirl.workers.rollout import RolloutWorker

    result: dict[str, Any] = {}

    def body(driver: mpirl.Driver) -> int:
        worker = driver.spawn("rollout", RolloutWorker, _rollout_settings(),
                              local_if_empty=True)[0]
        result.update(measure_rate(
            lambda: worker.call("sample", ROLLOUT_FRAGMENT_LENGTH)["env_steps"], plan))
        return 0

    code = mpirl.run(body, mpirl.Layout(num_rollout_workers=1),
                     mpirl.RuntimeSettings(print_layout=False))
    if code != 0:
        raise RuntimeError(f"the local worker's run exited with code {code}")
    return result


def role_local(plan: Plan) -> int:
    """One RolloutWorker in the driver's process (world size 1), batches returned in-process."""
    emit(_local_rate(plan))
    return 0


def role_raw_and_local(plan: Plan) -> int:
    """``raw``, then ``local``, in one process: ``--quick`` starts one process fewer."""
    emit({"raw": _raw_rate(plan), "local": _local_rate(plan)})
    return 0


def role_mpirl(plan: Plan) -> int:
    """Every rank but the driver a rollout rank; the driver only collects and drops batches."""
    return _mpirl_sampling(plan, None)


def role_dump(plan: Plan) -> int:
    """``mpirl`` with trajectory dumps on: each rollout rank's writer process writes every
    completed episode to HDF5 (in a temporary directory, deleted afterwards)."""
    return _mpirl_sampling(plan, True)


def role_dump_inline(plan: Plan) -> int:
    """The same, with the HDF5 file written by the rollout worker itself (no writer process)."""
    return _mpirl_sampling(plan, False)


#: ``mpirl_and_dumps``'s measurements, in order: a ``dump_writer_process`` of each (None: no
#: dump), by the role whose result it stands for.
QUICK_DUMP_MODES = {"mpirl": None, "dump": True, "dump_inline": False}


def role_mpirl_and_dumps(plan: Plan) -> int:
    """``--quick``: ``mpirl``, ``dump`` and ``dump_inline`` one after the other in one job (the
    rollout workers of each spawned anew), their results by role: one launch, not three."""
    return _mpirl_sampling(plan, *QUICK_DUMP_MODES.values(), names=tuple(QUICK_DUMP_MODES))


def _mpirl_sampling(plan: Plan, *dump_writer_processes: bool | None,
                    names: tuple[str, ...] | None = None) -> int:
    """Emits the result of each mode in turn (a dict of them by ``names`` if given)."""
    import shutil
    import tempfile

    import mpirl
    from mpirl.data.tags import BATCH
    from mpirl.execution.operators import parallel_rollouts
    from mpirl.runtime.core import Worker
    from mpirl.workers.rollout import RolloutWorker

    class BatchSink(Worker):
        """Stands in for the learner: receives the rollout ranks' batches and drops them."""

        MESSAGES = ("drain",)

        def drain(self, sources: list[int]) -> int:
            channel = self.context.data_channel
            return sum(len(channel.recv(src, BATCH)["advantages"]) for src in sources)

    def body(driver: mpirl.Driver) -> int:
        sink = driver.spawn("learner", BatchSink, local_if_empty=True)
        results = [measure_mode(driver, sink, mode) for mode in dump_writer_processes]
        emit(results[0] if names is None else dict(zip(names, results, strict=True)))
        return 0

    def measure_mode(driver: mpirl.Driver, sink: Any, dump_writer_process: bool | None) -> dict:
        from mpirl.data.dump_writer import DumpTarget

        directory = tempfile.mkdtemp(prefix="mpirl-dump-bench-")
        dump = (None if dump_writer_process is None else
                DumpTarget(directory, 0, writer_process=dump_writer_process))
        rollouts = driver.spawn("rollout", RolloutWorker, _rollout_settings(dump))
        dumped = {"episodes": 0, "steps": 0}

        def block() -> int:
            samples = parallel_rollouts(rollouts, sink, ROLLOUT_FRAGMENT_LENGTH)
            for _, episodes in samples.dumped:
                dumped["episodes"] += len(episodes)
                dumped["steps"] += sum(steps for _, steps in episodes)
            rows = sink[0].call("drain", samples.sources.get(0, []))
            if rows != samples.env_steps:
                raise RuntimeError(f"received {rows} rows for {samples.env_steps} env steps")
            return samples.env_steps

        result = measure_rate(block, plan)
        result["rollout_ranks"] = len(rollouts)
        if dump is not None:
            for worker in rollouts:
                _, episodes = worker.call("finish_dump")
                dumped["episodes"] += len(episodes)
                dumped["steps"] += sum(steps for _, steps in episodes)
            size = sum(p.stat().st_size for p in Path(directory).iterdir())
            result.update(dumped_episodes=dumped["episodes"], dumped_steps=dumped["steps"],
                          dump_bytes=size, dump_bytes_per_step=size / max(dumped["steps"], 1))
        shutil.rmtree(directory, ignore_errors=True)
        return result

    return mpirl.run(body, mpirl.Layout(num_rollout_workers=-1),
                     mpirl.RuntimeSettings(print_layout=False))


ROLES: dict[str, Callable[[Plan], int]] = {
    "raw": role_raw, "local": role_local, "raw_and_local": role_raw_and_local,
    "mpirl": role_mpirl, "dump": role_dump, "dump_inline": role_dump_inline,
    "mpirl_and_dumps": role_mpirl_and_dumps,
}


# The orchestrator.


def describe_rate(result: dict[str, Any]) -> str:
    """One program's rate on the console."""
    return f"{result['steps_per_s']:,.0f} env steps/s"


def orchestrate(plan: Plan, quick: bool, json_path: Path | None) -> int:
    """Run every measured program in turn, write the JSON report, print a table."""
    started = time.perf_counter()
    meta = {
        **run_metadata(quick, plan, ("mpirl", "mpi4py", "torch", "gymnasium", "numpy")),
        "env": ENV_ID,
        "num_envs_per_worker": NUM_ENVS,
        "rollout_fragment_length": ROLLOUT_FRAGMENT_LENGTH,
        "env_steps_per_sample_call": NUM_ENVS * ROLLOUT_FRAGMENT_LENGTH,
        "hidden_sizes": HIDDEN_SIZES,
        "torch_threads": 1,
    }
    if quick:  # the two plain programs in one process
        both = attempt_role(SCRIPT, "raw_and_local", None, quick,
                            lambda r: f"raw {describe_rate(r['raw'])}, "
                                      f"local {describe_rate(r['local'])}")
        raw, local = (both, both) if "error" in both else (both["raw"], both["local"])
    else:
        raw = attempt_role(SCRIPT, "raw", None, quick, describe_rate)
        local = attempt_role(SCRIPT, "local", None, quick, describe_rate)
    if quick:
        # 1 rollout rank only, and the dumps' runs after it in the same job: one launch of 2
        # ranks instead of three.
        runs = attempt_role(SCRIPT, "mpirl_and_dumps", 2, quick,
                            lambda r: ", ".join(f"{name} {describe_rate(r[name])}"
                                                for name in QUICK_DUMP_MODES))
        no_dump, dump, dump_inline = (runs if "error" in runs else runs[name]
                                      for name in QUICK_DUMP_MODES)
        by_ranks, pairs = {"1": no_dump}, [(no_dump, dump)]
    else:
        by_ranks = {str(n): attempt_role(SCRIPT, "mpirl", n + 1, quick, describe_rate)
                    for n in ROLLOUT_RANKS}
        # Trajectory dumps, side by side with the same 1-rollout-rank run without them.
        pairs = []
        for _ in range(DUMP_PAIRS):
            no_dump = attempt_role(SCRIPT, "mpirl", 2, quick, describe_rate)
            pairs.append((no_dump, attempt_role(SCRIPT, "dump", 2, quick, describe_rate)))
        dump_inline = attempt_role(SCRIPT, "dump_inline", 2, quick, describe_rate)
    pair_ratios = [ratio(d.get("steps_per_s"), n.get("steps_per_s")) for n, d in pairs]
    no_dump, dump = pairs[-1]

    mpirl: dict[str, Any] = {"steps_per_s_total": {}, "steps_per_s_per_rank": {}, "runs": by_ranks}
    errors = {n: r["error"] for n, r in by_ranks.items() if "error" in r}
    for n, result in by_ranks.items():
        if "error" not in result:
            mpirl["steps_per_s_total"][n] = result["steps_per_s"]
            mpirl["steps_per_s_per_rank"][n] = result["steps_per_s"] / int(n)
    if errors:
        mpirl["error"] = " | ".join(f"{n} rollout rank(s): {e}" for n, e in errors.items())
    raw_rate = raw.get("steps_per_s")
    per_rank = mpirl["steps_per_s_per_rank"]
    report: dict[str, Any] = {
        "meta": meta,
        "raw_steps_per_s": raw_rate,
        "local_worker_steps_per_s": local.get("steps_per_s"),
        "mpirl": mpirl,
        "efficiency": ratio(per_rank.get("1"), raw_rate),
        "efficiency_2": ratio(per_rank.get("2"), raw_rate),
        "local_worker_efficiency": ratio(local.get("steps_per_s"), raw_rate),
        # Sampling rate with trajectory dumps on over the rate without, 1 rollout rank.
        "dump_efficiency": (None if None in pair_ratios else statistics.median(pair_ratios)),
        "dump_efficiency_pairs": pair_ratios,
        "dump_inline_efficiency": ratio(dump_inline.get("steps_per_s"),
                                        no_dump.get("steps_per_s")),
        "dump": {"no_dump": no_dump, "writer_process": dump, "inline": dump_inline,
                 "pairs": [{"no_dump": n, "writer_process": d} for n, d in pairs]},
        "raw": raw,
        "local": local,
    }
    meta["wall_s"] = time.perf_counter() - started

    write_report(report, json_path)
    print_summary(report)
    if json_path is not None:
        print(f"wrote {json_path}")
    # Without the raw rate there is no efficiency to report, so that is a failure too.
    dump_errors = any("error" in r for r in (*(r for pair in pairs for r in pair), dump_inline))
    return 1 if errors or raw_rate is None or "error" in local or dump_errors else 0


def print_summary(report: dict[str, Any]) -> None:
    """A small table for people; the JSON holds everything."""
    meta = report["meta"]
    mpirl = report["mpirl"]
    raw = report["raw_steps_per_s"]
    rows = [("", "env steps/s", "per rank", "vs raw")]
    rows.append(("raw loop (1 process)", fmt(raw, 0), fmt(raw, 0), fmt(1.0 if raw else None, 2)))
    local = report["local_worker_steps_per_s"]
    rows.append(("RolloutWorker in-process", fmt(local, 0), fmt(local, 0),
                 fmt(report["local_worker_efficiency"], 2)))
    for n in map(str, ROLLOUT_RANKS):
        per_rank = mpirl["steps_per_s_per_rank"].get(n)
        rows.append((f"mpirl, {n} rollout rank(s)", fmt(mpirl["steps_per_s_total"].get(n), 0),
                     fmt(per_rank, 0), fmt(ratio(per_rank, raw), 2)))
    mode = "quick" if meta["quick"] else "full"
    print(f"\nsampling benchmark ({mode}): {ENV_ID}, {NUM_ENVS} envs per worker, "
          f"{ROLLOUT_FRAGMENT_LENGTH} steps per env per call, on {meta['hostname']}, "
          f"{meta['cpu_count']} CPUs, {meta['wall_s']:.0f} s")
    print_table(rows)
    print_problems({"raw": report["raw"], "local": report["local"], "mpirl": mpirl})
    print(f"efficiency (per-rank rate / raw): 1 rank {fmt(report['efficiency'], 2)}, "
          f"2 ranks {fmt(report['efficiency_2'], 2)}")
    dump = report["dump"]["writer_process"]
    print(f"trajectory dumps (1 rollout rank, rate with / without): writer process "
          f"{fmt(report['dump_efficiency'], 2)} (median of pairs "
          f"{', '.join(fmt(r, 2) for r in report['dump_efficiency_pairs'])}), in the worker "
          f"{fmt(report['dump_inline_efficiency'], 2)}; "
          f"{fmt(dump.get('dump_bytes_per_step'), 1)} bytes per step on disk")


def main(argv: list[str] | None = None) -> int:
    """Entry point for the orchestrator and for every measured program."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--quick", action="store_true", help="short run (under a minute)")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.role is not None:
        return ROLES[args.role](plan)
    return orchestrate(plan, args.quick, args.json)


if __name__ == "__main__":
    sys.exit(main())
