"""Atari: the DQN preprocessing on the real ALE (each step and the key that turns it off),
reward clipping for training only, EnvPool's vector env, bad input, and a run through the CLI."""

import dataclasses
import json
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from conftest import mpi_env
from mpirl.algorithms import ppo
from mpirl.algorithms.q_learning import dqn
from test_env_failures import GAMMA, local_context
from test_train import MPIRL, train

from mpirl.config.fields import CommonConfig
from mpirl.config.parse import build
from mpirl.envs import atari
from mpirl.errors import ConfigError
from mpirl.models.policy import PolicySpec
from mpirl.workers.env_spec import EnvSpec, env_spec_for
from mpirl.workers.q_workers import TransitionWorker
from mpirl.workers.replay_shard import stacked_frames
from mpirl.workers.rollout import RolloutSettings, RolloutWorker

pytest.importorskip("ale_py")

BREAKOUT = "ALE/Breakout-v5"


def breakout(**keys):
    """Breakout as a run with these config keys makes it, without sticky actions unless asked
    (so that two envs given the same actions and seed play the same game)."""
    keys.setdefault("env_config", {"repeat_action_probability": 0.0})
    return env_spec_for(BREAKOUT, None, dataclasses.asdict(CommonConfig(**keys)))


def wrappers(env):
    names = []
    while isinstance(env, gym.Wrapper):
        names.append(type(env).__name__)
        env = env.env
    return names


def test_breakout_observes_four_stacked_84x84_grayscale_frames():
    spec = env_spec_for(BREAKOUT, None, dataclasses.asdict(CommonConfig()))
    assert spec.atari == atari.AtariSettings() and spec.clip_rewards
    env = spec.make()
    assert env.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    assert wrappers(env)[:4] == ["StackFrames", "ResizeFrame", "MaxAndSkip", "NoopStart"]
    # The ALE skips no frames itself, draws grayscale, and keeps v5's sticky actions.
    ale = env.unwrapped
    assert ale._frameskip == 1 and ale._obs_type == "grayscale"
    assert ale.ale.getFloat("repeat_action_probability") == pytest.approx(0.25)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
    obs, *_ = env.step(1)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8 and obs.max() > 0
    env.close()


@pytest.mark.parametrize("key, value, missing, shape", [
    ("atari_noop_max", 0, "NoopStart", (4, 84, 84)),
    ("atari_frame_skip", 1, "MaxAndSkip", (4, 84, 84)),
    ("atari_frame_size", 0, "ResizeFrame", (4, 210, 160)),
    ("atari_grayscale", False, None, (12, 84, 84)),
    ("atari_frame_stack", 1, None, (1, 84, 84)),
])
def test_each_key_turns_its_step_off(key, value, missing, shape):
    env = breakout(**{key: value}).make()
    if missing:
        assert missing not in wrappers(env)
    obs, _ = env.reset(seed=0)
    assert obs.shape == shape == env.observation_space.shape and obs.dtype == np.uint8
    if key == "atari_grayscale":
        assert env.unwrapped._obs_type == "rgb"
    env.close()


def test_frame_skip_sums_rewards_and_max_pools_the_last_two_frames():
    settings = dataclasses.replace(breakout().atari, noop_max=0)
    raw = gym.make(BREAKOUT, **atari.ale_kwargs(settings, {"repeat_action_probability": 0.0}))
    skipped = atari.MaxAndSkip(gym.make(BREAKOUT, frameskip=1, obs_type="grayscale",
                                        repeat_action_probability=0.0), 4)
    raw.reset(seed=3)
    skipped.reset(seed=3)
    for step in range(60):
        action = 1 if step % 10 == 0 else 2 + step % 2  # FIRE now and then, else move
        frames, total = [], 0.0
        for _ in range(4):
            frame, reward, *_ = raw.step(action)
            frames.append(frame)
            total += reward
        obs, reward, *_ = skipped.step(action)
        np.testing.assert_array_equal(obs, np.maximum(frames[-2], frames[-1]))
        assert reward == total


