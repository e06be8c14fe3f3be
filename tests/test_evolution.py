"""ES and ARS through the CLI: thresholds within step budgets, a noise table once per node,
messages that do not grow with the policy, resume after kill -9, env failures, and bad input."""

import csv
import json
import pickle
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    BIN,
    kill_9_after_checkpoint,
    latest_checkpoint_iteration,
    mpi_env,
    run_mpi,
)

from mpirl.commands.train import make_request
from mpirl.errors import ConfigError

MPIRL = str(BIN / "mpirl")


def _train(n, *args, timeout=300):
    return run_mpi(n, MPIRL, "train", *args, timeout=timeout, env={"CI": "true"})


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "progress.csv") as file:
        return list(csv.DictReader(file))


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr}"


# Learning: the defaults; seed 7 was not used to choose them (seeds 0-4 were run while tuning).


def _learn(run_dir: Path, algo: str, budget: int) -> Path:
    _ok(_train(3, "--algo", algo, "--env", "CartPole-v1", "--run-dir", str(run_dir),
               "--seed", "7", "--stop",
               json.dumps({"episode_return_mean": 475, "timesteps_total": budget})))
    return run_dir


@pytest.fixture(scope="module")
def ars_run(tmp_path_factory):
    """ARS's learning run: checked by the learning test, evaluated and exported by another."""
    return _learn(tmp_path_factory.mktemp("ars") / "run", "ARS", 1_000_000)


@pytest.mark.parametrize(("algo", "budget"), [("ES", 3_000_000), ("ARS", 1_000_000)])
def test_cartpole_reaches_475_within_budget(tmp_path, request, algo, budget):
    if algo == "ARS":
        run_dir = request.getfixturevalue("ars_run")
    else:
        run_dir = _learn(tmp_path / "run", algo, budget)
    last = _rows(run_dir)[-1]
    assert float(last["episode_return_mean"]) >= 475, (
        f"{algo}: {last['episode_return_mean']} after {last['timesteps_total']} env steps")
    assert int(last["timesteps_total"]) <= budget + 50_000
    # Every generation's pairs came from both rollout ranks, all of them antithetic.
    assert int(last["pairs_this_iter"]) >= 2


def test_the_noise_table_is_shared_by_the_ranks_of_a_node(tmp_path):
    """Two rollout ranks with a 381 MB table: their summed proportional memory grows by about
    one table over a run with a 4 MB one, not two."""
    totals = {}
    for size in (1_000_000, 100_000_000):
        run_dir = tmp_path / f"noise{size}"
        _ok(_train(3, "--algo", "ES", "--env", "CartPole-v1", "--run-dir", str(run_dir),
                   "--config", json.dumps({"noise_size": size}),
                   "--stop", '{"training_iteration": 2}'))
        last = _rows(run_dir)[-1]
        totals[size] = float(last["rollout_pss_mb_total"])
        table_mb = float(last["noise_table_mb"])
    assert table_mb == pytest.approx(381.5, abs=0.1)
    growth = totals[100_000_000] - totals[1_000_000]
    assert 0.8 * table_mb < growth < 1.5 * table_mb, totals


def test_bytes_per_generation_do_not_grow_with_the_number_of_weights(tmp_path):
    """A 1M-weight policy (two hidden layers of 1000) sends what a 1.3k-weight one does (one
    rollout rank, which plays all 4 pairs)."""
    sent = {}
    for hidden in ([32], [1000, 1000]):
        run_dir = tmp_path / f"h{len(hidden)}"
        _ok(_train(2, "--algo", "ES", "--env", "CartPole-v1", "--run-dir", str(run_dir),
                   "--config", json.dumps({"hidden_sizes": hidden, "episodes_per_batch": 8,
                                           "train_batch_size": 0, "num_envs_per_worker": 2,
                                           "eval_prob": 0.0, "noise_size": 2_000_000}),
                   "--stop", '{"training_iteration": 2}'))
        last = _rows(run_dir)[-1]
        assert int(last["pairs_this_iter"]) == 4
        sent[len(hidden)] = float(last["bytes_per_rank_per_generation"])
    assert sent[2] == pytest.approx(sent[1], rel=0.05), sent
    assert sent[2] < 4_000  # about 2 KB, against 4 MB for one copy of the weights


