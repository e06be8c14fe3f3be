"""The Kuramoto-Sivashinsky showcase: PPO learns to hold the chaotic KS equation at its steady
solution E2 (Bucci et al. 2019's control problem: L = 22, 4 Gaussian actuators, 8 sensors),
against doing nothing and the best proportional controller of a small grid of gains.

    python benchmarks/kuramoto_sivashinsky.py --json benchmarks/kuramoto_sivashinsky.json
    python benchmarks/kuramoto_sivashinsky.py --quick --json /tmp/ks.json   # every key, cheaply

Each training seed runs ``mpirl train --algo PPO --env mpirl/KuramotoSivashinsky-v0 --config
@examples/tuned/ppo_kuramoto_sivashinsky.json --seed S`` in local mode (one process, 8 envs) for
``steps`` env steps, then ``mpirl evaluate``'s code plays its final policy (the most likely
action) on the evaluation episodes: seeds 10,000 and up, each a start on the chaotic attractor
that no training episode had. The baselines play the same episodes in this process: no
action, and the proportional controller a_i = -gain (u - E2) at actuator i's sensor, the best
of ``GAINS`` on those very episodes (which favours it).

Returns are in the tuned config's units (``reward_scale`` 0.01 of Bucci et al.'s -||u - E2||
over the 64 grid values, 400 steps of 0.25 time units); ``mean_distance`` is ||u - E2|| averaged
over an episode's steps (-return / (reward_scale x length); no episode here ends early), so 0 is
the target held from the first step; ``held_distance`` the same over the last quarter of each
episode (the last 25 time units), once the start's transient is over (for PPO's policy: played
again on ``LastQuarter``, the env whose reward counts there only, with the env's defaults: the
tuned config's episodes but for ``reward_scale``; ``--quick`` trains on shorter ones).
``gap_closed`` is how far PPO's mean return goes from doing nothing (0) towards holding the
target exactly (1, return 0); ``vs_proportional`` the same from doing nothing to the
proportional controller.

``$MPIRL_MAX_GAMES``, which caps the games of every board-game evaluation, caps the evaluation
episodes here too (the baselines' and PPO's alike), as ``$MPIRL_MAX_ITERATIONS`` caps the
training runs: the docs' command runs as written, in seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import attempt, fmt, print_table, run_main, run_metadata, run_process, write_report

from mpirl.commands.match import MAX_GAMES_ENV, max_games_from_env
from mpirl.envs.kuramoto_sivashinsky import DEFAULTS, KuramotoSivashinsky

ROOT = Path(__file__).resolve().parent.parent
TUNED = ROOT / "examples" / "tuned" / "ppo_kuramoto_sivashinsky.json"
ENV_ID = "mpirl/KuramotoSivashinsky-v0"
GAINS = (0.5, 1.0, 2.0, 4.0, 8.0)
EVAL_SEED = 10_000


@dataclass
class Plan:
    seeds: tuple[int, ...]
    steps: int
    eval_episodes: int
    gains: tuple[float, ...]
    overrides: dict  # config keys on top of the tuned file (--quick: short episodes)


FULL = dict(steps=400_000, eval_episodes=20, gains=GAINS, overrides={})
# Episodes of 40 steps and one 320-step iteration: every key, in a few CPU-seconds.
QUICK = dict(steps=320, eval_episodes=2, gains=(2.0, 4.0),
             overrides={"rollout_fragment_length": 40, "env_config": {"max_steps": 40}})


class LastQuarter(KuramotoSivashinsky):
    """The env whose reward counts over the last quarter of an episode only: evaluating a
    policy on it gives the distance it holds the state at once the transient is over."""

    def step(self, action: Any) -> tuple[Any, float, bool, bool] | None:
        out = super().step(action)
        if out is None:
            return None
        obs, reward, terminated, truncated = out
        steps = self.config["max_steps"]
        return obs, (reward if self.t > steps - steps // 4 else 0.0), terminated, truncated


def tuned_config(plan: Plan) -> dict[str, Any]:
    config = json.loads(TUNED.read_text())
    env_config = {**config.get("env_config", {}), **plan.overrides.get("env_config", {})}
    return {**config, **plan.overrides, "env_config": env_config}


def summarize(returns: list[float], lengths: list[int], held: list[float], scale: float
              ) -> dict[str, Any]:
    """Returns and lengths of the evaluation episodes, and the mean distance over the last
    quarter of each."""
    distances = [-r / (scale * n) for r, n in zip(returns, lengths, strict=True)]
    return {"return_mean": sum(returns) / len(returns), "returns": returns, "lengths": lengths,
            "mean_distance": sum(distances) / len(distances),
            "held_distance": sum(held) / len(held)}


def baselines(plan: Plan, env_config: dict[str, Any]) -> dict[str, Any]:
    """No action and the best proportional controller on the evaluation episodes."""
    import numpy as np
    from mpi4py import MPI

    from mpirl.envs.kuramoto_sivashinsky import ProportionalController

    seeds = range(EVAL_SEED, EVAL_SEED + plan.eval_episodes)
    scale = env_config.get("reward_scale", 1.0)

    def play(policy: Any) -> dict[str, Any]:
        env = KuramotoSivashinsky(MPI.COMM_SELF, **env_config)
        tail = env.config["max_steps"] - env.config["max_steps"] // 4  # LastQuarter's start
        returns, lengths, last_quarter = [], [], []
        for seed in seeds:
            obs, rewards, done = env.reset(seed), [], False
            while not done:
                obs, reward, terminated, truncated = env.step(policy(obs))
                rewards.append(reward)
                done = terminated or truncated
            returns.append(sum(rewards))
            lengths.append(len(rewards))
            last_quarter.append(-sum(rewards[tail:]) / (scale * len(rewards[tail:])))
        return summarize(returns, lengths, last_quarter, scale)

    zero = play(lambda obs: np.zeros(4))
    by_gain = {str(g): play(ProportionalController(g, **env_config)) for g in plan.gains}
    best = max(by_gain, key=lambda g: by_gain[g]["return_mean"])
    return {"zero_action": zero,
            "proportional": {"gain": float(best), **by_gain[best],
                             "return_by_gain": {g: r["return_mean"]
                                                for g, r in by_gain.items()}}}


def train_and_evaluate(plan: Plan, config: dict[str, Any], seed: int, where: Path
                       ) -> dict[str, Any]:
    """One PPO run in local mode and its final policy on the evaluation episodes."""
    from mpirl.commands.evaluate import evaluate

    run_dir = where / f"seed{seed}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    train = run_process(
        [sys.executable, "-m", "mpirl", "train", "--algo", "PPO", "--env", ENV_ID,
         "--config", json.dumps(config), "--seed", str(seed), "--run-dir", str(run_dir),
         "--progress", "off", "--stop", json.dumps({"timesteps_total": plan.steps})],
        f"PPO seed {seed}", timeout_s=max(300.0, plan.steps / 100))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads((run_dir / "result.json").read_text())
    # What `mpirl evaluate RUN_DIR --episodes E --seed 10000` plays, with every episode's return.
    played = evaluate(run_dir, plan.eval_episodes, seed=EVAL_SEED)
    # An env named to evaluate gets its defaults (reward_scale 1, 400 steps): the tuned
    # config's episodes, whose one env_config key is reward_scale.
    last_quarter = evaluate(run_dir, plan.eval_episodes, seed=EVAL_SEED,
                            env_id=f"{Path(__file__).stem}:LastQuarter")
    quarter = DEFAULTS["max_steps"] // 4
    scale = config["env_config"].get("reward_scale", 1.0)
    return {"train_wall_s": train.wall_s,
            "train_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "timesteps_total": result["timesteps_total"],
            "train_return_mean_last": result["episode_return_mean"],
            **summarize(played.returns, played.lengths,
                        [-r / quarter for r in last_quarter.returns], scale)}


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="40-step episodes, one short training iteration, 2 evaluation "
                             "episodes: every key, cheaply")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--seeds", default="0,1,2",
                        help="training seeds, comma-separated (default 0,1,2)")
    parser.add_argument("--steps", type=int, help="env steps per training run (default 400,000; "
                                                  "--quick 320)")
    args = parser.parse_args()
    try:
        seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    except ValueError:
        parser.error(f"--seeds takes whole numbers separated by commas, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds needs at least one seed")
    plan = Plan(seeds=seeds, **(QUICK if args.quick else FULL))
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be at least 1, got {args.steps}")
        plan.steps = args.steps
    cap = max_games_from_env()
    if cap is not None and cap < plan.eval_episodes:
        print(f"{MAX_GAMES_ENV}={cap}: {cap} evaluation episodes, whatever the plan says")
        plan.eval_episodes = cap
    config = tuned_config(plan)
    env_config = config["env_config"]
    base = attempt("baselines (no action, proportional controllers)",
                   lambda: baselines(plan, env_config),
                   lambda r: f"no action {r['zero_action']['return_mean']:.2f}, proportional "
                             f"(gain {r['proportional']['gain']:g}) "
                             f"{r['proportional']['return_mean']:.2f}")
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ks-bench-") as where:
        for seed in seeds:
            runs[str(seed)] = attempt(
                f"PPO seed {seed}, {plan.steps:,} steps",
                lambda seed=seed: train_and_evaluate(plan, config, seed, Path(where)),
                lambda r: f"evaluation return {r['return_mean']:.2f} (mean distance "
                          f"{r['mean_distance']:.3f}), {r['train_cpu_s']:.0f} CPU-s")
    done = [r for r in runs.values() if "error" not in r]
    ppo_mean = sum(r["return_mean"] for r in done) / len(done) if done else None
    zero = base.get("zero_action", {}).get("return_mean")
    proportional = base.get("proportional", {}).get("return_mean")
    gap_closed = (1 - ppo_mean / zero) if ppo_mean is not None and zero else None
    vs_proportional = ((ppo_mean - zero) / (proportional - zero)
                       if None not in (ppo_mean, zero, proportional) and proportional != zero
                       else None)
    rows = [["policy", "return", "mean ||u - E2||", "last quarter"]]
    named = [(f"PPO seed {s}", r) for s, r in runs.items()]
    if "error" not in base:
        named = [("no action", base["zero_action"]),
                 (f"proportional, gain {base['proportional']['gain']:g}",
                  base["proportional"])] + named
    rows += [[name, fmt(r.get("return_mean"), 2), fmt(r.get("mean_distance"), 3),
              fmt(r.get("held_distance"), 3)] for name, r in named]
    print(f"{plan.eval_episodes} evaluation episodes (seeds {EVAL_SEED}-"
          f"{EVAL_SEED + plan.eval_episodes - 1}):")
    print_table(rows)
    report = {
        "meta": run_metadata(args.quick, plan, ("mpi4py", "numpy", "torch")),
        "config": config,
        "baselines": base,
        "ppo": runs,
        "ppo_return_mean": ppo_mean,
        "gap_closed": gap_closed,
        "vs_proportional": vs_proportional,
    }
    write_report(report, args.json)
    failed = "error" in base or len(done) < len(runs)
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
