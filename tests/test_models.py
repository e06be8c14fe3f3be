"""The model catalog (issue 17): CNNs on images with uint8 kept to the learner, Dict and Tuple
observations, MultiDiscrete and MultiBinary actions, custom models, and their bad input."""

import csv
import json
import pickle
import subprocess
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from conftest import mpi_env, rewound_copy, run_mpi
from mpirl.algorithms.evolution.spec import DirectPolicySpec
from mpirl.algorithms.q_learning.network import dqn_loss
from test_env_failures import local_context
from test_train import MPIRL, train

from mpirl.commands.train import make_request
from mpirl.data.batches import standardize_fields
from mpirl.envs.probes import PixelTarget
from mpirl.errors import ConfigError
from mpirl.models.encoders import Encoder, ModelOptions, StructuredBox, channels_first
from mpirl.models.policy import PolicySpec, evaluate_batch
from mpirl.models.q_spec import QSpec
from mpirl.models.soft_q import SACSpec, sac_loss
from mpirl.models.torch_model import build_torch_model
from mpirl.workers.env_spec import EnvSpec
from mpirl.workers.postprocess import sequence_batch
from mpirl.workers.rollout import RolloutSettings, RolloutWorker

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
PROBES = "mpirl.envs.probes"


# The catalog, chosen from the spaces.

def test_images_get_a_cnn_and_vectors_keep_their_old_parameters():
    nature = Encoder(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), ModelOptions())
    assert nature.images[0].kind == "nature_cnn" and nature.out_dim == 512
    assert nature(np.zeros((3, 4, 84, 84), np.uint8)).shape == (3, 512)
    impala = Encoder(gym.spaces.Box(0, 255, (64, 64, 3), np.uint8),
                     ModelOptions(encoder="impala_cnn", cnn_dense_size=256))
    assert impala.images[0].kind == "impala_cnn" and impala.images[0].to_chw
    assert impala(torch.zeros(2, 64, 64, 3, dtype=torch.uint8)).shape == (2, 256)
    assert Encoder(PixelTarget().observation_space, ModelOptions()).images[0].kind == "small_cnn"
    assert channels_first((4, 84, 84)) and not channels_first((84, 84, 4))
    # A CartPole policy has exactly the parameters it had before encoders existed (4-64-64-2
    # actor and 4-64-64-1 critic), in the same order: older checkpoints load.
    cartpole = PolicySpec(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
    policy = build_torch_model(cartpole)
    assert policy.num_weights() == (4 * 64 + 64 + 64 * 64 + 64 + 64 * 2 + 2) + (
        4 * 64 + 64 + 64 * 64 + 64 + 64 + 1)
    assert not list(policy.encoder.parameters())


def test_the_shared_trunk_example_is_one_32x32_trunk_that_the_value_loss_trains_too(monkeypatch):
    # examples/custom_models.py:SharedTrunk is what benchmarks/RESULTS.md's shared-trunk curves
    # (before and after the sampling core) ran: one trunk, two linear heads.
    monkeypatch.syspath_prepend(EXAMPLES)
    spec = PolicySpec(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2),
                      model=ModelOptions(custom_model="custom_models:SharedTrunk"))
    policy = build_torch_model(spec)
    assert policy.num_weights() == (4 * 32 + 32 + 32 * 32 + 32) + (32 * 2 + 2) + (32 + 1)
    logp, _, values = policy.evaluate(torch.rand(3, 4), torch.zeros(3))
    assert logp.shape == values.shape == (3,)
    values.sum().backward()
    trunk = [p for name, p in policy.named_parameters() if ".trunk." in name]
    assert trunk and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trunk)


