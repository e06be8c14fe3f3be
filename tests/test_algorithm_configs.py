"""Every algorithm's Config: its flat ``--config`` keys, key defaults and field docstrings.

The shared fields live in base classes (mpirl.config.fields); these tests pin the keys each
algorithm exposes, so that params.json, ``--config`` and checkpoints see the same keys.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from mpirl.config.fields import field_docs
from mpirl.config.parse import build, parse_json_object
from mpirl.errors import ConfigError
from mpirl.execution.contract import ALGORITHMS, load_algorithm

COMMON = {"callbacks", "tensorboard_histograms_every", "wandb_project", "mlflow_experiment",
          "num_rollout_workers", "num_learners", "num_envs_per_worker",
          "max_env_failures", "env_failure_window", "lr", "grad_clip", "hidden_sizes", "activation",
          "torch_threads", "metrics_window", "seed", "multiagent",
          # the model's
          "encoder", "cnn_dense_size", "custom_model", "custom_model_config", "use_lstm",
          "lstm_cell_size", "max_seq_len",
          # the environment's
          "env_config", "clip_rewards", "atari_noop_max", "atari_frame_skip", "atari_frame_size",
          "atari_grayscale", "atari_frame_stack", "env_backend",
          # env groups (simulations as environments)
          "ranks_per_env", "env_step_timeout_s"}
#: Every algorithm but A3C, whose single learner makes no allreduce.
ALLREDUCE = {"learner_backend", "learner_master_addr"}
ON_POLICY = COMMON | {"rollout_fragment_length", "normalize_observations", "gamma", "vf_coef",
                      "ent_coef"}
REPLAY = COMMON | ALLREDUCE | {
                   "num_replay_shards", "rollout_fragment_length", "buffer_size",
                   "learning_starts", "prioritized_replay", "prioritized_replay_alpha",
                   "prioritized_replay_beta",
                   "prioritized_replay_beta_final", "prioritized_replay_beta_anneal_steps",
                   "prioritized_replay_eps", "n_step", "gamma", "train_batch_size",
                   "sgd_steps_per_env_step"}
OFFLINE = COMMON | ALLREDUCE | {"input", "max_rows_in_memory", "train_batch_size",
                    "num_sgd_steps_per_iteration", "ent_coef", "evaluation_episodes",
                    "evaluation_interval", "evaluation_deterministic"}

KEYS = {
    "PPO": ON_POLICY | ALLREDUCE | {"gae_lambda", "num_epochs", "minibatch_size", "clip_param",
                                    "centralized_critic"},
    "A2C": ON_POLICY | ALLREDUCE | {"gae_lambda", "standardize_advantages"},
    "A3C": ON_POLICY | {"gae_lambda", "max_requests_in_flight_per_worker",
                        "min_steps_per_iteration"},
    "IMPALA": ON_POLICY | ALLREDUCE | {"max_requests_in_flight_per_worker", "train_batch_size",
                           "min_steps_per_iteration", "vtrace_rho_bar", "vtrace_c_bar",
                           "lr_decay_steps", "num_epochs", "num_minibatches", "fragments_per_call"},
    "DQN": REPLAY | {"target_network_update_freq", "initial_epsilon", "final_epsilon",
                     "exploration_steps", "double_q", "dueling", "lr_final", "lr_decay_steps"},
    "APEX": REPLAY | {"target_network_update_freq", "epsilon", "epsilon_alpha",
                      "min_env_steps_per_iteration", "throttle_sampling", "batches_per_train",
                      "weight_sync_every", "double_q", "fragments_per_call",
                      "dueling", "metrics_max_epsilon"},
    "SAC": REPLAY | {"tau", "initial_alpha", "target_entropy", "custom_q_model"},
    "BC": OFFLINE,
    "MARWIL": OFFLINE | {"beta", "gamma", "advantage_norm_rate", "max_weight", "vf_coef"},
    "ES": COMMON | {"episodes_per_batch", "train_batch_size", "noise_stdev", "stepsize",
                    "l2_coeff", "action_noise_std", "eval_prob", "noise_size", "noise_seed",
                    "normalize_observations"},
    "ARS": COMMON | {"zero_init", "num_rollouts", "rollouts_used", "train_batch_size",
                     "noise_stdev", "sgd_stepsize", "offset", "action_noise_std", "eval_prob",
                     "noise_size", "noise_seed", "normalize_observations"},
    "AlphaZero": COMMON | ALLREDUCE | {"games_per_worker", "simulations", "c_puct", "gumbel",
                           "temperature_moves", "dirichlet_epsilon", "channels", "blocks",
                           "value_hidden", "weight_decay", "train_batch_size",
                           "sgd_steps_per_iteration", "replay_capacity", "evaluation_interval",
                           "evaluation_games", "evaluation_opponents",
                           "evaluation_simulations", "evaluation_gumbel", "gating",
                           "gating_threshold", "gating_games", "gating_opening_moves"},
    "PETS": COMMON | {"rollout_fragment_length", "initial_random_steps", "buffer_size",
                      "planning_horizon", "cem_population", "cem_elites", "cem_iterations",
                      "cem_alpha", "particles", "planner", "mppi_population",
                      "mppi_iterations", "mppi_temperature", "mppi_noise_std",
                      "ensemble_size", "elites", "termination_fn", "learn_termination",
                      "model_weight_decay", "model_batch_size", "model_holdout_ratio",
                      "model_patience", "model_max_epochs", "evaluation_interval",
                      "evaluation_episodes"},
    "MBPO": COMMON | {"rollout_fragment_length", "initial_random_steps", "buffer_size",
                      "model_train_freq", "rollout_batch_size", "rollout_schedule",
                      "epoch_length", "model_retain_epochs", "trajectory_sampling",
                      "real_ratio", "sgd_steps_per_env_step", "train_batch_size", "gamma",
                      "tau", "initial_alpha", "target_entropy", "ensemble_size", "elites",
                      "model_hidden_sizes", "model_activation", "termination_fn",
                      "learn_termination", "model_lr",
                      "model_weight_decay", "model_batch_size", "model_holdout_ratio",
                      "model_patience", "model_max_epochs", "evaluation_interval",
                      "evaluation_episodes"},
}

# The defaults that differ most between algorithms (and that a slip in a base class would change).
DEFAULTS = {
    "PPO": {"num_learners": 0, "num_envs_per_worker": 8, "rollout_fragment_length": 64,
            "gamma": 0.98, "gae_lambda": 0.8, "lr": 1e-3, "grad_clip": 0.5, "ent_coef": 0.0,
            "hidden_sizes": (64, 64), "activation": "tanh", "metrics_window": 100},
    "A2C": {"rollout_fragment_length": 8, "gamma": 0.99, "gae_lambda": 1.0, "grad_clip": 0.5},
    "A3C": {"rollout_fragment_length": 8, "max_requests_in_flight_per_worker": 1},
    "IMPALA": {"rollout_fragment_length": 50, "gamma": 0.98, "lr": 1e-3, "ent_coef": 0.003,
               "train_batch_size": 800, "max_requests_in_flight_per_worker": 2},
    "DQN": {"num_replay_shards": 0, "num_learners": 0, "num_envs_per_worker": 4,
            "rollout_fragment_length": 64, "grad_clip": 10.0, "hidden_sizes": (256, 256),
            "activation": "relu", "prioritized_replay": False, "n_step": 3,
            "train_batch_size": 64, "learning_starts": 1_000, "lr": 5e-4, "lr_final": 5e-5,
            "lr_decay_steps": 150_000,
            "target_network_update_freq": 500},
    "APEX": {"num_replay_shards": 2, "num_learners": 1, "rollout_fragment_length": 32,
             "prioritized_replay": True, "hidden_sizes": (256, 256),
             "prioritized_replay_beta_anneal_steps": 0},
    "SAC": {"num_envs_per_worker": 1, "n_step": 1, "train_batch_size": 256, "grad_clip": 0.0,
            "learning_starts": 128, "hidden_sizes": (64, 64),
            "activation": "relu"},
    "BC": {"num_learners": 1, "num_envs_per_worker": 5, "grad_clip": 0.0, "metrics_window": 10,
           "train_batch_size": 512, "hidden_sizes": (64, 64), "activation": "tanh"},
    "MARWIL": {"num_learners": 1, "gamma": 0.99, "vf_coef": 1.0, "metrics_window": 10},
    "ES": {"num_learners": 0, "hidden_sizes": (32,), "noise_stdev": 0.02, "stepsize": 0.01,
           "l2_coeff": 0.005, "noise_size": 25_000_000, "eval_prob": 0.1, "metrics_window": 20,
           "normalize_observations": True},
    "ARS": {"num_learners": 0, "hidden_sizes": (), "zero_init": True, "num_rollouts": 16,
            "rollouts_used": 8, "noise_stdev": 0.03, "sgd_stepsize": 0.02},
    "AlphaZero": {"num_learners": 0, "games_per_worker": 32, "simulations": 16, "lr": 3e-3,
                  "weight_decay": 1e-4, "grad_clip": 0.0, "train_batch_size": 128,
                  "replay_capacity": 20_000, "evaluation_opponents": "auto",
                  "evaluation_simulations": 100, "evaluation_interval": 20},
    "PETS": {"num_learners": 0, "num_envs_per_worker": 5, "rollout_fragment_length": 20,
             "initial_random_steps": 200, "planning_horizon": 30, "cem_population": 200,
             "cem_elites": 20, "cem_iterations": 5, "cem_alpha": 0.1, "particles": 2,
             "planner": "cem", "ensemble_size": 5, "elites": 5, "activation": "silu"},
    "MBPO": {"num_learners": 0, "num_envs_per_worker": 1, "rollout_fragment_length": 25,
             "model_train_freq": 250, "rollout_batch_size": 2500, "real_ratio": 0.05,
             "sgd_steps_per_env_step": 10.0, "train_batch_size": 256, "ensemble_size": 7,
             "elites": 5, "hidden_sizes": (64, 64), "activation": "relu",
             "model_activation": "silu"},
}


def config_class(name: str) -> type:
    return load_algorithm(name).Config


def test_every_algorithm_is_covered():
    assert set(KEYS) == set(ALGORITHMS) == set(DEFAULTS)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_keys_are_flat_and_unchanged(name):
    config = config_class(name)()
    values = dataclasses.asdict(config)
    assert set(values) == KEYS[name]
    # Flat: every value is a JSON scalar or a list of them, never a nested config; the objects
    # are the multi-agent policy table (per-policy overrides) and the keyword arguments handed
    # to the user's env and model constructors.
    objects = {"multiagent", "env_config", "custom_model_config"}
    assert all(not isinstance(v, dict) for k, v in values.items() if k not in objects)
    json.dumps(values)
    assert build(config_class(name), json.loads(json.dumps(values))) == config


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_defaults(name):
    values = dataclasses.asdict(config_class(name)())
    assert {key: values[key] for key in DEFAULTS[name]} == DEFAULTS[name]
    assert values["num_rollout_workers"] == -1 and values["seed"] == 0
    assert values["max_env_failures"] == 10 and values["torch_threads"] == 1


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_key_has_a_docstring(name):
    cls = config_class(name)
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
    assert not missing


def test_the_most_derived_docstring_wins():
    assert field_docs(config_class("PPO"))["learner_backend"].startswith("Gradient allreduce")
    # Redeclared only for its default: the base's docstring stays.
    assert field_docs(config_class("IMPALA"))["gamma"] == "Discount factor."
    assert field_docs(config_class("SAC"))["grad_clip"].startswith("Global gradient-norm clip")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_inherited_checks_run(name):
    with pytest.raises(ConfigError, match="max_env_failures"):
        config_class(name)(max_env_failures=0)


def test_algorithm_checks_still_run_after_the_shared_ones():
    with pytest.raises(ConfigError, match="num_learners must be 0 or 1"):
        config_class("A3C")(num_learners=2)
    with pytest.raises(ConfigError, match="rollout_fragment_length"):
        config_class("IMPALA")(rollout_fragment_length=0)
    assert config_class("MARWIL")(evaluation_episodes=7).metrics_window == 7
    assert config_class("BC")(metrics_window=3).metrics_window == 3


def test_unknown_keys_are_still_rejected():
    with pytest.raises(ConfigError, match="Did you mean 'num_learners'"):
        build(config_class("PPO"), {"num_learner": 1})
    with pytest.raises(ConfigError, match="unknown config key 'num_replay_shards'"):
        build(config_class("PPO"), {"num_replay_shards": 1})


@pytest.mark.parametrize(("name", "key"), [("SAC", "target_network_update_freq"),
                                           ("A3C", "learner_backend")])
def test_dead_keys_are_gone(name, key):
    # SAC's target network follows tau after every step; A3C's one learner makes no allreduce.
    with pytest.raises(ConfigError, match=key):
        build(config_class(name), {key: 1})


TUNED = sorted((Path(__file__).resolve().parent.parent / "examples" / "tuned").glob("*.json"))


@pytest.mark.parametrize("path", TUNED, ids=[p.stem for p in TUNED])
def test_tuned_configs_read_with_at_and_build_for_their_algorithm(path):
    # examples/tuned/<algo>_<env>.json: every key must exist for that algorithm.
    config = parse_json_object(f"@{path}", "--config")
    assert config == json.loads(path.read_text())
    built = build(config_class(path.stem.split("_")[0].upper()), config)
    assert all(getattr(built, key) == value for key, value in config.items())


def test_config_at_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"--config @.*nope\.json: cannot read .*No such file"):
        parse_json_object(f"@{tmp_path / 'nope.json'}", "--config")
    bad = tmp_path / "bad.json"
    bad.write_text('{"lr": 0.1,}')
    with pytest.raises(ConfigError, match=r"is not valid JSON .*bad\.json \(from --config @\)"):
        parse_json_object(f"@{bad}", "--config")
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must be a JSON object .* in .*bad\.json"):
        parse_json_object(f"@{bad}", "--config")


def test_only_plans_that_evaluate_accept_a_stop_on_their_evaluations():
    """``--stop eval_return_mean`` is reachable only where the config says its plan reports
    that column (``reports_eval_return``): PETS and MBPO with evaluation_interval, no other
    built-in (BC's and MARWIL's evaluations count as episodes, not in eval_return_mean)."""
    for name in ALGORITHMS:
        config = load_algorithm(name).Config
        if name in ("PETS", "MBPO"):
            assert config(evaluation_interval=2).reports_eval_return(), name
            assert not config(evaluation_interval=0).reports_eval_return(), name
        else:
            assert not config().reports_eval_return(), name