def _state(run_dir: Path, iteration: int, name: str):
    path = run_dir / "checkpoints" / f"checkpoint_{iteration:06d}" / name
    with open(path, "rb") as file:
        return pickle.load(file)


DETERMINISTIC = ("iteration", "timesteps_total", "episodes_total", "episode_return_mean",
                 "perturbed_return_mean", "grad_norm", "pairs_this_iter")


def test_resume_after_kill_9_is_bit_identical(tmp_path):
    total = 6  # killed after the checkpoint at 2 (or 4), resumed through a periodic one
    config = json.dumps({"checkpoint_every": 2, "keep_checkpoints": 20, "print_layout": True,
                         "normalize_observations": True})
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    _ok(_train(3, "--algo", "ES", "--env", "CartPole-v1", "--run-dir", str(reference),
               "--config", config, "--stop", json.dumps({"training_iteration": total})))
    kill_9_after_checkpoint(3, interrupted, "rollout", 2, "--algo", "ES", "--env", "CartPole-v1",
                            "--config", config)
    assert latest_checkpoint_iteration(interrupted) < total
    proc = _train(3, "--resume", str(interrupted), "--stop",
                  json.dumps({"training_iteration": total}))
    _ok(proc)
    assert "resumed from" in proc.stdout
    for name in ("learner_0.pkl", "rollout_0.pkl", "rollout_1.pkl"):
        a, b = _state(reference, total, name), _state(interrupted, total, name)
        key = "weights" if name.startswith("learner") else "theta"
        assert np.array_equal(a[key], b[key]), name
    keep = [{k: r[k] for k in DETERMINISTIC} for r in _rows(reference)]
    assert [{k: r[k] for k in DETERMINISTIC} for r in _rows(interrupted)] == keep


def test_evaluate_and_export_an_es_checkpoint(tmp_path, ars_run):
    run_dir = ars_run  # its final checkpoint
    proc = subprocess.run([MPIRL, "evaluate", str(run_dir), "--episodes", "5", "--json"],
                          capture_output=True, text=True, timeout=120, env=mpi_env())
    _ok(proc)
    # The unperturbed policy, with the observation statistics of the run: a solved CartPole.
    assert json.loads(proc.stdout.strip().splitlines()[-1])["return_mean"] >= 400


def test_env_failures_are_recovered(tmp_path):
    run_dir = tmp_path / "run"
    _ok(_train(3, "--algo", "ES", "--env", "mpirl.testing:OccasionallyFailingCartPole",
               "--run-dir", str(run_dir), "--stop", '{"training_iteration": 10}'))
    last = _rows(run_dir)[-1]
    assert int(last["num_env_failures"]) > 0
    assert float(last["perturbed_return_mean"]) > 30  # it learns in spite of them
    # Episodes that reach the 300th step of an env instance fail every time: those pairs are
    # left out after their retries, not retried forever.
    assert sum(int(r["pairs_abandoned_this_iter"]) for r in _rows(run_dir)) > 0


def test_an_env_that_keeps_failing_ends_the_run_with_its_error(tmp_path):
    """A rank whose generation raises still takes part in the generation's collectives (the
    gather, the update's broadcast, the comparison), so none waits on it; the driver sends no
    update and raises that rank's own error."""
    proc = _train(3, "--algo", "ES", "--env", "mpirl.testing:FlakyCartPoleEnv",
                  "--run-dir", str(tmp_path / "run"), "--progress", "off",
                  "--config", json.dumps({"env_config": {"fail_every_steps": 3},
                                          "max_env_failures": 2}),
                  "--stop", '{"training_iteration": 5}', timeout=120)
    assert proc.returncode != 0
    # Under mpirl train the generations run in one standing call per rank.
    assert "raised in generation_rounds(): mpirl.errors.EnvFailureError" in proc.stderr, \
        proc.stderr[-3000:]
    assert "injected failure in step 3" in proc.stderr and "AssertionError" not in proc.stderr


