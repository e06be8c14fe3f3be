"""What the dump writer costs, and what a kill -9 of it leaves: the writer's CPU per CartPole-sized
episode through ``EpisodeFile`` (batches of 95 episodes, about a 50 ms block at 1,900 episodes/s),
and how many of ``kills`` writers killed mid-batch leave a file that ``open_dataset`` cannot read.
Half the kills land anywhere in a batch, half within a millisecond of HDF5's close starting.

    python benchmarks/dump_writer.py --json /tmp/dump_writer.json
    PYTHONPATH=/tmp/old python benchmarks/dump_writer.py     # another checkout's writer, A/B

Each CPU figure is one process's ``process_time`` over 59 batches after a warm-up batch; the
report gives the median and the minimum of ``repeats`` processes (a shared VM's steal time
inflates the median, never the minimum).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BATCH = 95
BATCHES = 60


def _episodes(rng: Any, start: int, count: int) -> list[tuple[int, dict]]:
    import numpy as np

    out = []
    for k in range(start, start + count):
        steps = int(rng.integers(10, 35))
        out.append((k, {"observations": rng.standard_normal((steps + 1, 4)).astype(np.float32),
                        "actions": rng.integers(0, 2, steps), "rewards": np.ones(steps),
                        "terminations": np.arange(steps) == steps - 1,
                        "truncations": np.zeros(steps, bool),
                        "action_logp": np.full(steps, -0.69, np.float32), "seed": None}))
    return out


def _attrs() -> dict[str, Any]:
    import gymnasium as gym

    from mpirl.data.dump_format import FORMAT_ATTR, serialize_space

    return {FORMAT_ATTR: 1, "env_id": "CartPole-v1",
            "observation_space": serialize_space(gym.spaces.Box(-1e6, 1e6, (4,))),
            "action_space": serialize_space(gym.spaces.Discrete(2))}


def role_cpu(directory: Path) -> None:
    """One process: print the writer's CPU µs per episode."""
    import numpy as np

    from mpirl.data.episode_file import EpisodeFile

    rng = np.random.default_rng(0)
    batches = [_episodes(rng, b * BATCH, BATCH) for b in range(BATCHES)]
    file = EpisodeFile(directory / f"cpu-{os.getpid()}.hdf5", _attrs(), 1, 4096)
    file.write(batches[0])
    start = time.process_time()
    for batch in batches[1:]:
        file.write(batch)
    print((time.process_time() - start) / ((BATCHES - 1) * BATCH) * 1e6)


def _this_trees_testing() -> Any:
    """``mpirl/testing.py`` of the tree this script is in, whichever mpirl ``PYTHONPATH``
    points at: an older checkout's writer is measured with this tree's kill helper."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "mpirl_testing_of_this_tree", Path(__file__).resolve().parents[1] / "mpirl" / "testing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kills(directory: Path, count: int) -> dict[str, int]:
    """Kill ``count`` busy writers; count the files that read back and those that do not."""
    import numpy as np

    from mpirl.data.reader import DatasetError, open_dataset

    kill_a_busy_dump_writer = _this_trees_testing().kill_a_busy_dump_writer
    rng, episodes = random.Random(), np.random.default_rng(0)
    attrs = _attrs()
    outcome = {"readable": 0, "unreadable": 0}
    for trial in range(count):
        path = directory / f"rollout-s0-w{trial}.hdf5"
        kill_a_busy_dump_writer(path, attrs, lambda k: _episodes(episodes, k, 10),
                                near_close=trial % 2 == 0, rng=rng)
        try:
            with open_dataset(path) as dataset:
                for _ in dataset.iterate_episodes():
                    pass
            outcome["readable"] += 1
        except DatasetError:
            outcome["unreadable"] += 1
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--repeats", type=int, default=7, help="CPU measurements (processes)")
    parser.add_argument("--kills", type=int, default=100, help="writers killed")
    parser.add_argument("--role", choices=["cpu"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mpirl-dump-writer-") as tmp:
        directory = Path(tmp)
        if args.role == "cpu":
            role_cpu(directory)
            return 0
        import mpirl.data.episode_file as episode_file

        cpu = [float(subprocess.run([sys.executable, __file__, "--role", "cpu"], check=True,
                                    capture_output=True, text=True).stdout)
               for _ in range(args.repeats)]
        report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "hostname": os.uname().nodename, "episode_file": episode_file.__file__,
                  "writer_cpu_us_per_episode_median": statistics.median(cpu),
                  "writer_cpu_us_per_episode_min": min(cpu),
                  "writer_cpu_us_per_episode": cpu, "kills": kills(directory, args.kills)}
    print(f"writer CPU per episode: median {report['writer_cpu_us_per_episode_median']:.0f} µs, "
          f"min {report['writer_cpu_us_per_episode_min']:.0f} µs ({args.repeats} processes); "
          f"{args.kills} kills: {report['kills']['unreadable']} unreadable files "
          f"({report['episode_file']})")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
