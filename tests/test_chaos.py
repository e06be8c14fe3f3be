"""Faults together: ``benchmarks/chaos.py`` checks, from the files alone, that nothing a run
under faults wrote was lost, repeated or left unreadable. Its short version runs here on PPO and
DQN; the checks are tried on damaged files, so that a check that cannot fail is caught; the
hour-long chaos runs are benchmarks (RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import pytest
from conftest import mpi_env

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import chaos  # noqa: E402  (benchmarks/ is not a package)


def test_every_kind_of_fault_on_ppo_and_dqn_loses_and_repeats_nothing(tmp_path):
    """The issue's short version, ``chaos.py --quick``: PPO and DQN (replay) side by side under
    ``mpirl launch``, each kind of fault once, 1-3 s apart: kill -9 of a random rank, during a
    checkpoint write, during a resume and seconds after a restart; SIGUSR1/SIGTERM and a resume;
    the run's disk full until two attempts have ended on it (each in one line); an env that
    raises and one that hangs past its timeout. Every check of chaos.py passes: iterations once
    each, steps never counted twice, every checkpoint ``latest`` named verified, every dumped
    episode read, no process or lock left, each fault recovered within its limit."""
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--quick", "--workdir",
         str(tmp_path / "w"), "--json", str(out)], capture_output=True, text=True, timeout=480,
        env=mpi_env())
    assert out.exists(), proc.stdout + proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert sorted(runs) == ["DQN", "PPO"]
    problems = {name: run["problems"] for name, run in runs.items()}
    assert proc.returncode == 0 and not any(problems.values()), (problems, proc.stdout)
    for name, run in runs.items():
        kinds = set(chaos.KINDS) - ({"full_disk"} if run["full_disk"] != "on" else set())
        assert sorted(f["kind"] for f in run["faults"]) == sorted(kinds), name
        assert all(f["to_training_s"] is not None and not f["hang"] for f in run["faults"])
        assert run["iterations_lost"] == run["iterations_repeated"] == 0
        assert run["unreadable_files"] == 0 and run["dump"]["episodes"] > 0
        assert run["checkpoints_seen"] > 0 and run["processes_left"] == 0
        assert run["final"] == {"stop_exit": 75, "resume_exit": 0}
        if run["full_disk"] == "on":
            logs = "".join(p.read_text(errors="replace")
                           for p in (tmp_path / "w" / name).glob("launch*"))
            assert logs.count("is full (No space left on device)") >= 2
            assert "Traceback" not in logs
    if any(run["full_disk"] != "on" for run in runs.values()):
        pytest.skip(f"no tmpfs could be mounted here: {runs['PPO']['full_disk']}")


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
        # The job resumed between the rows of iterations 2 and 3.
        run.rows = [chaos.RowEvent(1.0, 2, 200, run="run"), chaos.RowEvent(3.0, 3, 700, run="run")]
        run.attempts = [2.0]
        run.check()
        assert any(what in problem for problem in run.problems), (what, run.problems)


def test_an_iteration_as_large_away_from_any_resume_is_no_step_counted_twice(tmp_path):
    # IMPALA's iterations take every finished fragment: 2-3 times the median occurs with no
    # fault near. Only an iteration just after a resume that outdoes all of those is flagged.
    rows = [(i, 100 * i) for i in range(1, 40)]
    rows[10:] = [(i, t + 150) for i, t in rows[10:]]  # iteration 11 adds 250, none near resume
    for resumed_at, flagged in ((None, False), (30, False), (11, True)):
        run = _run(tmp_path / str(resumed_at))
        _progress(run, rows)
        if resumed_at is not None:
            run.rows = [chaos.RowEvent(float(i), i, t, run="run") for i, t in rows]
            run.attempts = [resumed_at - 0.5]
        run.check()
        assert any("counted twice" in p for p in run.problems) == flagged, (resumed_at,
                                                                            run.problems)


def test_a_final_return_outside_the_uninterrupted_runs_spread_is_a_problem(tmp_path):
    for final, spread, flagged in ((480.0, [470.0, 500.0, 455.0], False),
                                   (300.0, [470.0, 500.0, 455.0], True),
                                   (300.0, [], True)):
        run = _run(tmp_path / f"{final}-{len(spread)}")
        report = {"final_return": final}
        chaos.compare_with_baselines(run, report, {"finals": [500.0], "stretch": spread})
        assert bool(run.problems) == flagged, (final, spread, run.problems)
        assert report.get("within_spread", False) == (bool(spread) and not flagged)


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


@pytest.mark.parametrize("multiagent", [False, True], ids=["env", "multiagent-env"])
def test_the_trigger_file_makes_exactly_one_env_fail(tmp_path, multiagent):
    from mpirl.envs.parallel import is_parallel_env
    from mpirl.testing import (
        FaultTrigger,
        InjectedFailure,
        TriggeredFaultEnv,
        TriggeredFaultMultiAgentEnv,
    )

    def make():
        if multiagent:
            return TriggeredFaultMultiAgentEnv(trigger_dir=str(tmp_path), hang_s=0.2)
        return TriggeredFaultEnv(trigger_dir=str(tmp_path), hang_s=0.2)

    envs = [make(), make()]
    actions = ({a: 0 for a in envs[0].possible_agents} if multiagent else 0)
    for env in envs:
        env.reset(seed=0)
        env.step(actions)
    if multiagent:  # what mpirl's multi-agent loader and a centralized critic ask of it
        assert is_parallel_env(envs[0]) and len(envs[0].possible_agents) == 4
        assert envs[0].state().shape == (16,)
    for what in ("raise", "hang"):
        (tmp_path / FaultTrigger.NAME).write_text(what)
        with pytest.raises(InjectedFailure, match=f"injected failure \\({what}\\)"):
            envs[0].step(actions)
        envs[1].step(actions)  # claimed by the first: the second goes on
        assert not (tmp_path / FaultTrigger.NAME).exists()


def test_a_job_slow_to_stop_is_waited_for_its_iteration_and_never_started_twice(tmp_path,
                                                                                monkeypatch):
    """A stop signal is answered when the iteration in progress ends (PETS's took 160 s at load
    25); the wait allows the longest iteration seen, and a job that still runs after it is a
    hang, not a second job started on its run directory."""
    run = _run(tmp_path)
    run.rows = [chaos.RowEvent(0.0, 1, 10), chaos.RowEvent(100.0, 2, 20),
                chaos.RowEvent(101.0, 4, 40)]  # 2 -> 4 skips a row: not an iteration's length
    assert run.stop_allowance_s() == chaos.STOP_ALLOWANCE_S + 100.0

    monkeypatch.setattr(chaos, "STOP_ALLOWANCE_S", 0.5)
    run.rows = []
    deaf = "import signal, time\nfor s in (signal.SIGUSR1, signal.SIGTERM):\n" \
           "    signal.signal(s, signal.SIG_IGN)\ntime.sleep(60)"
    run.launch = subprocess.Popen([sys.executable, "-c", deaf])
    try:
        time.sleep(0.5)  # its handlers set
        fault = run.inject("stop_signal", 5.0)
        assert fault.hang and "did not stop within 0 s" in fault.note, fault
        assert run.launches == 0 and run.launch.poll() is None
    finally:
        run.launch.kill()
        run.launch.wait()


def test_a_loss_survived_in_place_is_noticed_when_the_job_says_so(tmp_path):
    """Under ULFM the row showing a survived loss can come an iteration later (PETS: 53 s at
    load 25); the time to notice is the job's own line, the time to training that row."""
    run = _run(tmp_path)
    t0 = chaos.now()
    run.rows = [chaos.RowEvent(t0 - 5.0, 4, 40)]
    run.survived = [t0 + 1.5]

    def row_comes():  # as the monitor adds it (its time set ahead: the wait takes it at once)
        time.sleep(0.3)
        with run._lock:
            run.rows.append(chaos.RowEvent(t0 + 40.0, 5, 50, ranks_lost=1))

    threading.Thread(target=row_comes).start()
    fault = chaos.Fault("kill_rank", 0.0)
    run.wait_training(fault, t0, 60.0)
    assert fault.note == "survived in place" and fault.detect_s == 1.5, fault
    assert fault.to_training_s == 40.0 and not fault.hang


