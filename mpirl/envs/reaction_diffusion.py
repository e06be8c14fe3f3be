"""A bundled simulation to control: the 1-D unstable reaction-diffusion equation

    u_t = nu u_xx + lam u + sum_i a_i g_i(x)   on [0, pi],  u = 0 at both ends,

with Gaussian actuators g_i, point sensors and reward -(||u||^2 dx + c ||a||^2). With the
defaults (nu 1, lam 2) the first mode grows as e^t: left alone, the state blows up within an
episode; a controller holds it near zero.

The domain is decomposed over the group's communicator: each of the k ranks owns a contiguous
block of the N interior points and swaps one ghost value per side per substep with its
neighbours. Every point is updated by one expression in one order, and the root gathers u and
computes sensors and reward with plain loops in global order, so a trajectory is bitwise the
same for any k, and the same as ``examples/solvers/rd_core.c``'s (the same maths in C).

With the defaults, on the episodes of seeds 0-4: no action returns -901.8 on average, the best
``ProportionalController`` of gains 0.5, 1, 2, 4, 8 (gain 2) -0.0395, a uniformly random policy
about -5,400 (seeds 0-19). See ``best_gain`` and ``zero_action_return``.

Ids: ``mpirl/ReactionDiffusion-v0`` (Box actions) and ``mpirl/ReactionDiffusionDiscrete-v0``
(a few fixed actuation patterns, for DQN).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from mpi4py import MPI

from mpirl.envs import simulation_baselines as baselines
from mpirl.envs.simulation import Simulation
from mpirl.errors import ConfigError

__all__ = ["ReactionDiffusion", "ReactionDiffusionDiscrete", "ProportionalController",
           "controller_return", "zero_action_return", "episode_return", "best_gain",
           "splitmix64", "DEFAULTS"]

#: env_config keys and their defaults (the C solver reads the same keys with the same defaults).
DEFAULTS: dict[str, float | int] = {
    "n_points": 32,         # interior grid points N (a multiple of the group's ranks)
    "nu": 1.0,              # diffusion
    "lam": 2.0,             # reaction: modes n with lam > nu n^2 grow
    "num_actuators": 4,     # Gaussians centred at pi (i + 1/2) / num_actuators
    "actuator_width": 0.2,  # their sigma
    "num_sensors": 8,       # point sensors near pi (s + 1/2) / num_sensors: the observation
    "a_max": 2.0,           # an action of 1 drives an actuator at a_max
    "control_cost": 0.01,   # c in the reward
    "dt": 0.05,             # one env step; explicit Euler substeps below the stability limit
    "max_steps": 100,       # steps per episode, then truncated
    "init_amplitude": 0.1,  # u0 = sum_{n=1..3} b_n sin(n x), b_n ~ U(-amp, amp)
}
_INTEGER_KEYS = ("n_points", "num_actuators", "num_sensors", "max_steps")
_TAG_LEFT, _TAG_RIGHT = 4901, 4902
_MASK64 = (1 << 64) - 1


def splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64: (new state, 64-bit output). The C solver has the same."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def _uniform(state: int) -> tuple[int, float]:
    """(new state, a float in [0, 1) from the top 53 bits)."""
    state, z = splitmix64(state)
    return state, (z >> 11) * (1.0 / 9007199254740992.0)


def check_config(env_config: dict[str, Any]) -> dict[str, Any]:
    """The env_config with defaults filled in; ConfigError naming a bad key or value."""
    unknown = sorted(set(env_config) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"ReactionDiffusion has no env_config key {unknown[0]!r}; its keys are "
                          f"{', '.join(DEFAULTS)}")
    values = {**DEFAULTS, **env_config}
    for key, value in values.items():
        if key in _INTEGER_KEYS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ReactionDiffusion env_config {key} must be a positive "
                                  f"integer, got {value!r}")
        elif (isinstance(value, bool) or not isinstance(value, (int, float))
              or not math.isfinite(value)):
            raise ConfigError(f"ReactionDiffusion env_config {key} must be a number, got "
                              f"{value!r}")
        else:
            values[key] = float(value)
    for key in ("nu", "actuator_width", "dt", "a_max"):
        if values[key] <= 0:
            raise ConfigError(f"ReactionDiffusion env_config {key} must be above 0, got "
                              f"{values[key]!r}")
    for key in ("control_cost", "init_amplitude"):
        if values[key] < 0:
            raise ConfigError(f"ReactionDiffusion env_config {key} must be 0 or more, got "
                              f"{values[key]!r}")
    if values["n_points"] < 2:
        raise ConfigError(f"ReactionDiffusion env_config n_points must be at least 2, got "
                          f"{values['n_points']}")
    return values


def _gaussian(d: float, width: float) -> float:
    return math.exp(-(d * d) / (2.0 * width * width))


def sensor_indices(n_points: int, num_sensors: int) -> list[int]:
    """The grid point (0-based, interior) nearest each sensor's place pi (s + 1/2) / S."""
    return [min(max(((2 * s + 1) * (n_points + 1) + num_sensors) // (2 * num_sensors) - 1, 0),
                n_points - 1) for s in range(num_sensors)]


class ReactionDiffusion(Simulation):
    """The reaction-diffusion env on the ranks of ``comm`` (``n_points`` a multiple of their
    number). Collective: the ghost swaps per substep (neighbours) and one gather of u to the
    root per step; the action reaches every member from the caller."""

    def __init__(self, comm: MPI.Comm, **env_config: Any) -> None:
        super().__init__(comm)
        self.config = c = check_config(env_config)
        k, rank = comm.Get_size(), comm.Get_rank()
        n = c["n_points"]
        if n % k:
            raise ConfigError(f"ReactionDiffusion splits its n_points {n} over the group's {k} "
                              f"ranks: n_points must be a multiple of ranks_per_env {k}")
        self.k, self.rank, self.n, self.block = k, rank, n, n // k
        self.nu, self.lam = c["nu"], c["lam"]
        self.dx = math.pi / (n + 1)
        self.dx2 = self.dx * self.dx
        # Explicit Euler is stable below dx^2 / (2 nu); 0.95 of it leaves a margin.
        self.substeps = math.ceil(c["dt"] / (0.95 * self.dx2 / (2.0 * self.nu)))
        self.h = c["dt"] / self.substeps
        first = rank * self.block
        # math.exp and math.sin are the C library's, as in rd_core.c (NumPy's own may differ
        # in the last bit).
        m, width = c["num_actuators"], c["actuator_width"]
        centres = [math.pi * (i + 0.5) / m for i in range(m)]
        self.shapes = np.array([[_gaussian((first + j + 1) * self.dx - centre, width)
                                 for j in range(self.block)] for centre in centres])
        self.sines = np.array([[math.sin(mode * (first + j + 1) * self.dx)
                                for j in range(self.block)] for mode in (1, 2, 3)])
        self.sensors = sensor_indices(n, c["num_sensors"])
        self.num_actuators = m
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (c["num_sensors"],), np.float64)
        # float32 as most Box envs: replay-based learners (SAC) keep actions in their dtype.
        self.action_space = gym.spaces.Box(-1.0, 1.0, (m,), np.float32)
        self.ext = np.zeros(self.block + 2)  # u with one ghost value each side
        self.u_global = np.zeros(n) if rank == 0 else None
        self.left = rank - 1 if rank > 0 else MPI.PROC_NULL
        self.right = rank + 1 if rank < k - 1 else MPI.PROC_NULL
        self.rng_state = 0
        self.t = 0

    @property
    def u(self) -> np.ndarray:
        """This rank's block of u (a view)."""
        return self.ext[1:-1]

    def reset(self, seed: int | None = None) -> np.ndarray | None:
        if seed is not None:
            self.rng_state = int(seed) & _MASK64  # else the stream goes on: a new episode
        b = []
        for _ in range(3):
            self.rng_state, draw = _uniform(self.rng_state)
            b.append(self.config["init_amplitude"] * (2.0 * draw - 1.0))
        u = self.u
        u[:] = b[0] * self.sines[0]
        u += b[1] * self.sines[1]
        u += b[2] * self.sines[2]
        self.t = 0
        if self._gather() is None:
            return None
        return self._observe()

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool] | None:
        a = self.scaled_action(action)
        forcing = a[0] * self.shapes[0]
        for i in range(1, self.num_actuators):
            forcing = forcing + a[i] * self.shapes[i]
        ext, h, nu, lam, dx2 = self.ext, self.h, self.nu, self.lam, self.dx2
        for _ in range(self.substeps):
            self._swap_ghosts()
            left, centre, right = ext[:-2], ext[1:-1], ext[2:]
            ext[1:-1] = centre + h * ((nu * ((left - 2.0 * centre) + right)) / dx2
                                      + lam * centre + forcing)
        self.t += 1
        u = self._gather()
        if u is None:
            return None
        energy = 0.0
        for value in u.tolist():
            energy += value * value
        effort = 0.0
        for value in a.tolist():
            effort += value * value
        reward = -(energy * self.dx + self.config["control_cost"] * effort)
        return self._observe(), reward, False, self.t >= self.config["max_steps"]

    def scaled_action(self, action: Any) -> np.ndarray:
        """The actuator amplitudes an action asks for: clipped to [-1, 1], times a_max."""
        a = np.asarray(action, np.float64).reshape(-1)
        if a.shape != (self.num_actuators,):
            raise ValueError(f"ReactionDiffusion takes {self.num_actuators} actions per step, "
                             f"got {a.shape[0]}")
        return np.clip(a, -1.0, 1.0) * self.config["a_max"]

    def state(self) -> np.ndarray | None:
        """The whole u on the root (gathered: collective), None on the others."""
        u = self._gather()
        return None if u is None else u.copy()

    def _swap_ghosts(self) -> None:
        if self.k == 1:
            return
        ext = self.ext
        # Send my first value left and take my right ghost from the right, then the mirror.
        self.comm.Sendrecv(ext[1:2], self.left, _TAG_LEFT, ext[-1:], self.right, _TAG_LEFT)
        self.comm.Sendrecv(ext[-2:-1], self.right, _TAG_RIGHT, ext[0:1], self.left, _TAG_RIGHT)

    def _gather(self) -> np.ndarray | None:
        if self.k == 1:
            return self.u
        block = np.ascontiguousarray(self.u)
        self.comm.Gather(block, self.u_global, root=0)
        return self.u_global if self.rank == 0 else None

    def _observe(self) -> np.ndarray:
        u = self._gather_view()
        return np.array([u[j] for j in self.sensors], np.float64)

    def _gather_view(self) -> np.ndarray:
        return self.u if self.k == 1 else self.u_global


