"""The model-based algorithms (PETS, MBPO) through the whole CLI, as a user meets them beside
the other algorithms (issue 39): a resume after kill -9 that is bit-identical, a stop signal on
a rollout rank, HDF5 dumps of the real transitions, ``mpirl export`` whose file acts like the
checkpoint, ``mpirl tune`` over their keys, callbacks on every role, and model terminations
(a user's function, or a learned classifier) on an env that ends off a cliff."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import test_mbpo
import test_pets
from conftest import (
    hook_log,
    hook_ranks,
    kill_9_after_checkpoint,
    latest_checkpoint_iteration,
    local_train,
    resume_then_stop_a_rollout_rank,
    run_mpi,
)
from test_mbpo import QUICK as MBPO_QUICK
from test_pets import QUICK
from test_train import MPIRL, rows

PENDULUM = ("--env", "Pendulum-v1")
ALGOS = ("PETS", "MBPO")
#: Each algorithm's quick settings: small plans or SAC steps, small models.
QUICK_OF = {"PETS": QUICK, "MBPO": MBPO_QUICK}
#: What each algorithm's learner checkpoints beside its weights: its buffers.
BUFFERS = {"PETS": ("data",), "MBPO": ("real", "model_data")}
#: Its real transitions column, and how many a quick iteration adds (2 rollout ranks).
REAL = {"PETS": ("transitions", 40), "MBPO": ("real_buffer_size", 20)}

#: Columns that follow from the data and the training alone (not from wall time).
DETERMINISTIC = {
    "PETS": ("iteration", "timesteps_total", "transitions", "model_error", "model_train_nll",
             "model_epochs_total", "eval_return_mean", "episode_return_mean"),
    "MBPO": ("iteration", "timesteps_total", "real_buffer_size", "model_buffer_size",
             "rollout_length", "model_error", "model_train_nll", "critic_loss", "actor_loss",
             "sgd_steps_total", "eval_return_mean", "episode_return_mean")}


def _deterministic(run_dir, algo):
    return [{k: row[k] for k in DETERMINISTIC[algo]} for row in rows(run_dir)]


def _checkpointed(run_dir, iteration, name):
    path = run_dir / "checkpoints" / f"checkpoint_{iteration:06d}" / name
    with open(path, "rb") as file:
        return pickle.load(file)


def _same_arrays(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


#: The reference run's iterations: it checkpoints every 2 and keeps every checkpoint.
TOTAL = 8
#: Where the interrupted run of the kill -9 test ends, compared with the reference's checkpoint.
RESUMED_TO = 6


def _reference_config(algo):
    return json.dumps({**QUICK_OF[algo], "checkpoint_every": 2, "keep_checkpoints": 10,
                       "print_layout": True})


@pytest.fixture(scope="module", params=ALGOS)
def reference(request, tmp_path_factory):
    """One uninterrupted quick run of each algorithm, 8 iterations: the kill -9 test's
    reference, the run the export test exports (its last checkpoint), and the quick run whose
    rows, output and checkpoint test_pets.py and test_mbpo.py check."""
    algo = request.param
    run_dir = tmp_path_factory.mktemp(f"reference_{algo}") / "run"
    proc = run_mpi(3, *MPIRL, "train", "--algo", algo, *PENDULUM, "--config",
                   _reference_config(algo), "--run-dir", str(run_dir), "--stop",
                   json.dumps({"training_iteration": TOTAL}), timeout=120, env={"CI": "true"})
    assert proc.returncode == 0, proc.stderr
    return algo, run_dir, proc


def test_a_quick_run_reports_its_columns_and_its_checkpoint_evaluates(reference, monkeypatch):
    """test_pets.check_a_quick_run and test_mbpo.check_a_quick_run on the reference run."""
    algo, run_dir, proc = reference
    {"PETS": test_pets, "MBPO": test_mbpo}[algo].check_a_quick_run(proc, run_dir, monkeypatch)


def test_resume_after_kill_9_and_a_stop_signal_is_bit_identical(tmp_path, reference):
    """The driver is killed with kill -9 after checkpoint 2 (the ensemble fitted, and for MBPO
    its first model rollouts made); the run resumed from there (with no periodic checkpoints:
    ``checkpoint_every`` 0 given on resume) gets SIGUSR1 on a rollout rank once it has run an
    iteration: it checkpoints where it stopped and exits 75 (resume me), naming the rank;
    resumed again, on to 6. Its rows (the real transitions column: the resumed learners kept
    every one), its learner's buffers and weights (the ensemble and, for MBPO, SAC) and the
    rollout ranks' weights and observations equal those of the reference run (never stopped)
    at its checkpoint 6, bit for bit. (The stop signal was a test of its own, 2 launches. Until
    2026-11-29 the kill came after checkpoint 4 and the resumed run went on to 8, the
    reference's end: some 3 iterations more over the 3 launches.)"""
    algo, reference, _ = reference
    total, config = RESUMED_TO, _reference_config(algo)
    interrupted = tmp_path / "interrupted"
    kill_9_after_checkpoint(3, interrupted, "driver", 2, "--algo", algo, *PENDULUM,
                            "--config", config)
    killed_at = latest_checkpoint_iteration(interrupted)
    assert killed_at < total - 2, "the kill came too late"
    resume_then_stop_a_rollout_rank(3, interrupted, killed_at, total)
    proc = run_mpi(3, *MPIRL, "train", "--resume", str(interrupted), "--stop",
                   json.dumps({"training_iteration": total}), timeout=120)
    assert proc.returncode == 0, proc.stderr

    assert _deterministic(interrupted, algo) == _deterministic(reference, algo)[:total]
    a = _checkpointed(reference, total, "learner_0.pkl")
    b = _checkpointed(interrupted, total, "learner_0.pkl")
    assert np.array_equal(a["weights"], b["weights"])
    for buffer in BUFFERS[algo]:
        assert len(a[buffer]["obs"]) and _same_arrays(a[buffer], b[buffer]), buffer
    column, _ = REAL[algo]
    assert len(a[BUFFERS[algo][0]]["obs"]) == int(float(rows(reference)[total - 1][column]))
    for name in ("rollout_0.pkl", "rollout_1.pkl"):
        ra = _checkpointed(reference, total, name)["runner"]
        rb = _checkpointed(interrupted, total, name)["runner"]
        assert np.array_equal(ra["weights"]["default"], rb["weights"]["default"]), name
        assert np.array_equal(ra["obs"], rb["obs"]), name
        if algo == "PETS":  # the broadcast arrived: the rank plans with the whole ensemble
            assert np.array_equal(ra["weights"]["default"], a["weights"]), name


def check_the_dump(run_dir, dump, envs):
    """Each env played one whole 200-step Pendulum episode: the dump holds every env's episode
    with the rewards the envs gave and actions inside the bounds. (MBPO's dump: test_mbpo.py's
    test_real_transitions_are_dumped_to_hdf5, on its learning run.)"""
    from mpirl.data.reader import open_dataset

    last = rows(run_dir)[-1]
    dataset = open_dataset(dump)
    assert dataset.num_episodes == envs == int(last["episodes_total"])
    assert dataset.total_steps == 200 * envs == int(last["timesteps_total"])
    returns = sorted(float(episode.rewards.sum()) for episode in dataset.iterate_episodes())
    for episode in dataset.iterate_episodes():
        assert episode.observations.shape[1:] == (3,) and len(episode.actions) == 200
        assert np.all(np.abs(episode.actions) <= 2.0) and np.all(episode.rewards <= 0)
    assert float(last["episode_return_mean"]) == pytest.approx(np.mean(returns), rel=1e-5)


def test_export_keeps_the_whole_model_and_acts_like_the_checkpoint(tmp_path, reference):
    """The exported .npz holds the whole broadcast vector (the ensemble's normalizers and
    elites beside the parameters; MBPO's SAC too), so evaluating the file acts exactly as
    evaluating the checkpoint (``evaluate``, what ``mpirl evaluate`` runs, in-process: the
    command itself is run end to end by test_pets.py and test_mbpo.py)."""
    from mpirl.commands.evaluate import evaluate

    _, run_dir, _ = reference
    exported = tmp_path / "model.npz"
    proc = run_mpi(1, *MPIRL, "export", str(run_dir), "-o", str(exported), timeout=60)
    assert proc.returncode == 0, proc.stderr
    rollout = _checkpointed(run_dir, TOTAL, "rollout_0.pkl")["runner"]["weights"]["default"]
    with np.load(exported, allow_pickle=False) as arrays:
        assert np.array_equal(arrays["flat_weights"], rollout)
    played = [evaluate(source, 1) for source in (run_dir, exported)]
    assert played[0].returns == played[1].returns and np.isfinite(played[0].returns).all()


SPACES = {"PETS": {"planning_horizon": {"randint": [3, 6]},
                   "cem_population": {"choice": [16, 24]},
                   "lr": {"loguniform": [3e-4, 3e-3]}},
          "MBPO": {"rollout_batch_size": {"choice": [16, 24]},
                   "real_ratio": {"uniform": [0.05, 0.5]},
                   "model_lr": {"loguniform": [3e-4, 3e-3]}}}


@pytest.mark.parametrize("algo", ALGOS)
def test_tune_searches_their_keys(tmp_path, algo):
    space = SPACES[algo]
    proc = run_mpi(2, *MPIRL, "tune", "--search", "random", "--num-samples", "2", "--space",
                   json.dumps(space), "--ranks-per-trial", "1", "--metric", "eval_return_mean",
                   "--mode", "max", "--run-dir", str(tmp_path / "tune"), "--",
                   "--algo", algo, *PENDULUM, "--config", json.dumps(QUICK_OF[algo]),
                   "--stop", '{"training_iteration": 2}', timeout=150)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "tune" / "result.json").read_text())
    assert set(result["best_config"]) == set(space), result
    for trial in ("trial_000", "trial_001"):
        config = json.loads((tmp_path / "tune" / trial / "params.json").read_text())["config"]
        for key, value in config.items():
            if "choice" in space.get(key, {}):
                assert value in space[key]["choice"], (key, value)
        progress = rows(tmp_path / "tune" / trial)
        assert len(progress) == 2 and progress[-1]["eval_return_mean"] != "nan"


