"""PETS with its ensemble sharded over learner ranks, and a model or data that goes bad (issue
39): every learner trains its block of members on the same transitions, learner 0 gathers the
whole ensemble and broadcasts it; a diverged member or non-finite observations stop the run
with one line naming the training iteration, exit 2, and the last good checkpoint kept."""

from __future__ import annotations

import json
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import local_train, run_mpi
from mpirl.algorithms.model_based.dynamics import DynamicsEnsemble, EnsembleTrainer
from mpirl.algorithms.model_based.dynamics_spec import DynamicsSpec, EnsembleTrainerSpec
from mpirl.algorithms.model_based.pets_learner import DynamicsLearner, member_block
from test_pets import QUICK, refusal
from test_train import MPIRL, rows, train

from mpirl.errors import CheckpointError, ModelDivergedError
from mpirl.runtime.state_files import read_state_file

#: Columns that follow from the data and the training alone.
MODEL_COLUMNS = ("transitions", "model_error", "model_error_max", "model_train_nll",
                 "model_epochs", "model_epochs_total", "eval_return_mean")
#: Early stopping within the iteration (patience 1 of at most 40 epochs), so the learners must
#: agree on when to stop. The rollout rank plans with MPPI (the other runs use CEM).
SHARDED = {**QUICK, "model_max_epochs": 40, "model_patience": 1, "evaluation_interval": 1,
           "planner": "mppi", "mppi_population": 20, "mppi_iterations": 2}


def _model_rows(run_dir):
    return [{k: float(row[k]) for k in MODEL_COLUMNS} for row in rows(run_dir)]


