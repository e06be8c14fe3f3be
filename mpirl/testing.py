"""Fake, deterministic workers for tests, benchmarks and ``mpirl doctor``-style checks.

They live in the package (not under tests/) because every rank must be able to import a worker
class by name when the driver spawns it.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from mpirl.envs.examples import MultiAgentCartPole
from mpirl.envs.parallel import load_factory, make_parallel
from mpirl.envs.simulation import Simulation
from mpirl.errors import ConfigError
from mpirl.runtime.core import RankContext, Worker
from mpirl.runtime.memory import rss_bytes
from mpirl.workers.callbacks import Callbacks


class Echo(Worker):
    """Echoes, counts, sleeps, fails and exits on request; reports where it runs."""

    MESSAGES = (
        "echo", "ping", "count", "sleep_then", "fail", "exit_outside_task", "make_array",
        "checksum", "whoami", "unpicklable_result",
    )

    def __init__(self, context: RankContext, label: str = "") -> None:
        super().__init__(context)
        self.label = label
        self.calls = 0

    def echo(self, value: Any) -> Any:
        self.calls += 1
        return value

    def ping(self) -> None:
        return None

    def count(self) -> int:
        """How many ``echo`` calls this worker has served (its state survives errors)."""
        return self.calls

    def sleep_then(self, seconds: float, value: Any) -> Any:
        time.sleep(seconds)
        return value

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def exit_outside_task(self, code: int) -> None:
        # SystemExit is not an Exception: it escapes the serve loop like a crash of the loop.
        raise SystemExit(code)

    def make_array(self, nbytes: int, seed: int) -> np.ndarray:
        return deterministic_bytes(nbytes, seed)

    def checksum(self, array: np.ndarray) -> tuple[tuple[int, ...], str, str]:
        return array.shape, str(array.dtype), sha256(array)

    def whoami(self) -> dict[str, Any]:
        ctx = self.context
        return {"rank": ctx.rank, "role": ctx.role, "index": ctx.role_index,
                "role_size": ctx.role_size, "pid": os.getpid(), "label": self.label}

    def unpicklable_result(self) -> Any:
        return lambda: None


class FailingConstructor(Worker):
    """A worker whose constructor raises on the ranks listed, to test that spawn reports it."""

    MESSAGES = ()

    def __init__(self, context: RankContext, failing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(context)
        if not failing_ranks or context.rank in failing_ranks:
            raise RuntimeError(f"constructor refused on rank {context.rank}")


def deterministic_bytes(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` pseudo-random uint8 values, the same on every rank for the same seed.

    A multiplicative hash of each 8-byte word's index (every word differs, so a chunk lost,
    repeated or moved changes the bytes): a pass or two over memory, some 3 times cheaper than
    a random generator's, which matters for the 2 GiB payloads of the transport's tests."""
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64)
    words += np.uint64(seed * 0x632BE59BD9B4E019 % (1 << 64))
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)[:nbytes]


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()


