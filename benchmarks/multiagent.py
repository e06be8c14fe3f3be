"""Multi-agent runs: 2-agent CartPole against RLlib, and MPE's simple_spread against a random
policy.

    python benchmarks/multiagent.py --json /tmp/multiagent.json [--seeds N] [--peers mpirl,rllib]
    python benchmarks/multiagent.py --spread --json /tmp/spread.json [--steps 2000000]
    (--quick: shorter budgets and lower targets, to check the script)

``--cartpole`` (the default): two independent CartPole-v1 copies, one policy each (PPO). A run has
solved it when the mean over the last ``WINDOW`` episodes of the episode return (the sum of both
agents' returns) reaches ``TARGET`` (450 each); each run is a whole process timed from launch to
exit, one after another, mpirl and RLlib alternating per seed.

* mpirl: ``mpiexec -n 3 mpirl train --algo PPO --env mpirl.envs.examples:MultiAgentCartPole``
  with one policy per cart and its default PPO settings (2 rollout ranks of 8 envs, the learners
  in the driver).
* RLlib 2.60 (new API stack): ``PPOConfig`` with 2 env runners on RLlib's own
  ``MultiAgentCartPole`` (``make_multi_agent("CartPole-v1")``), one module per agent as in its
  ``multi_agent_cartpole.py`` example, and the training settings of its CartPole PPO example.

Sampling throughput is agent steps per second per rollout rank (env runner) while training:
mpirl's from progress.csv (the policies' agent steps over the run's time), RLlib's from its
lifetime agent-step counter over the training time.

``--spread``: MPE ``simple_spread_v3`` (3 agents, 25 cycles), one PPO policy shared by all agents,
for ``--steps`` env steps; its curve (100-episode mean return against env steps) and final return
against a random policy's return played in the same harness (a scripted policy that samples the
action space, run the same way). Papers' thresholds come from 10M+ steps; this reports the
improvement.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness import (
    PROGRESS_PREFIX,
    BenchError,
    add_peers_option,
    attempt,
    emit,
    fmt,
    mpiexec_command,
    not_installed,
    print_table,
    ratio,
    run_main,
    run_metadata,
    run_process,
    run_role,
    skipped,
    write_report,
)

SCRIPT = Path(__file__).resolve()
MPIRL = str(Path(sys.executable).parent / "mpirl")
PEERS = ("mpirl", "rllib")

CARTPOLES = "mpirl.envs.examples:MultiAgentCartPole"
TARGET = 900.0
QUICK_TARGET = 100.0
"""With --quick: 50 per cart, above a random policy's 22 (the sum of both about 44)."""
STEP_CAP = 400_000
WINDOW = 20
MPIRL_RANKS = 3
MPIRL_CONFIG = {"metrics_window": WINDOW, "multiagent": {
    "policies": {"p0": {}, "p1": {}}, "policy_mapping": {"cart_0": "p0", "cart_1": "p1"}}}
RLLIB_ENV_RUNNERS = 2
# RLlib's CartPole PPO example (as benchmarks/learning.py), for each of the two modules.
RLLIB_TRAINING = {"lr": 3e-4, "num_epochs": 6, "vf_loss_coeff": 0.01}
RLLIB_MODEL = {"fcnet_hiddens": [32], "fcnet_activation": "linear", "vf_share_layers": True}

SPREAD = "mpe2.simple_spread_v3"
SPREAD_STEPS = 2_000_000
SPREAD_RANKS = 3
RANDOM_EPISODES = 200


@dataclass
class Plan:
    seeds: int
    steps: int
    spread: bool


class RandomPolicy:
    """Samples its action space: the baseline ``--spread`` compares with."""

    def __init__(self, observation_space: Any, action_space: Any, config: dict) -> None:
        self.space = action_space
        self.space.seed(config.get("seed", 0))

    def compute_actions(self, obs: np.ndarray) -> np.ndarray:
        return np.array([self.space.sample() for _ in range(len(obs))])


# --cartpole


