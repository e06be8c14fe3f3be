"""Atari (ALE) envs as the DQN papers preprocess them, each step a gymnasium wrapper.

``preprocess`` stacks, on an ALE env made with ``frameskip=1``: no-op starts (``NoopStart``),
frame skip with max-pooling over the last two frames (``MaxAndSkip``), grayscale (ALE's own
``obs_type="grayscale"``, or gymnasium's ``GrayscaleObservation`` on RGB frames), a square resize
(``ResizeFrame``) and a channels-first stack (``StackFrames``), so that Breakout's observations are
uint8 of shape (4, 84, 84). Each step has a config key that turns it off (``AtariSettings``).
Rewards are left as the game gives them: the rollout workers clip what they train on, and report
the game's score.

``EnvPoolVectorEnv`` runs the same preprocessing in EnvPool's batched C++ envs instead, as a
gymnasium vector env with same-step autoreset, which is what the rollout workers step.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from mpirl.config.fields import CommonConfig
from mpirl.errors import ConfigError

#: What ale-py registers its envs with.
ALE_ENTRY_POINT = "ale_py.env:AtariEnv"
#: How users get ale-py (and its ROMs).
INSTALL_HINT = "pip install 'mpirl[atari]'"
#: ale-py's limit of frames per episode (v5 ids); EnvPool's is in agent steps.
MAX_FRAMES_PER_EPISODE = 108_000


@dataclass(frozen=True)
class AtariSettings:
    """The preprocessing of an Atari env, from the ``atari_*`` and ``env_backend`` keys."""

    noop_max: int = 30
    frame_skip: int = 4
    frame_size: int = 84
    grayscale: bool = True
    frame_stack: int = 4
    backend: str = "gymnasium"

    @classmethod
    def from_config(cls, values: Mapping[str, Any]) -> AtariSettings:
        """From a run's config values (a dict; keys it lacks take CommonConfig's defaults, so a
        manifest written before a key existed still reads)."""
        defaults = {f.name: f.default for f in dataclasses.fields(CommonConfig)}

        def get(key: str) -> Any:
            return values.get(key, defaults[key])

        return cls(noop_max=get("atari_noop_max"), frame_skip=get("atari_frame_skip"),
                   frame_size=get("atari_frame_size"), grayscale=get("atari_grayscale"),
                   frame_stack=get("atari_frame_stack"), backend=get("env_backend"))


def register_ale(env_id: str) -> None:
    """Make ``ALE/...`` ids resolvable: ale-py registers them when imported. ConfigError naming
    the extra to install when ale-py is missing."""
    if not env_id.startswith("ALE/") or env_id in gym.registry:
        return
    try:
        import ale_py
    except ImportError:
        raise ConfigError(f"environment {env_id!r} is an Atari game, which needs ale-py: "
                          f"{INSTALL_HINT}") from None
    # The ALE's greeting would be printed by every rank; its errors still are.
    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)
    gym.register_envs(ale_py)


def is_atari(env_id: str) -> bool:
    """True for an id registered by ale-py (``ALE/Breakout-v5``, ``BreakoutNoFrameskip-v4``)."""
    spec = gym.registry.get(env_id)
    return spec is not None and spec.entry_point == ALE_ENTRY_POINT


def ale_kwargs(settings: AtariSettings, env_config: Mapping[str, Any]) -> dict[str, Any]:
    """The AtariEnv's keyword arguments: the ALE skips no frames (MaxAndSkip does) and draws
    grayscale when asked; ``env_config`` overrides both (and keeps v5's sticky actions unless
    it names ``repeat_action_probability``)."""
    kwargs = {"frameskip": 1, "obs_type": "grayscale" if settings.grayscale else "rgb",
              **env_config}
    if settings.frame_skip > 1 and kwargs["frameskip"] != 1:
        raise ConfigError(f"env_config frameskip {kwargs['frameskip']!r} and atari_frame_skip "
                          f"{settings.frame_skip} would both skip frames; set atari_frame_skip "
                          f"to 1 to let the ALE skip them (without max-pooling)")
    return kwargs


def preprocess(env: gym.Env, settings: AtariSettings) -> gym.Env:
    """``env`` (an ALE env) wrapped in the preprocessing steps ``settings`` turn on."""
    if settings.noop_max > 0:
        env = NoopStart(env, settings.noop_max)
    if settings.frame_skip > 1:
        env = MaxAndSkip(env, settings.frame_skip)
    shape = env.observation_space.shape
    if shape is None or len(shape) not in (2, 3):
        return env  # RAM observations: no frames to shrink or stack
    if settings.grayscale and len(shape) == 3:
        env = gym.wrappers.GrayscaleObservation(env)
    if settings.frame_size > 0:
        env = ResizeFrame(env, settings.frame_size)
    return StackFrames(env, settings.frame_stack)


class NoopStart(gym.Wrapper):
    """After each reset, a random number (1 to ``noop_max``) of no-op actions, so that episodes
    start from different states although the ALE is deterministic."""

    def __init__(self, env: gym.Env, noop_max: int) -> None:
        super().__init__(env)
        meanings = env.unwrapped.get_action_meanings()
        if meanings[0] != "NOOP":
            raise ConfigError(f"action 0 of {env.spec.id if env.spec else env} is "
                              f"{meanings[0]}, not NOOP: set atari_noop_max to 0")
        self.noop_max = noop_max

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        # The env's own generator: seeded by reset(seed), and pickled with the env.
        for _ in range(int(self.np_random.integers(1, self.noop_max + 1))):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset(options=options)
        return obs, info


class MaxAndSkip(gym.Wrapper):
    """Repeat each action ``skip`` frames, summing the rewards; observe the pixel-wise maximum
    of the last two frames (Atari sprites flicker: some are drawn only every other frame)."""

    def __init__(self, env: gym.Env, skip: int) -> None:
        super().__init__(env)
        self.skip = skip

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        total = 0.0
        frames: deque[np.ndarray] = deque(maxlen=2)
        for _ in range(self.skip):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            frames.append(obs)
            if terminated or truncated:
                break
        frame = frames[0] if len(frames) == 1 else np.maximum(frames[0], frames[1])
        return frame, total, terminated, truncated, info


class ResizeFrame(gym.ObservationWrapper):
    """Frames resized to ``size`` x ``size`` by area averaging (Pillow's box filter, as
    OpenCV's INTER_AREA that EnvPool and most Atari code use)."""

    def __init__(self, env: gym.Env, size: int) -> None:
        super().__init__(env)
        self.size = size
        shape = (size, size, *env.observation_space.shape[2:])
        self.observation_space = gym.spaces.Box(0, 255, shape, np.uint8)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        from PIL import Image

        image = Image.fromarray(np.asarray(observation, np.uint8))
        return np.asarray(image.resize((self.size, self.size), Image.Resampling.BOX))


class StackFrames(gym.Wrapper):
    """The last ``stack`` frames, channels first: (stack, H, W) for grayscale frames, (3 *
    stack, H, W) for RGB, oldest first. A reset fills the stack with its first frame. With
    ``stack`` 1 this only moves the channels first."""

    def __init__(self, env: gym.Env, stack: int) -> None:
        super().__init__(env)
        space = env.observation_space
        channels = space.shape[2] if len(space.shape) == 3 else 1
        self.frames: deque[np.ndarray] = deque(maxlen=stack)
        self.observation_space = gym.spaces.Box(
            0, 255, (channels * stack, *space.shape[:2]), space.dtype)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        frame = self._channels_first(obs)
        for _ in range(self.frames.maxlen):
            self.frames.append(frame)
        return np.concatenate(self.frames), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.frames.append(self._channels_first(obs))
        return np.concatenate(self.frames), reward, terminated, truncated, info

    @staticmethod
    def _channels_first(frame: np.ndarray) -> np.ndarray:
        return frame[None] if frame.ndim == 2 else np.moveaxis(frame, 2, 0)


def check_envpool(env_id: str) -> None:
    """ConfigError unless EnvPool can be imported and has the game ``env_id`` names."""
    try:
        import envpool
    except Exception as error:  # noqa: BLE001 - a broken native build raises more than ImportError
        raise ConfigError(f"env_backend 'envpool' needs envpool, which could not be imported "
                          f"({type(error).__name__}: {error}): pip install envpool, or leave "
                          f"env_backend at 'gymnasium'") from None
    task = envpool_task(env_id)
    if task not in envpool.list_all_envs():
        raise ConfigError(f"EnvPool has no {task!r} (from {env_id!r}); its Atari games are "
                          f"named like ALE/Breakout-v5. Leave env_backend at 'gymnasium' for "
                          f"this game.")


def envpool_task(env_id: str) -> str:
    """EnvPool's name of an ALE game: ``ALE/Breakout-v5`` and ``BreakoutNoFrameskip-v4`` ->
    ``Breakout-v5``."""
    name = env_id.removeprefix("ALE/").rpartition("-v")[0].removesuffix("NoFrameskip")
    return f"{name}-v5"


class EnvPoolVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` copies of an Atari game in one EnvPool, preprocessed as ``settings`` say,
    with gymnasium's same-step autoreset (a done env's next first observation comes with the
    step that ended it, its last one in ``infos["final_obs"]``), as the rollout workers expect.

    EnvPool's own defaults that differ from mpirl's gymnasium path are set to match: sticky
    actions (0.25), no FIRE on reset, no reward clipping, no episodic life, 108,000 frames per
    episode. Its no-op starts take 0 to ``noop_max`` no-ops (NoopStart takes at least one).
    ``env_config`` goes to ``envpool.make_gymnasium`` and overrides any of these. The pool runs
    one thread unless ``env_config`` gives ``num_threads``: a rollout rank is meant to use one
    core. It cannot be pickled, so a checkpoint resets these envs on resume."""

    def __init__(self, env_id: str, settings: AtariSettings, env_config: Mapping[str, Any],
                 num_envs: int, seed: int) -> None:
        import envpool

        size = settings.frame_size
        self.kwargs = {
            "num_envs": num_envs, "batch_size": num_envs, "num_threads": 1,
            "noop_max": settings.noop_max + 1, "frame_skip": settings.frame_skip,
            "stack_num": settings.frame_stack, "gray_scale": settings.grayscale,
            "img_height": size or 210, "img_width": size or 160, "episodic_life": False,
            "reward_clip": False, "use_fire_reset": False, "repeat_action_probability": 0.25,
            "max_episode_steps": MAX_FRAMES_PER_EPISODE // settings.frame_skip, **env_config}
        self.task, self.seed, self._make = envpool_task(env_id), seed, envpool.make_gymnasium
        self.pool = self._build(seed)
        self.num_envs = num_envs
        self.single_observation_space = self.pool.observation_space
        self.single_action_space = self.pool.action_space
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space,
                                                              num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def _build(self, seed: int) -> Any:
        try:
            return self._make(self.task, seed=seed, **self.kwargs)
        except TypeError as error:  # an env_config key EnvPool does not know
            raise ConfigError(f"EnvPool's {self.task}: {error}") from None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None and seed != self.seed:
            # EnvPool seeds its envs once, when it builds them.
            self.pool.close()
            self.seed, self.pool = seed, self._build(seed)
        obs, _ = self.pool.reset()
        return obs, {}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                          dict[str, Any]]:
        obs, rewards, terminated, truncated, _ = self.pool.step(np.asarray(actions))
        done = terminated | truncated
        infos: dict[str, Any] = {}
        if done.any():
            index = np.flatnonzero(done)
            final = np.full(self.num_envs, None, dtype=object)
            final[index] = list(obs[index])  # copies: obs[index] is overwritten next
            first, reset_info = self.pool.reset(index)
            obs[reset_info["env_id"]] = first
            infos = {"final_obs": final, "_final_obs": done}
        return obs, np.asarray(rewards, np.float32), terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        self.pool.close()