def test_noop_starts_begin_episodes_after_1_to_noop_max_frames():
    env = atari.NoopStart(gym.make(BREAKOUT, frameskip=1), 30)
    frames = {env.reset(seed=seed)[1]["episode_frame_number"] for seed in range(12)}
    assert frames <= set(range(1, 31)) and len(frames) > 3
    assert env.reset(seed=5)[1] == env.reset(seed=5)[1]  # seeded: reproducible


def test_the_stack_holds_the_last_frames_oldest_first():
    env = breakout(atari_noop_max=0).make()
    obs, _ = env.reset(seed=0)
    assert all((obs[i] == obs[0]).all() for i in range(4))  # a reset fills it
    for action in (1, 2, 2, 3, 3):
        new, *_ = env.step(action)
        np.testing.assert_array_equal(new[:3], obs[1:])
        obs = new


class FivesEnv(gym.Env):
    """Episodes of 4 steps with reward 5 each (and -5 on the last)."""

    observation_space = gym.spaces.Box(0, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.steps += 1
        return np.zeros(2, np.float32), 5.0 if self.steps < 4 else -5.0, self.steps >= 4, \
            False, {}


if "AtariTestFives-v0" not in gym.registry:
    gym.register("AtariTestFives-v0", entry_point=FivesEnv)


@pytest.mark.parametrize("trajectories", [False, True])
def test_rollouts_train_on_clipped_rewards_and_report_the_score(trajectories):
    spec = env_spec_for("AtariTestFives-v0", None, {"clip_rewards": True})
    policy = PolicySpec(*spec.spaces(), (8,), "tanh")
    worker = RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=2, seed=0, gamma=GAMMA))
    metrics = worker.sample(8, form="fragments" if trajectories else "advantages")
    assert metrics["episode_returns"] == [10.0] * 4  # 5 + 5 + 5 - 5, in every episode
    batch = metrics["batch"]
    if trajectories:  # IMPALA's fragments hold the rewards themselves
        assert batch["rewards"].tolist() == [[1, 1, 1, -1] * 2] * 2
    else:  # lambda 1: the value target of an episode's first step is its discounted return
        first = batch["value_targets"].reshape(8, 2)[0]
        np.testing.assert_allclose(first, 1 + GAMMA + GAMMA**2 - GAMMA**3, rtol=1e-5)
    worker.envs.close()


def test_replay_holds_clipped_rewards_and_reports_the_score():
    spec = env_spec_for("AtariTestFives-v0", None, {"clip_rewards": True})
    q_spec = dqn.model_spec(*spec.spaces(), dqn.Config(hidden_sizes=(8,)))
    worker = TransitionWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=q_spec, num_envs=2, seed=0))
    metrics = worker.sample_transitions(8, 0.5, None)
    assert metrics["episode_returns"] == [10.0] * 4
    assert metrics["chunk"]["rewards"].T.tolist() == [[1, 1, 1, -1] * 2] * 2
    worker.envs.close()


def test_replay_stores_each_stacked_frame_once_for_atari_only():
    assert stacked_frames(env_spec_for(BREAKOUT, None, {})) == 4
    assert stacked_frames(env_spec_for(BREAKOUT, None, {"atari_frame_stack": 1})) == 1
    assert stacked_frames(env_spec_for("CartPole-v1", None, {})) == 0


def test_clip_rewards_auto_clips_atari_only():
    assert env_spec_for("CartPole-v1", None, {}) == EnvSpec("CartPole-v1")
    assert env_spec_for("CartPole-v1", None, {"clip_rewards": True}).clip_rewards
    assert env_spec_for(BREAKOUT, None, {}).clip_rewards
    assert not env_spec_for(BREAKOUT, None, {"clip_rewards": False}).clip_rewards


@pytest.mark.parametrize("keys, expected", [
    ({"clip_rewards": "yes"}, 'config key "clip_rewards" = "yes" is not one of "auto", true'),
    ({"clip_rewards": 1}, 'config key "clip_rewards" = 1 is not one of'),
    ({"env_backend": "cuda"}, 'config key "env_backend" = "cuda" is not one of "gymnasium"'),
    ({"atari_frame_skip": 0}, '"atari_frame_skip" = 0 is out of range: must be an integer >='),
    ({"atari_noop_max": -1}, '"atari_noop_max" = -1 is out of range'),
    ({"atari_grayscale": 1}, "'atari_grayscale' must be true or false"),
    ({"env_config": [1]}, '"env_config" must be a JSON object'),
])
def test_bad_keys_are_config_errors(keys, expected):
    with pytest.raises(ConfigError) as error:
        build(ppo.Config, keys)
    assert expected in str(error.value)


