"""V-trace: off-policy value targets and policy-gradient advantages (Espeholt et al., 2018).

Samples produced by older weights (the behaviour policy) are corrected towards the current
weights (the target policy) with truncated importance weights. Everything here is time-major,
``[T, B]`` (steps by trajectories), and runs on the learner only; nothing crosses ranks.

With ``rho_t = pi(a_t|x_t) / mu(a_t|x_t)``, ``discounts_t = gamma * (1 - done_t)`` and
``V_T`` the bootstrap value of the observation after the last step::

    delta_t = min(rho_bar, rho_t) * (r_t + discounts_t * V_{t+1} - V_t)
    vs_t    = V_t + delta_t + discounts_t * lambda * min(c_bar, rho_t) * (vs_{t+1} - V_{t+1})
    pg_t    = min(pg_rho_bar, rho_t) * (r_t + discounts_t * vs_{t+1} - V_t)

A step that ends an episode has ``discounts_t = 0``, so nothing flows across the boundary into
the next episode's rows of the same fragment.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["VTrace", "vtrace"]


class VTrace(NamedTuple):
    """V-trace's outputs, each ``[T, B]``."""

    vs: torch.Tensor
    """Value targets for the critic."""
    pg_advantages: torch.Tensor
    """Advantages for the policy gradient."""
    clipped_rhos: torch.Tensor
    """The truncated importance weights ``min(rho_bar, rho_t)``."""


@torch.no_grad()
def vtrace(behaviour_logp: torch.Tensor, target_logp: torch.Tensor, rewards: torch.Tensor,
           values: torch.Tensor, bootstrap_value: torch.Tensor, discounts: torch.Tensor,
           rho_bar: float = 1.0, c_bar: float = 1.0, pg_rho_bar: float | None = None,
           lam: float = 1.0) -> VTrace:
    """V-trace targets for time-major ``[T, B]`` inputs; ``bootstrap_value`` is ``[B]``.

    ``discounts`` is ``gamma * (1 - done)`` per step. ``pg_rho_bar`` defaults to ``rho_bar``.
    No gradient flows through the result.
    """
    rhos = torch.exp(target_logp - behaviour_logp)
    clipped_rhos = rhos.clamp(max=rho_bar)
    cs = lam * rhos.clamp(max=c_bar)
    next_values = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], 0)
    deltas = clipped_rhos * (rewards + discounts * next_values - values)
    corrections = torch.zeros_like(values)
    running = torch.zeros_like(bootstrap_value)
    for t in reversed(range(values.shape[0])):
        running = deltas[t] + discounts[t] * cs[t] * running
        corrections[t] = running
    vs = values + corrections
    next_vs = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], 0)
    pg_rhos = rhos.clamp(max=rho_bar if pg_rho_bar is None else pg_rho_bar)
    pg_advantages = pg_rhos * (rewards + discounts * next_vs - values)
    return VTrace(vs, pg_advantages, clipped_rhos)
