"""PETS's planner: CEM over a dynamics ensemble with TS-inf particles (Chua et al. 2018).

``PETSSpec.build()`` makes a ``PlanningModel``: the ``DynamicsEnsemble`` a rollout rank plans
with, behind the interface of an exploring actor (``explore``, ``act``, ``env_actions``), so the
rank's sampling core steps its real envs with planned actions. ``epsilon`` 1 (the first
iteration) takes uniformly random actions; otherwise every action is planned.

Each step plans for all of the rank's envs at once: ``cem_iterations`` rounds of
``cem_population`` action sequences of ``planning_horizon`` steps per env, each sequence scored
by ``particles`` TS-inf particles (each particle keeps one elite member for the whole horizon),
so one ``predict`` per horizon step covers envs x candidates x particles. A sequence's score is
the mean over its particles of the summed predicted rewards (zero after a predicted
termination). The ``cem_elites`` best sequences refit a Gaussian, smoothed by ``cem_alpha``;
the first action of the final mean is taken, and the mean, shifted by one step, warm-starts the
next step's search.

``planner="mppi"`` plans with MPPI instead (model predictive path integral control, Williams et
al. 2017, as PDDM uses it with an ensemble): ``mppi_iterations`` rounds of ``mppi_population``
Gaussian perturbations (std ``mppi_noise_std`` x half the action range) of the warm-started
mean, scored by the same TS-inf particles; the new mean is the average of the candidates
weighted by exp((return - best return) / ``mppi_temperature``).

The weight vector a rollout rank receives carries the whole ensemble, not only its parameters
(``pack_ensemble``, ``mpirl.algorithms.model_based.dynamics``).
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

#: The planners ``PETSSpec.planner`` names.
PLANNERS = ("cem", "mppi")


@dataclass(frozen=True)
class PETSSpec:
    """What every rank needs to build the same planner: the ensemble and the planner's (CEM's
    or MPPI's) settings."""

    dynamics: DynamicsSpec
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    planning_horizon: int = 30
    cem_population: int = 200
    cem_elites: int = 20
    cem_iterations: int = 5
    cem_alpha: float = 0.1
    particles: int = 2
    planner: str = "cem"
    mppi_population: int = 200
    mppi_iterations: int = 3
    mppi_temperature: float = 1.0
    mppi_noise_std: float = 0.5

    def build(self, device: Any = "cpu") -> PlanningModel:
        return PlanningModel(self).to(device)


