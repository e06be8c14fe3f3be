"""PETS through the real CLI (issue 39): CEM planning over the dynamics ensemble on the rollout
ranks, the ensemble trained on the learner in the driver's process; checkpoint and evaluate, and
bad input.

Learning on Pendulum-v1 (the issue's goal: a mean of -200 over 10 deterministic evaluation
episodes within 2,000 env steps, mpiexec -n 3, defaults) is benchmarks/model_based.py's figure
(benchmarks/RESULTS.md, "Model-based RL: PETS vs SAC": -200 reached at 800-1,200 env steps on
seeds 0-4). It was this file's test until issue 48: 327 CPU seconds, most of them CEM planning
(every training step and every step of the 10 evaluation episodes), too dear for the suite. The
suite's learning test of PETS is test_model_based_cli.py's cliff walk, where plans over the
learned ensemble (and a learned termination classifier) must score above a return threshold
within 5 iterations.

The removed test's runs, measured when written (2026-11-28, 2 cores, mpiexec -n 3, defaults,
2,000 env steps, evaluated once after the last iteration on 10 deterministic episodes): seed 0
-132.2 in 96.6 s of training (100 s wall), seed 1 -155.6 in 83.8 s, seed 2 -169.1 in 118.0 s.
The model's held-out error (normalized) falls from 0.07-0.15 after the 200 random steps to
0.004-0.009. With another job's tests sharing the two cores the same seed 0 run took 195 s (the
same -132.2: a run is the same for the same seed on one machine), so the 150 s bound holds only
on a quiet machine. With 3 particles instead of 2, seed 0 reached -131.7 but planned 3x slower.
Since each member draws its bootstraps from a generator of its own (sharding over learner
ranks), seed 0 reaches -132.7 (380 s of training with 3 other agents' jobs on the 2 cores). With
"planner": "mppi" seeds 0, 1, 2 reached -130.4, -153.7, -167.0 (673, 633, 636 s, as contended)."""

from __future__ import annotations

import io
import json
import math
import subprocess

import numpy as np
import pytest
import torch
from conftest import mpi_env, train_refused, train_refused_in_process
from mpirl.algorithms.model_based.dynamics import pack_ensemble
from mpirl.algorithms.model_based.dynamics_spec import DynamicsSpec
from mpirl.algorithms.model_based.planner import PETSSpec, PlanningModel
from test_train import MPIRL, rows, train

from mpirl.commands.evaluate import evaluate
from mpirl.report.progress import ProgressDisplay

COLUMNS = {"model_error", "model_error_max", "model_train_nll", "model_epochs",
           "model_epochs_total", "transitions", "random_actions", "eval_return_mean"}
#: A quick run's settings: a small plan and model, little data.
QUICK = {"num_envs_per_worker": 2, "rollout_fragment_length": 10, "initial_random_steps": 40,
         "cem_population": 20, "cem_elites": 4, "cem_iterations": 2, "planning_horizon": 4,
         "particles": 2, "model_max_epochs": 3, "hidden_sizes": [32, 32],
         "evaluation_interval": 2, "evaluation_episodes": 2}


