"""A bundled chaotic simulation to control: the Kuramoto-Sivashinsky (KS) equation

    u_t + u u_x + u_xx + u_xxxx = sum_i a_i g_i(x)   on [0, L), periodic,

as in Bucci et al. (2019), "Control of chaotic systems by deep reinforcement learning", Proc. R.
Soc. A 475: L = 22 (chaotic), 4 Gaussian actuators g_i of width 0.4 and peak 1 centred at
x = i L / 4, 8 point sensors at x = s L / 8 (the observation), actions in [-1, 1]^4 scaled by
``a_max`` 0.5, and the reward -||u - E||_2 over the 64 grid values (times ``reward_scale``, 1 by
default): the agent drives the state to E, one of the equation's unstable steady solutions E1,
E2, E3 (the steady waves of 1, 2 and 3 wavelengths per period; Cvitanovic et al. 2010), or to
u = 0 (``target`` 0).

The solver is pseudo-spectral: 64 Fourier modes (NumPy's real FFT) and the ETDRK4 scheme of Cox
and Matthews with Kassam and Trefethen's contour-integral coefficients, exact for the stiff
linear part, so it is stable at the env's step (0.25 time units in 2 substeps; Bucci et al.
step 0.05 and act every step). The forcing is held over a step.

An episode starts on the chaotic attractor: small random Fourier modes from the seed, then
``warmup`` time units unforced. Episodes last ``max_steps`` 400 steps (100 time units) and are
truncated; one whose distance to the target passes ``fail_distance`` ends (terminated) with
``fail_reward`` for that step, as in Bucci et al.'s training. The steady solutions are found
once per process by Newton's method in the odd subspace (``steady_state``).

The k ranks of a group (``ranks_per_env`` k): the root integrates, the others wait (64 modes
leave nothing worth decomposing). Nothing but the root's return value crosses ranks.

With the defaults (target E2, Bucci et al.'s units), on the episodes of seeds 0-4: no action
returns -4,606 on average (the state stays 11.5 from E2 per step, the chaotic attractor's
typical distance), the best ``ProportionalController`` of gains 0.5, 1, 2, 4, 8 (gain 4) -2,091:
it holds E2 on some starts and locks onto another forced state on others. See
``zero_action_return`` and ``best_gain``. PPO (examples/tuned/ppo_kuramoto_sivashinsky.json,
``reward_scale`` 0.01) learns in 400,000 steps, about 130 CPU-s, to take the state to E2 and
hold it within 0.02-0.15 (seeds 0-2): benchmarks/kuramoto_sivashinsky.py, benchmarks/RESULTS.md.

Id: ``mpirl/KuramotoSivashinsky-v0``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from mpi4py import MPI

from mpirl.envs import simulation_baselines as baselines
from mpirl.envs.simulation import Simulation
from mpirl.errors import ConfigError

__all__ = ["KuramotoSivashinsky", "KSSolver", "ProportionalController", "steady_state",
           "episode_return", "controller_return", "zero_action_return", "best_gain",
           "DEFAULTS"]

#: env_config keys and their defaults.
DEFAULTS: dict[str, float | int] = {
    "length": 22.0,          # L, the period: chaotic from about 22 on
    "n_modes": 64,           # grid points = Fourier modes (an even number)
    "num_actuators": 4,      # Gaussians centred at i L / num_actuators
    "actuator_width": 0.4,   # their sigma; peak 1
    "num_sensors": 8,        # point sensors at s L / num_sensors: the observation
    "a_max": 0.5,            # an action of 1 drives an actuator at a_max
    "target": 2,             # 0: u = 0; 1, 2, 3: the steady solution E1, E2, E3
    "control_cost": 0.0,     # c in the reward -scale (||u - E|| + c ||a||^2)
    "reward_scale": 1.0,     # scale: 1 is Bucci et al.'s units; PPO's critic likes ~0.01
    "dt": 0.25,              # one env step (time units)
    "substeps": 2,           # ETDRK4 steps per env step
    "max_steps": 400,        # steps per episode, then truncated
    "warmup": 40.0,          # unforced time from the random start before an episode
    "init_amplitude": 0.1,   # the random start: modes 1-4, cos and sin, each U(-amp, amp)
    "fail_distance": 35.0,   # ||u - E|| beyond which the episode ends (terminated)
    "fail_reward": -100.0,   # the reward of that last step
}
_INTEGER_KEYS = ("n_modes", "num_actuators", "num_sensors", "target", "substeps", "max_steps")


def check_config(env_config: dict[str, Any]) -> dict[str, Any]:
    """The env_config with defaults filled in; ConfigError naming a bad key or value."""
    unknown = sorted(set(env_config) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"KuramotoSivashinsky has no env_config key {unknown[0]!r}; its keys "
                          f"are {', '.join(DEFAULTS)}")
    values = {**DEFAULTS, **env_config}
    for key, value in values.items():
        if key in _INTEGER_KEYS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"KuramotoSivashinsky env_config {key} must be a whole number "
                                  f">= 0, got {value!r}")
        elif (isinstance(value, bool) or not isinstance(value, (int, float))
              or not math.isfinite(value)):
            raise ConfigError(f"KuramotoSivashinsky env_config {key} must be a number, got "
                              f"{value!r}")
        else:
            values[key] = float(value)
    for key in ("length", "actuator_width", "a_max", "dt", "fail_distance", "reward_scale"):
        if values[key] <= 0:
            raise ConfigError(f"KuramotoSivashinsky env_config {key} must be above 0, got "
                              f"{values[key]!r}")
    for key in ("control_cost", "warmup", "init_amplitude"):
        if values[key] < 0:
            raise ConfigError(f"KuramotoSivashinsky env_config {key} must be 0 or more, got "
                              f"{values[key]!r}")
    for key in ("num_actuators", "num_sensors", "substeps", "max_steps"):
        if values[key] < 1:
            raise ConfigError(f"KuramotoSivashinsky env_config {key} must be at least 1, got "
                              f"{values[key]}")
    n = values["n_modes"]
    if n < 16 or n % 2:
        raise ConfigError(f"KuramotoSivashinsky env_config n_modes must be an even number >= 16, "
                          f"got {n}")
    if values["target"] > 3:
        raise ConfigError(f"KuramotoSivashinsky env_config target must be 0 (u = 0) or 1, 2, 3 "
                          f"(E1, E2, E3), got {values['target']}")
    return values


class KSSolver:
    """ETDRK4 for u_t = -u u_x - u_xx - u_xxxx + f on ``n`` points of [0, length), in
    Fourier space (NumPy's rfft). One process; nothing crosses ranks."""

    def __init__(self, length: float, n: int, h: float) -> None:
        self.length, self.n, self.h = length, n, h
        self.x = np.arange(n) * length / n
        k = np.fft.rfftfreq(n, d=length / (2.0 * math.pi * n))
        self.lin = k ** 2 - k ** 4
        k_odd = k.copy()
        k_odd[-1] = 0.0  # the Nyquist mode of a first derivative of a real field is zero
        self.half_ik = -0.5j * k_odd  # N(v) = -(u^2 / 2)_x
        # Kassam & Trefethen (2005): phi functions by a mean over a circle of radius 1 around
        # each h * lin, which avoids the cancellation of the plain formulas near 0.
        lh = h * self.lin
        roots = np.exp(1j * math.pi * (np.arange(1, 33) - 0.5) / 32)
        z = lh[:, None] + roots[None, :]
        self.e, self.e2 = np.exp(lh), np.exp(lh / 2)
        self.q = h * np.real(np.mean((np.exp(z / 2) - 1) / z, axis=1))
        self.f1 = h * np.real(np.mean((-4 - z + np.exp(z) * (4 - 3 * z + z ** 2)) / z ** 3, axis=1))
        self.f2 = h * np.real(np.mean((2 + z + np.exp(z) * (-2 + z)) / z ** 3, axis=1))
        self.f3 = h * np.real(np.mean((-4 - 3 * z - z ** 2 + np.exp(z) * (4 - z)) / z ** 3,
                                      axis=1))

    def nonlinear(self, v: np.ndarray, forcing_hat: np.ndarray) -> np.ndarray:
        u = np.fft.irfft(v, self.n)
        return self.half_ik * np.fft.rfft(u * u) + forcing_hat

    def step(self, v: np.ndarray, forcing_hat: np.ndarray) -> np.ndarray:
        """One ETDRK4 step of h from the Fourier coefficients v; the forcing held."""
        nv = self.nonlinear(v, forcing_hat)
        a = self.e2 * v + self.q * nv
        na = self.nonlinear(a, forcing_hat)
        b = self.e2 * v + self.q * na
        nb = self.nonlinear(b, forcing_hat)
        c = self.e2 * a + self.q * (2 * nb - nv)
        nc = self.nonlinear(c, forcing_hat)
        return self.e * v + nv * self.f1 + 2 * (na + nb) * self.f2 + nc * self.f3

    def residual(self, u: np.ndarray) -> np.ndarray:
        """u_t of the unforced equation at u, on the grid (zero at a steady solution)."""
        v = np.fft.rfft(u)
        return np.fft.irfft(self.lin * v + self.nonlinear(v, 0.0), self.n)


@functools.lru_cache(maxsize=16)
def steady_state(wavelengths: int, length: float = 22.0, n: int = 64) -> np.ndarray:
    """E1, E2 or E3 (``wavelengths`` 1, 2, 3) on the grid: the steady solution whose leading
    Fourier mode is that one, found by Newton's method over the odd (sine) subspace, which
    fixes its phase; 0 gives u = 0. ConfigError when Newton finds none at this length."""
    if wavelengths == 0:
        return np.zeros(n)
    solver = KSSolver(length, n, 0.1)
    modes = np.arange(1, n // 2)
    sines = np.sin(np.outer(modes, 2 * math.pi * solver.x / length))  # [mode, point]
    best = None
    for amplitude in (0.5, 1.0, 2.0, 3.0):
        b = np.zeros(len(modes))
        b[wavelengths - 1] = amplitude
        for _ in range(60):
            u = b @ sines
            r = solver.residual(u) @ sines.T * (2.0 / n)  # the residual's sine coefficients
            if np.abs(r).max() < 1e-12:
                break
            jacobian = np.empty((len(modes), len(modes)))
            for m in range(len(modes)):
                jacobian[:, m] = (solver.residual(u + 1e-7 * sines[m]) @ sines.T * (2.0 / n)
                                  - r) / 1e-7
            b = b - np.linalg.lstsq(jacobian, r, rcond=None)[0]
        u = b @ sines
        leading = int(np.argmax(np.abs(np.fft.rfft(u))[1:])) + 1
        if (np.abs(solver.residual(u)).max() < 1e-9 and np.abs(u).max() > 0.1
                and leading == wavelengths):
            best = u
            break
    if best is None:
        raise ConfigError(f"KuramotoSivashinsky found no steady solution E{wavelengths} at "
                          f"length {length}; choose target 0 or another length")
    best.setflags(write=False)
    return best


def _gaussian_columns(x: np.ndarray, centres: Sequence[float], width: float,
                      length: float) -> np.ndarray:
    """[point, actuator]: periodic Gaussians of peak 1."""
    d = x[:, None] - np.asarray(centres)[None, :]
    d = (d + length / 2) % length - length / 2  # the nearest image on the circle
    return np.exp(-(d * d) / (2 * width * width))


class KuramotoSivashinsky(Simulation):
    """The KS env on the ranks of ``comm``: the root integrates, the others wait (their reset
    and step return None at once). Only the root's return value crosses ranks."""

    def __init__(self, comm: MPI.Comm, **env_config: Any) -> None:
        super().__init__(comm)
        self.config = c = check_config(env_config)
        self.is_root = comm.Get_rank() == 0
        n, length = c["n_modes"], c["length"]
        self.solver = KSSolver(length, n, c["dt"] / c["substeps"])
        m, s = c["num_actuators"], c["num_sensors"]
        self.actuators = _gaussian_columns(self.solver.x, [length * i / m for i in range(m)],
                                           c["actuator_width"], length)
        self.actuator_hats = np.fft.rfft(self.actuators, axis=0)  # [mode, actuator]
        self.sensors = [round(j * n / s) % n for j in range(s)]
        self.target = steady_state(c["target"], length, n)
        self.num_actuators = m
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (s,), np.float64)
        # float32 as most Box envs: replay-based learners (SAC) keep actions in their dtype.
        self.action_space = gym.spaces.Box(-1.0, 1.0, (m,), np.float32)
        self.rng = np.random.default_rng(0)
        self.v = np.zeros(n // 2 + 1, complex)
        self.t = 0

    @property
    def u(self) -> np.ndarray:
        """The state on the grid (root; zeros elsewhere)."""
        return np.fft.irfft(self.v, self.config["n_modes"])

    def reset(self, seed: int | None = None) -> np.ndarray | None:
        if not self.is_root:
            return None
        if seed is not None:
            self.rng = np.random.default_rng(int(seed))  # else the stream goes on
        c = self.config
        phase = 2 * math.pi * self.solver.x / c["length"]
        u = np.zeros(c["n_modes"])
        for mode in range(1, 5):
            a, b = self.rng.uniform(-c["init_amplitude"], c["init_amplitude"], 2)
            u += a * np.cos(mode * phase) + b * np.sin(mode * phase)
        self.v = np.fft.rfft(u)
        unforced = np.zeros_like(self.v)
        for _ in range(round(c["warmup"] / self.solver.h)):
            self.v = self.solver.step(self.v, unforced)
        self.t = 0
        return self._observe(self.u)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool] | None:
        if not self.is_root:
            return None
        a = self.scaled_action(action)
        forcing_hat = self.actuator_hats @ a
        for _ in range(self.config["substeps"]):
            self.v = self.solver.step(self.v, forcing_hat)
        self.t += 1
        u = self.u
        distance = float(np.linalg.norm(u - self.target))
        c = self.config
        truncated = self.t >= c["max_steps"]
        if not math.isfinite(distance) or distance > c["fail_distance"]:
            return (np.nan_to_num(self._observe(u)), c["reward_scale"] * c["fail_reward"], True,
                    truncated)
        reward = -c["reward_scale"] * (distance + c["control_cost"] * float(a @ a))
        return self._observe(u), reward, False, truncated

    def scaled_action(self, action: Any) -> np.ndarray:
        """The actuator amplitudes an action asks for: clipped to [-1, 1], times a_max."""
        a = np.asarray(action, np.float64).reshape(-1)
        if a.shape != (self.num_actuators,):
            raise ValueError(f"KuramotoSivashinsky takes {self.num_actuators} actions per step, "
                             f"got {a.shape[0]}")
        return np.clip(a, -1.0, 1.0) * self.config["a_max"]

    def _observe(self, u: np.ndarray) -> np.ndarray:
        return u[self.sensors].astype(np.float64)


class ProportionalController:
    """The baseline: a_i = clip(-gain * (u - E) at the sensor nearest actuator i, -1, 1)."""

    def __init__(self, gain: float, **env_config: Any) -> None:
        c = check_config(env_config)
        m, s, n = c["num_actuators"], c["num_sensors"], c["n_modes"]
        self.gain = gain
        self.nearest = [round(i * s / m) % s for i in range(m)]
        target = steady_state(c["target"], c["length"], n)
        self.reference = target[[round(j * n / s) % n for j in range(s)]]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        error = (np.asarray(obs) - self.reference)[self.nearest]
        return np.clip(-self.gain * error, -1.0, 1.0)


def episode_return(policy: Any, seed: int, **env_config: Any) -> float:
    """The return of one episode from ``seed`` on one rank; ``policy(obs) -> action``."""
    return baselines.episode_return(KuramotoSivashinsky, policy, seed, **env_config)


def controller_return(gain: float, seeds: Iterable[int] = range(5),
                      **env_config: Any) -> float:
    """The proportional controller's mean return over episodes from ``seeds``."""
    controller = ProportionalController(gain, **env_config)
    return baselines.mean_return(KuramotoSivashinsky, controller, seeds, **env_config)


def zero_action_return(seeds: Iterable[int] = range(5), **env_config: Any) -> float:
    """The mean return over episodes from ``seeds`` with every actuator off."""
    m = check_config(env_config)["num_actuators"]
    return baselines.mean_return(KuramotoSivashinsky, lambda obs: np.zeros(m), seeds, **env_config)


def best_gain(gains: Sequence[float] = (0.5, 1, 2, 4, 8), seeds: Iterable[int] = range(5),
              **env_config: Any) -> tuple[float, float]:
    """(gain, mean return) of the best proportional controller among ``gains``."""
    return baselines.best_gain(KuramotoSivashinsky, ProportionalController, gains, seeds,
                               **env_config)
