"""Ape-X through the real CLI: rollout ranks, 2 replay shards and a learner working at once.

The full threshold (475) is measured by ``benchmarks/learning.py --thresholds``; here Ape-X must
reach a 20-episode mean return of 100 within 25k env steps (seeds 0-4, on which its defaults were
measured, took 7.2k-9.2k), and the run's checkpoint must show every part at work. It runs seed 5.
"""

import json
import pickle
import sys

import pytest
from conftest import run_mpi
from test_train import MPIRL, rows, train

LAYOUT = {"num_rollout_workers": 2, "num_replay_shards": 2, "num_learners": 1,
          "metrics_window": 20}


#: fragments_per_call 4: the calls run from checkpoint to checkpoint; each rollout rank sends
#: its chunks straight to its shard, the shards serve the learner's requests themselves, and the
#: learner reports each iteration (StreamedReplayLoop).
STREAMED = {"fragments_per_call": 4}


@pytest.mark.parametrize("extra", [{}, STREAMED], ids=["driver-driven", "streamed"])
def test_apex_learns_with_two_shards_and_async_weights(tmp_path, extra):
    # Streamed, seeds 0-4 reached 100 at 8.6k-10.6k env steps (2026-11-27, calls across
    # iterations; 8.6k-13.7k with a call per 4 chunks).
    _, run_dir, result = train(
        6, tmp_path, "--algo", "APEX", "--env", "CartPole-v1", "--seed", "5",
        "--config", json.dumps(LAYOUT | extra),
        "--stop", '{"episode_return_mean": 100, "timesteps_total": 25000}', timeout=240)
    assert result["episode_return_mean"] >= 100, result
    # Past the stop: the calls in flight at the end (2 per rank, of 8 envs x 32 steps);
    # streamed, the last report's overshoot and what was sampled after it (each at most an
    # iteration's 1000 env steps and a shard's reply, of a chunk or so of 256 per rank).
    assert result["timesteps_total"] <= 25000 + (2 * (1000 + 2 * 256) if extra else 2 * 4 * 32)
    progress = rows(run_dir)
    assert float(progress[-1]["sgd_steps_total"]) > 0
    lags = [float(r["weights_lag_sgd_steps"]) for r in progress[3:]]
    assert lags and max(lags) < 100, lags  # posted every 16 SGD steps, taken at the next call
    # The rollout ranks act with NumpyQPolicy: no torch (about 300 MB a rank with it).
    assert float(progress[-1]["perf/max_rollout_rss_mb"]) < 150, progress[-1]
    checkpoint = sorted((run_dir / "checkpoints").glob("checkpoint_*"))[-1]
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["layout"] == {"learner": 1, "rollout": 2, "replay": 2}
    # Rollout worker i feeds shard i mod 2: both shards hold rows.
    written = 0
    for k in (0, 1):
        shard = pickle.loads((checkpoint / f"replay_{k}.pkl").read_bytes())
        assert shard["written"].sum() > 1000
        assert shard["max_priority"] > 1.0  # TD errors came back as priorities
        written += shard["written"].sum()
    if extra:  # the final checkpoint stopped the calls and stored every chunk sent first
        assert written >= result["timesteps_total"], (written, result)
    learner = pickle.loads((checkpoint / "learner_0.pkl").read_bytes())
    assert learner["updates"] >= 16 and learner["posted"] > 0  # weights were posted