def check_a_quick_run(proc, run_dir, monkeypatch):
    """test_model_based_cli.py's reference run (QUICK, mpiexec -n 3, 8 iterations, a
    checkpoint every 2), checked here: its model columns and evaluations, its notes, and its
    last checkpoint evaluated by ``mpirl evaluate`` and in one batch by ``evaluate``."""
    result = json.loads((run_dir / "result.json").read_text())
    progress = rows(run_dir)[:4]
    assert COLUMNS <= set(progress[0])
    # The evaluation's episodes are the only ones that end here (each evaluation abandons the
    # sampling's, 20 steps into their 200): they are the run's episodes, shown and counted.
    assert [int(r["episodes_total"]) for r in progress] == [0, 2, 2, 4]
    assert [int(float(r["evaluation_env_steps_total"])) for r in progress] == [0, 400, 400, 800]
    assert float(progress[1]["episode_return_mean"]) == pytest.approx(
        float(progress[1]["eval_return_mean"]))
    assert float(progress[1]["episode_len_mean"]) == 200
    assert math.isfinite(result["episode_return_mean"])
    # Rank 0 says when an evaluation starts, before the iteration's line.
    lines = proc.stdout.splitlines()
    note = lines.index("iter 2: evaluating 2 episodes, every step planned, on 2 rollout ranks ...")
    assert lines[note + 1].startswith("iter 2/8") and proc.stdout.count("evaluating") == 4
    # 2 rollout ranks x 2 envs x 10 steps an iteration; random actions while below 40 steps.
    assert [int(r["transitions"]) for r in progress] == [40, 80, 120, 160]
    assert [r["random_actions"] for r in progress] == ["1.0", "0.0", "0.0", "0.0"]
    assert all(math.isfinite(float(r["model_error"])) for r in progress)
    assert progress[1]["eval_return_mean"] != "nan"
    # mpirl evaluate plans with the learner's ensemble from the checkpoint.
    proc = subprocess.run([*MPIRL, "evaluate", str(run_dir), "--episodes", "1", "--json"],
                          capture_output=True, text=True, timeout=120, env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["episodes"] == 1 and math.isfinite(summary["return_mean"])
    # Several episodes are planned in one batch, as training's evaluation plans its envs: one
    # plan a step for all of them (Pendulum's episodes are 200 steps), not one per episode.
    batches = []
    plan = PlanningModel.plan

    def counted(self, obs, rng, deterministic):
        batches.append((len(obs), deterministic))
        return plan(self, obs, rng, deterministic)

    monkeypatch.setattr(PlanningModel, "plan", counted)
    played = evaluate(run_dir, 3)
    assert batches == [(3, True)] * 200
    # What the checkpoint's own evaluation (iteration 8) played: whole 200-step episodes.
    assert played.lengths == [200] * 3 and all(math.isfinite(r) for r in played.returns)
    assert progress[3]["eval_return_mean"] != "nan"


def test_local_mode_plans_and_trains(tmp_path):
    _, run_dir, _ = train(1, tmp_path, "--algo", "PETS", "--env", "Pendulum-v1",
                          "--config", json.dumps(QUICK), "--stop",
                          '{"training_iteration": 3}', timeout=120)
    progress = rows(run_dir)
    assert [int(r["transitions"]) for r in progress] == [20, 40, 60]


def test_the_broadcast_vector_carries_normalizers_and_elites():
    spec = PETSSpec(DynamicsSpec(3, 1, ensemble_size=4, elites=2, hidden_sizes=(8,)),
                    (-2.0,), (2.0,), planning_horizon=2, cem_population=8, cem_elites=2,
                    particles=2)
    source, target = spec.build(), spec.build()
    with np.errstate(all="ignore"):
        source.ensemble.input_mean += 3.0
        source.ensemble.target_std *= 2.0
    source.ensemble.elites = [1, 3]
    target.set_flat_weights(source.get_flat_weights())
    assert target.ensemble.elites == [1, 3]
    assert np.array_equal(pack_ensemble(target.ensemble), pack_ensemble(source.ensemble))
    obs = np.zeros((3, 3), np.float32)
    actions = target.plan(obs, np.random.default_rng(0), deterministic=False)
    assert actions.shape == (3, 1) and np.all(np.abs(actions) <= 2.0)




def refusal(tmp_path, capsys, *args: str) -> str:
    """What ``mpirl train ARGS`` refuses, in-process (``train_refused_in_process``: rank 0's
    checks before anything starts, exit 2 and one line), with no run directory made."""
    message = train_refused_in_process(tmp_path, capsys, *args)
    assert not (tmp_path / "run").exists()
    return message


def test_bad_input_exits_2_in_one_line(tmp_path):
    """End to end, one case: exit 2, one line on stderr, no traceback."""
    assert ("PETS plans continuous actions: it needs a Box action space, and this "
            "environment's is Discrete(2)"
            in train_refused(tmp_path, "--algo", "PETS", "--env", "CartPole-v1"))


@pytest.mark.parametrize("args, message", [
    (["--env", "CartPole-v1"], "PETS plans continuous actions: it needs a Box action space, "
                               "and this environment's is Discrete(2)"),
    (["--env", "Pendulum-v1", "--config", '{"planning_horizon": 0}'],
     '"planning_horizon" = 0 is out of range'),
    (["--env", "Pendulum-v1", "--config", '{"elites": 6}'],
     "PETS: elites (6) cannot exceed ensemble_size (5)"),
    (["--env", "Pendulum-v1", "--config", '{"termination_fn": "nowhere_mod:fn"}'],
     "termination_fn 'nowhere_mod:fn': no module named 'nowhere_mod'"),
    (["--env", "Pendulum-v1", "--config",
      '{"termination_fn": "mpirl.testing:cliff_walk_ended", "learn_termination": true}'],
     "termination_fn 'mpirl.testing:cliff_walk_ended' and learn_termination both give model "
     "terminations: set one of them"),
    (["--env", "Pendulum-v1", "--config", '{"cem_elites": 300}'],
     "cem_elites (300) cannot exceed cem_population (200)"),
    (["--env", "Pendulum-v1", "--config", '{"planner": "ilqr"}'],
     "PETS: planner 'ilqr': use one of 'cem', 'mppi'"),
    (["--env", "Pendulum-v1", "--config", '{"mppi_temperature": 0}'],
     '"mppi_temperature" = 0 is out of range'),
])
def test_bad_input_is_refused(tmp_path, capsys, args, message):
    assert message in refusal(tmp_path, capsys, "--algo", "PETS", *args)


def _walk_to_target_planner(planner: str, target: float = 0.5) -> PlanningModel:
    """A planner over a hand-built exact model of a 1-D walk: the action moves the position
    (x' = x + a, a in [-1, 1]) and the reward is -|x + a - target|, so the best plan from 0 is
    a first action of ``target``, then 0. Each of the 2 members is the same 4-unit ReLU net:
    a = relu(a) - relu(-a) and |z| = relu(z) + relu(-z); its log-variance sits at the lower
    bound, so sampled steps are exact up to 1e-2."""
    dynamics = DynamicsSpec(1, 1, ensemble_size=2, elites=2, hidden_sizes=(4,),
                            activation="relu")
    spec = PETSSpec(dynamics, (-1.0,), (1.0,), planning_horizon=5, particles=2,
                    planner=planner, cem_population=100, cem_elites=10, cem_iterations=4,
                    mppi_population=100, mppi_iterations=4, mppi_temperature=0.1)
    model = spec.build()
    first, last = model.ensemble.layers
    with torch.no_grad():
        first.weight.copy_(torch.tensor([[0.0, 0.0, 1.0, -1.0],     # from x
                                         [1.0, -1.0, 1.0, -1.0]]))  # from a
        first.bias.copy_(torch.tensor([[[0.0, 0.0, -target, target]]]))
        # Outputs: delta mean, reward mean, delta logvar, reward logvar.
        last.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0],
                                        [0.0, -1.0, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0]]))
        last.bias.copy_(torch.tensor([[[0.0, 0.0, -30.0, -30.0]]]))
    return model


