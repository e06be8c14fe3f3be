"""Training on a solver program beside the run (MPMD): ``mpiexec -n N mpirl train --env
mpirl/Solver-v0 ... : -n S ./solver``, with the example solvers of examples/solvers (the
reaction-diffusion env in C, rd_solver, and in Fortran, rd_solver_f; the Fortran echo solver).
One mpiexec per test; the training run is shared by the tests that read its outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import BIN, run_mpi, train_refused_in_process

from mpirl.errors import ConfigError
from mpirl.runtime.layout import parse_layout_row, parse_solver_row

MPIRL = str(BIN / "mpirl")
#: Open MPI's note when a process exits non-zero before the others: a solver must not cause it.
NON_ZERO_NOTE = "exited with non-zero status"
RD_CONFIG = {"observation_size": 8, "action_size": 4}
SMALL = {"num_envs_per_worker": 1, "rollout_fragment_length": 32, "num_epochs": 1,
         "minibatch_size": 32, "checkpoint_every": 1}


def train_args(run_dir: Path, k: int, env_config: dict, iterations: int,
               groups: int = 1) -> list[str]:
    config = {**SMALL, "ranks_per_env": k, "num_envs_per_worker": groups,
              "env_config": env_config}
    return [MPIRL, "train", "--algo", "PPO", "--env", "mpirl/Solver-v0", "--seed", "0",
            "--run-dir", str(run_dir), "--stop", json.dumps({"training_iteration": iterations}),
            "--config", json.dumps(config)]


@pytest.fixture(scope="module")
def rd_run(built_solvers, tmp_path_factory):
    """2 mpirl ranks (driver, one rollout rank) and one env group of rd_solver on k = 2."""
    run_dir = tmp_path_factory.mktemp("mpmd") / "run"
    proc = run_mpi(2, *train_args(run_dir, 2, RD_CONFIG, 2), ":", "-n", "2",
                   built_solvers.path("rd_solver"), timeout=120)
    return proc, run_dir


def test_ppo_trains_on_the_c_solver_with_its_ranks_in_the_tables_and_records(rd_run):
    proc, run_dir = rd_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert NON_ZERO_NOTE not in proc.stderr
    lines = proc.stdout.splitlines()
    assert "solver 2 (1 group x 2)" in lines[0] and "world size 2 + 2 solver ranks" in lines[0]
    assert [row["role"] for row in map(parse_layout_row, lines) if row] == ["driver", "rollout"]
    assert any(line.split()[:3] == ["0", "1", "solver"] for line in lines)  # env groups table
    solvers = [row for row in map(parse_solver_row, lines) if row]
    assert [(r["world"], r["group"], r["member"]) for r in solvers] == [(2, 0, 0), (3, 0, 1)]
    assert all(r["program"].endswith("rd_solver") for r in solvers)
    params = json.loads((run_dir / "params.json").read_text())
    group, = params["layout"]["env_groups"]
    assert group["external"] and group["ranks"] == [0, 1] and group["world_ranks"] == [2, 3]
    assert group["pids"] == [r["pid"] for r in solvers]
    assert params["layout"]["solver_ranks"] == 2
    startup = json.loads((run_dir / "startup.json").read_text())["env_groups"]
    assert startup["external"] and startup["k"] == 2 and startup["solver_hello_s"] >= 0
    result = json.loads((run_dir / "result.json").read_text())
    assert result["iteration"] == 2 and result["timesteps_total"] == 64


def test_the_c_solver_plays_the_episode_the_python_env_plays(rd_run, built_solvers):
    # One checkpoint, one episode from one seed: the policy's every action depends on every
    # observation before it, so equal returns mean the same 100 observations and rewards.
    # (One env both ways: a batch of another size rounds the policy's float32 differently.)
    from mpirl.commands.evaluate import evaluate

    proc, run_dir = rd_run
    assert proc.returncode == 0, proc.stderr
    played = run_mpi(1, MPIRL, "evaluate", str(run_dir), "--episodes", "1", "--seed", "3",
                     "--json", ":", "-n", "2", built_solvers.path("rd_solver"), timeout=90)
    assert played.returncode == 0, played.stdout + played.stderr
    assert NON_ZERO_NOTE not in played.stderr
    solver = json.loads(played.stdout.strip().splitlines()[-1])
    python = evaluate(run_dir, 1, 3, env_id="mpirl/ReactionDiffusion-v0").summary()
    assert solver["env"] == "mpirl/Solver-v0" and python["env"] == "mpirl/ReactionDiffusion-v0"
    assert solver["length_mean"] == python["length_mean"] == 100
    assert solver["return_mean"] == pytest.approx(python["return_mean"], abs=1e-9, rel=0)
    # Without its program (no MPMD launch here), the Solver checkpoint is one line.
    with pytest.raises(ConfigError, match="is a solver program beside the run: evaluate it in "
                                          "an MPMD launch"):
        evaluate(run_dir, 1, 3)


def test_a_solver_env_without_its_program_is_one_line(tmp_path, capsys):
    line = train_refused_in_process(tmp_path, capsys, "--algo", "PPO", "--env",
                                    "mpirl/Solver-v0", "--config", json.dumps(
                                        {"ranks_per_env": 1, "env_config": RD_CONFIG}))
    assert "'mpirl/Solver-v0' stands for a solver program launched beside the run, but none " \
           "was: launch it after ':'" in line


def test_the_fortran_solver_trains_one_iteration_in_two_groups_of_one(built_solvers, tmp_path):
    # Local mode (mpirl on one rank) driving two groups of k = 1, each on its own clock.
    solver = built_solvers.fortran("echo_solver_f")
    env_config = {"observation_size": 4, "action_size": 2, "episode_length": 10}
    proc = run_mpi(1, *train_args(tmp_path / "run", 1, env_config, 1, groups=2),
                   ":", "-n", "2", solver, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert NON_ZERO_NOTE not in proc.stderr
    assert "solver 2 (2 groups x 1)" in proc.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    # Episodes of 10 steps: 3 ended in each group's 32 steps.
    assert result["timesteps_total"] == 64 and result["episode_len_mean"] == 10, result
    assert result["episodes_total"] == 6, result


def test_ppo_trains_one_iteration_on_the_fortran_reaction_diffusion_solver(built_solvers,
                                                                           tmp_path):
    # rd_solver.f90 in one group of k = 2 (its halo exchange every substep); its trajectory
    # is the Python env's (test_reaction_diffusion.py).
    solver = built_solvers.fortran("rd_solver_f")
    proc = run_mpi(1, *train_args(tmp_path / "run", 2, {**RD_CONFIG, "max_steps": 10}, 1),
                   ":", "-n", "2", solver, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert NON_ZERO_NOTE not in proc.stderr
    assert "solver 2 (1 group x 2)" in proc.stdout and "rd_solver_f" in proc.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    # Episodes of max_steps 10: 3 ended in the iteration's 32 steps; rewards -(u^2 + c a^2).
    assert result["timesteps_total"] == 32 and result["episode_len_mean"] == 10, result
    assert result["episode_return_mean"] < 0, result


def test_a_solver_count_that_does_not_fit_is_one_line_and_the_solvers_end_quietly(
        built_solvers, tmp_path):
    proc = run_mpi(1, *train_args(tmp_path / "run", 2, RD_CONFIG, 1), ":", "-n", "3",
                   built_solvers.path("rd_solver"), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "mpirl: error: the MPMD job has 3 solver ranks; 1 rollout x 1 envs "
        "(num_envs_per_worker) x ranks_per_env 2 need 2. Launch the solver with -n 2 after "
        "':', or change num_rollout_workers / num_envs_per_worker / ranks_per_env."]


def test_doctor_checks_the_wiring_to_the_solver(built_solvers):
    proc = run_mpi(2, MPIRL, "doctor", "--config", '{"ranks_per_env": 2}', ":", "-n", "2",
                   built_solvers.path("rd_solver"), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "solver 2 (1 group x 2)" in proc.stdout
    assert [row["member"] for row in map(parse_solver_row, proc.stdout.splitlines()) if row] \
        == [0, 1]
    assert "doctor: 1 worker(s) answered, 0 payload error(s)" in proc.stdout
    assert proc.stderr.strip() == "", proc.stderr  # the solvers ended quietly


def test_a_python_simulation_beside_a_solver_program_is_one_line(tmp_path, capsys,
                                                                 monkeypatch):
    from mpirl.runtime import apps

    monkeypatch.setattr(apps, "solver_ranks", lambda: 2)  # as join_apps found them
    line = train_refused_in_process(tmp_path, capsys, "--algo", "PPO", "--env",
                                    "mpirl/ReactionDiffusion-v0", "--config",
                                    '{"ranks_per_env": 2}')
    assert "this MPMD launch has a solver program (2 solver ranks), but " \
           "'mpirl/ReactionDiffusion-v0' is not mpirl.envs.simulation:Solver" in line
