"""Faults together: ``benchmarks/chaos.py --quick`` trains PPO and DQN side by side under
``mpirl launch`` and injects every kind of fault once into each, for real (kill -9 of ranks, also
during a checkpoint write and during a resume, two kills in a row, SIGUSR1 or SIGTERM, a full
disk, an env that raises and one that hangs), then checks from the files alone that nothing was
lost, repeated or left unreadable. The checks themselves are tried here on damaged files, so
that a check that cannot fail is caught too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from conftest import mpi_env

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import chaos  # noqa: E402  (benchmarks/ is not a package)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    work = tmp_path_factory.mktemp("chaos")
    out = work / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--quick", "--workdir",
         str(work / "runs"), "--json", str(out)],
        capture_output=True, text=True, timeout=540, env=mpi_env())
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def test_every_kind_of_fault_struck_each_algorithm_and_every_check_passed(quick):
    proc, report = quick
    assert report is not None, proc.stdout + proc.stderr
    problems = {name: run["problems"] for name, run in report["runs"].items()}
    assert proc.returncode == 0 and not any(problems.values()), (problems, proc.stdout[-3000:])
    for name, run in report["runs"].items():
        kinds = sorted(f["kind"] for f in run["faults"])
        expected = sorted(k for k in chaos.KINDS if k != "full_disk" or run["full_disk"] == "on")
        assert kinds == expected, (name, kinds)
        assert run["recoveries"] == len(kinds), name


def test_nothing_lost_repeated_unreadable_or_left_behind(quick):
    _, report = quick
    for name, run in report["runs"].items():
        assert run["iterations"] >= 2 and run["iterations_lost"] == 0, name
        assert run["iterations_repeated"] == 0 and run["unreadable_files"] == 0, name
        assert run["hangs"] == 0 and run["processes_left"] == 0 and run["lock_left"] is None
        assert run["checkpoints_seen"] >= 2, name
        assert run["dump"]["episodes"] > 0 and run["dump"]["unreadable"] == [], name
        assert run["final"] == {"stop_exit": 75, "resume_exit": 0}, name


def test_a_full_disk_is_one_line_and_the_run_goes_on(quick):
    _, report = quick
    for name, run in report["runs"].items():
        if run["full_disk"] != "on":
            pytest.skip(f"no tmpfs could be mounted here: {run['full_disk']}")
        logs = "".join(p.read_text(errors="replace")
                       for p in Path(report["meta"]["workdir"], name).glob("launch*.log"))
        full = [line for line in logs.splitlines() if "is full (No space left on device)" in line]
        assert full and "Traceback" not in logs, name


# --- the checks, on damaged files -------------------------------------------------------------
def _run(tmp_path: Path) -> chaos.ChaosRun:
    run = chaos.ChaosRun("PPO", chaos.PLANS["PPO"], tmp_path, 1.0, chaos.random.Random(0),
                         chaos.KINDS, (1.0, 2.0), 64)
    run.run_dir.mkdir(parents=True)
    return run


def _progress(run: chaos.ChaosRun, rows: list[tuple[int, int]]) -> None:
    lines = ["iteration,timesteps_total,episode_return_mean"]
    lines += [f"{i},{t},10.0" for i, t in rows]
    (run.run_dir / "progress.csv").write_text("\n".join(lines) + "\n")


def test_the_checks_find_a_repeated_or_lost_iteration_and_steps_counted_twice(tmp_path):
    run = _run(tmp_path / "a")
    _progress(run, [(1, 100), (2, 200), (3, 300)])
    assert run.check()["iterations_lost"] == 0 and run.problems == []
    for rows, what in (([(1, 100), (2, 200), (2, 300), (3, 400)], "repeated [2]"),
                       ([(1, 100), (3, 200), (4, 300)], "lost [2]"),
                       ([(1, 100), (2, 200), (3, 700), (4, 800)], "counted twice"),
                       ([(1, 100), (2, 200), (3, 150)], "went backwards")):
        run = _run(tmp_path / what.replace(" ", "_"))
        _progress(run, rows)
        run.check()
        assert any(what in problem for problem in run.problems), (what, run.problems)


def test_the_checks_find_an_unreadable_dump_a_held_lock_and_a_leftover_process(tmp_path):
    run = _run(tmp_path)
    _progress(run, [(1, 100)])
    run.dump_dir.mkdir()
    damaged = run.dump_dir / "rollout-s0-w0.hdf5"
    with h5py.File(damaged, "w") as file:
        file["x"] = list(range(1000))
    damaged.write_bytes(damaged.read_bytes()[:200])
    (run.run_dir / "run.lock").write_text(json.dumps({"pid": os.getpid()}))
    sleeper = subprocess.Popen(["sleep", "30"], env={**os.environ, "MPIRL_CHAOS_TAG": run.tag})
    try:
        report = run.check()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert report["unreadable_files"] >= 1 and report["processes_left"] == 1
    assert report["lock_left"] == f"pid {os.getpid()}"


def test_no_room_is_found_behind_other_errors_and_in_a_workers_error():
    from mpirl.errors import RemoteError, no_room_cause

    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as error:
            raise RuntimeError("closing the event file failed") from error
    except RuntimeError as error:
        assert no_room_cause(error) == "No space left on device"
    remote = RemoteError(2, "rollout", "sample_rounds", "OSError",
                         "[Errno 122] Disk quota exceeded", "Traceback ...")
    assert no_room_cause(remote) == "Disk quota exceeded, on rank 2 (rollout)"
    assert no_room_cause(OSError(5, "Input/output error")) is None