@pytest.mark.parametrize("planner", ["mppi", "cem"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_planner_walks_to_the_target_on_an_exact_model(planner, seed):
    """8 planned steps (warm-started as in a run) from 4 starts, on the true dynamics. The best
    plan's total distance to the target after each step is 0.3 from -0.8 (one step of 1 short)
    and 0 from the others; a planner that did not move would total 8 x |start - 0.5|, up to
    10.4. Measured: every distance after the second step 0.14 or less, totals 0.45-0.73 (10
    seeds, both planners)."""
    model = _walk_to_target_planner(planner)
    rng = np.random.default_rng(seed)
    x = np.array([[0.0], [0.3], [0.9], [-0.8]], np.float32)
    distances = []
    for _ in range(8):
        x = x + model.plan(x, rng, deterministic=False)
        distances.append(np.abs(x[:, 0] - 0.5))
    distances = np.array(distances)
    assert distances[2:].max() <= 0.2, distances
    assert distances.sum(0).max() <= 1.0, distances


def test_a_note_shows_on_the_live_display_and_in_plain_output_and_the_log():
    """What rank 0 says while an evaluation plans: below the last line of a live display until
    the next iteration's, a line of its own in plain output, and a line in output.log."""
    note = "iter 10: evaluating 10 episodes, every step planned, on 2 rollout ranks ..."
    row = {"iteration": 9, "timesteps_total": 1800, "time_total_s": 60.0}
    for mode in ("live", "plain"):
        stream, log = io.StringIO(), io.StringIO()
        with ProgressDisplay("PETS", stream=stream, mode=mode, log=log) as display:
            display.update(row)
            display.note(note)
            if mode == "live":
                assert display._stats_text.plain.splitlines() == [display._stats(row), note]
                assert note in stream.getvalue()
                display.update({**row, "iteration": 10})
                assert note not in display._stats_text.plain
            else:
                assert stream.getvalue().splitlines()[-1] == note
        assert log.getvalue().splitlines()[1] == note
    stream = io.StringIO()
    with ProgressDisplay("PETS", stream=stream, mode="off") as display:
        display.note(note)
    assert stream.getvalue() == ""


def test_evaluate_plays_at_once_the_episodes_it_played_in_turn():
    """Batched through the sampling core, episode i still starts from seed + i and plays as it
    did alone: a policy that acts on each row alone gets the same returns, and an env whose
    episode has ended waits in the batch, unstepped."""
    from mpirl.commands.evaluate import _policy_runner
    from mpirl.workers.env_spec import EnvSpec

    rows = []

    class Lean:
        """CartPole pushed the way the pole leans: episodes of different lengths."""

        def act(self, obs, deterministic):
            rows.append(len(obs))
            return (obs[:, 2] > 0).astype(np.int64), None, None

        def env_actions(self, actions):
            return actions

    spec = EnvSpec("CartPole-v1")
    probe = spec.make()
    spaces = (probe.observation_space, probe.action_space)

    def play(count, seed):
        runner = _policy_runner(spec, spaces, Lean(), None, count, seed)
        played = runner.evaluate(count, deterministic=True, seed=seed, standalone=True)
        lengths = played["episode_lengths"]  # in the order of the envs
        assert [env.steps for env in runner.envs.sub_envs()] == lengths  # none stepped after
        return played["episode_returns"], lengths

    together = play(3, 7)
    assert set(rows) == {3}  # one forward pass a step over all three envs
    alone = [play(1, 7 + i) for i in range(3)]
    returns, lengths = zip(*alone, strict=True)  # each alone: ([its return], [its length])
    assert together == ([r for (r,) in returns], [n for (n,) in lengths])
    assert len(set(together[1])) > 1, together
