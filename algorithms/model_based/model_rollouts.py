"""MBPO's rollout-rank model: SAC's actor and the dynamics ensemble, and the branched k-step
rollouts that run the actor through the ensemble (Janner et al. 2019).

``MBPOSpec.build()`` makes an ``MBPOActor``: a ``SACModel`` that acts in the real envs
(``explore``, ``act``, ``env_actions``: SAC's), beside the ``DynamicsEnsemble`` it rolls out
through. Its weight vector, the one broadcast to the rollout ranks and checkpointed as learner
0's ``weights``, is SAC's flat weights followed by ``pack_ensemble``'s vector (parameters,
normalizers, elites), so ``mpirl evaluate`` acts with the SAC actor of a checkpoint.

``branched_rollouts`` starts from real states and steps the actor's sampled actions through the
ensemble for k steps: each step's member is a uniformly drawn elite per particle (TS-1, MBPO's
choice) or one elite kept for the whole rollout (TS-inf). A particle that the termination
function says terminated stops after that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpirl.algorithms.model_based.dynamics import (
    DynamicsEnsemble,
    ensemble_vector_size,
    pack_ensemble,
    unpack_ensemble,
)
from mpirl.algorithms.model_based.dynamics_spec import DynamicsSpec
from torch import nn

from mpirl.models.soft_q import SACModel, SACSpec

__all__ = ["MBPOSpec", "TRAJECTORY_SAMPLING"]

#: How a model rollout picks the member of each step: ``ts1`` a random elite every step,
#: ``tsinf`` one elite per rollout.
TRAJECTORY_SAMPLING = ("ts1", "tsinf")


@dataclass(frozen=True)
class MBPOSpec:
    """What every rank needs to build the same MBPO model: SAC's and the ensemble's specs."""

    sac: SACSpec
    dynamics: DynamicsSpec
    trajectory_sampling: str = "ts1"

    def build(self, device: Any = "cpu") -> MBPOActor:
        return MBPOActor(self).to(device)


class MBPOActor(nn.Module):
    """SAC's model and the dynamics ensemble, acting as SAC (see the module's docstring)."""

    def __init__(self, spec: MBPOSpec) -> None:
        super().__init__()
        self.spec = spec
        self.sac = SACModel(spec.sac)
        self.ensemble = DynamicsEnsemble(spec.dynamics)
        self.ensemble.eval()

    # -- the weight vector: SAC's, then the ensemble's ----------------------------------------

    def num_weights(self) -> int:
        return self.sac.num_weights() + ensemble_vector_size(self.ensemble)

    def get_flat_weights(self) -> np.ndarray:
        return np.concatenate([self.sac.get_flat_weights(), pack_ensemble(self.ensemble)])

    def set_flat_weights(self, flat: np.ndarray) -> None:
        flat = np.asarray(flat, np.float32)
        if flat.size != self.num_weights():
            raise ValueError(f"MBPO weight vector has {flat.size} values, the model "
                             f"{self.num_weights()}")
        n = self.sac.num_weights()
        self.sac.set_flat_weights(flat[:n])
        unpack_ensemble(self.ensemble, flat[n:])

    # -- acting in the real envs: SAC's -------------------------------------------------------

    def act(self, obs: np.ndarray, deterministic: bool = False):
        return self.sac.act(obs, deterministic)

    def explore(self, obs: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
        return self.sac.explore(obs, epsilon, rng)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        return actions

    # -- model rollouts -----------------------------------------------------------------------

    @torch.no_grad()
    def branched_rollouts(self, start_obs: np.ndarray, length: int,
                          generator: torch.Generator) -> dict[str, np.ndarray]:
        """Up to ``length`` model steps from each of ``start_obs [N, obs]``, with actions
        sampled from the actor: the transitions ``(obs, actions, rewards, next_obs,
        terminated)``, step by step. ``generator`` draws the actions, the members and the
        ensemble's Gaussian noise."""
        obs = torch.as_tensor(np.asarray(start_obs, np.float32).reshape(len(start_obs), -1))
        elites = torch.as_tensor(self.ensemble.elites)
        members = None
        if self.spec.trajectory_sampling == "tsinf":
            members = elites[torch.randint(len(elites), (len(obs),), generator=generator)]
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in
                                                ("obs", "actions", "rewards", "next_obs",
                                                 "terminated")}
        for _ in range(length):
            if not len(obs):
                break
            mean, log_std = self.sac.actor_outputs(obs).chunk(2, -1)
            noise = torch.randn(mean.shape, generator=generator)
            squashed = torch.tanh(mean + log_std.clamp(-20, 2).exp() * noise)
            actions = self.sac.to_env(squashed)
            next_obs, rewards, terminated = self.ensemble.predict(
                obs, actions, generator, mode="sample", members=members)
            # A diverged model's step is not worth learning from (nor continuing).
            finite = torch.isfinite(next_obs).all(1) & torch.isfinite(rewards)
            for key, value in (("obs", obs), ("actions", actions), ("rewards", rewards),
                               ("next_obs", next_obs), ("terminated", terminated.float())):
                parts[key].append(value[finite])
            alive = finite & ~terminated
            obs = next_obs[alive]
            if members is not None:
                members = members[alive]
        return {key: (torch.cat(values).numpy().astype(np.float32) if values
                      else np.zeros((0, *obs.shape[1:]) if key in ("obs", "next_obs")
                                    else (0, self.sac.act_dim) if key == "actions" else (0,),
                                    np.float32))
                for key, values in parts.items()}
