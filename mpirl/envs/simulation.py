"""Simulations as environments: an environment that is an MPI program of its own.

A ``Simulation`` is one environment instance spread over the k ranks of its group's
communicator (``ranks_per_env`` k): a solver with its domain decomposed over them. Every member
constructs it and calls ``reset`` and ``step`` together (they are collective over ``comm``); the
group's root (rank 0 of ``comm``) returns what the rollout rank gets, the others return None.
The rollout rank sends one message per step to the root and gets one back
(``mpirl.runtime.sim_link``); a reset is a message, so the simulation stays alive across
episodes. With k = 1 (and in local mode, and in ``mpirl evaluate``) a Simulation runs inside the
rollout process on ``MPI.COMM_SELF``, wrapped by ``SimulationEnv``.

A solver written in C, C++ or Fortran runs as a program of its own beside the run (MPMD) and
speaks the same protocol through ``mpirl/envs/solver/mpirl_solver.h``; ``Solver`` is the env id
that stands for it in the run's config.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from mpi4py import MPI

__all__ = ["Simulation", "SimulationEnv", "Solver"]


class Simulation:
    """An environment whose one instance spans the ranks of ``comm``.

    Subclasses set ``observation_space`` (a Box) and ``action_space`` (a Box or Discrete) in
    ``__init__``, the same on every member, and implement ``reset`` and ``step``:

    * ``reset(seed)``: start an episode; the root returns the observation, the others None.
    * ``step(action)``: every member gets the same action; the root returns ``(obs, reward,
      terminated, truncated)``, the others None.

    Both are collective over ``comm``. ``env_config`` comes from the run's config on every
    member. Nothing but the root's return value crosses to the rollout rank.
    """

    observation_space: gym.spaces.Box
    action_space: gym.spaces.Box | gym.spaces.Discrete

    def __init__(self, comm: MPI.Comm, **env_config: Any) -> None:
        self.comm = comm

    def reset(self, seed: int | None = None) -> np.ndarray | None:
        raise NotImplementedError

    def step(self, action: np.ndarray | int
             ) -> tuple[np.ndarray, float, bool, bool] | None:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the simulation holds; collective like ``reset``."""


class SimulationEnv(gym.Env):
    """A ``Simulation`` on one rank (``MPI.COMM_SELF``) as a gymnasium env: how k = 1, local
    mode and ``mpirl evaluate`` run it. Nothing crosses ranks."""

    def __init__(self, simulation_class: type[Simulation], **env_config: Any) -> None:
        self.simulation = simulation_class(MPI.COMM_SELF, **env_config)
        self.observation_space = self.simulation.observation_space
        self.action_space = self.simulation.action_space

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        obs = self.simulation.reset(seed)
        return np.asarray(obs, self.observation_space.dtype), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated = self.simulation.step(action)
        return (np.asarray(obs, self.observation_space.dtype), float(reward), bool(terminated),
                bool(truncated), {})

    def close(self) -> None:
        self.simulation.close()


class Solver(Simulation):
    """The stand-in, in the run's config, for a solver program launched beside the run (MPMD:
    ``mpiexec -n 3 mpirl train --env mpirl.envs.simulation:Solver ... : -n 8 ./solver``).

    Its spaces come from ``env_config``: ``observation_size``, and ``action_size`` (a Box in
    [``action_low``, ``action_high``], default [-1, 1]) or ``action_n`` (Discrete). The whole
    ``env_config`` reaches the solver as JSON. It cannot step in-process."""

    def __init__(self, comm: MPI.Comm, **env_config: Any) -> None:
        super().__init__(comm)
        self.env_config = env_config
        self.observation_space, self.action_space = solver_spaces(env_config)

    def reset(self, seed: int | None = None) -> np.ndarray | None:
        raise RuntimeError("a Solver env steps only in an MPMD launch, with the solver program "
                           "after ':' (mpiexec -n N mpirl train ... : -n S ./solver)")

    step = reset  # type: ignore[assignment]


def solver_spaces(env_config: dict[str, Any]) -> tuple[gym.spaces.Box, gym.spaces.Space]:
    """The spaces a ``Solver`` env_config describes; ConfigError naming what is missing."""
    from mpirl.errors import ConfigError

    size = env_config.get("observation_size")
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"a Solver env needs env_config observation_size, a positive integer "
                          f"(the floats the solver sends per step); got {size!r}")
    observation = gym.spaces.Box(-np.inf, np.inf, (size,), np.float64)
    if "action_n" in env_config:
        n = env_config["action_n"]
        if not isinstance(n, int) or n < 2:
            raise ConfigError(f"env_config action_n must be an integer >= 2, got {n!r}")
        return observation, gym.spaces.Discrete(n)
    a = env_config.get("action_size")
    if not isinstance(a, int) or a < 1:
        raise ConfigError(f"a Solver env needs env_config action_size (a Box action's floats) or "
                          f"action_n (a Discrete action's choices); got action_size {a!r}")
    low, high = env_config.get("action_low", -1.0), env_config.get("action_high", 1.0)
    # float32 as the bundled simulations: SAC's critic takes actions beside float32 features.
    return observation, gym.spaces.Box(float(low), float(high), (a,), np.float32)


# The bundled simulations, registered under gymnasium ids by their class's path (a string: nothing
# is imported until one is made). EnvSpec recognises a Simulation entry point and wraps it
# (SimulationEnv on one rank; an env group with ranks_per_env), so `--env
# mpirl/ReactionDiffusion-v0` works wherever this module is imported (EnvSpec imports it).
BUNDLED_IDS = {
    "mpirl/ReactionDiffusion-v0": "mpirl.envs.reaction_diffusion:ReactionDiffusion",
    "mpirl/ReactionDiffusionDiscrete-v0": "mpirl.envs.reaction_diffusion:ReactionDiffusionDiscrete",
    "mpirl/KuramotoSivashinsky-v0": "mpirl.envs.kuramoto_sivashinsky:KuramotoSivashinsky",
}
for _id, _entry_point in BUNDLED_IDS.items():
    if _id not in gym.registry:
        gym.register(_id, entry_point=_entry_point)
# The solver program beside the run (MPMD), its spaces from env_config: --env mpirl/Solver-v0.
SOLVER_ID = "mpirl/Solver-v0"
if SOLVER_ID not in gym.registry:
    gym.register(SOLVER_ID, entry_point="mpirl.envs.simulation:Solver")