def test_streamed_apex_needs_ranks_of_its_own_for_learner_and_shards(tmp_path):
    proc = run_mpi(4, *MPIRL, "train", "--algo", "APEX", "--env", "CartPole-v1",
                   "--config", json.dumps({"num_learners": 0, **STREAMED}),
                   "--run-dir", str(tmp_path / "run"), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("fragments_per_call streams chunks to replay ranks") == 1, \
        proc.stderr
    assert "set fragments_per_call 0" in proc.stderr and "Traceback" not in proc.stderr


STREAMED_API_PROGRAM = """
import sys, mpirl
algo = mpirl.Algorithm.build("APEX", "CartPole-v1", run_dir=sys.argv[1], config={
    "num_rollout_workers": 2, "num_replay_shards": 1, "num_learners": 1,
    "fragments_per_call": 2, "min_env_steps_per_iteration": 500, "learning_starts": 200,
    "tensorboard_histograms_every": 2})
rows = [algo.train() for _ in range(3)]
actions = algo.compute_actions([[0.0] * 4] * 3)  # the learner's call runs: settled first
rows.append(algo.train())
saved = algo.save()
rows.append(algo.train())
algo.restore(saved)
rows.append(algo.train())
code = algo.stop()
print("RESULT", repr(([[r[k] for k in ("iteration", "timesteps_total", "sgd_steps_total")]
                       for r in rows], actions.tolist(), code)))
"""


def test_streamed_apex_calls_span_iterations_and_settle_for_the_api(tmp_path):
    # The calls run across iterations: compute_actions, save, restore and stop must each
    # find the workers free (no hang), and the learner's reports bring the histograms.
    program = tmp_path / "streamed.py"
    program.write_text(STREAMED_API_PROGRAM)
    run_dir = tmp_path / "run"
    proc = run_mpi(5, sys.executable, str(program), str(run_dir), timeout=180)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    rows_seen, actions, code = eval(line[len("RESULT "):])
    assert code == 0 and len(actions) == 3 and set(actions) <= {0, 1}, (actions, code)
    iterations = [r[0] for r in rows_seen]
    steps = [r[1] for r in rows_seen]
    assert iterations == [1, 2, 3, 4, 5, 5], rows_seen
    # Each iteration is one report of at least 500 env steps; the restore goes back to row 4.
    assert all(b - a >= 500 for a, b in zip(steps[:4], steps[1:5], strict=True)), rows_seen
    assert steps[5] - steps[3] >= 500 and rows_seen[3][2] > 0, rows_seen
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator").EventAccumulator
    (events,) = run_dir.glob("events.out.tfevents.*")
    tensorboard = accumulator(str(events), size_guidance={"histograms": 0})
    tensorboard.Reload()
    weights = [t for t in tensorboard.Tags()["histograms"] if t.startswith("weights/")]
    assert weights and "grad_norm" in tensorboard.Tags()["histograms"]
    # Every second iteration, from the report of the learner's running call.
    assert [h.step for h in tensorboard.Histograms(weights[0])] == [steps[1], steps[3]]


# The driver's loop with fake workers: what it asks the replay shards to store.


class _Answered:
    """A finished call: its value, or the error it raised on the worker."""

    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def done(self, poll=True):
        return True

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.value


class _Shard:
    def __init__(self):
        self.calls = []

    def call_async(self, method, *args):
        self.calls.append((method, *args))
        return _Answered(0)


def _loop(rollouts: int, shards: int):
    from types import SimpleNamespace

    from mpirl.algorithms.q_learning.apex_loops import AsyncReplayLoop

    workers = [SimpleNamespace(rank=2 + shards + i, in_process=False) for i in range(rollouts)]
    trainer = SimpleNamespace(rollouts=workers, config=SimpleNamespace(metrics_max_epsilon=0.5),
                              counted=[])
    trainer.count = trainer.counted.append
    replay = [_Shard() for _ in range(shards)]
    return AsyncReplayLoop(trainer, replay, [0.1] * rollouts), trainer, replay


def _fragment(i):
    return _Answered({"env_steps": 50, "env_failures": 0, "episode_returns": [float(i)],
                      "episode_lengths": [50], "weights_version": 0})


def test_one_insert_call_stores_several_fragments_when_many_ranks_feed_a_shard():
    loop, trainer, replay = _loop(rollouts=16, shards=2)  # 8 ranks per shard: 2 per insert
    for i in range(16):
        loop._stored(i, _fragment(i))
    for k, shard in enumerate(replay):
        feeders = [trainer.rollouts[i].rank for i in range(k, 16, 2)]
        assert shard.calls == [("insert", feeders[j:j + 2], None) for j in range(0, 8, 2)]
    assert loop.stored == [400, 400] and len(trainer.counted) == 16
    # Steps count toward a shard's training only once it was told to insert them.
    loop._stored(0, _fragment(0))
    assert loop.stored == [400, 400]
    loop._stored(2, _fragment(2))
    assert loop.stored == [500, 400]
    # A fragment left over when the iteration ends is inserted then, not carried into the next.
    loop._stored(0, _fragment(0))
    for k in list(loop.unsent_inserts):
        loop._insert(k)
    assert replay[0].calls[-1] == ("insert", [trainer.rollouts[0].rank], None)
    assert not loop.unsent_inserts


def test_few_ranks_per_shard_insert_each_fragment_at_once_and_a_failed_insert_is_raised():
    from mpirl.errors import RemoteError

    loop, trainer, replay = _loop(rollouts=2, shards=2)
    loop._stored(1, _fragment(1))
    assert replay[1].calls == [("insert", [trainer.rollouts[1].rank], None)]
    loop.inserts.append(_Answered(error=RemoteError(3, "replay", "insert", "MemoryError",
                                                    "no space left", "")))
    with pytest.raises(RemoteError, match="no space left"):
        loop._check_inserts()