class ReactionDiffusionDiscrete(ReactionDiffusion):
    """The same env with a few fixed actuation patterns (Discrete, for DQN): 0 nothing, 1 every
    actuator at +1, 2 every actuator at -1, then each actuator alone at +1 and at -1."""

    def __init__(self, comm: MPI.Comm, **env_config: Any) -> None:
        super().__init__(comm, **env_config)
        m = self.num_actuators
        patterns = [np.zeros(m), np.ones(m), -np.ones(m)]
        for i in range(m):
            for sign in (1.0, -1.0):
                pattern = np.zeros(m)
                pattern[i] = sign
                patterns.append(pattern)
        self.patterns = patterns
        self.action_space = gym.spaces.Discrete(len(patterns))

    def scaled_action(self, action: Any) -> np.ndarray:
        index = int(np.asarray(action).reshape(-1)[0])
        if not 0 <= index < len(self.patterns):
            raise ValueError(f"ReactionDiffusionDiscrete takes an action in 0..."
                             f"{len(self.patterns) - 1}, got {index}")
        return self.patterns[index] * self.config["a_max"]


class ProportionalController:
    """The baseline: a_i = clip(-gain * the sensor nearest actuator i, -1, 1)."""

    def __init__(self, gain: float, **env_config: Any) -> None:
        c = check_config(env_config)
        m, s = c["num_actuators"], c["num_sensors"]
        places = [math.pi * (j + 1) / (c["n_points"] + 1)
                  for j in sensor_indices(c["n_points"], s)]
        self.gain = gain
        self.nearest = [min(range(s), key=lambda j: abs(places[j] - math.pi * (i + 0.5) / m))
                        for i in range(m)]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return np.clip(-self.gain * np.asarray(obs)[self.nearest], -1.0, 1.0)


def episode_return(policy: Any, seed: int, **env_config: Any) -> float:
    """The return of one episode from ``seed`` on one rank; ``policy(obs) -> action``."""
    return baselines.episode_return(ReactionDiffusion, policy, seed, **env_config)


def controller_return(gain: float, seeds: Iterable[int] = range(5),
                      **env_config: Any) -> float:
    """The proportional controller's mean return over episodes from ``seeds``."""
    controller = ProportionalController(gain, **env_config)
    return baselines.mean_return(ReactionDiffusion, controller, seeds, **env_config)


def zero_action_return(seeds: Iterable[int] = range(5), **env_config: Any) -> float:
    """The mean return over episodes from ``seeds`` with every actuator off."""
    m = check_config(env_config)["num_actuators"]
    return baselines.mean_return(ReactionDiffusion, lambda obs: np.zeros(m), seeds, **env_config)


def best_gain(gains: Sequence[float] = (0.5, 1, 2, 4, 8), seeds: Iterable[int] = range(5),
              **env_config: Any) -> tuple[float, float]:
    """(gain, mean return) of the best proportional controller among ``gains``."""
    return baselines.best_gain(ReactionDiffusion, ProportionalController, gains, seeds,
                               **env_config)