class CorridorEnv(gym.Env):
    """Walk right along a corridor of ``length`` cells: +1 at the end, -0.01 per step.

    Deterministic and tiny, with a Box observation (position, steps left) and either a Discrete
    action (0 left, 1 right) or, with ``multi=True``, a MultiDiscrete one (direction, stride) so
    that every action-space path of the policy can be trained end to end in seconds.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, length: int = 6, max_steps: int = 30, multi: bool = False) -> None:
        self.length, self.max_steps, self.multi = length, max_steps, multi
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = (gym.spaces.MultiDiscrete([2, 2]) if multi
                             else gym.spaces.Discrete(2))
        self.position = 0
        self.steps = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.position / self.length, 1 - self.steps / self.max_steps],
                        dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position, self.steps = 0, 0
        return self._obs(), {}

    def step(self, action):
        direction, stride = (int(action[0]), int(action[1]) + 1) if self.multi else (int(action), 1)
        self.position = max(0, self.position + (stride if direction == 1 else -1))
        self.steps += 1
        terminated = self.position >= self.length
        truncated = not terminated and self.steps >= self.max_steps
        return self._obs(), (1.0 if terminated else -0.01), terminated, truncated, {}


class MultiCorridorEnv(CorridorEnv):
    """CorridorEnv with the MultiDiscrete action space."""

    def __init__(self, length: int = 6, max_steps: int = 30) -> None:
        super().__init__(length, max_steps, multi=True)


class SleepEnv(gym.Env):
    """An env whose cost is set, for measuring the runtime rather than the cores: each step
    sleeps ``step_s`` (time on the rank without using its core) and episodes last ``episode_len``
    steps. Observations are ``obs_size`` random floats; action 1 earns 1 when the first is
    positive, action 0 when it is not, so a policy can learn, but nothing here is a task.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, step_s: float = 0.01, episode_len: int = 100, obs_size: int = 4) -> None:
        self.step_s, self.episode_len = step_s, episode_len
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(obs_size,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.steps = 0
        self._obs = np.zeros(obs_size, dtype=np.float32)

    def _draw(self) -> np.ndarray:
        self._obs = self.np_random.uniform(-1.0, 1.0, self._obs.shape).astype(np.float32)
        return self._obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.steps = 0
        return self._draw(), {}

    def step(self, action):
        time.sleep(self.step_s)
        reward = float(int(action) == int(self._obs[0] > 0))
        self.steps += 1
        return self._draw(), reward, False, self.steps >= self.episode_len, {}


class InjectedFailure(RuntimeError):
    """What the flaky test environments raise."""


class FailureSchedule:
    """When a flaky test env raises: in ``step`` at every ``fail_every_steps``-th step of the
    instance (0: never), in ``reset`` from reset number ``fail_resets_after + 1`` of the instance on
    (None: never). Counting per instance keeps it deterministic: a rebuilt env starts over."""

    def __init__(self, fail_every_steps: int = 0, fail_resets_after: int | None = None) -> None:
        self.fail_every_steps = fail_every_steps
        self.fail_resets_after = fail_resets_after
        self.instance_steps = 0
        self.instance_resets = 0

    def before_step(self) -> None:
        self.instance_steps += 1
        if self.fail_every_steps and self.instance_steps % self.fail_every_steps == 0:
            raise InjectedFailure(f"injected failure in step {self.instance_steps}")

    def before_reset(self) -> None:
        self.instance_resets += 1
        if self.fail_resets_after is not None and self.instance_resets > self.fail_resets_after:
            raise InjectedFailure(f"injected failure in reset {self.instance_resets}")


class FlakyCartPoleEnv(CartPoleEnv):
    """CartPole that raises ``InjectedFailure`` on a ``FailureSchedule``."""

    def __init__(self, fail_every_steps: int = 0, fail_resets_after: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.schedule = FailureSchedule(fail_every_steps, fail_resets_after)

    def step(self, action):
        self.schedule.before_step()
        return super().step(action)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.schedule.before_reset()
        return super().reset(seed=seed, options=options)


class OccasionallyFailingCartPole(FlakyCartPoleEnv):
    """CartPole whose every instance raises in its 300th step (for runs started from the CLI,
    which cannot pass constructor arguments)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(fail_every_steps=300, **kwargs)


class TrialFailureCartPole(CartPoleEnv):
    """CartPole that fails for real in one ``mpirl tune`` trial: in the process that runs trial
    ``$MPIRL_FAIL_TRIAL`` (``$MPIRL_TUNE_TRIAL`` names the trial a process runs), every step
    after the process's first ``$MPIRL_FAIL_AFTER_STEPS`` steps raises while the count in the
    file ``$MPIRL_FAIL_BUDGET`` is above 0, taking one off each time. A budget of
    ``max_env_failures`` ends the trial's first attempt and leaves its retry healthy."""

    process_steps = 0

    def step(self, action):
        TrialFailureCartPole.process_steps += 1
        trial = os.environ.get("MPIRL_TUNE_TRIAL")
        budget = os.environ.get("MPIRL_FAIL_BUDGET")
        if (trial and budget and trial == os.environ.get("MPIRL_FAIL_TRIAL")
                and self.process_steps > int(os.environ.get("MPIRL_FAIL_AFTER_STEPS", "0"))):
            left = int(Path(budget).read_text() or 0)
            if left > 0:
                Path(budget).write_text(str(left - 1))
                raise InjectedFailure(f"injected failure in {trial} ({left - 1} left)")
        return super().step(action)


class FaultTrigger:
    """The file ``trigger_dir/fault`` that tells one env to fail (``benchmarks/chaos.py``): the
    first instance to rename it to its own name claims it, in whichever process, and then does
    what the file says: ``raise`` raises ``InjectedFailure``; ``hang`` sleeps for ``hang_s``
    without using the CPU, as a simulator stuck on a lost licence server would, then raises."""

    NAME = "fault"

    def __init__(self, trigger_dir: str, hang_s: float) -> None:
        self.path = Path(trigger_dir) / self.NAME
        self.hang_s = hang_s

    def check(self) -> None:
        """Called before each step: obey the file if it is there and this instance claims it."""
        if not self.path.exists():
            return
        claimed = self.path.with_name(f"{self.NAME}.taken-{os.getpid()}-{id(self)}")
        try:
            os.rename(self.path, claimed)
        except OSError:
            return  # another instance claimed it first
        what = claimed.read_text().strip()
        if what == "hang":
            time.sleep(self.hang_s)
        raise InjectedFailure(f"injected failure ({what}) by {self.path}")


class TriggeredFaultEnv(gym.Env):
    """The env ``env_id`` (made with ``env_kwargs``) that fails when ``trigger_dir/fault`` tells
    it to (``FaultTrigger``), for fault drills."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, env_id: str = "CartPole-v1", trigger_dir: str = ".",
                 hang_s: float = 3600.0, env_kwargs: dict[str, Any] | None = None) -> None:
        self.inner = gym.make(env_id, **(env_kwargs or {}))
        self.observation_space = self.inner.observation_space
        self.action_space = self.inner.action_space
        self.trigger = FaultTrigger(trigger_dir, hang_s)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return self.inner.reset(seed=seed, options=options)

    def step(self, action):
        self.trigger.check()
        return self.inner.step(action)

    def close(self) -> None:
        self.inner.close()


class TriggeredFaultMultiAgentEnv:
    """The multi-agent env ``env`` (any id ``--env`` takes for one: ``module:Name``, a PettingZoo
    module, an AEC env that may run as Parallel; made with ``env_kwargs``) that fails when
    ``trigger_dir/fault`` tells it to (``FaultTrigger``). Anything else (``state()`` for a
    centralized critic, ``metadata``) is the inner env's."""

    def __init__(self, env: str = "mpirl.envs.examples:FourAgentCartPole", trigger_dir: str = ".",
                 hang_s: float = 3600.0, env_kwargs: dict[str, Any] | None = None) -> None:
        factory = load_factory(env)
        if factory is None:
            raise ConfigError(f"TriggeredFaultMultiAgentEnv: {env!r} names no multi-agent env")
        self.inner = make_parallel(env, factory, env_kwargs or {})
        self.trigger = FaultTrigger(trigger_dir, hang_s)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not built yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def step(self, actions: dict[str, Any]):
        self.trigger.check()
        return self.inner.step(actions)


class UnpicklableCartPoleEnv(CartPoleEnv):
    """CartPole holding a lock, as an env holding a simulator handle would: pickle refuses it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.simulator_handle = threading.Lock()


def tagged_processes(variable: str, value: str) -> list[tuple[int, bytes, list[str]]]:
    """(pid, environment, /proc stat fields after the name) of every live, not zombie, process
    but this one whose environment sets ``variable=value`` (Linux): a job's ranks, found by a
    tag their launcher passed down."""
    found = []
    marker = f"{variable}={value}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if marker in environ.split(b"\0") and stat[0] != "Z":
            found.append((int(entry.name), environ, stat))
    return found


def tagged_ranks(variable: str, value: str) -> dict[int, int]:
    """World rank -> pid of the live processes that ``tagged_processes`` finds (Open MPI's
    ``OMPI_COMM_WORLD_RANK``); the newest pid where two attempts' ranks overlap."""
    found: dict[int, tuple[int, int]] = {}
    for pid, environ, stat in tagged_processes(variable, value):
        for item in environ.split(b"\0"):
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                rank, start = int(item.split(b"=")[1]), int(stat[19])
                if rank not in found or found[rank][1] < start:
                    found[rank] = (pid, start)
    return {rank: pid for rank, (pid, _) in found.items()}


class SlowToSaveCartPole(CartPoleEnv):
    """CartPole whose pickling (a checkpoint's ``save_state``) first writes
    ``marker_dir/saving-<pid>`` and then sleeps ``save_s``: a test knows a rollout rank is in the
    middle of a checkpoint, and can kill it there."""

    def __init__(self, marker_dir: str = ".", save_s: float = 2.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marker_dir, self.save_s = marker_dir, save_s

    def __getstate__(self) -> dict[str, Any]:
        (Path(self.marker_dir) / f"saving-{os.getpid()}").touch()
        time.sleep(self.save_s)
        return self.__dict__.copy()


class SlowToBuildCartPole(CartPoleEnv):
    """CartPole whose construction first writes ``marker_dir/building-<pid>`` and then sleeps
    ``build_s``: a test knows that the rank building it (rank 0, checking a request at start-up,
    while the others wait for it) is past ``MPI_Init``, and can kill a rank there."""

    def __init__(self, marker_dir: str = ".", build_s: float = 3.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        (Path(marker_dir) / f"building-{os.getpid()}").touch()
        time.sleep(build_s)


class StragglerCartPoleEnv(CartPoleEnv):
    """CartPole that sleeps ``base_delay_s`` in every step on every rank, and ``step_delay_s``
    more on MPI rank ``slow_rank`` only, so that one rollout rank is slow for real (sleeping, it
    leaves the cores to the others). A base delay makes every rank's step cost mostly waiting, as
    for a simulator that is not CPU-bound, so that on a 2-core machine the rates measure the
    driver and not how the kernel shares 2 cores among 4 busy processes. The environment
    variables ``MPIRL_STEP_DELAY_S``, ``MPIRL_STRAGGLER_DELAY_S`` and ``MPIRL_STRAGGLER_RANK``
    override the arguments (benchmarks calibrate the delays to a slow-down factor)."""

    def __init__(self, slow_rank: int = 1, step_delay_s: float = 7e-4, base_delay_s: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from mpirl.runtime.world import run_rank

        slow_rank = int(os.environ.get("MPIRL_STRAGGLER_RANK", slow_rank))
        step_delay_s = float(os.environ.get("MPIRL_STRAGGLER_DELAY_S", step_delay_s))
        base_delay_s = float(os.environ.get("MPIRL_STEP_DELAY_S", base_delay_s))
        slow = run_rank() == slow_rank
        self.delay_s = base_delay_s + (step_delay_s if slow else 0.0)
        self.owed_s = 0.0

    def step(self, action):
        if self.delay_s:
            # Sleep in lumps of 10 steps' delay: on a shared 2-core machine a wake-up every
            # step would preempt the busy ranks a thousand times a second, which a rank on a
            # node of its own never suffers. The average delay per step is the same.
            self.owed_s += self.delay_s
            if self.owed_s >= 10 * self.delay_s:
                time.sleep(self.owed_s)
                self.owed_s = 0.0
        return super().step(action)


class CountingEnv(gym.Env):
    """Episodes of exactly ``episode_length`` steps whatever the actions, reward 1 a step, on a
    ``FailureSchedule``. The observation is the number of steps this instance has taken, so a
    test can tell which rows of a batch came from which step of which episode."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, episode_length: int = 5, fail_every_steps: int = 0,
                 fail_resets_after: int | None = None) -> None:
        self.episode_length = episode_length
        self.schedule = FailureSchedule(fail_every_steps, fail_resets_after)
        self.observation_space = gym.spaces.Box(0.0, np.inf, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.episode_steps = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.schedule.instance_steps], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.schedule.before_reset()
        self.episode_steps = 0
        return self._obs(), {}

    def step(self, action):
        self.schedule.before_step()
        self.episode_steps += 1
        return self._obs(), 1.0, self.episode_steps >= self.episode_length, False, {}


class OverflowingEnv(gym.Env):
    """A continuous 1-D walk (the action moves the position, reward minus its distance from 0)
    whose observations, from its ``explode_after``-th step of each instance, go wrong for
    good: with ``value="huge"`` they alternate between +-3e38, finite but at float32's edge (a
    model's targets, the changes, overflow to infinity: its training diverges); with
    ``value="nan"`` they are NaN."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, explode_after: int = 50, value: str = "huge") -> None:
        if value not in ("huge", "nan"):
            raise ValueError(f"value {value!r}: use 'huge' or 'nan'")
        self.explode_after, self.value = explode_after, value
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.position, self.instance_steps = 0.0, 0

    def _obs(self) -> np.ndarray:
        if self.instance_steps < self.explode_after:
            return np.array([self.position], np.float32)
        if self.value == "nan":
            return np.array([np.nan], np.float32)
        return np.array([3e38 if self.instance_steps % 2 else -3e38], np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position = float(self.np_random.uniform(-1, 1))
        return self._obs(), {}

    def step(self, action):
        self.instance_steps += 1
        self.position = float(np.clip(self.position + 0.1 * float(np.ravel(action)[0]), -2, 2))
        return self._obs(), -abs(self.position), False, False, {}


class CliffWalkEnv(gym.Env):
    """A continuous 1-D walk (the action moves the position by up to 0.25) that pays 1 plus
    the position a step and ends by termination once the position leaves [-0.8, 0.8]: the
    reward pulls right, over the cliff, so a planner does well only if its model knows where
    the walk ends (a learned termination, or a termination_fn)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-2.0, 2.0, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.position = 0.0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position = float(self.np_random.uniform(-0.5, 0.5))
        return np.array([self.position], np.float32), {}

    def step(self, action):
        self.position += 0.25 * float(np.clip(np.ravel(action)[0], -1, 1))
        terminated = abs(self.position) > 0.8
        return (np.array([self.position], np.float32), 1.0 + self.position, terminated, False,
                {})


def cliff_walk_ended(obs: np.ndarray, action: np.ndarray, next_obs: np.ndarray) -> np.ndarray:
    """CliffWalkEnv's termination, as a ``termination_fn``."""
    return np.abs(np.asarray(next_obs)[:, 0]) > 0.8


# Importing this module registers these envs under ids, as third-party env packages do
# (what `mpirl train --env-module mpirl.testing --env MpirlCorridor-v0` relies on).
_IDS = {
    "MpirlCorridor-v0": dict(entry_point=CorridorEnv),
    # CartPole-v1 that fails in step every 2000 steps of each instance: rare enough to solve.
    "MpirlFlakyCartPole-v0": dict(entry_point=FlakyCartPoleEnv, max_episode_steps=500,
                                  kwargs={"fail_every_steps": 2000}),
    # CartPole-v1 that fails in every reset, and one that fails in every step.
    "MpirlBrokenResetCartPole-v0": dict(entry_point=FlakyCartPoleEnv, max_episode_steps=500,
                                        kwargs={"fail_resets_after": 0}),
    "MpirlBrokenStepCartPole-v0": dict(entry_point=FlakyCartPoleEnv, max_episode_steps=500,
                                       kwargs={"fail_every_steps": 1}),
    # CartPole-v1 that fails in every 50th step of each instance: never twice in a row, but 10
    # times within 500 steps of a sub-env (env_failure_window ends such a run).
    "MpirlFailEvery50CartPole-v0": dict(entry_point=FlakyCartPoleEnv, max_episode_steps=500,
                                        kwargs={"fail_every_steps": 50}),
    # CartPole-v1 holding a lock, which cannot be pickled into a checkpoint.
    "MpirlUnpicklableCartPole-v0": dict(entry_point=UnpicklableCartPoleEnv,
                                        max_episode_steps=500),
    # CartPole-v1 whose steps on rank 1 (the first rollout rank) each sleep 0.7 ms: about 10x
    # the cost of a healthy rank's step (policy included) on the project's 2-core machine.
    "MpirlStragglerCartPole-v0": dict(entry_point=StragglerCartPoleEnv, max_episode_steps=500),
    # CartPole-v1 that fails in one trial of mpirl tune (see TrialFailureCartPole).
    "MpirlTrialFailureCartPole-v0": dict(entry_point=TrialFailureCartPole,
                                         max_episode_steps=500),
    # A continuous walk whose observations overflow (or are NaN) after some steps.
    "MpirlOverflowing-v0": dict(entry_point=OverflowingEnv, max_episode_steps=100),
    # A continuous walk that ends off a cliff on either side (see CliffWalkEnv).
    "MpirlCliffWalk-v0": dict(entry_point=CliffWalkEnv, max_episode_steps=40),
}
for _id, _registration in _IDS.items():
    if _id not in gym.registry:
        gym.register(_id, **_registration)


class RankInspector(Worker):
    """Reports what a rank holds on to: its data channel's unfinished sends and its resident
    memory (for leak tests and soaks)."""

    MESSAGES = ("pending_sends", "rss_bytes")

    def pending_sends(self) -> int:
        channel = self.context.data_channel
        if channel is None:
            return 0
        channel.flush()
        return channel.pending_sends

    def rss_bytes(self) -> int:
        return rss_bytes()


class FlakyMultiAgentCartPole(MultiAgentCartPole):
    """Two-cart ``MultiAgentCartPole`` that raises ``InjectedFailure`` on a ``FailureSchedule``
    (a multi-agent env's failures are recovered like a single-agent env's)."""

    def __init__(self, fail_every_steps: int = 1500, fail_resets_after: int | None = None
                 ) -> None:
        super().__init__(num_agents=2)
        self.schedule = FailureSchedule(fail_every_steps, fail_resets_after)

    def step(self, actions: dict[str, Any]):
        self.schedule.before_step()
        return super().step(actions)

    def reset(self, seed: int | None = None, options: dict | None = None):
        self.schedule.before_reset()
        return super().reset(seed=seed, options=options)


class BrokenStepMultiAgentCartPole(FlakyMultiAgentCartPole):
    """Raises in every step."""

    def __init__(self) -> None:
        super().__init__(fail_every_steps=1)


def swap_sides(agent_id: str, episode_info: dict[str, Any]) -> str:
    """A policy mapping function: in even episodes cart_0 is driven by "a" and cart_1 by "b",
    in odd ones the other way round."""
    first = agent_id.endswith("0")
    return "a" if first == (episode_info["episode"] % 2 == 0) else "b"


class BatchBytesProbe(Callbacks):
    """Adds to each learner result what its batch carried: the observations' bytes per element
    (1 for uint8 images) and the batch's bytes per env step, as the rollout rank sent them."""

    def on_learn_on_batch(self, *, learner: Any, batch: dict[str, Any],
                          result: dict[str, Any]) -> None:
        def nbytes(value: Any) -> int:
            return int(value.nbytes) if hasattr(value, "nbytes") else \
                int(value.element_size() * value.nelement())

        steps = float(batch["mask"].sum()) if "mask" in batch else len(batch["obs"])
        obs = batch["obs"]
        result["probe/obs_itemsize"] = float(getattr(obs, "itemsize", None) or
                                             obs.element_size())
        result["probe/bytes_per_step"] = sum(nbytes(v) for v in batch.values()) / steps


def kill_a_busy_dump_writer(path: Path, attrs: dict[str, Any],
                            batch: Callable[[int], list[tuple[int, dict[str, Any]]]],
                            near_close: bool, rng: random.Random) -> int:
    """Fork a process that writes batches of episodes (``batch(k)``: those from local id k on)
    to a new ``EpisodeFile`` at ``path`` back to back; once it confirmed its first batch, kill
    it with SIGKILL, anywhere in a batch or, with ``near_close``, within a millisecond of HDF5's
    close starting (the close rewrites the file's index). Returns how many episodes it
    confirmed (``write`` returned), as the dump writer process confirms them to its rank."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _busy_dump_writer(path, attrs, batch, write_end)
    os.close(write_end)
    with os.fdopen(read_end, "rb", buffering=0) as reports:
        said = b""
        try:
            while b"." not in said:
                said += reports.read(1)
            if near_close:
                while not said.endswith(b"c"):
                    said += reports.read(1)
                time.sleep(rng.uniform(0.0, 0.001))
            else:
                time.sleep(rng.uniform(0.0, 0.05))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        said += reports.read()
    return max(int(x) for x in said.replace(b"c", b"").split(b".") if x)


def _busy_dump_writer(path: Path, attrs: dict[str, Any],
                      batch: Callable[[int], list[tuple[int, dict[str, Any]]]],
                      report: int) -> None:
    """The forked child: says "c" on ``report`` as HDF5 starts to close the file and
    "<episodes>." once each ``write`` returned; never returns."""
    import h5py

    from mpirl.data.episode_file import EpisodeFile

    close = h5py.File.close

    def announced_close(file: h5py.File) -> None:
        os.write(report, b"c")
        close(file)

    h5py.File.close = announced_close
    try:
        file = EpisodeFile(path, attrs, 1, 4096)
        k = 0
        while True:
            episodes = batch(k)
            file.write(episodes)
            k += len(episodes)
            os.write(report, f"{k}.".encode())
    finally:
        os._exit(1)


class ManyPickers:
    """A multi-agent env of ``pickers`` agents ``pick_<i>`` and ``steerers`` agents
    ``steer_<i>``, each playing its own game for ``length`` steps (an env episode): a picker sees
    a one-hot target among 3 and earns 1 for picking it (Discrete actions), a steerer sees a
    number and loses the distance of its action to it (a Box action). Every agent has a policy of
    its own in the composition tests, so that one run holds one policy per algorithm."""

    metadata = {"name": "many_pickers", "is_parallelizable": True}

    def __init__(self, pickers: int = 9, steerers: int = 1, length: int = 10) -> None:
        self.pickers = [f"pick_{i}" for i in range(pickers)]
        self.steerers = [f"steer_{i}" for i in range(steerers)]
        self.possible_agents = self.pickers + self.steerers
        self.length = length
        self.agents: list[str] = []
        self.rng = np.random.default_rng()
        self.target: dict[str, Any] = {}

    def observation_space(self, agent: str) -> gym.Space:
        if agent.startswith("pick"):
            return gym.spaces.Box(0.0, 1.0, (3,), np.float32)
        return gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def action_space(self, agent: str) -> gym.Space:
        if agent.startswith("pick"):
            return gym.spaces.Discrete(3)
        return gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def _observe(self) -> dict[str, np.ndarray]:
        obs = {}
        for agent in self.agents:
            if agent.startswith("pick"):
                self.target[agent] = int(self.rng.integers(3))
                obs[agent] = np.eye(3, dtype=np.float32)[self.target[agent]]
            else:
                self.target[agent] = float(self.rng.uniform(-0.8, 0.8))
                obs[agent] = np.array([self.target[agent], 1.0], np.float32)
        return obs

    def reset(self, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.t = 0
        self.agents = list(self.possible_agents)
        return self._observe(), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]):
        rewards = {}
        for agent in self.agents:
            action = actions[agent]
            if agent.startswith("pick"):
                rewards[agent] = 1.0 if int(action) == self.target[agent] else 0.0
            else:
                rewards[agent] = -abs(float(np.asarray(action).reshape(-1)[0])
                                      - self.target[agent])
        self.t += 1
        done = self.t >= self.length
        acting = list(self.agents)
        terminations = dict.fromkeys(acting, done)
        truncations = dict.fromkeys(acting, False)
        infos = {a: {} for a in acting}
        self.agents = [] if done else acting
        obs = self._observe() if not done else {
            a: np.zeros(self.observation_space(a).shape, np.float32) for a in acting}
        return obs, rewards, terminations, truncations, infos

    def close(self) -> None:
        pass


class SplitVectorSimulation(Simulation):
    """A test simulation whose state, ``size`` numbers (env_config, default 8), is split evenly
    over its group's ranks: each step every rank updates its own block with no halo,
    ``x <- 0.9 x + 0.1 a0 + 0.05 a1 i / size`` (i the global index), and the root gathers the
    state as the observation. Reward ``-mean(x^2)``; ``horizon`` steps (default 16) truncate an
    episode. The start comes from the reset's seed alone (the same for any k). ``fail_at``:
    step n of an episode raises on the root; ``nan_at``: step n's observation is NaN;
    ``slow_s``: a step sleeps that long where step + world rank is even, so groups on ranks of
    both parities take turns being the slow one. ``member_fails_at``: step n raises on the
    group's last member before the gather, leaving the root waiting in it. ``hang_at``: step n
    of the first episode never returns (every member sleeps until killed), as a simulation
    stuck in a solve."""

    def __init__(self, comm: Any, size: int = 8, horizon: int = 16, fail_at: int = 0,
                 nan_at: int = 0, slow_s: float = 0.0, member_fails_at: int = 0,
                 hang_at: int = 0) -> None:
        super().__init__(comm)
        self.member_fails_at = member_fails_at if comm.Get_rank() == comm.Get_size() - 1 else 0
        k, rank = comm.Get_size(), comm.Get_rank()
        if size % k:
            raise ValueError(f"size {size} does not split over {k} ranks")
        block = size // k
        self.size, self.horizon, self.fail_at, self.nan_at = size, horizon, fail_at, nan_at
        self.slow_s, self.hang_at = slow_s, hang_at
        self.parity = 0
        if slow_s:
            from mpi4py import MPI

            self.parity = MPI.COMM_WORLD.Get_rank() % 2
        self.index = np.arange(rank * block, (rank + 1) * block, dtype=np.float64)
        self.x = np.zeros(block)
        self.full = np.zeros(size) if rank == 0 else None
        self.t = self.episodes = 0
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (size,), np.float64)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float64)

    def _gathered(self) -> np.ndarray | None:
        self.comm.Gather(self.x, self.full, root=0)
        return None if self.full is None else self.full.copy()

    def reset(self, seed: int | None = None) -> np.ndarray | None:
        self.episodes += 1
        start = np.random.default_rng(self.episodes if seed is None else seed).uniform(
            -1.0, 1.0, self.size)
        self.x[:] = start[self.index.astype(int)]
        self.t = 0
        return self._gathered()

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool] | None:
        self.t += 1
        while self.episodes == 1 and self.t == self.hang_at:
            time.sleep(1.0)
        if self.slow_s and (self.t + self.parity) % 2 == 0:
            time.sleep(self.slow_s)
        a = np.asarray(action, np.float64)
        self.x[:] = 0.9 * self.x + 0.1 * a[0] + 0.05 * a[1] * self.index / self.size
        if self.t == self.member_fails_at:
            raise RuntimeError(f"a member of the test simulation fails at step {self.t}")
        obs = self._gathered()
        if obs is None:
            return None
        if self.t == self.fail_at:
            raise RuntimeError(f"the test simulation fails at step {self.t}")
        if self.t == self.nan_at:
            obs[:] = np.nan
        return obs, -float(np.mean(obs ** 2)), False, self.t >= self.horizon