def _commit_checkpoint(store, iteration: int, state) -> Path:
    from mpirl.runtime.state_files import write_state_file

    tmp = store.begin(iteration)
    entry = write_state_file(tmp / "driver.pkl", state)
    return store.commit(tmp, {"iteration": iteration, "files": {"driver.pkl": entry}})


def test_a_checkpoint_swapped_in_place_while_read_is_checked_again_and_a_damaged_one_is_not(
        tmp_path, monkeypatch):
    """PBT's exploit commits the winner's copy under the name of the loser's own checkpoint at
    the same iteration, by a rename, while the monitor may be reading it: the old manifest
    against the new files failed to verify, and was counted unreadable (5 in PBT's second hour).
    Such a read is done again; a checkpoint damaged in place is still counted."""
    from mpirl.jobs.checkpoint import CheckpointStore

    run = _run(tmp_path)
    store = CheckpointStore(run.run_dir)
    _commit_checkpoint(store, 300, {"trial": "loser"})
    real_verify = chaos.verify

    def read_across_a_swap(path):
        monkeypatch.setattr(chaos, "verify", real_verify)
        _commit_checkpoint(store, 300, {"trial": "winner"})  # the rename, mid-read
        raise chaos.CheckpointError(f"{path}/driver.pkl: SHA-256 does not match the manifest")

    monkeypatch.setattr(chaos, "verify", read_across_a_swap)
    run.check_latest(run.run_dir)
    assert run.latest_seen == {}, run.latest_seen  # not counted: read again next time
    run.check_latest(run.run_dir)
    assert run.latest_seen == {"checkpoint_000300": "ok"}
    assert run.swapped_reads == 1

    damaged = _commit_checkpoint(store, 301, {"trial": "loser"})
    (damaged / "driver.pkl").write_bytes(b"\0" + (damaged / "driver.pkl").read_bytes()[1:])
    run.check_latest(run.run_dir)
    assert run.latest_seen[damaged.name].startswith("failed to verify"), run.latest_seen
