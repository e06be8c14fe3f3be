"""Environments that raise are recreated in place, so one bad episode does not end a run.

``GuardedEnv`` wraps each sub-environment of a rollout worker's vector env. When the environment
raises in ``step`` or ``reset``, the wrapper closes it, builds a fresh one from its ``EnvSpec``,
resets that one with a seed derived from the worker's seed and the failure count, and reports the
failure in the info dict; the vector env never sees the exception. A failed ``step`` returns the
fresh environment's first observation with ``terminated = truncated = False`` and
``info[EPISODE_DROPPED] = True``, which tells the rollout worker to drop the partial episode.

``max_failures`` failures of one sub-env raise ``EnvFailureError`` on the rollout rank when they
come in a row, or within the sub-env's last ``window`` steps (so an env that
fails every few steps, with successes between, still ends the run); the driver re-raises it with
``unwrap_env_failure`` so the user reads one message, not a remote traceback. Nothing here
crosses ranks by itself.
"""

from __future__ import annotations

import traceback
from collections import deque
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np

from mpirl.config.fields import check_key
from mpirl.errors import (
    EnvFailureError,
    MpirlError,
    RemoteError,
    SimulationError,
    SimulationStuck,
    unwrap_remote,
)

__all__ = ["unwrap_env_failure"]

if TYPE_CHECKING:
    from mpirl.workers.env_spec import EnvSpec

#: Info key: how many failures this call recovered from (an int; absent when none).
FAILURES = "mpirl_env_failures"
#: Info key: True when ``step`` itself failed, so the episode it belonged to is lost.
EPISODE_DROPPED = "mpirl_episode_dropped"
#: Info key: ``"Type: message"`` of the latest failure.
ERROR = "mpirl_env_error"

#: The config keys that set ``max_failures`` and ``window``, named in the error message.
CONFIG_KEY = "max_env_failures"
WINDOW_KEY = "env_failure_window"


class _Recovering:
    """Rebuilding a broken env from ``env_spec``, counting failures in a row and within the
    last ``window`` steps; the guards below share it."""

    env: Any
    env_spec: EnvSpec
    max_failures: int
    window: int
    base_seed: int
    index: int
    where: str
    failures_in_row: int
    failures_total: int
    steps: int
    recent_failures: deque[int]
    last_error: str | None

    def _recover(self, error: Exception) -> tuple[Any, dict[str, Any]]:
        """Replace the broken env with a fresh, reset one; retry while that fails too."""
        failures = 0
        while True:
            failures += 1
            self.failures_in_row += 1
            self.failures_total += 1
            self.last_error = _describe(error)
            self.recent_failures.append(self.steps)
            while self.recent_failures[0] <= self.steps - self.window:
                self.recent_failures.popleft()
            if self.failures_in_row >= self.max_failures:
                raise EnvFailureError(self._limit_message()) from error
            if len(self.recent_failures) >= self.max_failures:
                raise EnvFailureError(self._window_message()) from error
            _close_quietly(self.env)
            try:
                self.env = self.env_spec.make()
                obs, info = self.env.reset(seed=self._recovery_seed())
            except Exception as next_error:  # noqa: BLE001 - counts as the next failure in a row
                error = next_error
                continue
            return obs, {**info, FAILURES: failures, ERROR: self.last_error}

    def _recovery_seed(self) -> int:
        # A pure function of (worker seed, sub-env, failures so far): a rerun sees the same envs.
        entropy = (self.base_seed & 0xFFFFFFFF, self.index, self.failures_total)
        return int(np.random.SeedSequence(entropy).generate_state(1)[0])

    def _limit_message(self) -> str:
        n = self.failures_in_row
        return (
            f"environment {self.env_spec.env_id!r} failed {n} time{'s' if n > 1 else ''} in a "
            f"row (sub-env {self.index} of {self.where}); the last error was {self.last_error}. "
            f"Fix the environment, or allow more failures in a row with --config "
            f"'{{\"{CONFIG_KEY}\": {max(2 * n, 10)}}}' (now {self.max_failures})."
        )

    def _window_message(self) -> str:
        n, steps = len(self.recent_failures), self.steps - self.recent_failures[0] + 1
        return (
            f"environment {self.env_spec.env_id!r} failed {n} times within {steps} steps "
            f"(sub-env {self.index} of {self.where}; {CONFIG_KEY} {self.max_failures} within "
            f"{WINDOW_KEY} {self.window} steps end the run); the last error was "
            f"{self.last_error}. Fix the environment, or tolerate it with a larger "
            f"{CONFIG_KEY} or a smaller {WINDOW_KEY}, e.g. --config "
            f"'{{\"{WINDOW_KEY}\": {max(1, steps // n)}}}'."
        )