def test_pets_callbacks_run_on_every_role_and_its_real_transitions_are_dumped(tmp_path):
    """The driver's hooks, the planning ranks' episodes and samples, and each learner rank's
    training of its members (two learner ranks); the same run dumps its real transitions to
    HDF5 (check_the_dump: each of the planning rank's 2 envs one whole 200-step episode)."""
    from conftest import PROGRAMS

    probe, run_dir, dump = tmp_path / "probe", tmp_path / "run", tmp_path / "dump"
    probe.mkdir()
    config = {**QUICK, "callbacks": "callbacks_probe:Probe", "num_learners": 2,
              "rollout_fragment_length": 100, "checkpoint_every": 2, "evaluation_interval": 0}
    proc = run_mpi(4, *MPIRL, "train", "--algo", "PETS", *PENDULUM, "--run-dir", str(run_dir),
                   "--config", json.dumps(config), "--dump-trajectories", str(dump),
                   "--stop", '{"training_iteration": 2}',
                   timeout=120, env={"PYTHONPATH": str(PROGRAMS), "PROBE_DIR": str(probe)})
    assert proc.returncode == 0, proc.stderr
    check_the_dump(run_dir, dump, config["num_envs_per_worker"])
    log = hook_log(probe)
    ranks_of = hook_ranks(log)
    # The driver (rank 0), one planning rank (1) with 2 envs: one 200-step episode each in 2
    # iterations of 100 steps; learner ranks 2 and 3.
    assert ranks_of == {"on_algorithm_init": {0}, "on_train_result": {0}, "on_checkpoint": {0},
                        "on_episode_end": {1}, "on_sample_end": {1},
                        "on_learn_on_batch": {2, 3}}
    assert sum(e["hook"] == "on_episode_end" for e in log) == 2
    samples = [e for e in log if e["hook"] == "on_sample_end"]
    assert [e["rows"] for e in samples] == [200, 200]
    assert {e["actor"] for e in samples} == {"PlanningModel"}
    learned = [e for e in log if e["hook"] == "on_learn_on_batch"]
    assert len(learned) == 4 and all(e["epochs"] >= 1 for e in learned)
    assert [int(float(r["iteration_twice"])) for r in rows(run_dir)] == [2, 4]


