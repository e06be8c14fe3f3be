"""A stand-in for a job command that ``mpirl launch`` supervises (tests/test_launch.py).

It imports nothing from mpirl and no MPI: under mpiexec it reads its rank from the environment.
Each rank counts its own attempts in ``$FAKE_DIR/attempts.RANK``; rank 0 appends its argv to
``$FAKE_DIR/argv.jsonl``. ``$FAKE_PLAN`` is a comma-separated list of actions, one per attempt
(the last one repeats):

* ``exit:N`` exits with N;
* ``kill`` kills itself with SIGKILL;
* ``wait`` writes ``$FAKE_DIR/ready.RANK.ATTEMPT``, logs every signal it gets to
  ``$FAKE_DIR/signals.RANK`` and exits 75 on SIGUSR1, SIGUSR2 or SIGTERM (SIGINT and SIGHUP are
  only logged); after 30 s it gives up with 99;
* ``orphan:N`` starts a grandchild that sleeps 60 s, writes its pid to ``$FAKE_DIR/orphan.pid``
  and exits with N.

An action ending in ``@R`` is done by rank R only; the other ranks sleep until the launcher ends
them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WAIT_LIMIT_S = 30


def main() -> int:
    state = Path(os.environ["FAKE_DIR"])
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))
    counter = state / f"attempts.{rank}"
    attempt = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(attempt))
    if rank == 0:
        with open(state / "argv.jsonl", "a") as log:
            log.write(json.dumps(sys.argv[1:]) + "\n")

    plan = os.environ["FAKE_PLAN"].split(",")
    action = plan[min(attempt, len(plan)) - 1]
    action, _, only_rank = action.partition("@")
    if only_rank and int(only_rank) != rank:
        time.sleep(WAIT_LIMIT_S)
        return 98
    name, _, value = action.partition(":")
    if name == "exit":
        return int(value)
    if name == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if name == "orphan":
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (state / "orphan.pid").write_text(str(sleeper.pid))
        return int(value)
    if name == "wait":
        return wait_for_signal(state, rank, attempt)
    raise SystemExit(f"fake_job.py: unknown action {action!r}")


def wait_for_signal(state: Path, rank: int, attempt: int) -> int:
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        with open(state / f"signals.{rank}", "a") as log:
            log.write(signal.Signals(signum).name + "\n")

    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    (state / f"ready.{rank}.{attempt}").touch()
    deadline = time.monotonic() + WAIT_LIMIT_S
    while time.monotonic() < deadline:
        if any(sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM) for sig in received):
            time.sleep(0.2)  # as if writing a checkpoint
            return 75
        time.sleep(0.02)
    return 99


if __name__ == "__main__":
    sys.exit(main())