class GuardedEnv(gym.Wrapper, _Recovering):
    """One sub-environment that is rebuilt from ``spec`` whenever it raises.

    Picklable: it holds the ``EnvSpec``, not a factory function. ``where`` names the rollout
    worker in error messages; ``seed`` and ``index`` make the seeds of rebuilt environments
    deterministic. ``window`` counts calls of ``step`` (a reset's failure counts at the step it
    follows).
    """

    def __init__(self, spec: EnvSpec, max_failures: int, seed: int = 0, index: int = 0,
                 where: str = "this process", window: int = 1_000) -> None:
        check_key(CONFIG_KEY, max_failures)
        check_key(WINDOW_KEY, window)
        super().__init__(spec.make())
        self.env_spec = spec
        self.max_failures = max_failures
        self.window = window
        self.base_seed = seed
        self.index = index
        self.where = where
        self.failures_in_row = 0
        self.failures_total = 0
        self.steps = 0
        #: the step numbers of the failures within the last ``window`` steps
        self.recent_failures: deque[int] = deque()
        self.last_error: str | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Environments pickled in checkpoints written before the window existed.
        state.setdefault("window", 1_000)
        state.setdefault("steps", 0)
        state.setdefault("recent_failures", deque())
        self.__dict__.update(state)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        try:
            result = self.env.step(action)
        except Exception as error:  # noqa: BLE001 - any error of the env's own code is recovered
            obs, info = self._recover(error)
            info[EPISODE_DROPPED] = True
            return obs, 0.0, False, False, info
        self.failures_in_row = 0
        return result

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        try:
            return self.env.reset(seed=seed, options=options)
        except Exception as error:  # noqa: BLE001 - as in step
            return self._recover(error)

class GuardedParallelEnv(_Recovering):
    """A multi-agent env (Parallel API) that is rebuilt from ``spec`` whenever it raises, as
    ``GuardedEnv`` does for one agent. A failed ``step`` returns the fresh env's first
    observations with empty rewards and ``dropped`` True: the episode it was in is lost.
    ``failures`` counts the recoveries since the caller last read and cleared it."""

    def __init__(self, spec: EnvSpec, max_failures: int, seed: int = 0, index: int = 0,
                 where: str = "this process", window: int = 1_000) -> None:
        check_key(CONFIG_KEY, max_failures)
        check_key(WINDOW_KEY, window)
        self.env = spec.make()
        self.env_spec, self.max_failures, self.window = spec, max_failures, window
        self.base_seed, self.index, self.where = seed, index, where
        self.failures_in_row = self.failures_total = self.steps = 0
        self.recent_failures = deque()
        self.last_error = None
        self.dropped = False
        self.failures = 0

    @property
    def agents(self) -> list[str]:
        return list(self.env.agents)

    def state(self) -> Any:
        return self.env.state()

    def reset(self, seed: int | None = None) -> tuple[dict, dict]:
        try:
            return self.env.reset(seed=seed)
        except Exception as error:  # noqa: BLE001 - any error of the env's own code is recovered
            obs, info = self._recover(error)
            self.failures += info[FAILURES]
            return obs, {}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        self.steps += 1
        self.dropped = False
        try:
            result = self.env.step(actions)
        except Exception as error:  # noqa: BLE001 - as in reset
            obs, info = self._recover(error)
            self.failures += info[FAILURES]
            self.dropped = True
            return obs, {}, {}, {}, {}
        self.failures_in_row = 0
        return result

    def close(self) -> None:
        _close_quietly(self.env)


def _describe(error: BaseException) -> str:
    """``Type: message (at file:line in function)``: short enough for one line of a report."""
    text = f"{type(error).__name__}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text


def _close_quietly(env: gym.Env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - the env is broken already; closing is best effort
        pass


def unwrap_env_failure(error: RemoteError) -> MpirlError:
    """The ``EnvFailureError`` a rollout worker raised, as one of this process, so the driver
    reports its message alone; any other remote error unchanged."""
    return unwrap_remote(error, EnvFailureError, SimulationError, SimulationStuck)