class PlanningModel(nn.Module):
    """A rollout rank's planner (see the module's docstring)."""

    def __init__(self, spec: PETSSpec) -> None:
        super().__init__()
        self.spec = spec
        self.ensemble = DynamicsEnsemble(spec.dynamics)
        self.ensemble.eval()
        self.low = torch.as_tensor(spec.action_low, dtype=torch.float32)
        self.high = torch.as_tensor(spec.action_high, dtype=torch.float32)
        #: Warm starts: the last plan's mean per env, by (envs, deterministic).
        self._previous: dict[tuple[int, bool], torch.Tensor] = {}
        #: Planning noise of deterministic acting (evaluation): a generator of its own.
        self._eval_rng = np.random.default_rng(12345)

    # -- the weight vector ---------------------------------------------------------------------

    def num_weights(self) -> int:
        return ensemble_vector_size(self.ensemble)

    def get_flat_weights(self) -> np.ndarray:
        return pack_ensemble(self.ensemble)

    def set_flat_weights(self, flat: np.ndarray) -> None:
        unpack_ensemble(self.ensemble, flat)
        # A new model: plans start afresh, and evaluation's noise from its seed (a resumed run,
        # whose rollout ranks get the weights again, plans as one that never stopped).
        self._previous.clear()
        self._eval_rng = np.random.default_rng(12345)

    # -- acting (ExploringActor's interface) ---------------------------------------------------

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        return actions

    def random_actions(self, count: int, rng: np.random.Generator) -> np.ndarray:
        low, high = self.low.numpy(), self.high.numpy()
        return rng.uniform(low, high, size=(count, len(low))).astype(np.float32)

    def explore(self, obs: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
        """Uniformly random actions with ``epsilon`` 1 (seeding the data), else planned ones."""
        if epsilon >= 1.0:
            return self.random_actions(len(obs), rng)
        return self.plan(obs, rng, deterministic=False)

    def act(self, obs: np.ndarray, deterministic: bool = True) -> tuple[np.ndarray, None, None]:
        """The plan's mean action, as a model acts for evaluation: (actions, no log-probs, no
        values)."""
        return self.plan(obs, self._eval_rng, deterministic=True), None, None

    @torch.no_grad()
    def plan(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool
             ) -> np.ndarray:
        """The planner's (CEM's or MPPI's) first action for each of ``obs``'s envs ``[B, A]``."""
        spec = self.spec
        obs_t = torch.as_tensor(np.asarray(obs, np.float32).reshape(len(obs), -1))
        b, h, a = obs_t.shape[0], spec.planning_horizon, self.low.numel()
        n = spec.mppi_population if spec.planner == "mppi" else spec.cem_population
        p = spec.particles
        generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
        low, high = self.low, self.high
        key = (b, deterministic)
        mean = torch.zeros(b, h, a) + (low + high) / 2
        previous = self._previous.get(key)
        if previous is not None:
            mean[:, :-1] = previous[:, 1:]
        elites = torch.as_tensor(self.ensemble.elites)
        # TS-inf: each particle keeps one elite member over the horizon (the same draws for
        # every round, so that candidates are compared on the same model samples).
        members = elites[torch.randint(len(elites), (b, 1, p), generator=generator)
                         ].expand(b, n, p).reshape(-1)
        start = obs_t[:, None, None, :].expand(b, n, p, obs_t.shape[1]).reshape(-1, obs_t.shape[1])
        if spec.planner == "mppi":
            mean = self._mppi(mean, start, members, generator, b, n, p)
        else:
            mean = self._cem(mean, start, members, generator, b, n, p)
        self._previous[key] = mean
        return mean[:, 0].numpy().astype(np.float32)

    def _cem(self, mean: torch.Tensor, start: torch.Tensor, members: torch.Tensor,
             generator: torch.Generator, b: int, n: int, p: int) -> torch.Tensor:
        """CEM's final mean action sequences ``[B, H, A]`` from the warm start ``mean``."""
        spec, low, high = self.spec, self.low, self.high
        h, a = mean.shape[1], mean.shape[2]
        var = ((high - low) ** 2 / 16).expand(b, h, a).clone()
        for _ in range(spec.cem_iterations):
            # Truncated at two standard deviations and at the action bounds, as PETS's CEM.
            lb, ub = mean - low, high - mean
            std = torch.minimum(torch.minimum((lb / 2) ** 2, (ub / 2) ** 2), var).sqrt()
            noise = torch.randn(b, n, h, a, generator=generator).clamp_(-2, 2)
            candidates = (mean[:, None] + std[:, None] * noise).clamp(low, high)
            returns = self._score(start, candidates, members, generator, b, n, p)
            top = returns.topk(spec.cem_elites, dim=1).indices
            best = torch.gather(candidates, 1, top[:, :, None, None].expand(-1, -1, h, a))
            mean = spec.cem_alpha * mean + (1 - spec.cem_alpha) * best.mean(1)
            var = spec.cem_alpha * var + (1 - spec.cem_alpha) * best.var(1, unbiased=False)
        return mean

    def _mppi(self, mean: torch.Tensor, start: torch.Tensor, members: torch.Tensor,
              generator: torch.Generator, b: int, n: int, p: int) -> torch.Tensor:
        """MPPI's mean action sequences ``[B, H, A]`` after ``mppi_iterations`` rounds: Gaussian
        perturbations of the mean (the first candidate is the mean itself), each weighted by
        exp((return - best return) / temperature), the weighted average the new mean."""
        spec, low, high = self.spec, self.low, self.high
        h, a = mean.shape[1], mean.shape[2]
        std = spec.mppi_noise_std * (high - low) / 2
        for _ in range(spec.mppi_iterations):
            noise = torch.randn(b, n, h, a, generator=generator) * std
            noise[:, 0] = 0.0
            candidates = (mean[:, None] + noise).clamp(low, high)
            returns = self._score(start, candidates, members, generator, b, n, p)
            weights = torch.softmax((returns - returns.max(1, keepdim=True).values)
                                    / spec.mppi_temperature, dim=1)
            mean = (weights[:, :, None, None] * candidates).sum(1)
        return mean

    def _score(self, start: torch.Tensor, candidates: torch.Tensor, members: torch.Tensor,
               generator: torch.Generator, b: int, n: int, p: int) -> torch.Tensor:
        """Mean over particles of each candidate's summed predicted rewards ``[B, N]``."""
        state = start
        total = torch.zeros(b * n * p)
        alive = torch.ones(b * n * p)
        a = candidates.shape[-1]
        for t in range(candidates.shape[2]):
            actions = candidates[:, :, None, t].expand(b, n, p, a).reshape(-1, a)
            state, rewards, terminated = self.ensemble.predict(
                state, actions, generator, mode="sample", members=members)
            if rewards is not None:
                total += alive * rewards
            alive = alive * (~terminated).float()
        total = torch.nan_to_num(total, nan=-1e6, posinf=-1e6, neginf=-1e6)
        return total.view(b, n, p).mean(2)
