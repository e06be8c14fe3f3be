"""ES and ARS rollout ranks without torch: the NumPy population forward pass gives the torch
DirectPolicy's outputs and actions from the same flat weights, the specs it cannot run are named,
and a run's rollout ranks stay far below the memory a torch import costs."""

from __future__ import annotations

import csv
import json

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import BIN, run_mpi
from mpirl.algorithms.evolution.spec import DirectPolicySpec, NumpyDirectPolicy, numpy_unsupported

from mpirl.models.spaces import StructuredBox
from mpirl.models.torch_model import build_torch_model

VECTOR = gym.spaces.Box(-2.0, 2.0, (5,), np.float32)
CASES = {
    "discrete-tanh": (VECTOR, gym.spaces.Discrete(3), (16, 8), "tanh"),
    "box-relu": (VECTOR, gym.spaces.Box(-0.5, 0.5, (2,), np.float32), (16,), "relu"),
    "linear-box": (gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32),
                   gym.spaces.Box(-1.0, 1.0, (3,), np.float32), (), "tanh"),
    "discrete-elu": (VECTOR, gym.spaces.Discrete(4), (8, 8), "elu"),
    "dict-of-vectors": (StructuredBox(gym.spaces.Dict({
        "a": gym.spaces.Box(-1.0, 1.0, (3,), np.float32), "b": gym.spaces.Discrete(3)})),
        gym.spaces.Discrete(2), (8,), "tanh"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_population_outputs_and_actions_match_torch(case):
    obs_space, act_space, hidden, activation = CASES[case]
    spec = DirectPolicySpec(obs_space, act_space, hidden, activation)
    torch.manual_seed(0)
    policy = build_torch_model(spec)
    actor = NumpyDirectPolicy(spec)
    assert actor.num_weights() == policy.num_weights()
    rng = np.random.default_rng(0)
    k = 7
    params = (policy.get_flat_weights()[None] + 0.5 * rng.standard_normal(
        (k, policy.num_weights()))).astype(np.float32)
    obs_space.seed(0)
    obs = np.stack([obs_space.sample() for _ in range(k)]).astype(np.float32)
    with torch.no_grad():
        expected = policy.population_outputs(torch.from_numpy(params),
                                             torch.from_numpy(obs)).numpy()
    got = actor.population_outputs(params, obs)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Discrete: the same argmax; Box: the same clipped values, to float32 rounding.
    np.testing.assert_allclose(actor.to_actions(got), policy.to_actions(expected), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize(("obs_space", "reason"), [
    (gym.spaces.Box(0, 255, (84, 84, 4), np.uint8), "image observations go through a CNN"),
    (gym.spaces.Discrete(4), "observation space Discrete(4)"),
])
def test_what_needs_torch_is_named(obs_space, reason):
    spec = DirectPolicySpec(obs_space, gym.spaces.Discrete(2))
    assert reason in (numpy_unsupported(spec) or "")
    with pytest.raises(ValueError, match="NumpyDirectPolicy cannot run this policy"):
        NumpyDirectPolicy(spec)
    assert numpy_unsupported(DirectPolicySpec(VECTOR, gym.spaces.Discrete(2))) is None


@pytest.mark.parametrize("algo", ["ES", "ARS"])
def test_rollout_ranks_of_a_vector_env_stay_small(tmp_path, algo):
    # A rollout rank that imported torch takes about 300 MB (measured); one that acts in NumPy
    # about 60-70, plus what it touched of the 4 MB noise table.
    run_dir = tmp_path / "run"
    proc = run_mpi(3, str(BIN / "mpirl"), "train", "--algo", algo, "--env", "CartPole-v1",
                   "--run-dir", str(run_dir), "--config", json.dumps({"noise_size": 1_000_000}),
                   "--stop", '{"training_iteration": 3}', timeout=180, env={"CI": "true"})
    assert proc.returncode == 0, proc.stderr
    with open(run_dir / "progress.csv") as file:
        last = list(csv.DictReader(file))[-1]
    assert float(last["perf/max_rollout_rss_mb"]) < 150, last["perf/max_rollout_rss_mb"]
    assert int(last["num_rollout_workers"]) == 2