#: PETS on the cliff walk: small plans, one rollout rank x 4 envs x 40 steps an iteration,
#: one evaluation (4 episodes) after the last.
CLIFF = {**QUICK, "num_envs_per_worker": 4, "rollout_fragment_length": 40,
         "initial_random_steps": 80, "model_max_epochs": 10, "evaluation_interval": 5,
         "evaluation_episodes": 4, "checkpoint_every": 5}


def _cliff_run(tmp_path, name, **config):
    """In local mode: its rows and checkpoint are bit for bit those of mpiexec -n 2 (one
    rollout rank), checked 2026-11-29, without a second rank's start-up."""
    run_dir = tmp_path / name
    proc = local_train(run_dir, "--algo", "PETS", "--env", "MpirlCliffWalk-v0",
                       "--env-module", "mpirl.testing", "--config",
                       json.dumps({**CLIFF, **config}), "--stop", '{"training_iteration": 5}')
    run_dir = run_dir / "run"
    assert proc.returncode == 0, proc.stderr
    return rows(run_dir), _checkpointed(run_dir, 5, "learner_0.pkl")["data"]


def test_a_termination_fn_or_a_learned_one_keeps_the_plans_off_the_cliff(tmp_path):
    """The cliff walk pays more the further right, and ends past 0.8. Told where it ends
    (termination_fn), the planner stays near the edge; so it does once its classifier has
    learned the terminations (learn_termination, which also keeps the terminated steps, their
    next state marked unknown); blind, it walks off within a few steps. PETS's learning test in
    the suite (its Pendulum goal is benchmarks/model_based.py's figure): the ensemble learns
    the walk's dynamics and rewards from 800 real steps, and the plans over it must reach the
    return thresholds. The evaluation after the 5th iteration, mpiexec -n 2 (one rollout rank
    of 4 envs; the local mode this test runs in plays the same, bit for bit), seeds 0/1/2/3/4
    (2026-11-29): told 65.2/65.6/65.7/51.5/51.7, learned 55.2/56.3/61.4/58.0/60.8, blind
    6.6/6.8/6.2/7.1/6.2 (at most 40 x 1.8; uniformly random actions score about 24, standing
    still 40). Until 2026-11-29 it ran on 2 rollout ranks of 2
    envs, evaluated every iteration (seeds 0/1/2: told 65.1/58.9/65.7, learned
    59.2/52.3/54.1, blind 7.5/7.6/8.6), 36.5 CPU-s against about 24 now."""
    told, data = _cliff_run(tmp_path, "told", termination_fn="mpirl.testing:cliff_walk_ended")
    blind, _ = _cliff_run(tmp_path, "blind")
    learned, kept = _cliff_run(tmp_path, "learned", learn_termination=True,
                               model_max_epochs=50)
    assert float(told[-1]["eval_return_mean"]) > 40 > 20 > float(blind[-1]["eval_return_mean"])
    assert float(learned[-1]["eval_return_mean"]) > 35
    assert not data["terminated"].any() and "next_obs_observed" not in data
    ended = kept["terminated"] > 0.5
    assert ended.any() and np.array_equal(kept["next_obs_observed"], ~ended)
    assert np.array_equal(kept["next_obs"][ended], kept["obs"][ended])
