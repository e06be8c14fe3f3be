"""Policies, GAE and observation statistics: pure functions, no MPI launch."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from mpirl.data.batches import concat_batches, standardize_fields
from mpirl.errors import ConfigError
from mpirl.models.policy import PolicySpec, RunningMeanStd, compute_gae
from mpirl.models.torch_model import build_torch_model

BOX_OBS = gym.spaces.Box(-1, 1, shape=(3,), dtype=np.float32)


@pytest.mark.parametrize("action_space, action_shape", [
    (gym.spaces.Discrete(4), ()),
    (gym.spaces.MultiDiscrete([3, 2, 5]), (3,)),
    (gym.spaces.Box(-2.0, 2.0, shape=(2,), dtype=np.float32), (2,)),
])
def test_every_action_space_samples_and_scores_consistently(action_space, action_shape):
    torch.manual_seed(0)
    policy = build_torch_model(PolicySpec(BOX_OBS, action_space))
    obs = np.random.default_rng(0).uniform(-1, 1, (16, 3)).astype(np.float32)
    actions, logp, values = policy.act(obs)
    assert actions.shape == (16, *action_shape) and logp.shape == values.shape == (16,)
    env_actions = policy.env_actions(actions)
    assert all(action_space.contains(a.astype(action_space.dtype)) for a in env_actions)
    again, _, values_again = policy.evaluate(torch.as_tensor(obs), torch.as_tensor(actions))
    np.testing.assert_allclose(again.detach().numpy(), logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(values_again.detach().numpy(), values, rtol=1e-5, atol=1e-6)


def test_box_actions_are_clipped_for_the_env_only():
    space = gym.spaces.Box(-0.1, 0.1, shape=(1,), dtype=np.float32)
    policy = build_torch_model(PolicySpec(BOX_OBS, space))
    actions = np.array([[5.0], [-5.0], [0.05]], dtype=np.float32)
    np.testing.assert_allclose(policy.env_actions(actions), [[0.1], [-0.1], [0.05]])


def test_discrete_observations_are_one_hot():
    policy = build_torch_model(PolicySpec(gym.spaces.Discrete(5), gym.spaces.Discrete(2)))
    assert policy.encode(np.array([0, 4])).tolist() == [[1, 0, 0, 0, 0], [0, 0, 0, 0, 1]]


def test_unsupported_spaces_are_config_errors():
    with pytest.raises(ConfigError, match="action space"):
        build_torch_model(PolicySpec(BOX_OBS, gym.spaces.Text(5)))
    with pytest.raises(ConfigError, match="observation space"):
        build_torch_model(PolicySpec(gym.spaces.Text(5), gym.spaces.Discrete(2)))


def test_flat_weights_round_trip_between_policies():
    spec = PolicySpec(BOX_OBS, gym.spaces.Discrete(2))
    torch.manual_seed(1)
    a = build_torch_model(spec)
    torch.manual_seed(2)
    b = build_torch_model(spec)
    assert not np.array_equal(a.get_flat_weights(), b.get_flat_weights())
    b.set_flat_weights(a.get_flat_weights())
    assert np.array_equal(a.get_flat_weights(), b.get_flat_weights())
    assert a.get_flat_weights().dtype == np.float32
    with pytest.raises(ValueError, match="weight vector has 3 values"):
        b.set_flat_weights(np.zeros(3, np.float32))


def test_gae_matches_a_hand_computation():
    rewards = np.array([[1.0], [1.0], [1.0]], np.float32)
    values = np.array([[0.5], [0.4], [0.3]], np.float32)
    dones = np.array([[0.0], [1.0], [0.0]], np.float32)  # the episode ends after step 1
    last = np.array([0.2], np.float32)
    gamma, lam = 0.9, 0.8
    adv, targets = compute_gae(rewards, values, dones, last, gamma, lam)
    d2 = 1 + gamma * 0.2 - 0.3
    d1 = 1 - 0.4  # no bootstrap across the episode end
    d0 = 1 + gamma * 0.4 - 0.5
    expected = [d0 + gamma * lam * d1, d1, d2]
    np.testing.assert_allclose(adv[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(targets, adv + values, rtol=1e-6)


def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    rewards = np.ones((4, 2), np.float32)
    adv, _ = compute_gae(rewards, np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32),
                         np.zeros(2, np.float32), gamma=0.5, lam=1.0)
    np.testing.assert_allclose(adv[:, 0], [1.875, 1.75, 1.5, 1.0])


def test_merged_statistics_equal_those_of_all_the_data():
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, (1000, 4))
    merged = RunningMeanStd((4,))
    for part in np.array_split(data, 7):  # like 7 rollout ranks' deltas
        delta = RunningMeanStd((4,))
        delta.update(part)
        merged.merge(*delta.state())
    np.testing.assert_allclose(merged.mean, data.mean(0), rtol=1e-10)
    np.testing.assert_allclose(merged.var, data.var(0), rtol=1e-10)
    assert merged.count == 1000


def _stacked(deltas):
    """(counts, means, variances) of ``(mean, var, count)`` deltas, stacked as ranks' are."""
    return (np.array([count for _, _, count in deltas]), np.stack([m for m, _, _ in deltas]),
            np.stack([v for _, v, _ in deltas]))


def test_merging_all_deltas_at_once_equals_merging_them_one_by_one():
    rng = np.random.default_rng(1)
    data = rng.normal(-1.0, 3.0, (900, 2, 3))
    deltas = []
    for part in np.array_split(data, 9):
        delta = RunningMeanStd((2, 3))
        delta.update(part)
        deltas.append(delta.state())
    deltas.append((np.zeros((2, 3)), np.ones((2, 3)), 0.0))  # a rank that saw nothing
    one_by_one, at_once = RunningMeanStd((2, 3), 4.0), RunningMeanStd((2, 3), 4.0)
    for delta in deltas:
        one_by_one.merge(*delta)
    at_once.merge_stacked(*_stacked(deltas))
    np.testing.assert_allclose(at_once.mean, one_by_one.mean, rtol=1e-12)
    np.testing.assert_allclose(at_once.var, one_by_one.var, rtol=1e-12)
    assert at_once.count == one_by_one.count == 904
    at_once.merge_stacked(*_stacked([(np.ones((2, 3)), np.ones((2, 3)), 0.0)]))  # none seen
    assert at_once.count == 904


def test_concat_and_standardize():
    batch = concat_batches([{"a": np.arange(3.0)}, {"a": np.arange(3.0, 6.0)}])
    assert batch["a"].tolist() == [0, 1, 2, 3, 4, 5]
    standardize_fields(batch, ("a",))
    assert abs(batch["a"].mean()) < 1e-6 and abs(batch["a"].std() - 1) < 1e-5