def run_mpirl(seed: int, target: float, step_cap: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        finished = run_process(
            mpiexec_command(MPIRL_RANKS, MPIRL, "train", "--algo", "PPO", "--env", CARTPOLES,
                            "--run-dir", str(run_dir), "--progress", "off", "--seed", str(seed),
                            "--config", json.dumps(MPIRL_CONFIG), "--stop",
                            json.dumps({"episode_return_mean": target,
                                        "timesteps_total": step_cap})),
            f"mpirl seed {seed}", 1800)
        rows = _rows(run_dir)
    last = rows[-1]
    agent_steps = sum(float(last[f"agent_steps_total/{p}"]) for p in ("p0", "p1"))
    return {"wall_s": finished.wall_s, "env_steps": int(last["timesteps_total"]),
            "episode_return_mean": float(last["episode_return_mean"]),
            "reached": float(last["episode_return_mean"]) >= target,
            "agent_steps_per_s_per_rollout": agent_steps / float(last["time_total_s"])
            / (MPIRL_RANKS - 1)}


def role_rllib(seed: int, target: float, step_cap: int) -> int:
    started = time.perf_counter()
    try:
        import ray
        from ray.rllib.algorithms.ppo import PPOConfig
        from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
        from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
        from ray.tune.registry import register_env
    except ImportError as error:
        return not_installed("RLlib", error)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        register_env("two_cartpoles", lambda _: MultiAgentCartPole(config={"num_agents": 2}))
        config = (PPOConfig().environment("two_cartpoles")
                  .env_runners(num_env_runners=RLLIB_ENV_RUNNERS)
                  .multi_agent(policies={"p0", "p1"},
                               policy_mapping_fn=lambda agent, *args, **kw: f"p{agent}")
                  .training(**RLLIB_TRAINING)
                  .rl_module(model_config=DefaultModelConfig(**RLLIB_MODEL))
                  .reporting(metrics_num_episodes_for_smoothing=WINDOW)
                  .debugging(seed=seed))
        algo = config.build_algo()
        built = time.perf_counter()
        mean_return, steps, agent_steps, iterations = math.nan, 0, 0, 0
        while True:
            result = algo.train()
            iterations += 1
            runners = result.get("env_runners", {})
            mean_return = float(runners.get("episode_return_mean", math.nan))
            steps = int(result.get("num_env_steps_sampled_lifetime")
                        or runners.get("num_env_steps_sampled_lifetime", 0))
            agent_steps = _count(result.get("num_agent_steps_sampled_lifetime")
                                 or runners.get("num_agent_steps_sampled_lifetime", 0))
            print(f"{PROGRESS_PREFIX}rllib iteration {iterations}: {steps} env steps, return "
                  f"{mean_return:.1f}", file=sys.stderr, flush=True)
            if mean_return >= target or steps >= step_cap:
                break
        trained = time.perf_counter()
        algo.stop()
        emit({"env_steps": steps, "episode_return_mean": mean_return,
              "reached": mean_return >= target, "startup_s": built - started,
              "train_s": trained - built,
              "agent_steps_per_s_per_rollout": agent_steps / (trained - built)
              / RLLIB_ENV_RUNNERS})
    finally:
        ray.shutdown()
    return 0


def _count(value: Any) -> int:
    """RLlib's agent-step counter: a number, or (2.60) a dict of counts per agent."""
    if isinstance(value, dict):
        return int(sum(_count(v) for v in value.values()))
    return int(value or 0)


def cartpole(args: argparse.Namespace) -> dict[str, Any]:
    target = QUICK_TARGET if args.quick else TARGET
    step_cap = 100_000 if args.quick else STEP_CAP
    runs: dict[str, list[dict[str, Any]]] = {peer: [] for peer in PEERS}
    for seed in range(args.seeds):
        runs["mpirl"].append(attempt(f"mpirl seed {seed}",
                                     lambda s=seed: run_mpirl(s, target, step_cap), _describe))
        if "rllib" in args.peers:
            runs["rllib"].append(attempt(
                f"rllib seed {seed}",
                lambda s=seed: {**(r := run_role(SCRIPT, "rllib", False,
                                                 [str(s), str(target), str(step_cap)],
                                                 timeout_s=1800)).result,
                                "wall_s": r.wall_s}, _describe))
    summary = {}
    for peer, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            summary[peer] = skipped() if peer not in args.peers else {"error": "no run"}
            continue
        summary[peer] = {
            "reached": sum(r["reached"] for r in ok), "runs": len(results),
            "wall_s_median": statistics.median(r["wall_s"] for r in ok),
            "env_steps_median": statistics.median(r["env_steps"] for r in ok),
            "agent_steps_per_s_per_rollout_median": statistics.median(
                r["agent_steps_per_s_per_rollout"] for r in ok)}
    if "wall_s_median" in summary.get("rllib", {}):
        summary["time_to_target_rllib_over_mpirl"] = ratio(
            summary["rllib"]["wall_s_median"], summary["mpirl"]["wall_s_median"])
        summary["sampling_mpirl_over_rllib"] = ratio(
            summary["mpirl"]["agent_steps_per_s_per_rollout_median"],
            summary["rllib"]["agent_steps_per_s_per_rollout_median"])
    print_table([["peer", "reached", "wall s (median)", "env steps", "agent steps/s/rollout"]]
                + [[peer, f"{s.get('reached', '-')}/{s.get('runs', '-')}",
                    fmt(s.get("wall_s_median"), 1), fmt(s.get("env_steps_median"), 0),
                    fmt(s.get("agent_steps_per_s_per_rollout_median"), 0)]
                   for peer, s in summary.items() if isinstance(s, dict) and "runs" in s])
    return {"runs": runs, "summary": summary, "target": target, "step_cap": step_cap}


def _describe(result: dict[str, Any]) -> str:
    return (f"{result['wall_s']:.1f} s, {result['env_steps']} env steps, return "
            f"{result['episode_return_mean']:.1f}, {result['agent_steps_per_s_per_rollout']:,.0f}"
            f" agent steps/s per rollout rank")


# --spread


def run_spread(policy: dict[str, Any], steps: int, seed: int, extra: dict[str, Any]
               ) -> list[dict[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        config = {"multiagent": {"policies": {"shared": policy}, "policy_mapping": {"*": "shared"}},
                  **extra}
        run_process(
            mpiexec_command(SPREAD_RANKS, MPIRL, "train", "--algo", "PPO", "--env", SPREAD,
                            "--run-dir", str(run_dir), "--progress", "off", "--seed", str(seed),
                            "--config", json.dumps(config),
                            "--stop", json.dumps({"timesteps_total": steps})),
            "simple_spread", 7200, extra_env={"PYTHONPATH": str(SCRIPT.parent)})
        return _rows(run_dir)


def spread(args: argparse.Namespace) -> dict[str, Any]:
    steps = 100_000 if args.quick else args.steps

    def measure() -> dict[str, Any]:
        random_rows = run_spread({"policy_class": "multiagent:RandomPolicy"}, 20_000, 0,
                                 {"metrics_window": RANDOM_EPISODES})
        trained = run_spread({}, steps, 0, {})
        every = max(1, len(trained) // 40)
        curve = [(int(r["timesteps_total"]), round(float(r["episode_return_mean"]), 2))
                 for r in trained[::every]] + [(int(trained[-1]["timesteps_total"]),
                                                round(float(trained[-1]["episode_return_mean"]),
                                                      2))]
        return {"random_return": float(random_rows[-1]["episode_return_mean"]),
                "first_return": float(trained[0]["episode_return_mean"]),
                "final_return": float(trained[-1]["episode_return_mean"]),
                "env_steps": int(trained[-1]["timesteps_total"]),
                "time_s": float(trained[-1]["time_total_s"]), "curve": curve}

    result = attempt(f"simple_spread_v3, shared PPO, {steps} env steps", measure)
    if "error" not in result:
        result["improvement_over_random"] = result["final_return"] - result["random_return"]
        print_table([["what", "value"],
                     ["random policy: mean return", f"{result['random_return']:.1f}"],
                     ["PPO, first iteration", f"{result['first_return']:.1f}"],
                     [f"PPO after {result['env_steps']:,} env steps",
                      f"{result['final_return']:.1f}"],
                     ["improvement over random", f"{result['improvement_over_random']:.1f}"],
                     ["training time, s", f"{result['time_s']:.0f}"]])
    return result


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "progress.csv") as file:
        rows = list(csv.DictReader(file))
    if not rows:
        raise BenchError(f"{run_dir}: no progress rows")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--role", choices=["rllib"])
    parser.add_argument("role_args", nargs="*")
    parser.add_argument("--spread", action="store_true")
    parser.add_argument("--steps", type=int, default=SPREAD_STEPS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    add_peers_option(parser, PEERS)
    args = parser.parse_args()
    if args.role == "rllib":
        seed, target, cap = args.role_args
        return role_rllib(int(seed), float(target), int(cap))
    plan = Plan(args.seeds, args.steps, args.spread)
    report = {"meta": run_metadata(args.quick, plan, ["torch", "ray", "pettingzoo", "mpe2"])}
    report |= {"spread": spread(args)} if args.spread else {"cartpole": cartpole(args)}
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