def test_dict_observations_are_one_vector_cut_apart_per_component():
    env = EnvSpec(f"{PROBES}:DictCue").make()
    space = env.observation_space
    assert isinstance(space, StructuredBox) and space.dtype == np.uint8  # image + one-hot
    obs, _ = env.reset(seed=0)
    assert obs.dtype == np.uint8 and obs.shape == (4 * 4 * 1 + 2,)
    encoder = Encoder(space, ModelOptions())
    assert [i for _, _, i in encoder.parts] == [-1, 0]  # flip (one-hot) as is, view by a CNN
    assert encoder(obs[None]).shape == (1, 2 + 512)
    mixed = StructuredBox(gym.spaces.Tuple((gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(3))))
    assert mixed.dtype == np.float32 and mixed.shape == (5,)
    with pytest.raises(ConfigError, match="not supported"):
        StructuredBox(gym.spaces.Dict({"text": gym.spaces.Text(5)}))


def test_multibinary_and_multidiscrete_actions_sample_in_the_space():
    for space in (gym.spaces.MultiBinary(3), gym.spaces.MultiDiscrete([[2, 3], [4, 5]])):
        policy = build_torch_model(PolicySpec(gym.spaces.Box(-1, 1, (2,), np.float32), space))
        actions, logp, _ = policy.act(np.zeros((5, 2), np.float32))
        env_actions = policy.env_actions(actions)
        assert env_actions.shape == (5, *space.shape) and all(space.contains(a)
                                                              for a in env_actions)
        logp_again, _, _ = policy.evaluate(torch.zeros(5, 2), torch.as_tensor(actions))
        np.testing.assert_allclose(logp_again.detach().numpy(), logp, rtol=1e-5)


@pytest.mark.parametrize("trajectories", [False, True])
def test_image_observations_stay_uint8_on_the_wire(trajectories):
    spec = EnvSpec(f"{PROBES}:PixelTarget")
    policy = PolicySpec(*spec.spaces(), (64, 64), "tanh")
    worker = RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=2, seed=0, gamma=0.99, lam=0.95,
        normalize_observations=True))
    batch = worker.sample(16, form="fragments" if trajectories else "advantages")["batch"]
    assert batch["obs"].dtype == np.uint8
    if trajectories:
        assert batch["bootstrap_obs"].dtype == np.uint8
    # Bytes sent per env step against the raw frame (10 x 10 x 3 = 300 bytes): the step's other
    # fields and pickle's framing add a few dozen bytes, not the 4x of float32.
    per_step = len(pickle.dumps(batch, protocol=5)) / 32
    assert 300 <= per_step <= 300 + 150, per_step


def test_q_networks_take_images_through_a_cnn_with_linear_dueling_heads():
    # DQN and Ape-X on Atari: the Nature CNN, then the dueling heads on its 512 units.
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    spec = QSpec(space, gym.spaces.Discrete(4), (256, 256), "relu", True)
    model, target = build_torch_model(spec), build_torch_model(spec)
    assert model.encoder.images[0].kind == "nature_cnn" and model.advantage.in_features == 512
    obs = torch.as_tensor(np.stack([space.sample() for _ in range(5)]))
    batch = {"obs": obs, "next_obs": obs, "actions": torch.zeros(5), "rewards": torch.ones(5),
             "discounts": torch.full((5,), 0.99), "weights": torch.ones(5)}
    loss, td, _ = dqn_loss(model, target, batch, type("C", (), {"double_q": True}))
    loss.backward()
    assert td.shape == (5,) and all(p.grad is not None for p in model.parameters())


