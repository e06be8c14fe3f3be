"""V-trace against a straightforward reference: the paper's sums, written as plain loops."""

import numpy as np
import pytest
import torch

from mpirl.models.vtrace import vtrace


def reference(behaviour_logp, target_logp, rewards, values, bootstrap, discounts, rho_bar, c_bar,
              lam=1.0):
    """vs_s = V_s + sum_t (prod_{i<t} discount_i c_i) delta_t, element by element."""
    steps, width = rewards.shape
    rhos = np.exp(target_logp - behaviour_logp)
    vs = np.zeros_like(values)
    pg = np.zeros_like(values)
    for b in range(width):
        v = list(values[:, b]) + [bootstrap[b]]
        delta = [min(rho_bar, rhos[t, b]) * (rewards[t, b] + discounts[t, b] * v[t + 1] - v[t])
                 for t in range(steps)]
        for s in range(steps):
            total, weight = 0.0, 1.0
            for t in range(s, steps):
                total += weight * delta[t]
                weight *= discounts[t, b] * lam * min(c_bar, rhos[t, b])
            vs[s, b] = v[s] + total
        for s in range(steps):
            next_vs = vs[s + 1, b] if s + 1 < steps else bootstrap[b]
            pg[s, b] = min(rho_bar, rhos[s, b]) * (rewards[s, b] + discounts[s, b] * next_vs
                                                    - v[s])
    return vs, pg


def random_inputs(seed, steps=7, width=3, done_rate=0.2):
    rng = np.random.default_rng(seed)
    behaviour = rng.normal(-0.7, 0.5, (steps, width))
    target = behaviour + rng.normal(0, 0.6, (steps, width))
    rewards = rng.normal(0, 1, (steps, width))
    values = rng.normal(0, 1, (steps, width))
    bootstrap = rng.normal(0, 1, width)
    dones = rng.random((steps, width)) < done_rate
    discounts = 0.9 * (1.0 - dones)
    return behaviour, target, rewards, values, bootstrap, discounts


def run(*arrays, **kwargs):
    out = vtrace(*(torch.as_tensor(a, dtype=torch.float64) for a in arrays), **kwargs)
    return out.vs.numpy(), out.pg_advantages.numpy()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho_bar, c_bar", [(1.0, 1.0), (2.0, 0.5), (100.0, 100.0)])
def test_matches_the_reference_sums(seed, rho_bar, c_bar):
    inputs = random_inputs(seed)
    vs, pg = run(*inputs, rho_bar=rho_bar, c_bar=c_bar)
    ref_vs, ref_pg = reference(*inputs, rho_bar, c_bar)
    np.testing.assert_allclose(vs, ref_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(pg, ref_pg, rtol=1e-10, atol=1e-10)


def test_on_policy_targets_are_n_step_returns():
    behaviour, _, rewards, values, bootstrap, _ = random_inputs(7)
    discounts = np.full_like(rewards, 0.9)
    vs, _ = run(behaviour, behaviour, rewards, values, bootstrap, discounts)
    steps = rewards.shape[0]
    for s in range(steps):
        expected = sum(0.9 ** (t - s) * rewards[t] for t in range(s, steps))
        expected = expected + 0.9 ** (steps - s) * bootstrap
        np.testing.assert_allclose(vs[s], expected, rtol=1e-10)


def test_nothing_crosses_an_episode_boundary():
    behaviour, target, rewards, values, bootstrap, discounts = random_inputs(3, done_rate=0.0)
    discounts[3] = 0.0  # the episode ends after step 3
    vs, pg = run(behaviour, target, rewards, values, bootstrap, discounts)
    # Whatever happens after the boundary (rewards, values, bootstrap) leaves rows 0..3 alone.
    changed_rewards, changed_values = rewards.copy(), values.copy()
    changed_rewards[4:] += 100.0
    changed_values[4:] -= 50.0
    vs2, pg2 = run(behaviour, target, changed_rewards, changed_values, bootstrap + 7.0, discounts)
    np.testing.assert_allclose(vs2[:4], vs[:4], rtol=1e-12)
    np.testing.assert_allclose(pg2[:4], pg[:4], rtol=1e-12)
    # The last step of the episode bootstraps nothing: its target is its reward alone.
    rho = min(1.0, np.exp(target[3, 0] - behaviour[3, 0]))
    assert vs[3, 0] == pytest.approx(values[3, 0] + rho * (rewards[3, 0] - values[3, 0]))


def test_truncation_clips_the_importance_weights():
    behaviour, target, rewards, values, bootstrap, discounts = random_inputs(11)
    target = behaviour + 5.0  # rho = e^5 everywhere
    out = vtrace(*(torch.as_tensor(a) for a in (behaviour, target, rewards, values, bootstrap,
                                               discounts)), rho_bar=1.0, c_bar=1.0)
    assert torch.all(out.clipped_rhos == 1.0)
    on_policy = run(behaviour, behaviour, rewards, values, bootstrap, discounts)
    np.testing.assert_allclose(out.vs.numpy(), on_policy[0], rtol=1e-10)