def test_bad_environment_settings_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="runs Atari games only"):
        env_spec_for("CartPole-v1", None, {"env_backend": "envpool"})
    with pytest.raises(ConfigError, match="would both skip frames"):
        breakout(env_config={"frameskip": 4}).make()
    # With ale-py missing, an ALE id says what to install.
    monkeypatch.setitem(sys.modules, "ale_py", None)
    with pytest.raises(ConfigError, match=r"needs ale-py: pip install 'mpirl\[atari\]'"):
        env_spec_for("ALE/NoSuchGame-v5", None, {})
    # And so does a missing envpool.
    monkeypatch.setitem(sys.modules, "envpool", None)
    with pytest.raises(ConfigError, match="env_backend 'envpool' needs envpool, which could not "
                                          "be imported"):
        env_spec_for(BREAKOUT, None, {"env_backend": "envpool"})


def test_envpool_runs_the_same_observations_with_same_step_autoreset():
    pytest.importorskip("envpool")
    spec = breakout(env_backend="envpool", env_config={"max_episode_steps": 5})
    policy = ppo.model_spec(*breakout().spaces(), ppo.Config())
    worker = RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=2, seed=0, gamma=GAMMA))
    assert isinstance(worker.envs, atari.EnvPoolVectorEnv)
    assert worker.envs.single_observation_space == breakout().make().observation_space
    metrics = worker.sample(10, form="fragments")
    assert metrics["episode_lengths"] == [5] * 4  # cut by the time limit, and reset at once
    assert metrics["batch"]["obs"].dtype == np.uint8
    assert metrics["batch"]["obs"].shape == (2, 10, 4, 84, 84)
    worker.envs.close()


#: One stacked observation, (4, 84, 84) uint8: what each step must cost on the wire, give or
#: take its action, log-probability and value targets (float32 frames would be 4x).
STACK_BYTES = 4 * 84 * 84


@pytest.mark.parametrize("algo", ["IMPALA", "PPO"])
def test_ppo_and_impala_run_12k_frames_of_breakout_with_uint8_to_the_learner(tmp_path, algo):
    # 3,000 agent steps of frame skip 4 (several episodes over 8 envs); one SGD pass keeps PPO's
    # CNN within CI's time.
    proc, run_dir, result = train(
        3, tmp_path, "--algo", algo, "--env", BREAKOUT, "--stop", '{"timesteps_total": 3000}',
        "--config", json.dumps({"num_envs_per_worker": 4, "callbacks":
                                "mpirl.testing:BatchBytesProbe",
                                **({"num_epochs": 1} if algo == "PPO" else {})}), timeout=180)
    assert result["timesteps_total"] >= 3000 and result["episodes_total"] >= 5
    assert result["episode_return_mean"] >= 0 and result["episode_len_mean"] > 20
    # What the learners received, as the rollout ranks sent it: uint8 frames.
    assert result["probe/obs_itemsize"] == 1
    assert STACK_BYTES < result["probe/bytes_per_step"] < 1.05 * STACK_BYTES, result
    if algo == "IMPALA":
        return
    params = json.loads((run_dir / "params.json").read_text())
    assert params["config"]["atari_frame_stack"] == 4 and params["config"]["clip_rewards"] == \
        "auto"
    # The saved config's preprocessing: the policy takes (4, 84, 84). Sampled actions FIRE
    # sooner or later; the most likely one might never start the game.
    played = subprocess.run([*MPIRL, "evaluate", str(run_dir), "--episodes", "1", "--json",
                             "--stochastic"], capture_output=True, text=True, timeout=120,
                            env=mpi_env())
    assert played.returncode == 0, played.stderr
    assert json.loads(played.stdout)["length_mean"] > 20