def test_two_learner_ranks_train_the_same_ensemble_as_one(tmp_path):
    """mpiexec -n 3 with one learner rank against -n 4 with two (members 0-2 and 3-4), the
    two-learner run stopped after iteration 2 and resumed from its checkpoint to 4: the model
    columns agree within 1e-4 (relative; only floating-point summation may differ), and so
    do the evaluation returns, which the rollout rank plans with the whole broadcast
    ensemble. The one-learner run is also the check of a learner rank (driver, learner rank,
    one rollout rank: the transitions travel from the rollout rank to the learner's over the
    data plane) and of MPPI planning: random actions below 40 steps, then planned ones."""
    one = {**SHARDED, "num_learners": 1}
    two = {**SHARDED, "num_learners": 2, "checkpoint_every": 2}
    _, single, _ = train(3, tmp_path / "one", "--algo", "PETS", "--env", "Pendulum-v1",
                         "--config", json.dumps(one), "--stop", '{"training_iteration": 4}')
    _, sharded, _ = train(4, tmp_path / "two", "--algo", "PETS", "--env", "Pendulum-v1",
                          "--config", json.dumps(two), "--stop", '{"training_iteration": 2}')
    proc = run_mpi(4, *MPIRL, "train", "--resume", str(sharded), "--stop",
                   '{"training_iteration": 4}', timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout, proc.stdout
    progress = rows(single)
    assert [int(r["transitions"]) for r in progress] == [20, 40, 60, 80]
    assert [r["random_actions"] for r in progress] == ["1.0", "1.0", "0.0", "0.0"]
    assert all(math.isfinite(float(r["model_error"])) for r in progress)
    assert all(math.isfinite(float(r["eval_return_mean"])) for r in progress)
    expected, got = _model_rows(single), _model_rows(sharded)
    assert len(got) == 4
    assert [r["transitions"] for r in got] == [20, 40, 60, 80]
    # The early stopping did stop some iteration before its 40 epochs.
    assert min(r["model_epochs"] for r in expected) < 40, expected
    for want, have in zip(expected, got, strict=True):
        for column in MODEL_COLUMNS:
            assert have[column] == pytest.approx(want[column], rel=1e-4, nan_ok=True), column
    # Its checkpoint resumes only on two learner ranks: a learner of a one-learner run (members
    # 0..4) refuses the state learner 0 of the two wrote, in-process here (it is the check
    # load_state runs on the learner rank; a learner rank's error ending the run with exit 2
    # and one line: test_a_diverging_member_stops_the_run_..., end to end).
    checkpoint = sharded / "checkpoints" / _latest(sharded)
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    state = read_state_file(checkpoint / "learner_0.pkl", files["learner_0.pkl"])
    assert state["block"] == [0, 1, 2] and state["learners"] == 2
    alone = DynamicsLearner.__new__(DynamicsLearner)
    alone.context, alone.block = SimpleNamespace(local=True), [0, 1, 2, 3, 4]
    alone.model = SimpleNamespace(spec=SimpleNamespace(ensemble_size=5))
    with pytest.raises(CheckpointError) as refused:
        alone.set_state(state)
    assert str(refused.value) == (
        "this checkpoint's ensemble was trained on 2 learner ranks (this one's members 0..2), "
        "this run has 1 (members 0..4): resume with num_learners 2")
    assert CheckpointError.exit_code == 2


def _fit_alone_and_in_blocks(blocks: list[list[int]]) -> tuple[dict, list[dict],
                                                                  DynamicsEnsemble,
                                                                  list[DynamicsEnsemble]]:
    """One trainer over 4 members, and one per block over the same members' initial weights,
    the blocks' trainers agreeing every epoch as learner ranks do (here threads)."""
    rng = np.random.default_rng(0)
    n = 300
    obs = rng.normal(size=(n, 2)).astype(np.float32)
    actions = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    data = {"obs": obs, "actions": actions, "rewards": -np.square(obs).sum(1),
            "next_obs": obs + 0.1 * actions + 0.1 * rng.normal(size=(n, 2)),
            "terminated": np.zeros(n, np.float32)}
    spec = DynamicsSpec(2, 1, ensemble_size=4, elites=2, hidden_sizes=(16,))
    trainer_spec = EnsembleTrainerSpec(max_epochs=30, patience=1, batch_size=32)
    torch.manual_seed(0)
    whole = DynamicsEnsemble(spec)
    shards = []
    for block in blocks:
        shard = DynamicsEnsemble(DynamicsSpec(2, 1, ensemble_size=len(block), elites=1,
                                              hidden_sizes=(16,)))
        for i, m in enumerate(block):
            shard.load_member_state(i, whole.member_state(m))
        shards.append(shard)
    stats = EnsembleTrainer(whole, trainer_spec, seed=3).train(data)
    barrier, board = threading.Barrier(len(blocks)), {}

    def agree(index):
        def combine(improved, divergence):
            board[index] = (improved, divergence)
            barrier.wait()
            answers = [board[i] for i in range(len(blocks))]
            barrier.wait()
            return any(a for a, _ in answers), next((d for _, d in answers if d), None)
        return combine

    results = [None] * len(blocks)

    def fit(index):
        trainer = EnsembleTrainer(shards[index], trainer_spec, seed=3,
                                  member_ids=blocks[index], agree=agree(index))
        results[index] = trainer.train(data)

    threads = [threading.Thread(target=fit, args=(i,)) for i in range(len(blocks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return stats, results, whole, shards


def test_a_sharded_trainer_fits_the_same_members_as_the_whole():
    blocks = [member_block(4, 2, 0), member_block(4, 2, 1)]
    assert blocks == [[0, 1], [2, 3]]
    stats, results, whole, shards = _fit_alone_and_in_blocks(blocks)
    assert stats["epochs"] < 30  # early stopping decided, on the same epoch for both blocks
    assert all(r["epochs"] == stats["epochs"] for r in results)
    mse = [e for r in results for e in r["member_mse"]]
    np.testing.assert_allclose(mse, stats["member_mse"], rtol=1e-4)
    for block, shard in zip(blocks, shards, strict=True):
        for i, m in enumerate(block):
            for name, value in shard.member_state(i).items():
                torch.testing.assert_close(value, whole.member_state(m)[name], rtol=1e-4,
                                           atol=1e-5)


def test_more_learners_than_members_is_refused(tmp_path, capsys):
    """In-process (test_pets.refusal: rank 0's checks, through the CLI's main); test_pets.py and
    test_mbpo.py run a refusal end to end."""
    message = refusal(tmp_path, capsys, "--algo", "PETS", "--env", "Pendulum-v1", "--config",
                      '{"num_learners": 6}')
    assert "num_learners (6) cannot exceed ensemble_size (5)" in message


#: Each env instance's observations overflow from its 25th step: iteration 3 (steps 21-30 of
#: each env) brings the first bad transitions; iterations 1 and 2 are checkpointed.
EXPLODING = {**QUICK, "evaluation_interval": 0, "checkpoint_every": 1,
             "env_config": {"explode_after": 25}}


def _latest(run_dir):
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _one_stop_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mpirl:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_diverging_member_stops_the_run_at_its_iteration_and_keeps_the_last_checkpoint(
        tmp_path):
    """Observations at float32's edge make the changes the model learns overflow: the
    ensemble's loss is NaN in iteration 3, trained on two learner ranks (the divergence is
    agreed over both). Exit 2, one line naming member and iteration, checkpoint 2 the latest;
    resuming from it reaches iteration 3 again and stops the same way."""
    run_dir = tmp_path / "run"
    args = ["--algo", "PETS", "--env-module", "mpirl.testing", "--env", "MpirlOverflowing-v0",
            "--config", json.dumps({**EXPLODING, "num_learners": 2}), "--stop",
            '{"training_iteration": 5}', "--run-dir", str(run_dir)]
    proc = run_mpi(4, *MPIRL, "train", *args, timeout=120, env={"CI": "true"})
    assert proc.returncode == 2, proc.stderr
    line = _one_stop_line(proc.stderr)
    assert line.startswith("mpirl: training iteration 3: dynamics ensemble member 0 diverged "
                           "at epoch 7: its training loss is nan"), line
    assert "its last checkpoint is kept" in line
    assert _latest(run_dir) == "checkpoint_000002"
    assert [int(r["iteration"]) for r in rows(run_dir)] == [1, 2]
    assert ModelDivergedError.exit_code == 2
    again = run_mpi(4, *MPIRL, "train", "--resume", str(run_dir), "--stop",
                    '{"training_iteration": 5}', timeout=120, env={"CI": "true"})
    assert again.returncode == 2, again.stderr
    assert _one_stop_line(again.stderr) == line
    assert _latest(run_dir) == "checkpoint_000002"


def test_nan_observations_stop_the_run_before_the_model_learns_them(tmp_path):
    """In local mode (the learner in the driver's process) the same one line, for NaN data."""
    config = {**EXPLODING, "env_config": {"explode_after": 25, "value": "nan"}}
    proc = local_train(tmp_path, "--algo", "PETS", "--env-module", "mpirl.testing", "--env",
                       "MpirlOverflowing-v0", "--config", json.dumps(config), "--stop",
                       '{"training_iteration": 5}')
    assert proc.returncode == 2, proc.stderr
    line = _one_stop_line(proc.stderr)
    assert line == ("mpirl: training iteration 3: 10 of 20 new transitions have NaN or "
                    "infinite obs: the environment returned them, and the dynamics model "
                    "cannot learn from them; the run stopped, its last checkpoint is kept"), line
    assert _latest(tmp_path / "run") == "checkpoint_000002"
