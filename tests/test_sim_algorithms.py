"""Every algorithm that samples on rollout ranks trains on an env group (ranks_per_env 2, the
Python reaction-diffusion simulation) through the one sampling core, with trajectory dumps,
callbacks, checkpoints that ``mpirl evaluate`` plays in-process (k = 1) and resumes: one
``mpiexec -n 4`` runs one iteration of each in the same processes, then resumes two, then a
multi-agent run on SimulationAgents (tests/programs/sim_algorithms.py)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import PROGRAMS, parse_result, run_mpi, train_refused_in_process
from programs.sim_algorithms import CONFIGS, ENV_CONFIG, NO_DUMPS, RESUMED

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
    return {"root": root, "stderr": proc.stderr, **{record["rank"]: record for record in found}}


def test_the_program_covers_every_algorithm_that_samples_on_rollout_ranks():
    from mpirl.execution.contract import ALGORITHMS

    # BC and MARWIL learn from datasets (their rollout ranks only evaluate); AlphaZero plays
    # games by self-play, not gym envs.
    assert set(ALGORITHMS) - set(CONFIGS) == {"BC", "MARWIL", "AlphaZero"}


@pytest.mark.parametrize("algo", list(CONFIGS))
def test_one_iteration_on_a_group_of_two_env_ranks(records, algo):
    assert all(not records[rank]["errors"] for rank in range(4)), records[0]["errors"]
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


def test_a_multi_agent_run_composes_policies_on_one_simulation_per_env(records):
    """SimulationAgents: an agent per actuator of one reaction-diffusion simulation; PPO drives
    two of them and SAC the other two, on a rollout rank that steps the simulation in-process."""
    row = records[0]["multiagent"]
    assert row["iteration"] == 1 and row["timesteps_total"] >= EPISODE, row
    # Every env step is a step of each of the policy's two agents.
    assert row["agent_steps_total/ppo"] == row["agent_steps_total/sac"] == 2 * row[
        "timesteps_total"], row
    assert row["episode_len_mean/ppo"] == row["episode_len_mean/sac"] == EPISODE, row


def test_the_multi_agent_checkpoint_evaluates_in_process(records, capsys):
    from mpirl.cli import main

    assert main(["evaluate", f"{records['root']}/multiagent", "--episodes", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 1, result


def test_simulation_agents_step_the_one_simulation_with_the_joined_action():
    from mpi4py import MPI

    from mpirl.envs.reaction_diffusion import ReactionDiffusion
    from mpirl.envs.simulation_agents import SimulationAgents

    agents = SimulationAgents("mpirl/ReactionDiffusion-v0", **ENV_CONFIG)
    alone = ReactionDiffusion(MPI.COMM_SELF, **ENV_CONFIG)
    assert agents.possible_agents == [f"actuator_{i}" for i in range(4)]
    assert agents.action_space("actuator_2").shape == (1,)
    obs, _ = agents.reset(seed=3)
    first = alone.reset(3)
    np.testing.assert_allclose(obs["actuator_1"][:OBS_WIDTH], first, rtol=1e-6)
    np.testing.assert_array_equal(obs["actuator_1"][OBS_WIDTH:], [0, 1, 0, 0])
    action = np.array([0.5, -0.25, 1.0, 0.0], np.float32)
    for t in range(EPISODE):
        obs, rewards, terminated, truncated, _ = agents.step(
            {agent: action[i:i + 1] for i, agent in enumerate(agents.possible_agents)})
        expected, reward, _, done = alone.step(action)
        np.testing.assert_allclose(agents.state(), expected, rtol=1e-6)
        assert set(rewards.values()) == {reward} and set(truncated.values()) == {done}
        assert agents.agents == ([] if t == EPISODE - 1 else agents.possible_agents)


def test_env_groups_refuse_multi_agent_envs_with_one_line(tmp_path, capsys):
    line = train_refused_in_process(
        tmp_path, capsys, "--algo", "PPO", "--env",
        "mpirl.envs.simulation_agents:SimulationAgents", "--config",
        json.dumps({"ranks_per_env": 2, "env_config": {"max_steps": 8}}))
    assert ("ranks_per_env 2: env groups drive single-agent simulations only; a multi-agent "
            "env ('mpirl.envs.simulation_agents:SimulationAgents') steps in the rollout "
            "process. Leave ranks_per_env at 0") in line, line


@pytest.mark.parametrize("algo", RESUMED)
def test_a_resume_goes_on_with_new_episodes_on_the_group(records, algo):
    row = records[0]["rows"][f"{algo}-resumed"]
    assert row["iteration"] == 2 and row["timesteps_total"] > records[0]["rows"][algo][
        "timesteps_total"], row
    steps = [records[rank]["steps"].get(f"{algo}-resumed", 0) for rank in (2, 3)]
    assert steps[0] == steps[1] > 0, steps


def test_checkpoints_and_resumes_say_why_the_episodes_start_afresh(records):
    stderr = records["stderr"]
    # Once per run that checkpointed (ES and ARS too: their workers sample on the groups).
    assert stderr.count("mpirl: note: checkpoints hold the policy, not the episodes in progress "
                        "of rollout_0's env groups") == len(CONFIGS) + len(RESUMED), stderr
    assert stderr.count("rollout worker 0's environments were reset from fresh seeds instead of "
                        "continuing their episodes: they could not be restored (TypeError: an "
                        "env group's simulation keeps its state on its own ranks") == len(
        RESUMED), stderr


def test_every_checkpoint_evaluates_in_process(records, monkeypatch, capsys):
    from mpirl.cli import main

    monkeypatch.syspath_prepend(str(PROGRAMS))  # the runs' env is sim_algorithms:CountingRD
    root = records["root"]
    for algo in CONFIGS:
        assert main(["evaluate", f"{root}/{algo}", "--episodes", "1", "--json"]) == 0, algo
        result = json.loads(capsys.readouterr().out)
        assert result["episodes"] == 1 and result["length_mean"] == EPISODE, (algo, result)
