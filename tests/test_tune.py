"""``mpirl tune`` through the CLI: PBT finds a learning rate that fixed runs lack, a grid runs
every point with more trials than slots, a trial whose env fails for real is retried from its
checkpoint without disturbing the others, a stopped or killed population resumes, and bad
command lines get one clear error each."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    PROGRAMS,
    LiveRun,
    fill_disk,
    mounted_tmpfs,
    mpiexec_command,
    run_mpi,
)

from mpirl.jobs.launch import find_train, first_command, restart_command
from mpirl.tune.pbt import PBTSettings, decide, quantiles
from mpirl.tune.space import explore, grid_configs, parse_space

MPIRL = str(BIN / "mpirl")
CARTPOLE = ["--algo", "PPO", "--env", "CartPole-v1"]


def tune(n: int, *args: str, timeout: float = 240, env: dict | None = None):
    return run_mpi(n, MPIRL, "tune", *args, timeout=timeout, env=env)


def rows(path: Path) -> list[dict[str, str]]:
    with open(path) as file:
        return list(csv.DictReader(file))


def iterations(run_dir: Path) -> list[int]:
    return [int(row["iteration"]) for row in rows(run_dir / "progress.csv")]


#: The PBT test's 100-episode mean and env-step budget per member (see its docstring).
PBT_LEVEL, PBT_BUDGET = 100, 60_000


def test_pbt_finds_a_learning_rate_that_fixed_runs_lack(tmp_path):
    """Two PPO members start at lr 1e-5, with which PPO does not learn CartPole here (with that
    lr fixed, the best of 4 members is at 52 after 100k steps: benchmarks/tune.py's fixed arm,
    docs/tune.md). At each decision the loser takes the winner's state and draws a new lr from
    the list (--resample-probability 1), so the population moves to a rate that learns and a
    member's 100-episode mean reaches PBT_LEVEL within PBT_BUDGET steps: seeds 0-4 (--seed of
    the train options) did at 22.0k-24.6k steps (2026-11-29). The figure (4 members from lr
    1e-5 to 450, against the same population with lr fixed) is benchmarks/tune.py's, in
    benchmarks/RESULTS.md. PBT's mechanics (exploit, explore, the loser's resume with the new
    lr, pbt.jsonl, tune.csv, the members' run directories) are checked on the population of
    test_a_stopped_or_killed_population_resumes. The job is 3 ranks: a controller and two
    members of one rank (local mode)."""
    tune_dir = tmp_path / "pbt"
    proc = tune(3, "--scheduler", "pbt", "--population", "2", "--ranks-per-trial", "1",
                "--perturbation-interval", "10", "--resample-probability", "1",
                "--mutations", '{"lr": [1e-5, 1e-4, 3e-4, 1e-3]}', "--run-dir", str(tune_dir),
                "--", *CARTPOLE, "--config", '{"lr": 1e-5}',
                "--stop", json.dumps({"episode_return_mean": PBT_LEVEL,
                                      "timesteps_total": PBT_BUDGET}),
                timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tune_dir / "result.json").read_text())
    best = result["best_result"]
    assert (best["episode_return_mean"] >= PBT_LEVEL
            and best["timesteps_total"] <= PBT_BUDGET), result
    # Exploit copied state and explore moved lr off the start value.
    decisions = [json.loads(line) for line in (tune_dir / "pbt.jsonl").read_text().splitlines()]
    assert any(d["exploited"] and d["new_config"]["lr"] > 1e-5 for d in decisions), decisions


@pytest.fixture(scope="module")
def nested_grid(tmp_path_factory):
    """A grid population on the communicator the runtime gives it: ``mpiexec -n 4`` of
    programs/nested_tune.py, world rank 0 left out, so the population is world ranks 1-3 (its
    controller and one slot of 2 ranks: a driver and a rollout worker). Four grid points on that
    one slot, queued and run one after another. Checked by the next two tests."""
    tune_dir = tmp_path_factory.mktemp("nested") / "grid"
    proc = run_mpi(4, sys.executable, str(PROGRAMS / "nested_tune.py"), str(tune_dir),
                   "--search", "grid", "--ranks-per-trial", "2",
                   "--space", '{"lr": [1e-4, 1e-3], "num_epochs": [1, 2], '
                              '"ent_coef": {"uniform": [0, 0.01]}}',
                   "--", *CARTPOLE, "--config", '{"num_envs_per_worker": 1}',
                   "--stop", '{"training_iteration": 2}', timeout=240)
    return proc, tune_dir


def test_grid_search_runs_every_point_queued_on_fewer_slots(nested_grid):
    """Four grid points on one slot of 2 ranks: queued, run one after another, each an ordinary
    run with its own values."""
    proc, tune_dir = nested_grid
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tune_dir / "result.json").read_text())
    points = sorted((t["config"]["lr"], t["config"]["num_epochs"]) for t in result["trials"])
    assert points == [(1e-4, 1), (1e-4, 2), (1e-3, 1), (1e-3, 2)]
    for trial in result["trials"]:
        assert trial["status"] == "TERMINATED" and trial["last"]["iteration"] == 2, trial
        assert 0 <= trial["config"]["ent_coef"] <= 0.01
        params = json.loads((tune_dir / trial["trial"] / "params.json").read_text())
        for key, value in trial["config"].items():
            assert params["config"][key] == value
        assert params["world_size"] == 2
    assert result["best_trial"] in {t["trial"] for t in result["trials"]}
    assert not (tune_dir / "pbt.jsonl").exists()


FAILURE_ARGS = ["--ranks-per-trial", "1", "--search", "random", "--num-samples", "2", "--",
                "--algo", "PPO", "--env", "MpirlTrialFailureCartPole-v0", "--env-module",
                "mpirl.testing", "--config",
                '{"max_env_failures": 2, "checkpoint_every": 2, "num_envs_per_worker": 1}',
                "--stop", '{"training_iteration": 8}']


def failure_env(tmp_path: Path) -> dict[str, str]:
    """trial_001's env raises in every step after its process's 200th (iteration 4 of 64
    steps), twice: max_env_failures 2 in a row end that attempt, and the budget is spent."""
    budget = tmp_path / "budget"
    budget.write_text("2")
    return {"MPIRL_FAIL_TRIAL": "trial_001", "MPIRL_FAIL_BUDGET": str(budget),
            "MPIRL_FAIL_AFTER_STEPS": "200"}


def test_a_trial_whose_env_fails_is_retried_from_its_checkpoint(tmp_path):
    tune_dir = tmp_path / "retry"
    proc = tune(3, "--max-failures", "1", "--run-dir", str(tune_dir), *FAILURE_ARGS,
                env=failure_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trial_001 failed (exit code 1, failure 1); retrying" in proc.stdout
    result = json.loads((tune_dir / "result.json").read_text())
    statuses = {t["trial"]: (t["status"], t["failures"]) for t in result["trials"]}
    assert statuses == {"trial_000": ("TERMINATED", 0), "trial_001": ("TERMINATED", 1)}
    log = (tune_dir / "trial_001" / "output.log").read_text()
    assert "InjectedFailure" in log and "resumed from" in log and "checkpoint_000002" in log
    assert iterations(tune_dir / "trial_001") == list(range(1, 9))
    # The other trial ran once, undisturbed.
    other = (tune_dir / "trial_000" / "output.log").read_text()
    assert other.count("segment to") == 1 and "resumed" not in other
    assert [r["status"] for r in rows(tune_dir / "tune.csv") if r["trial"] == "trial_001"] == [
        "FAILED", "TERMINATED"]


def test_a_trial_out_of_retries_fails_the_population_but_not_the_others(tmp_path):
    tune_dir = tmp_path / "noretry"
    proc = tune(3, "--run-dir", str(tune_dir), *FAILURE_ARGS, env=failure_env(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 trial(s) failed: trial_001" in proc.stderr
    assert "Traceback" not in proc.stderr
    result = json.loads((tune_dir / "result.json").read_text())
    statuses = {t["trial"]: t["status"] for t in result["trials"]}
    assert statuses == {"trial_000": "TERMINATED", "trial_001": "ERROR"}
    assert result["best_trial"] in statuses


def _trial_pid(tune_dir: Path, trial: str) -> int:
    log = (tune_dir / trial / "output.log").read_text()
    return int(re.findall(r"pid (\d+) \(population rank", log)[-1])


def _decisions(tune_dir: Path) -> int:
    path = tune_dir / "pbt.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_stopped_or_killed_population_resumes(tmp_path):
    """SIGUSR2 to the whole job checkpoints every member and exits 75; --resume goes on. Then a
    kill -9 of a member's process ends the job (Open MPI ends the whole job); --resume goes on
    from the members' checkpoints and the population finishes, PBT's log kept."""
    tune_dir = tmp_path / "resume"
    # Boundaries every 256 env steps: 4 iterations of 64 (one env of 64-step fragments).
    args = ["--scheduler", "pbt", "--population", "2", "--ranks-per-trial", "1",
            "--time-attr", "timesteps_total", "--perturbation-interval", "256",
            "--mutations", '{"lr": [1e-4, 3e-4, 1e-3]}']
    # 48 iterations: long enough that the resumed job is still running when a member is killed
    # (with 16 it could finish within the half second after its first decision).
    train = ["--", *CARTPOLE, "--config", '{"num_envs_per_worker": 1}',
             "--stop", '{"training_iteration": 48}']
    first = LiveRun(3, command=mpiexec_command(3, MPIRL, "tune", *args, "--run-dir",
                                               str(tune_dir), *train))
    first.wait_until(lambda: _decisions(tune_dir) >= 1, "a first PBT decision")
    os.kill(first.proc.pid, signal.SIGUSR2)  # mpiexec passes it to every rank
    assert first.finish() == 75, first.stdout + first.stderr
    assert f"Continue with: mpirl tune --resume {tune_dir}" in first.stderr
    state = json.loads((tune_dir / "tune_state.json").read_text())
    assert {t["status"] for t in state["trials"]} <= {"PAUSED", "TERMINATED"}

    second = LiveRun(3, command=mpiexec_command(3, MPIRL, "tune", "--resume", str(tune_dir)))
    before = _decisions(tune_dir)
    second.wait_until(lambda: _decisions(tune_dir) > before, "a PBT decision after resuming")
    time.sleep(0.5)
    os.kill(_trial_pid(tune_dir, "trial_001"), signal.SIGKILL)
    assert second.finish() != 0

    proc = tune(3, "--resume", str(tune_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "best: trial_" in proc.stdout
    result = json.loads((tune_dir / "result.json").read_text())
    assert [t["last"]["iteration"] for t in result["trials"]] == [48, 48], result
    assert all(t["status"] == "TERMINATED" for t in result["trials"])
    # Every member is an ordinary run directory whose history has no gaps or repeats.
    for trial in ("trial_000", "trial_001"):
        assert (tune_dir / trial / "params.json").is_file()
        assert (tune_dir / trial / "checkpoints").is_dir()
        assert iterations(tune_dir / trial) == list(range(1, 49))
    assert {row["trial"] for row in rows(tune_dir / "tune.csv")} == {"trial_000", "trial_001"}
    decisions = [json.loads(line) for line in (tune_dir / "pbt.jsonl").read_text().splitlines()]
    # Boundaries every 256 env steps before the last (48 x 64 = 3072), the first three logged.
    boundaries = {d["boundary"] for d in decisions}
    assert {256, 512, 768} <= boundaries <= set(range(256, 3072, 256)), decisions
    assert all(d["time_attr"] == "timesteps_total" for d in decisions)
    for decision in decisions:
        assert {"time", "iteration", "from", "to", "old_config", "new_config"} <= set(decision)
        assert decision["from"] != decision["to"]
    # Exploit copied the winner's state to the loser (each of the 11 decisions has one of each).
    assert any(d["exploited"] for d in decisions), decisions
    # A loser's run continued from its winner's checkpoint with the explored lr (explore may
    # also draw the lr the winner had: then nothing changed to print).
    moved = [d for d in decisions if d["exploited"]
             and d["new_config"]["lr"] != d["old_config"]["lr"]]
    assert moved, decisions
    log = (tune_dir / moved[0]["to"] / "output.log").read_text()
    assert "resumed from" in log and "changed: lr" in log, log


@pytest.mark.parametrize("full", ["trial_001", "population"])
def test_a_full_disk_ends_the_population_in_one_line_and_fails_no_trial(tmp_path, full):
    """Found by benchmarks/chaos.py. The disk of one member's run directory, or of the whole
    population's, fills while the members train: the job ends in DiskFull's one line (exit 1,
    which launch answers with a resume), no traceback, and no member counts a failure (with
    --max-failures 0 it would be failed for good). Once freed, --resume finishes every member
    with each iteration once. A copy for PBT's exploit that finds no room keeps the loser's own
    state (in-process test below)."""
    tune_dir = tmp_path / "pop"
    disk = tune_dir / "trial_001" if full == "trial_001" else tune_dir
    args = ["--scheduler", "pbt", "--population", "2", "--ranks-per-trial", "1",
            "--perturbation-interval", "4", "--mutations", '{"lr": [1e-4, 3e-4, 1e-3]}',
            "--run-dir", str(tune_dir), "--", *CARTPOLE, "--config",
            '{"num_envs_per_worker": 1, "checkpoint_every": 2}',
            "--stop", '{"training_iteration": 400}']
    with mounted_tmpfs(disk, 16):
        job = LiveRun(3, command=mpiexec_command(3, MPIRL, "tune", *args))
        job.wait_until(lambda: (tune_dir / "trial_001" / "progress.csv").is_file()
                       and len(iterations(tune_dir / "trial_001")) >= 6, "six iterations")
        filler = fill_disk(disk)
        assert job.finish() == 1, job.stdout + job.stderr
        assert "is full (No space left on device" in job.stderr, job.stderr
        assert "Traceback" not in job.stdout + job.stderr, job.stdout + job.stderr
        state = json.loads((tune_dir / "tune_state.json").read_text())
        assert {t["failures"] for t in state["trials"]} == {0}, state["trials"]
        assert {t["status"] for t in state["trials"]} <= {"PAUSED", "PENDING"}, state["trials"]
        filler.unlink()
        last = max(len(iterations(tune_dir / f"trial_{t['index']:03d}"))
                   for t in state["trials"])
        proc = tune(3, "--resume", str(tune_dir), env={"MPIRL_MAX_ITERATIONS": str(last + 4)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads((tune_dir / "result.json").read_text())
        assert {(t["status"], t["failures"]) for t in result["trials"]} == {("TERMINATED", 0)}
        for trial in ("trial_000", "trial_001"):
            assert iterations(tune_dir / trial) == list(range(1, last + 5)), trial


def test_an_exploit_copy_that_finds_no_room_keeps_the_loser_s_own_state(small_disk):
    from mpirl.jobs.checkpoint import CheckpointStore
    from mpirl.tune import slot

    loser = CheckpointStore(small_disk / "trial_001")
    tmp = loser.begin(4)
    (tmp / "state.pt").write_bytes(b"own")
    loser.commit(tmp, {"iteration": 4})

    class Link:  # the winner's checkpoint, 4 MB: more than the 2 MB disk holds
        def receive(self, source, tag, what):
            return {"manifest": {"iteration": 8}, "files": {"state.pt": bytes(4 << 20)}}, source

    reply = slot._transfer(Link(), {"kind": "receive_state", "run_dir": str(loser.root.parent),
                                    "from": 1})
    assert reply["ok"] is False and "No space left on device" in reply["no_room"], reply
    path, manifest = loser.newest_valid()
    assert manifest["iteration"] == 4 and (path / "state.pt").read_bytes() == b"own"
    assert sorted(p.name for p in loser.root.iterdir()) == sorted(
        [path.name, "latest"]), list(loser.root.iterdir())


@pytest.mark.parametrize("killed_at", range(4))
def test_an_exploit_killed_at_any_point_leaves_latest_naming_a_whole_checkpoint(
        tmp_path, monkeypatch, killed_at):
    """Found by chaos.py: the loser's checkpoints were removed before the winner's copy went in
    place, so a kill in between left ``latest`` naming a removed one, or no checkpoint at all.
    The kill comes after the ``killed_at``-th removal of a directory; a resume (recover, then
    newest_valid) must find the loser's own newest state or the winner's copy."""
    import shutil

    from mpirl.jobs.checkpoint import CheckpointStore
    from mpirl.tune import slot

    loser = CheckpointStore(tmp_path / "trial_001")
    for iteration in (4, 8):
        tmp = loser.begin(iteration)
        (tmp / "state.pt").write_bytes(b"own")
        loser.commit(tmp, {"iteration": iteration})

    class Link:
        def receive(self, source, tag, what):
            return {"manifest": {"iteration": 8}, "files": {"state.pt": b"winner"}}, source

    class Killed(BaseException):
        pass

    removals, remove = [], shutil.rmtree

    def remove_then_die(path, *args, **kwargs):
        remove(path, *args, **kwargs)
        removals.append(path)
        if len(removals) > killed_at:
            raise Killed

    monkeypatch.setattr(shutil, "rmtree", remove_then_die)
    try:
        slot._transfer(Link(), {"kind": "receive_state", "run_dir": str(loser.root.parent),
                                "from": 1})
    except Killed:
        pass
    monkeypatch.setattr(shutil, "rmtree", remove)
    loser.recover()
    path, manifest = loser.newest_valid()
    assert manifest["iteration"] == 8, (killed_at, removals, list(loser.root.iterdir()))
    assert (path / "state.pt").read_bytes() in (b"own", b"winner")


BAD_TUNE_COMMAND_LINES = [
    (4, ["--ranks-per-trial", "2", "--", *CARTPOLE],
     "the job needs 1 + a multiple of 2 ranks; it has 4. Launch it with e.g. mpiexec -n 3"),
    (3, ["--scheduler", "pbt", "--population", "4", "--ranks-per-trial", "1",
         "--mutations", '{"lr": [1e-4, 1e-3]}', "--", *CARTPOLE],
     "PBT runs every member at once: --population 4 with --ranks-per-trial 1 needs 5 ranks"),
    (3, ["--scheduler", "pbt", "--ranks-per-trial", "1", "--", *CARTPOLE],
     "--scheduler pbt needs --mutations"),
    (3, ["--ranks-per-trial", "1", "--space", '{"lrr": [1e-4]}', "--", *CARTPOLE],
     "lrr"),
    (3, ["--ranks-per-trial", "1", "--space", '{"lr": {"uniform": [1, 0]}}', "--",
         *CARTPOLE], "uniform needs [low, high] with low < high"),
    (3, ["--ranks-per-trial", "1", "--", *CARTPOLE, "--run-dir", "x"],
     "--run-dir is set by mpirl tune for each trial"),
    (3, ["--ranks-per-trial", "1", "--space", '{"lr": [-1.0]}', "--", *CARTPOLE],
     "trial 0 ({\"lr\": -1.0})"),
    (3, ["--ranks-per-trial", "2", "--", *CARTPOLE, "--config",
         '{"num_rollout_workers": 3}'], "each trial runs on --ranks-per-trial 2 ranks"),
    (3, ["--ranks-per-trial", "2", "--space", '{"num_learners": [0, 1]}', "--", *CARTPOLE,
         "--config", '{"learner_backend": "gloo"}'],
     "--space varies num_learners with learner_backend 'gloo'"),
]


@pytest.mark.parametrize("n, args, message", BAD_TUNE_COMMAND_LINES)
def test_bad_tune_command_lines_get_one_clear_error(tmp_path, n, args, message):
    """In-process, the checks tune_main makes on every rank before it splits the world: the
    request (make_tune_request), the trials' train commands (rank 0's new_trials) and the
    world's size (check_world, with the job's n). End to end through mpiexec:
    test_a_bad_tune_command_line_ends_the_job_with_one_line."""
    from mpirl.cli import _parser
    from mpirl.errors import ConfigError
    from mpirl.tune.controller import new_trials
    from mpirl.tune.request import check_world, make_tune_request

    parsed = _parser().parse_args(["tune", "--run-dir", str(tmp_path / "t"), *args])
    with pytest.raises(ConfigError) as raised:
        request, _ = make_tune_request(parsed, "")
        check_world(request, n, len(new_trials(request, request.trial_configs())))
    assert raised.value.exit_code == 2
    assert "\n" not in str(raised.value)
    assert message in str(raised.value), str(raised.value)
    assert not (tmp_path / "t" / "tune_state.json").exists()


@pytest.mark.parametrize("n, args, message",
                         [BAD_TUNE_COMMAND_LINES[0], BAD_TUNE_COMMAND_LINES[2]])
def test_a_bad_tune_command_line_ends_the_job_with_one_line(tmp_path, n, args, message):
    """Through mpiexec: a world of the wrong size (found on every rank after rank 0 checked the
    trials) and a request refused before anything is imported: exit 2, one line."""
    proc = tune(n, "--run-dir", str(tmp_path / "t"), *args, timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("mpirl: error:") == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "t" / "tune_state.json").exists()


def test_a_metric_the_trials_do_not_report_stops_the_population(tmp_path):
    """RLlib's old name for the return: found out once the first trial reports, then every
    trial stops and the job exits 2 with the keys the trials do report."""
    proc = tune(3, "--ranks-per-trial", "1", "--search", "random", "--num-samples", "3",
                "--metric", "episode_reward_mean", "--run-dir", str(tmp_path / "t"), "--",
                *CARTPOLE, "--stop", '{"training_iteration": 3}', timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("mpirl: error:") == 1, proc.stderr
    assert ("--metric 'episode_reward_mean' is not in the trials' results; they have: "
            in proc.stderr)
    assert "episode_return_mean" in proc.stderr and "Traceback" not in proc.stderr


def test_resume_of_something_that_is_no_population(tmp_path):
    proc = tune(3, "--resume", str(tmp_path), timeout=90)
    assert proc.returncode == 2
    assert "not a tune directory (tune_state.json is missing)" in proc.stderr


def test_space_syntax_grids_and_pbt_decisions():
    import numpy as np

    space = parse_space({"lr": [1e-4, 3e-4, 1e-3], "n": {"randint": [1, 4]},
                         "c": {"loguniform": [1e-3, 1e-1]}}, "--space")
    rng = np.random.default_rng(0)
    grid = grid_configs(space, rng)
    assert [g["lr"] for g in grid] == [1e-4, 3e-4, 1e-3]
    assert all(1 <= g["n"] < 4 and 1e-3 <= g["c"] <= 1e-1 for g in grid)
    # Explore without resampling: categorical values move to a neighbour, numbers by 0.8/1.2.
    for _ in range(50):
        new = explore({"lr": 3e-4, "n": 10, "c": 0.01}, space, rng, resample_probability=0.0)
        assert new["lr"] in (1e-4, 1e-3)
        assert new["n"] in (8, 12)
        assert new["c"] == pytest.approx(0.008) or new["c"] == pytest.approx(0.012)
    assert quantiles({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, 0.25) == ([0], [3])
    assert quantiles({0: 1.0, 1: 2.0, 2: 3.0}, 0.5) == ([0], [2])
    decisions = decide({0: 5.0, 1: float("nan"), 2: 9.0, 3: 7.0},
                       {i: {"lr": 3e-4} for i in range(4)}, space,
                       PBTSettings(perturbation_interval=5), rng)
    assert [(d.loser, d.winner) for d in decisions] == [(1, 2)]
    # Explore never hands a member a value the algorithm refuses (gamma above 1 here).
    gamma = parse_space({"gamma": {"uniform": [0.9, 0.999]}}, "--mutations")
    for _ in range(20):
        [decision] = decide({0: 1.0, 1: 2.0}, {0: {"gamma": 0.99}, 1: {"gamma": 0.995}}, gamma,
                            PBTSettings(perturbation_interval=5), rng,
                            valid=lambda config: config["gamma"] <= 1.0)
        assert decision.new_config["gamma"] <= 1.0


def test_launch_and_slurm_resume_a_tune_command(tmp_path):
    command = ["mpiexec", "-n", "5", "mpirl", "tune", "--population", "2", "--", "--algo",
               "PPO", "--env", "CartPole-v1"]
    call = find_train(command)
    assert call.subcommand == "tune" and call.algo == "PPO" and call.run_dir is None
    first, run_dir = first_command(command)
    assert run_dir.startswith("runs/tune-PPO-CartPole-v1-")
    assert first[first.index("tune") + 1:first.index("tune") + 3] == ["--run-dir", run_dir]
    again = restart_command(first)
    assert again[again.index("tune") + 1:again.index("tune") + 3] == ["--resume", run_dir]
    # The options after -- are the trials' own: a --run-dir there is not the tune directory.
    assert find_train(["mpirl", "tune", "--", "--algo", "PPO", "--run-dir", "x"]).run_dir is None
    # mpirl slurm: the requeued job resumes the tune directory.
    script = subprocess.run(
        [MPIRL, "slurm", "--time", "10", "--ntasks-per-node", "5", "--run-dir",
         str(tmp_path / "t"), "--", "tune", "--population", "2", "--", *CARTPOLE],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert script.returncode == 0, script.stderr
    assert f'"$MPIRL" tune --resume {tmp_path / "t"} --run-dir' in script.stdout
    assert '[ -f "$RUN_DIR/tune_state.json" ]' in script.stdout


def test_ars_nests_in_tune_unchanged(tmp_path):
    """The design's claim: an algorithm written for the runtime runs as a trial without change.
    ARS, whose rollout ranks share one noise table per node in an MPI shared-memory window of
    their communicator, in two slots of 2 ranks at once, each solving CartPole."""
    tune_dir = tmp_path / "ars"
    proc = tune(5, "--ranks-per-trial", "2", "--space", '{"sgd_stepsize": [0.02, 0.04]}',
                "--run-dir", str(tune_dir), "--", "--algo", "ARS", "--env", "CartPole-v1",
                "--stop", '{"episode_return_mean": 475, "timesteps_total": 1000000}')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tune_dir / "result.json").read_text())
    for trial in result["trials"]:
        assert trial["last"]["episode_return_mean"] >= 475, trial


def test_a_population_runs_on_the_communicator_the_runtime_gives_it(nested_grid):
    """Given a sub-communicator (world rank 0 left out), the controller is its rank 0 (world
    rank 1) and the slot its other ranks: nothing in tune reaches for COMM_WORLD (on it the
    population would have waited for world rank 0 until the timeout)."""
    proc, tune_dir = nested_grid
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"CODE (\d) (\d+)", proc.stdout)) == [("1", "0"), ("2", "0"),
                                                                   ("3", "0")]
    result = json.loads((tune_dir / "result.json").read_text())
    assert [t["status"] for t in result["trials"]] == ["TERMINATED"] * 4
    # Each trial's driver is the slot's leader: population rank 1 (world rank 2).
    for trial in result["trials"]:
        log = (tune_dir / trial["trial"] / "output.log").read_text()
        assert "(population rank 1)" in log, log
