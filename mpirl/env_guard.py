"""Environments that raise are recreated in place, so one bad episode does not end a run.

``GuardedEnv`` wraps each sub-environment of a rollout worker's vector env. When the environment
raises in ``step`` or ``reset``, the wrapper closes it, builds a fresh one from its ``EnvSpec``,
resets that one with a seed derived from the worker's seed and the failure count, and reports the
failure in the info dict; the vector env never sees the exception. A failed ``step`` returns the
fresh environment's first observation with ``terminated = truncated = False`` and
``info[EPISODE_DROPPED] = True``, which tells the rollout worker to drop the partial episode.

``max_failures`` failures in a row on one sub-env (a successful ``step`` resets the count) raise
``EnvFailureError`` on the rollout rank; the driver re-raises it with ``unwrap_env_failure`` so
the user reads one message, not a remote traceback. Nothing here crosses ranks by itself.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np

from mpirl.errors import ConfigError, EnvFailureError, MpirlError, RemoteError

if TYPE_CHECKING:
    from mpirl.rollout import EnvSpec

#: Info key: how many failures this call recovered from (an int; absent when none).
FAILURES = "mpirl_env_failures"
#: Info key: True when ``step`` itself failed, so the episode it belonged to is lost.
EPISODE_DROPPED = "mpirl_episode_dropped"
#: Info key: ``"Type: message"`` of the latest failure.
ERROR = "mpirl_env_error"

#: The config key that sets ``max_failures``, named in the error message.
CONFIG_KEY = "max_env_failures"


def check_max_failures(value: int) -> None:
    """ConfigError unless ``value`` is a usable ``max_env_failures``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"config key {CONFIG_KEY!r} must be a whole number >= 1 (failures in a row of one "
            f"environment that end the run; 1 ends it on the first), got {value!r}"
        )


class GuardedEnv(gym.Wrapper):
    """One sub-environment that is rebuilt from ``spec`` whenever it raises.

    Picklable: it holds the ``EnvSpec``, not a factory function. ``where`` names the rollout
    worker in error messages; ``seed`` and ``index`` make the seeds of rebuilt environments
    deterministic.
    """

    def __init__(self, spec: EnvSpec, max_failures: int, seed: int = 0, index: int = 0,
                 where: str = "this process") -> None:
        check_max_failures(max_failures)
        super().__init__(spec.make())
        self.env_spec = spec
        self.max_failures = max_failures
        self.base_seed = seed
        self.index = index
        self.where = where
        self.failures_in_row = 0
        self.failures_total = 0
        self.last_error: str | None = None

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
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

    def _recover(self, error: Exception) -> tuple[Any, dict[str, Any]]:
        """Replace the broken env with a fresh, reset one; retry while that fails too."""
        failures = 0
        while True:
            failures += 1
            self.failures_in_row += 1
            self.failures_total += 1
            self.last_error = _describe(error)
            if self.failures_in_row >= self.max_failures:
                raise EnvFailureError(self._limit_message()) from error
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
    if error.cause_type == f"{EnvFailureError.__module__}.{EnvFailureError.__qualname__}":
        return EnvFailureError(error.cause_message)
    return error
