"""Every algorithm that samples on rollout ranks trains on an env group (ranks_per_env 2, the
Python reaction-diffusion simulation) through the one sampling core, with trajectory dumps and
callbacks: one ``mpiexec -n 4`` runs one iteration of each in the same processes
(tests/programs/sim_algorithms.py)."""

from __future__ import annotations

import sys

import pytest
from conftest import PROGRAMS, parse_result, run_mpi
from programs.sim_algorithms import CONFIGS, ENV_CONFIG, NO_DUMPS

EPISODE = ENV_CONFIG["max_steps"]
OBS_WIDTH = 8  # the default number of sensors


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim_algorithms")
    proc = run_mpi(4, sys.executable, str(PROGRAMS / "sim_algorithms.py"), str(root),
                   timeout=240, env={"PYTHONPATH": str(PROGRAMS)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    found = parse_result(proc.stdout)
    assert found is not None, proc.stdout + proc.stderr
    return {record["rank"]: record for record in found}


def test_the_program_covers_every_algorithm_that_samples_on_rollout_ranks():
    from mpirl.execution.contract import ALGORITHMS

    # BC and MARWIL learn from datasets (their rollout ranks only evaluate); AlphaZero plays
    # games by self-play, not gym envs.
    assert set(ALGORITHMS) - set(CONFIGS) == {"BC", "MARWIL", "AlphaZero"}


@pytest.mark.parametrize("algo", list(CONFIGS))
def test_one_iteration_on_a_group_of_two_env_ranks(records, algo):
    assert all(not record["errors"] for record in records.values()), records[0]["errors"]
    row = records[0]["rows"][algo]
    assert row["iteration"] == 1 and row["timesteps_total"] >= EPISODE, row
    assert row["episodes_total"] >= 1, row
    # Both env ranks stepped the group, as many steps as the run counted (plus episodes played
    # past the iteration's count by asynchronous samplers); the driver and the rollout rank
    # stepped no simulation.
    steps = [records[rank]["steps"].get(algo, 0) for rank in range(4)]
    assert steps[0] == steps[1] == 0 and steps[2] == steps[3] >= row["timesteps_total"], steps
    assert records[0]["hooks"][algo]["on_train_result"] == 1
    if algo in NO_DUMPS:
        return  # ES and ARS play perturbed policies: no dumps, no rollout-side callbacks
    hooks = records[1]["hooks"][algo]  # the rollout rank's
    # Each episode the group played reached on_episode_end, its length that of an episode.
    assert hooks["on_episode_end"] >= 1 and hooks["on_sample_end"] >= 1, hooks
    assert hooks["episode_steps"] == EPISODE * hooks["on_episode_end"], hooks
    assert row["custom/group_length_mean"] == EPISODE, row
    dump = row["dump"]
    assert dump["episodes"] >= row["episodes_total"] and dump["steps"] == EPISODE * dump[
        "episodes"], dump
    assert dump["obs_rows"] == [EPISODE + 1] and dump["obs_width"] == [OBS_WIDTH], dump