@pytest.mark.parametrize(("algo", "config", "message"), [
    ("ES", {"num_learners": 1}, "num_learners must be 0, got 1"),
    ("ARS", {"rollouts_used": 9, "num_rollouts": 4},
     r"rollouts_used \(9\) must be at most num_rollouts \(4\)"),
    ("ES", {"noise_size": 100}, "noise_size 100 is smaller than the policy's 226 weights"),
    ("ES", {"eval_prob": 1.0}, '"eval_prob" = 1.0 is out of range'),
    ("ES", {"noise_stdev": 0}, '"noise_stdev" = 0 is out of range'),
    ("ARS", {"stepsize": 0.1}, "unknown config key"),
])
def test_bad_settings_are_refused(algo, config, message):
    # make_request's checks, made on every rank before anything starts: in-process here, and
    # once through mpiexec below.
    with pytest.raises(ConfigError) as error:
        make_request(algo, "CartPole-v1", None, config, {"training_iteration": 1}, None, None)
    assert re.search(message, str(error.value)), str(error.value)
    assert "\n" not in str(error.value)


def test_a_bad_setting_through_mpiexec_is_one_line_without_a_traceback(tmp_path):
    proc = _train(2, "--algo", "ES", "--env", "CartPole-v1", "--run-dir",
                  str(tmp_path / "run"), "--config", '{"noise_size": 100}',
                  "--stop", '{"training_iteration": 1}', timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "noise_size 100 is smaller than the policy's 226 weights" in proc.stderr
    assert proc.stderr.count("mpirl: error:") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_trajectory_dumps_are_refused(tmp_path):
    proc = _train(2, "--algo", "ES", "--env", "CartPole-v1", "--run-dir", str(tmp_path / "run"),
                  "--dump-trajectories", str(tmp_path / "dump"),
                  "--stop", '{"training_iteration": 1}', timeout=120)
    assert proc.returncode != 0
    assert "ES does not write trajectory dumps" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_generation_fixes_the_steps_of_an_iteration_itself():
    """The trainer's steps per iteration (the manifest's train_batch_size) come from ES's and
    ARS's config, not from a probe for rollout_fragment_length; other configs leave it to the
    trainer's count."""
    from mpirl.algorithms import ppo
    from mpirl.algorithms.evolution import ars, es

    assert es.Config(train_batch_size=1234).samples_per_iteration(rollout_slots=16) == 1234
    assert ars.Config().samples_per_iteration(rollout_slots=16) == 0
    assert ppo.Config(rollout_fragment_length=50).samples_per_iteration(rollout_slots=16) == 800


def test_every_rank_plays_its_share_of_evaluations_no_more():
    """Evaluation episodes are every 1/p-th start from a random phase: of n starts a rank
    evaluates floor(np) or ceil(np), so the slowest of many ranks plays no more than any other
    (with a draw per start, the most of 64 ranks' binomial counts is about 3 at n = 9, p = 0.1),
    and p of all starts evaluate on average."""
    from mpirl.algorithms.evolution.perturbation_worker import EvaluationDraws

    rng = np.random.default_rng(0)
    for p in (0.03, 0.1, 0.25, 0.5):
        counts = []
        for _ in range(2000):
            draws = EvaluationDraws(p, rng)
            counts.append(sum(draws.next_is_evaluation() for _ in range(9)))
        assert set(counts) <= {int(9 * p), int(9 * p) + 1}, p
        assert abs(np.mean(counts) / 9 - p) < 0.01, p
    never = EvaluationDraws(0.0, rng)
    assert not any(never.next_is_evaluation() for _ in range(100))


class _Future:
    def __init__(self, error=None):
        self.error, self.settled = error, None

    def result(self):
        if self.error is not None:
            raise self.error
        raise AssertionError("the call answered no message of its own")

    def settle(self, value):
        self.settled = value


class _Worker:
    def __init__(self, rank):
        self.rank = rank


class _Learner:
    def __init__(self, *answers):
        self.answers, self.calls = list(answers), []

    def call(self, method, *args):
        self.calls.append((method, *args))
        return self.answers.pop(0)


def _generation(*learner_answers, failed=()):
    from types import SimpleNamespace

    workers = [_Worker(rank) for rank in (1, 2, 3)]
    futures = [_Future(RuntimeError(f"rank {w.rank} failed") if w.rank in failed else None)
               for w in workers]
    return SimpleNamespace(learners=[_Learner(*learner_answers)]), workers, futures


def _part(rank, result):
    from mpirl.runtime.gathered import encode_answer

    return encode_answer(rank, result)


def test_an_agreed_generation_settles_every_call_with_its_one_answer():
    from mpirl.algorithms.evolution.operators import _generation_update

    answer = {"checksum": "aa", "grad_norm": 0.5}
    algo, workers, futures = _generation((b"update", True, answer))
    message, applied = _generation_update(futures, workers, algo.learners[0])
    assert message == b"update" and applied == [(0, answer)]
    assert algo.learners[0].calls == [("take_generation",)]
    assert [f.settled for f in futures] == [answer] * 3


def test_a_failed_generation_gets_no_update_and_raises_its_error():
    """Rank 2's call failed: the update broadcast is empty, and rank 2's own error is raised."""
    from mpirl.algorithms.evolution.operators import _generation_update

    algo, workers, futures = _generation(
        (b"", False, [_part(1, {}), _part(2, None), _part(3, {})]), failed=(2,))
    with pytest.raises(RuntimeError, match="rank 2 failed"):
        _generation_update(futures, workers, algo.learners[0])
    assert [f.settled for f in futures] == [{}, None, {}]


def test_a_generation_whose_answers_differ_is_settled_from_each_rank():
    """The comparison failed: each rank's answer comes from the gather, so the checksums that
    differ are the driver's to see (``check_same_weights`` raises ``DivergedWeights`` on them)."""
    from mpirl.algorithms.evolution.operators import _generation_update

    algo, workers, futures = _generation((b"update", False, [
        _part(rank, {"checksum": checksum}) for rank, checksum in ((1, "aa"), (2, "aa"),
                                                                    (3, "ff"))]))
    _, applied = _generation_update(futures, workers, algo.learners[0])
    assert [(i, r["checksum"]) for i, r in applied] == [(0, "aa"), (1, "aa"), (2, "ff")]


def test_the_update_sums_up_the_records_whatever_the_ranks():
    """What the update's root broadcasts: the pairs in rank order, the observation statistics
    merged, the evaluation episodes and totals; the driver reads its statistics from it."""
    from mpirl.algorithms.evolution.generation_record import pack_generation, summarize_generation

    from mpirl.models.statistics import RunningMeanStd

    rng = np.random.default_rng(1)
    records, everything = [], RunningMeanStd((3,))
    for rank, pairs in enumerate((2, 0, 3)):
        delta = RunningMeanStd((3,))
        delta.update(rng.normal(size=(5 + rank, 3)))
        everything.merge(delta.mean, delta.var, delta.count)
        records.append(pack_generation(
            list(range(10 * rank, 10 * rank + pairs)), [[1.0 + i, -1.0] for i in range(pairs)],
            [[10, 20]] * pairs, [7.0 * rank], [30 + rank], 100, rank, 2, 50.0, delta))
    summary = summarize_generation(records)
    assert summary["indices"].tolist() == [0, 1, 20, 21, 22]
    assert summary["returns"].tolist() == [[1.0, -1.0], [2.0, -1.0]] + [
        [1.0, -1.0], [2.0, -1.0], [3.0, -1.0]]
    mean, var, count = summary["filter_delta"]
    assert np.allclose(mean, everything.mean) and np.allclose(var, everything.var)
    assert count == pytest.approx(everything.count)
    assert summary["eval_returns"] == [0.0, 7.0, 14.0] and summary["eval_lengths"] == [30, 31, 32]
    assert (summary["env_steps"], summary["pairs_abandoned"], summary["env_failures"],
            summary["pss_mb"], summary["len_mean"]) == (300, 3, 6, 150.0, 15.0)
    assert summary["record_bytes"] == records[0].nbytes


def test_generation_records_unpack_in_rank_order():
    """Ranks with different numbers of pairs and evaluation episodes, one with none at all:
    ``unpack_generations`` reads every field back exactly, in rank order."""
    from mpirl.algorithms.evolution.generation_record import pack_generation, unpack_generations

    from mpirl.models.statistics import RunningMeanStd

    rng = np.random.default_rng(0)
    ranks, deltas = [], []
    for pairs, evaluations in ((2, 1), (0, 0), (3, 2)):
        delta = RunningMeanStd((2, 2))
        delta.update(rng.normal(size=(5, 2, 2)))
        deltas.append(delta)
        ranks.append(dict(indices=[int(i) for i in rng.integers(0, 2**40, pairs)],
                          returns=rng.normal(size=(pairs, 2)).tolist(),
                          lengths=rng.integers(1, 500, (pairs, 2)).tolist(),
                          eval_returns=rng.normal(size=evaluations).tolist(),
                          eval_lengths=rng.integers(1, 500, evaluations).tolist(),
                          env_steps=int(rng.integers(1, 1000)), pairs_abandoned=pairs % 2,
                          env_failures=1, pss_mb=70.5, delta=delta))
    found = unpack_generations([pack_generation(**r) for r in ranks])
    assert found["indices"].tolist() == [i for r in ranks for i in r["indices"]]
    assert found["indices"].dtype == np.int64 and found["lengths"].dtype == np.int64
    assert found["returns"].tolist() == [p for r in ranks for p in r["returns"]]
    assert found["lengths"].tolist() == [p for r in ranks for p in r["lengths"]]
    assert found["eval_returns"].tolist() == [x for r in ranks for x in r["eval_returns"]]
    assert found["eval_lengths"].tolist() == [x for r in ranks for x in r["eval_lengths"]]
    for name in ("env_steps", "pairs_abandoned", "env_failures", "pss_mb"):
        assert found[name].tolist() == [r[name] for r in ranks], name
    assert found["filter_count"].tolist() == [5, 5, 5]
    assert np.array_equal(found["filter_means"], [d.mean.ravel() for d in deltas])
    assert np.array_equal(found["filter_vars"], [d.var.ravel() for d in deltas])
    # Without observation statistics (images): no delta in the records.
    bare = {**ranks[0], "delta": None}
    found = unpack_generations([pack_generation(**bare), pack_generation(**bare)])
    assert found["filter_means"].shape == (2, 0) and found["indices"].size == 4


def test_a_generation_whose_pairs_were_all_abandoned_makes_a_row_with_no_update():
    """Every pair of a generation may be left out after env failures (an env that fails at its
    300th step, once the policy lasts that long; seen on one rollout rank): the ranks apply no
    update, and the row says so with NaN returns instead of the driver raising ValueError."""
    from types import SimpleNamespace

    from mpirl.algorithms.evolution.operators import Generation, generation_stats

    summary = {"indices": np.zeros(0, np.int64), "returns": np.zeros((0, 2)),
               "len_mean": float("nan"), "pairs_abandoned": 25, "eval_returns": [],
               "record_bytes": 100, "pss_mb": 70.0}
    row = generation_stats(Generation(b"update", [(0, {"checksum": 1})], summary),
                           SimpleNamespace(noise_table_mb=95.4))
    assert row["pairs_this_iter"] == 0 and row["pairs_abandoned_this_iter"] == 25
    assert np.isnan(row["perturbed_return_mean"]) and np.isnan(row["perturbed_return_max"])
    assert np.isnan(row["grad_norm"])  # no update was made
