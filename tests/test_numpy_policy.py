"""The NumPy actor gives what the torch Policy gives, from the same flat weights: values and
log-probabilities equal, the same greedy actions, and samples from the same distribution."""

from __future__ import annotations

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

from mpirl.models.numpy_policy import NumpyPolicy, numpy_unsupported
from mpirl.models.policy import PolicySpec
from mpirl.models.spaces import ModelOptions, StructuredBox
from mpirl.models.torch_model import build_torch_model

VECTOR = gym.spaces.Box(-2.0, 2.0, (5,), np.float32)
CASES = {
    "vector-discrete": (VECTOR, gym.spaces.Discrete(3), "tanh"),
    "vector-box": (VECTOR, gym.spaces.Box(-1.0, 1.0, (2,), np.float32), "tanh"),
    "vector-multidiscrete-relu": (VECTOR, gym.spaces.MultiDiscrete([2, 3]), "relu"),
    "matrix-multibinary-elu": (gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32),
                               gym.spaces.MultiBinary(3), "elu"),
    "discrete-obs": (gym.spaces.Discrete(4), gym.spaces.Discrete(2), "tanh"),
    "dict-of-vectors": (StructuredBox(gym.spaces.Dict({
        "a": gym.spaces.Box(-1.0, 1.0, (3,), np.float32), "b": gym.spaces.Discrete(3)})),
        gym.spaces.Discrete(2), "tanh"),
}


def _pair(case: str, seed: int = 0) -> tuple[torch.nn.Module, NumpyPolicy, gym.Space]:
    obs_space, act_space, activation = CASES[case]
    spec = PolicySpec(obs_space, act_space, hidden_sizes=(16, 8), activation=activation)
    torch.manual_seed(seed)
    policy = build_torch_model(spec)
    with torch.no_grad():  # the default init keeps logits near 0: make them matter
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    actor = NumpyPolicy(spec, seed=seed)
    actor.set_flat_weights(policy.get_flat_weights())
    obs_space.seed(seed)
    return policy, actor, obs_space


def _batch(space: gym.Space, rows: int) -> np.ndarray:
    return np.stack([np.asarray(space.sample()) for _ in range(rows)])