def test_sac_takes_a_custom_actor_and_critics_and_a_cnn(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    box = gym.spaces.Box(-2, 2, (1,), np.float32)
    for spec in (SACSpec(gym.spaces.Box(-1, 1, (3,), np.float32), box,
                         model=ModelOptions(custom_model="custom_models:ActorCritic"),
                         custom_q_model="custom_models:TwinCritic"),
                 SACSpec(gym.spaces.Box(0, 255, (8, 8, 1), np.uint8), box)):
        model, target = build_torch_model(spec), build_torch_model(spec)
        obs = spec.observation_space.sample()[None].repeat(4, 0)
        batch = {"obs": torch.as_tensor(obs), "next_obs": torch.as_tensor(obs),
                 "actions": torch.zeros(4, 1), "rewards": torch.ones(4),
                 "discounts": torch.full((4,), 0.99), "weights": torch.ones(4)}
        loss, _, stats = sac_loss(model, target, batch, type("C", (), {"target_entropy": "auto"}))
        loss.backward()
        assert np.isfinite(stats["critic_loss"])
        # Every part learns (an actor-critic's value head has no use in SAC).
        assert all(p.grad is not None for name, p in model.named_parameters()
                   if not name.startswith("custom_actor.vf")), spec


def test_sac_trains_a_custom_actor_critic_whose_value_head_it_leaves_unused(tmp_path):
    """Through the learner: the actor-critic's value head gets no gradient from SAC's loss, and
    the replay learner's allreduce must still see one for every parameter (it failed at its
    first SGD step; docs/models.md's command)."""
    run_dir = tmp_path / "run"
    proc = run_mpi(3, *MPIRL, "train", "--algo", "SAC", "--env", "Pendulum-v1", "--run-dir",
                   str(run_dir), "--config",
                   json.dumps({"custom_model": "custom_models:ActorCritic", "learning_starts": 64,
                               "custom_q_model": "custom_models:TwinCritic",
                               "num_learners": 1}),
                   "--stop", '{"timesteps_total": 400}',  # some 300 SGD steps
                   env={"PYTHONPATH": EXAMPLES, "CI": "true"}, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(run_dir / "progress.csv") as file:
        last = list(csv.DictReader(file))[-1]
    assert np.isfinite(float(last["critic_loss"])), last


def test_es_perturbs_a_cnn_and_bc_learns_from_compressed_uint8_image_dumps(tmp_path,
                                                                          pixel_target_run):
    # ES: every weight vector of a population through the CNN at once, as one at a time.
    env = PixelTarget()
    policy = build_torch_model(DirectPolicySpec(env.observation_space, env.action_space))
    assert policy.functional
    theta = torch.as_tensor(policy.get_flat_weights())
    params = torch.stack([theta + 0.01 * torch.randn_like(theta) for _ in range(3)])
    obs = np.stack([env.observation_space.sample() for _ in range(3)])
    together = policy.population_outputs(params, torch.as_tensor(obs, dtype=torch.float32))
    for k in range(3):
        policy.set_flat_weights(params[k].numpy())
        np.testing.assert_allclose(policy(torch.as_tensor(obs[k:k + 1])).detach().numpy()[0],
                                   together[k].numpy(), rtol=1e-5, atol=1e-6)
    train(2, tmp_path / "es", "--algo", "ES", "--env", f"{PROBES}:PixelTarget", "--config",
          '{"cnn_dense_size": 64}', "--stop", '{"training_iteration": 1}')
    # Dumps keep the images as uint8 in gzip chunks (the pixel target's PPO run dumped every
    # episode, compressing every chunk); BC trains its CNN on them: 10 SGD steps of 64 rows read
    # from the dump (its defaults, 100 steps of 512 rows, took most of this test's CPU).
    dump = pixel_target_run[1]
    with h5py.File(next(dump.glob("rollout-*.hdf5"))) as file:
        observations = file["episode_0/observations"]
        assert observations.dtype == np.uint8 and observations.compression == "gzip"
    _, _, result = train(2, tmp_path / "bc", "--algo", "BC", "--env", f"{PROBES}:PixelTarget",
                         "--config", json.dumps({"input": str(dump), "train_batch_size": 64,
                                                 "num_sgd_steps_per_iteration": 10}),
                         "--stop", '{"training_iteration": 1}')
    assert result["sgd_steps"] == 10 and result["learner_samples"] == 640, result
    assert np.isfinite(result["episode_return_mean"])


# Learning, through the CLI.

def _cli(capsys, *argv):
    """``mpirl ARGV`` in-process (mpirl.cli.main, outside MPI: export and evaluate need no
    launcher); its exit code and stdout. The console script's own export and evaluate are run
    end to end by test_multiagent.py and test_evaluate.py."""
    from mpirl.cli import main

    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def pixel_target_run(tmp_path_factory):
    """PPO with the default CNN on the pixel target, dumping its episodes with every chunk
    compressed (dumping changes no step of the run): its run directory and dump."""
    base = tmp_path_factory.mktemp("pixel")
    dump = base / "dump"
    _, run_dir, result = train(
        3, base, "--algo", "PPO", "--env", f"{PROBES}:PixelTarget",
        "--dump-trajectories", str(dump), "--config", '{"dump_compression_min_bytes": 0}',
        "--stop", '{"episode_return_mean": 0.95, "timesteps_total": 60000}')
    return run_dir, dump, result


def test_ppo_with_the_default_cnn_reaches_the_pixel_target(pixel_target_run, capsys):
    run_dir, _, result = pixel_target_run
    # Random play reaches the target in about a third of the episodes.
    assert result["episode_return_mean"] >= 0.95, result
    code, out = _cli(capsys, "evaluate", str(run_dir), "--episodes", "10", "--json")
    assert code == 0 and json.loads(out)["episodes"] == 10, out


@pytest.mark.parametrize("env, threshold, chance", [("DictCue", 9.0, 2.5),
                                                    ("MultiDiscreteMatch", 18.0, 5.8)])
def test_dict_observations_and_multidiscrete_actions_learn(tmp_path, env, threshold, chance,
                                                          capsys):
    _, run_dir, result = train(
        3, tmp_path, "--algo", "PPO", "--env", f"{PROBES}:{env}",
        "--stop", f'{{"episode_return_mean": {threshold}, "timesteps_total": 60000}}')
    assert result["episode_return_mean"] >= threshold > 2 * chance, result
    # The exported file rebuilds the model from its spaces alone (a Dict's structure too).
    exported = tmp_path / "policy.npz"
    code, _ = _cli(capsys, "export", str(run_dir), "-o", str(exported))
    assert code == 0 and exported.is_file()
    code, out = _cli(capsys, "evaluate", str(exported), "--env", f"{PROBES}:{env}",
                     "--episodes", "10", "--json")
    assert code == 0 and json.loads(out)["return_mean"] >= threshold - 1, out


def test_a_custom_model_from_a_users_module_trains_ppo_and_dqn(tmp_path):
    user = {"PYTHONPATH": EXAMPLES, "CI": "true"}
    ppo = tmp_path / "ppo"
    proc = run_mpi(3, *MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir",
                   str(ppo), "--config", '{"custom_model": "custom_models:ActorCritic", '
                   '"custom_model_config": {"hidden": 64}}',
                   "--stop", '{"episode_return_mean": 200, "timesteps_total": 60000}',
                   timeout=300, env=user)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Seeds 0-4 reached 200 at 28.7k-30.7k steps (2026-11-29): it learns (random play is
    # about 22; PPO's own learning test to 475 is in tests/test_train.py).
    assert _result(ppo)["episode_return_mean"] >= 200
    dqn = tmp_path / "dqn"
    proc = subprocess.run([*MPIRL, "train", "--algo", "DQN", "--env", "CartPole-v1",
                           "--run-dir", str(dqn), "--config",
                           '{"custom_model": "custom_models:QModel", "metrics_window": 20}',
                           "--stop", '{"episode_return_mean": 150, "timesteps_total": 20000}'],
                          capture_output=True, text=True, timeout=240, env=mpi_env(user))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _result(dqn)["episode_return_mean"] >= 150


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


# Recurrent policies.

def test_sequences_start_from_the_carried_state_and_mask_padding_and_failures():
    steps, envs, length = 5, 2, 2
    column = np.arange(steps * envs, dtype=np.float32).reshape(steps, envs)  # [T, N]
    states = np.repeat(column[:, :, None, None], 2, 2).repeat(3, 3)  # [T, N, 2, 3]
    starts = np.zeros((steps, envs), bool)
    starts[3, 1] = True
    keep = np.ones((steps, envs), bool)
    keep[:2, 0] = False  # an episode an env failure cut short: its sequence goes
    batch = sequence_batch({"logp": column}, states, starts, keep, length)
    # env 0: [0 2] dropped, [4 _] kept, [8 pad]; env 1: [1 3] [5 7] [9 pad]
    assert batch["logp"].tolist() == [[4, 6], [8, 0], [1, 3], [5, 7], [9, 0]]
    assert batch["mask"].tolist() == [[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]]
    assert batch["state_in"][:, 0, 0].tolist() == [4, 8, 1, 5, 9]
    assert batch["resets"].tolist() == [[0, 0], [0, 0], [0, 0], [0, 1], [0, 0]]
    # Advantages standardize over the kept steps only, and the padding stays 0.
    advantages = {"advantages": batch["logp"].copy(), "mask": batch["mask"]}
    standardize_fields(advantages, ("advantages",))
    kept = advantages["advantages"][batch["mask"] > 0]
    assert abs(kept.mean()) < 1e-6 and abs(kept.std() - 1) < 1e-5
    assert advantages["advantages"][batch["mask"] == 0].tolist() == [0, 0]


def test_lstm_carries_its_state_across_fragments_and_resets_it_at_episode_starts():
    spec = EnvSpec(f"{PROBES}:RecallCue")
    policy = PolicySpec(*spec.spaces(), (16,), "tanh", model=ModelOptions(use_lstm=True,
                                                                           max_seq_len=4))
    worker = RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=2, seed=0, gamma=0.99, lam=0.95))
    first = worker.sample(5)["batch"]
    assert first["obs"].shape == (4, 4, 3) and not first["state_in"][[0, 2]].any()
    carried = worker.state.copy()
    assert carried.any()
    second = worker.sample(6)["batch"]  # RecallCue's episodes last 6 steps: one starts here
    assert np.array_equal(second["state_in"][0], carried[0])
    assert second["resets"].any()
    # The loss evaluates the batch's sequences; its log-probabilities are the sampled ones.
    tensors = {k: torch.as_tensor(v) for k, v in second.items()}
    logp, _, _, steps = evaluate_batch(worker.policy, tensors)
    np.testing.assert_allclose(logp.detach().numpy(), steps["logp"].numpy(), rtol=1e-4,
                               atol=1e-5)


def test_ppo_with_lstm_remembers_the_cue_and_without_it_stays_at_chance(tmp_path, capsys):
    # Chance is 0.5: the answer step looks the same whatever the cue was. Without the LSTM the
    # run gets the steps the LSTM took to remember (and never more than its 40k).
    budget = 40000
    for use_lstm, stop in (("true", 0.9), ("false", 2.0)):
        _, run_dir, result = train(
            3, tmp_path / use_lstm, "--algo", "PPO", "--env", f"{PROBES}:RecallCue",
            "--config", f'{{"use_lstm": {use_lstm}}}',
            "--stop", f'{{"episode_return_mean": {stop}, "timesteps_total": {budget}}}')
        if use_lstm == "true":
            budget = result["timesteps_total"]
            assert result["episode_return_mean"] >= 0.9, result
            # mpirl evaluate carries the state along each episode, as sampling did.
            code, out = _cli(capsys, "evaluate", str(run_dir), "--episodes", "20", "--json")
            assert code == 0 and json.loads(out)["return_mean"] >= 0.9, out
        else:
            assert result["episode_return_mean"] <= 0.65, result


def test_lstm_runs_resume_bit_identical_and_serve_a2c_a3c_and_impala(tmp_path):
    # Fragments of 25 steps end mid-episode (RecallCue's last 6): the state crosses checkpoints.
    config = ('{"use_lstm": true, "checkpoint_every": 1, "num_envs_per_worker": 3, '
              '"rollout_fragment_length": 25}')
    runs = {"reference": tmp_path / "reference", "resumed": tmp_path / "resumed"}
    proc = run_mpi(3, *MPIRL, "train", "--algo", "PPO", "--env", f"{PROBES}:RecallCue",
                   "--run-dir", str(runs["reference"]), "--config", config,
                   "--stop", '{"training_iteration": 4}', timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The resumed run: the reference rewound to its checkpoint at 2 (a copy without the later
    # ones; the rows after it are dropped on resume), not a run of its own stopped there.
    rewound_copy(runs["reference"], runs["resumed"], 2)
    checkpoints = runs["resumed"] / "checkpoints"
    proc = run_mpi(3, *MPIRL, "train", "--resume", str(runs["resumed"]),
                   "--stop", '{"training_iteration": 4}', timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {checkpoints}/checkpoint_000002" in proc.stdout, proc.stdout
    weights = [_checkpoint(runs[name], 4, "learner_0.pkl")["weights"] for name in runs]
    assert np.array_equal(*weights)
    # The rollout ranks' states went into the checkpoint and came back.
    assert _checkpoint(runs["reference"], 3, "rollout_0.pkl")["runner"]["lanes"]["default"][
        "state"].any()
    for algo in ("A2C", "A3C", "IMPALA"):  # one rollout rank: the state still crosses ranks
        _, run_dir, result = train(
            2, tmp_path / algo, "--algo", algo, "--env", f"{PROBES}:RecallCue",
            "--config", '{"use_lstm": true}', "--stop", '{"timesteps_total": 300}')
        assert result["episodes_total"] > 0 and np.isfinite(result["episode_return_mean"])


def _checkpoint(run_dir: Path, iteration: int, name: str) -> dict:
    with open(run_dir / "checkpoints" / f"checkpoint_{iteration:06d}" / name, "rb") as file:
        return pickle.load(file)


# Bad input: one line, before anything starts.

class WrongShapes(torch.nn.Module):
    def __init__(self, observation_space, action_space, config):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)

    def forward(self, obs):
        return self.layer(obs), obs.sum(-1)


class NotAModule:
    def __init__(self, observation_space, action_space, config):
        pass


@pytest.mark.parametrize("algo, env, config, message", [
    ("PPO", "CartPole-v1", {"custom_model": "no_such_module:Model"},
     "custom_model 'no_such_module:Model': no module named 'no_such_module'"),
    ("PPO", "CartPole-v1", {"custom_model": "test_models"},
     "custom_model 'test_models': give it as 'module:Class'"),
    ("PPO", "CartPole-v1", {"custom_model": "test_models:Missing"},
     "custom_model 'test_models:Missing': module test_models has no class Missing"),
    ("PPO", "CartPole-v1", {"custom_model": "test_models:NotAModule"}, "not a torch.nn.Module"),
    ("PPO", "CartPole-v1", {"custom_model": "test_models:WrongShapes"},
     "failed on a sampled observation"),
    ("DQN", "CartPole-v1", {"custom_model": "test_models:WrongShapes"},
     "failed on a sampled observation"),
    ("PPO", "CartPole-v1", {"encoder": "resnet"}, "encoder must be one of"),
    ("PPO", "CartPole-v1", {"encoder": "nature_cnn"}, "is for image observations"),
    ("PPO", f"{PROBES}:PixelTarget", {"encoder": "nature_cnn"}, "at least 36 pixels"),
    ("PPO", "CartPole-v1", {"cnn_dense_size": 0}, "cnn_dense_size"),
    ("DQN", "CartPole-v1", {"use_lstm": True}, "use_lstm is for PPO, A2C, A3C and IMPALA"),
    ("SAC", "Pendulum-v1", {"use_lstm": True}, "use_lstm is for PPO, A2C, A3C and IMPALA"),
    ("ES", "CartPole-v1", {"use_lstm": True}, "use_lstm is for PPO, A2C, A3C and IMPALA"),
    ("PPO", "CartPole-v1", {"use_lstm": True, "custom_model": "custom_models:ActorCritic"},
     "use_lstm wraps mpirl's own model"),
    ("PPO", "CartPole-v1", {"max_seq_len": 0}, "max_seq_len"),
])
def test_bad_model_config_is_one_clear_error(algo, env, config, message, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as error:
        make_request(algo, env, None, config, {}, None, None)
    assert "\n" not in str(error.value)


def test_a_bad_custom_model_through_the_cli_exits_2_without_a_traceback(tmp_path):
    proc = subprocess.run([*MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1",
                           "--run-dir", str(tmp_path / "run"), "--config",
                           '{"custom_model": "no_such_module:Model"}'],
                          capture_output=True, text=True, timeout=60, env=mpi_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "custom_model 'no_such_module:Model'" in proc.stderr
    assert not (tmp_path / "run").exists()

