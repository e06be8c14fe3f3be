"""Every registered algorithm, and a plug-in, as a policy of a multi-agent run: it trains,
resumes, evaluates and exports, or it is refused at start with one line that names the
algorithms that can. And the layouts a multi-agent run is launched with: local mode, and a world
one rank short of the layout."""

import csv
import json
import math
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, mpi_env, run_mpi

from mpirl.commands.evaluate import evaluate, find_checkpoint
from mpirl.commands.export import export_checkpoint, load_exported
from mpirl.commands.train import make_request
from mpirl.errors import ConfigError
from mpirl.execution.contract import ALGORITHMS, policy_algorithms

MPIRL = str(BIN / "mpirl")
PROGRAMS = str(Path(__file__).resolve().parent / "programs")
ENV = "mpirl.testing:ManyPickers"
#: A plug-in under a dotted module path (tests/programs/userpkg/myppo.py): the run's --algo, so
#: that a policy without "algo" is the plug-in's.
PLUGIN = "userpkg.myppo"
#: The smallest replay and offline configs that still train in two iterations.
REPLAY = {"sgd_steps_per_env_step": 0.05, "learning_starts": 10, "train_batch_size": 16}
OFFLINE = {"num_sgd_steps_per_iteration": 2, "evaluation_episodes": 1, "train_batch_size": 16,
           "num_learners": 0}
#: Each algorithm that drives a policy: the agent it drives (a picker has Discrete actions, a
#: steerer a Box), its overrides, a column of its own plan that must be finite after the
#: resume, and the model class its export holds.
POLICIES = {
    PLUGIN: ("pick_0", {"num_learners": 1}, "clip_fraction", "Policy"),
    "PPO": ("pick_1", {"num_learners": 1}, "approx_kl", "Policy"),
    "A2C": ("pick_2", {}, "policy_loss", "Policy"),
    "IMPALA": ("pick_3", {"min_steps_per_iteration": 20, "train_batch_size": 20},
               "policy_lag_mean", "Policy"),
    "A3C": ("pick_4", {"min_steps_per_iteration": 20}, "policy_lag_mean", "Policy"),
    "DQN": ("pick_5", REPLAY, "td_loss", "QNetwork"),
    "APEX": ("pick_6", {**REPLAY, "min_env_steps_per_iteration": 20, "num_learners": 0},
             "sgd_steps_total", "QNetwork"),
    "BC": ("pick_7", OFFLINE, "evaluation_env_steps_total", "Policy"),
    "MARWIL": ("pick_8", OFFLINE, "weight_mean", "Policy"),
    "SAC": ("steer_0", REPLAY, "alpha", "SACModel"),
    "MBPO": ("steer_1", {"initial_random_steps": 20, "model_train_freq": 20,
                         "rollout_batch_size": 20, "epoch_length": 20, "ensemble_size": 2,
                         "elites": 1, "model_max_epochs": 2, "model_hidden_sizes": [16],
                         "sgd_steps_per_env_step": 0.05, "train_batch_size": 16,
                         "evaluation_interval": 1, "evaluation_episodes": 1},
             "model_error", "MBPOActor"),
}
#: The algorithms whose rollout workers or learners serve a whole run, never one policy.
REFUSED = ("ES", "ARS", "AlphaZero", "PETS")


def test_every_registered_algorithm_is_walked():
    """A new algorithm joins POLICIES or REFUSED, as its contract says; docs/multiagent.md and
    the README list the same."""
    assert set(POLICIES) - {PLUGIN} | set(REFUSED) == set(ALGORITHMS)
    assert set(policy_algorithms()) == set(POLICIES) - {PLUGIN}