@pytest.mark.parametrize("case", list(CASES))
def test_values_greedy_actions_and_log_probs_match_torch(case):
    policy, actor, space = _pair(case)
    obs = _batch(space, 64)
    t_actions, t_logp, t_values = policy.act(obs, deterministic=True)
    n_actions, n_logp, n_values = actor.act(obs, deterministic=True)
    np.testing.assert_allclose(n_values, t_values, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(n_logp, t_logp, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(n_actions, t_actions, rtol=1e-5, atol=1e-5)  # Box: float32
    # Sampled actions: torch scores the NumPy sample exactly as the NumPy side did.
    actions, logp, _ = actor.act(obs)
    with torch.no_grad():
        t_logp, _, _ = policy.evaluate(torch.as_tensor(obs), torch.as_tensor(actions))
    np.testing.assert_allclose(logp, t_logp.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(actor.env_actions(actions), policy.env_actions(actions))
    assert actions.dtype == t_actions.dtype and logp.dtype == np.float32


def test_samples_follow_the_torch_distribution():
    policy, actor, space = _pair("vector-discrete", seed=3)
    obs = np.repeat(_batch(space, 1), 20_000, axis=0)
    actions, _, _ = actor.act(obs)
    with torch.no_grad():
        probs = torch.softmax(policy.heads(obs[:1])[0], -1).numpy()[0]
    counts = np.bincount(actions, minlength=3) / len(actions)
    np.testing.assert_allclose(counts, probs, atol=0.015)  # 20k draws: sd below 0.004
    policy, actor, space = _pair("vector-box", seed=3)
    obs = np.repeat(_batch(space, 1), 20_000, axis=0)
    actions, _, _ = actor.act(obs)
    with torch.no_grad():
        mean = policy.heads(obs[:1])[0].numpy()[0]
    np.testing.assert_allclose(actions.mean(0), mean, atol=0.03)
    np.testing.assert_allclose(actions.std(0), np.exp(actor.params["log_std"]), rtol=0.03)


def test_what_needs_torch_is_named_and_refused():
    image = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    assert "image" in numpy_unsupported(PolicySpec(image, gym.spaces.Discrete(4)))
    lstm = PolicySpec(VECTOR, gym.spaces.Discrete(2), model=ModelOptions(use_lstm=True))
    assert numpy_unsupported(lstm) == "use_lstm"
    assert "centralized" in numpy_unsupported(
        PolicySpec(VECTOR, gym.spaces.Discrete(2), critic_inputs=8))
    with pytest.raises(ValueError, match="NumpyPolicy cannot run this policy: use_lstm"):
        NumpyPolicy(lstm)
    actor = NumpyPolicy(PolicySpec(VECTOR, gym.spaces.Discrete(2)))
    with pytest.raises(ValueError, match="weight vector has 3 values"):
        actor.set_flat_weights(np.zeros(3, np.float32))


def test_the_numpy_actor_imports_no_torch():
    code = ("import sys, mpirl.models.numpy_policy\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _cartpole_worker(seed: int):
    from test_env_failures import local_context

    from mpirl.workers.env_spec import EnvSpec
    from mpirl.workers.rollout import RolloutSettings, RolloutWorker

    spec = EnvSpec("CartPole-v1")
    policy = PolicySpec(*spec.spaces(), (8,), "tanh")
    worker = RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=2, seed=seed, gamma=0.99, lam=0.95))
    weights = np.random.default_rng(0).normal(0, 0.5, worker.get_weights().size)
    worker.set_weights(weights.astype(np.float32))  # a policy whose actions are not all equal
    return worker


def test_a_restored_rollout_worker_resumes_its_own_draws_and_not_another_runs():
    worker = _cartpole_worker(seed=0)
    worker.sample(4)
    state = worker.get_state()
    expected = worker.sample(16)["batch"]["actions"]
    # The same run resuming (same seed): the same actions, bit for bit.
    same = _cartpole_worker(seed=0)
    same.set_state(state)
    np.testing.assert_array_equal(same.sample(16)["batch"]["actions"], expected)
    # Another run taking this state (PBT's exploit, seed 1): the same envs and weights, but
    # actions of its own, or the two members would stay clones.
    other = _cartpole_worker(seed=1)
    other.set_state(state)
    assert not np.array_equal(other.sample(16)["batch"]["actions"], expected)


Q_CASES = {
    "dueling-relu": (VECTOR, (16, 8), "relu", True),
    "plain-tanh": (VECTOR, (8,), "tanh", False),
    "no-hidden": (gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32), (), "relu", True),
    "discrete-obs-elu": (gym.spaces.Discrete(5), (8,), "elu", True),
}


@pytest.mark.parametrize("case", list(Q_CASES))
def test_q_values_and_epsilon_greedy_actions_match_torch(case):
    from mpirl.models.q_spec import NumpyQPolicy, QSpec

    obs_space, hidden, activation, dueling = Q_CASES[case]
    spec = QSpec(obs_space, gym.spaces.Discrete(4), hidden, activation, dueling)
    torch.manual_seed(0)
    network = build_torch_model(spec)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(0.3 * torch.randn_like(p))
    actor = NumpyQPolicy(spec)
    actor.set_flat_weights(network.get_flat_weights())
    assert actor.num_weights() == network.get_flat_weights().size
    obs_space.seed(0)
    obs = _batch(obs_space, 64)
    with torch.no_grad():
        expected = network(obs).numpy()
    np.testing.assert_allclose(actor.q_values(obs), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(actor.act(obs)[0], network.act(obs)[0])
    # The same generator state gives the same epsilon-greedy draws.
    for epsilon in (0.0, 0.3):
        np.testing.assert_array_equal(
            actor.explore(obs, epsilon, np.random.default_rng(5)),
            network.explore(obs, epsilon, np.random.default_rng(5)))


def test_q_networks_that_need_torch_are_named():
    from mpirl.models.q_spec import NumpyQPolicy, QSpec, numpy_unsupported

    image = QSpec(gym.spaces.Box(0, 255, (84, 84, 4), np.uint8), gym.spaces.Discrete(4))
    assert numpy_unsupported(image) == "image observations go through a CNN"
    custom = QSpec(VECTOR, gym.spaces.Discrete(2), model=ModelOptions(custom_model="m:C"))
    assert numpy_unsupported(custom) == "a custom_model is a torch module"
    with pytest.raises(ValueError, match="NumpyQPolicy cannot run this Q network"):
        NumpyQPolicy(image)
