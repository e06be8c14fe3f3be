"""Ape-X through the real CLI: rollout ranks, 2 replay shards and a learner working at once.

The full threshold (475) is measured by ``benchmarks/learning.py --thresholds``; here Ape-X must
reach a 20-episode mean return of 100 within 25k env steps (seeds 0-4, on which its defaults were
measured, took 7.2k-9.2k), and the run's checkpoint must show every part at work. It runs seed 5.
"""

import json
import pickle

from test_train import rows, train

LAYOUT = {"num_rollout_workers": 2, "num_replay_shards": 2, "num_learners": 1,
          "metrics_window": 20}


def test_apex_learns_with_two_shards_and_async_weights(tmp_path):
    _, run_dir, result = train(
        6, tmp_path, "--algo", "APEX", "--env", "CartPole-v1", "--seed", "5",
        "--config", json.dumps(LAYOUT),
        "--stop", '{"episode_return_mean": 100, "timesteps_total": 25000}', timeout=240)
    assert result["episode_return_mean"] >= 100, result
    assert result["timesteps_total"] <= 25000 + 2 * 4 * 32  # the calls in flight at the end
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
    for k in (0, 1):
        shard = pickle.loads((checkpoint / f"replay_{k}.pkl").read_bytes())
        assert shard["written"].sum() > 1000
        assert shard["max_priority"] > 1.0  # TD errors came back as priorities
    learner = pickle.loads((checkpoint / "learner_0.pkl").read_bytes())
    assert learner["updates"] >= 16 and learner["posted"] > 0  # weights were posted
