"""The bundled Kuramoto-Sivashinsky simulation: its solver against what the equation must do
(linear decay, conservation of the mean, chaos that stays bounded, steady solutions that stay
put, forcing that enters as it should), its config checks and its gymnasium id. In-process and
cheap (under 2 CPU-s together); the showcase training is benchmarks/kuramoto_sivashinsky.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import train_refused_in_process
from mpi4py import MPI

from mpirl.envs.kuramoto_sivashinsky import (
    KSSolver,
    KuramotoSivashinsky,
    ProportionalController,
    steady_state,
)
from mpirl.errors import ConfigError
from mpirl.workers.env_spec import EnvSpec

L, N = 22.0, 64


def run(solver: KSSolver, u: np.ndarray, steps: int, forcing: np.ndarray | None = None
        ) -> np.ndarray:
    v = np.fft.rfft(u)
    f = np.zeros_like(v) if forcing is None else np.fft.rfft(forcing)
    for _ in range(steps):
        v = solver.step(v, f)
    return np.fft.irfft(v, N)


def test_a_small_stable_mode_decays_at_its_linear_rate():
    solver = KSSolver(L, N, 0.125)
    k = 5 * 2 * math.pi / L  # k^2 - k^4 < 0: damped; 1e-8 keeps u u_x negligible
    u = run(solver, 1e-8 * np.sin(k * solver.x), 40)
    expected = 1e-8 * math.exp((k * k - k ** 4) * 5.0)
    assert np.abs(u).max() == pytest.approx(expected, rel=1e-6)


def test_the_unforced_flow_keeps_its_mean_and_stays_bounded_and_chaotic():
    solver = KSSolver(L, N, 0.125)
    rng = np.random.default_rng(3)
    u0 = 0.1 * rng.standard_normal(N)
    u0 -= u0.mean()
    u = run(solver, u0, 400)  # 50 time units: on the attractor
    assert abs(u.mean()) < 1e-12
    assert 1.0 < np.abs(u).max() < 5.0
    near = u + 1e-8 * np.sin(3 * 2 * math.pi * solver.x / L)
    a, b = run(solver, u, 800), run(solver, near, 800)  # 100 time units later
    assert abs(a.mean()) < 1e-12 and np.abs(a).max() < 5.0
    assert np.abs(a - u).max() > 0.5  # not steady
    assert np.abs(a - b).max() > 1e-5  # a perturbation of 1e-8 grew a thousandfold: chaos


def test_the_scheme_converges_at_the_env_step():
    u0 = steady_state(2) + 0.3 * np.cos(2 * math.pi * np.arange(N) / N)
    coarse = run(KSSolver(L, N, 0.125), u0, 40)
    fine = run(KSSolver(L, N, 0.0125), u0, 400)
    assert np.abs(coarse - fine).max() < 1e-4


@pytest.mark.parametrize("wavelengths", [1, 2, 3])
def test_a_steady_solution_stays_put(wavelengths):
    e = steady_state(wavelengths)
    spectrum = np.abs(np.fft.rfft(e))
    assert int(np.argmax(spectrum)) == wavelengths
    assert spectrum[wavelengths] > 1.0
    # E2 and E3 have only the multiples of their wavenumber.
    others = [m for m in range(1, N // 2) if m % wavelengths]
    assert spectrum[others].max(initial=0.0) < 1e-8
    solver = KSSolver(L, N, 0.125)
    assert np.abs(solver.residual(e)).max() < 1e-9
    assert np.abs(run(solver, e, 80) - e).max() < 1e-6  # 10 time units; unstable, yet still


def test_forcing_moves_the_mean_by_its_integral_and_changes_the_state():
    env = KuramotoSivashinsky(MPI.COMM_SELF, warmup=0.0)
    obs = env.reset(seed=1)
    before = env.u
    action = np.array([1.0, -0.5, 0.25, 0.0])
    obs_forced, reward, terminated, truncated = env.step(action)
    # d/dt mean(u) = mean(f): u u_x, u_xx and u_xxxx are derivatives of periodic fields.
    forcing = env.actuators @ (action * 0.5)
    assert env.u.mean() - before.mean() == pytest.approx(0.25 * forcing.mean(), abs=1e-12)
    idle = KuramotoSivashinsky(MPI.COMM_SELF, warmup=0.0)
    assert np.array_equal(idle.reset(seed=1), obs)
    obs_idle = idle.step(np.zeros(4))[0]
    assert np.abs(obs_forced - obs_idle).max() > 1e-2
    assert reward == pytest.approx(-np.linalg.norm(env.u - steady_state(2)))
    assert not terminated and not truncated


def test_episodes_end_as_configured_and_the_seed_fixes_the_start():
    env = KuramotoSivashinsky(MPI.COMM_SELF, max_steps=3, warmup=5.0)
    first = env.reset(seed=7)
    assert first.shape == (8,) and first.dtype == np.float64
    assert [env.step(np.zeros(4))[3] for _ in range(3)] == [False, False, True]
    assert np.array_equal(env.reset(seed=7), first)
    assert not np.array_equal(env.reset(), first)  # no seed: the stream goes on
    failing = KuramotoSivashinsky(MPI.COMM_SELF, fail_distance=1.0, warmup=40.0)
    failing.reset(seed=0)
    _, reward, terminated, _ = failing.step(np.zeros(4))
    assert terminated and reward == -100.0


def test_the_proportional_controller_acts_against_the_error_at_its_actuator():
    controller = ProportionalController(2.0)
    e = steady_state(2)
    sensors = e[::8].copy()
    assert np.abs(controller(sensors)).max() == 0.0
    sensors[2] += 0.1  # the sensor at x = L/4, the second actuator's place
    assert controller(sensors) == pytest.approx([0.0, -0.2, 0.0, 0.0])


def test_only_the_root_of_a_group_integrates():
    class SecondRank:
        def Get_rank(self) -> int:
            return 1

        def Get_size(self) -> int:
            return 2

    env = KuramotoSivashinsky(SecondRank())  # type: ignore[arg-type]
    assert env.reset(seed=0) is None and env.step(np.zeros(4)) is None


@pytest.mark.parametrize(("config", "message"), [
    ({"lenght": 22}, "no env_config key 'lenght'; its keys are length, n_modes"),
    ({"n_modes": 63}, "n_modes must be an even number >= 16, got 63"),
    ({"target": 4}, "target must be 0 (u = 0) or 1, 2, 3 (E1, E2, E3), got 4"),
    ({"dt": 0}, "dt must be above 0, got 0.0"),
    ({"substeps": 1.5}, "substeps must be a whole number >= 0, got 1.5"),
    ({"a_max": "1"}, "a_max must be a number, got '1'"),
])
def test_bad_env_config_is_a_config_error(config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KuramotoSivashinsky(MPI.COMM_SELF, **config)


def test_the_id_makes_a_simulation_env_in_process():
    env = EnvSpec("mpirl/KuramotoSivashinsky-v0", env_config={"max_steps": 2}).make()
    assert isinstance(env.simulation, KuramotoSivashinsky)
    obs, _ = env.reset(seed=3)
    assert obs.shape == (8,) and env.action_space.shape == (4,)
    _, reward, terminated, truncated, _ = env.step(np.ones(4, np.float32))
    assert reward < 0 and not terminated and not truncated
    assert env.step(np.zeros(4, np.float32))[3] is True


def test_a_bad_env_config_refuses_the_run(tmp_path, capsys):
    line = train_refused_in_process(
        tmp_path, capsys, "--algo", "PPO", "--env", "mpirl/KuramotoSivashinsky-v0",
        "--config", '{"env_config": {"target": 5}}')
    assert "KuramotoSivashinsky env_config target must be 0 (u = 0) or 1, 2, 3" in line