def _train(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MPIRL, "train", "--run-dir", str(run_dir), "--progress", "plain",
                           *args], capture_output=True, text=True, timeout=300,
                          env=mpi_env({"CI": "true", "PYTHONPATH": PROGRAMS}))


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr}"


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """One local-mode run with a policy per algorithm (the plug-in's the run's own): two
    iterations, resumed for a third; then evaluated and each policy exported, in-process. The
    run asks for learner ranks per policy (num_learners 2: the plug-in's and PPO's), which
    local mode runs in-process."""
    tmp = tmp_path_factory.mktemp("walk")
    dump, run_dir = tmp / "dump", tmp / "run"
    # The offline policies' dataset: a picker's episodes.
    _ok(_train(tmp / "first", "--algo", "PPO", "--env", ENV, "--stop",
               '{"training_iteration": 1}', "--config", json.dumps(
                   {"env_config": {"pickers": 1, "steerers": 0}, "num_envs_per_worker": 2,
                    "rollout_fragment_length": 20, "dump_trajectories": str(dump)})))
    policies = {agent: {**overrides, **({"algo": algo} if algo != PLUGIN else {})}
                for algo, (agent, overrides, _, _) in POLICIES.items()}
    for algo in ("BC", "MARWIL"):
        policies[POLICIES[algo][0]]["input"] = str(dump / "shared")
    config = {"env_config": {"steerers": 2}, "num_learners": 2, "checkpoint_every": 1,
              "rollout_fragment_length": 20, "num_envs_per_worker": 1, "hidden_sizes": [16],
              "multiagent": {"policies": policies}}
    first = _train(run_dir, "--algo", PLUGIN, "--env", ENV, "--config", json.dumps(config),
                   "--stop", '{"training_iteration": 2}')
    _ok(first)
    resumed = _train(run_dir, "--resume", str(run_dir), "--stop", '{"training_iteration": 3}')
    _ok(resumed)
    with open(run_dir / "progress.csv") as file:
        rows = list(csv.DictReader(file))
    checkpoint, manifest = find_checkpoint(run_dir)
    exported = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(PROGRAMS)  # the plug-in, as PYTHONPATH gave it to the run
        for algo, (agent, *_) in POLICIES.items():
            header, policy, _ = load_exported(export_checkpoint(checkpoint, manifest,
                                                                tmp / f"{agent}.npz", agent))
            exported[algo] = (header["algo"], type(policy).__name__)
        evaluation = evaluate(run_dir, 1).summary()
    return {"first": first, "resumed": resumed, "rows": rows, "manifest": manifest,
            "evaluation": evaluation, "exported": exported}


def test_local_mode_runs_policies_that_ask_for_learner_ranks_with_one_note(walked):
    """Local mode says once what it folded, first, and runs the policies' learners in-process;
    nothing contradicts it (it used to add that the run had 1 learner rank and refuse)."""
    err = walked["first"].stderr
    note = ("mpirl: local mode (world size 1) runs one in-process worker per role: "
            "num_learners 2 -> 1; launch 4 ranks (mpiexec -n 4)")
    assert err.startswith(note) and err.count("local mode") == 1, err
    assert "learner ranks of their own" not in err


@pytest.mark.parametrize("algo", list(POLICIES))
def test_each_algorithm_trains_resumes_evaluates_and_exports_as_a_policy(walked, algo):
    agent, _, column, model = POLICIES[algo]
    rows = walked["rows"]
    assert [int(row["iteration"]) for row in rows] == [1, 2, 3]
    assert "resumed from" in walked["resumed"].stdout
    steps = [float(row[f"agent_steps_total/{agent}"]) for row in rows]
    assert 0 < steps[1] < steps[2], steps  # it went on after the resume
    assert math.isfinite(float(rows[-1][f"{agent}/{column}"])), rows[-1]
    assert walked["manifest"]["algo"] == PLUGIN  # what evaluate and export load it by
    assert math.isfinite(walked["evaluation"][f"return_mean/{agent}"])
    assert walked["exported"][algo] == (algo, model)


@pytest.mark.parametrize("algo", REFUSED)
def test_an_algorithm_that_cannot_drive_a_policy_is_refused_at_start(tmp_path, algo):
    config = {"multiagent": {"policies": {"picker": {}, "steerer": {"algo": algo}}}}
    with pytest.raises(ConfigError) as raised:
        make_request("PPO", "mpirl.envs.examples:MixedAgents", None, config, {}, None,
                     str(tmp_path / "run"))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"policy 'steerer': {algo} cannot drive a policy of a "
                              f"multi-agent run"), message
    assert "Policies can use PPO, A2C, BC, MARWIL, DQN, APEX, SAC, IMPALA, A3C, MBPO, or a " \
           "plug-in" in message


def test_a_world_one_rank_short_says_so_on_its_first_line(tmp_path):
    """The README's FourAgentCartPole command under mpiexec -n 3 (its layout wants 4): it runs,
    with the driver sampling, and its first line says so and what -n gives a rollout rank."""
    config = {"num_learners": 2, "multiagent": {
        "policies": {"ppo": {"num_learners": 1}, "dqn": {"algo": "DQN", "num_learners": 1}},
        "policy_mapping": {"cart_[02]": "ppo", "cart_[13]": "dqn"}}}
    run_dir = tmp_path / "run"
    proc = run_mpi(3, MPIRL, "train", "--algo", "PPO", "--env",
                   "mpirl.envs.examples:FourAgentCartPole", "--run-dir", str(run_dir),
                   "--config", json.dumps(config), "--stop", '{"training_iteration": 1}',
                   timeout=180, env={"CI": "true"})
    _ok(proc)
    note = ("mpirl: no rank is left for rollout workers (world size 3 = 1 driver + 2 learner): "
            "the driver samples (rollout 0); launch 4 ranks (mpiexec -n 4) for one rollout rank")
    assert proc.stderr.startswith(note), proc.stderr
    assert proc.stdout.startswith("mpirl layout: driver 1, rollout 0, replay 0, learner 2")
    log = (run_dir / "output.log").read_text().splitlines()
    assert log[1].startswith(note), log[:3]  # after the log's own header line
