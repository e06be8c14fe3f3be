"""One algorithm trained for a while through the Python API, inspecting what every rank holds.

Run under ``mpiexec -n K``: ``python long_run.py ALGO --config JSON --warmup-s W --run-iterations
N``. Rank 0 trains for ``W`` seconds, inspects every rank (the unfinished sends of its data
channel, and its resident memory), trains ``N`` iterations more (or ``--run-s S`` seconds) and
inspects again, then prints
``RESULT {json}`` with both inspections, the iterations run and the memory columns of the last
progress row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mpirl.config.parse import build
from mpirl.execution.contract import load_algorithm
from mpirl.execution.trainer import Trainer
from mpirl.runtime.driver import RuntimeSettings, run
from mpirl.runtime.layout import WORKER_ROLES, Layout
from mpirl.testing import RankInspector
from mpirl.workers.env_spec import EnvSpec


def inspect(driver, inspectors) -> dict[str, list[int]]:
    """Pending data-channel sends and RSS (MiB) per rank, rank 0 first."""
    here = RankInspector(driver.context)  # rank 0 asks itself what the workers are asked
    pending = [here.pending_sends()]
    rss = [here.rss_bytes() >> 20]
    for group in inspectors:
        pending += group.call("pending_sends")
        rss += [value >> 20 for value in group.call("rss_bytes")]
    return {"pending_sends": pending, "rss_mb": rss}


def main(driver, args) -> int:
    module = load_algorithm(args.algo)
    config = build(module.Config, json.loads(args.config))
    trainer = Trainer(driver, module, config, EnvSpec(args.env))
    inspectors = [driver.spawn(role, RankInspector) for role in WORKER_ROLES
                  if driver.placement.count(role)]
    row, iterations = {}, []
    deadline = time.monotonic() + args.warmup_s
    while time.monotonic() < deadline:
        row = trainer.train()
    iterations.append(trainer.iteration)
    first = inspect(driver, inspectors)
    # A count of iterations, not seconds, when given: a slow machine then measures the same work.
    deadline = time.monotonic() + args.run_s
    while (trainer.iteration < iterations[0] + args.run_iterations if args.run_iterations
           else time.monotonic() < deadline):
        row = trainer.train()
    iterations.append(trainer.iteration)
    last = inspect(driver, inspectors)
    print("RESULT " + json.dumps({
        "iterations": iterations, "first": first, "last": last,
        "memory": {k: v for k, v in row.items() if k.startswith("perf/")}}), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("algo")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--config", default="{}")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--run-s", type=float, default=20.0)
    parser.add_argument("--run-iterations", type=int, default=0,
                        help="train this many iterations after the warm-up instead of --run-s")
    arguments = parser.parse_args()
    layout_config = json.loads(arguments.config)
    layout = Layout(num_rollout_workers=layout_config.get("num_rollout_workers", -1),
                    num_learners=layout_config.get("num_learners", 0))
    sys.exit(run(lambda driver: main(driver, arguments), layout,
                 RuntimeSettings(print_layout=False)))
