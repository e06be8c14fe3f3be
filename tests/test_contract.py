"""The contract of an algorithm module (``mpirl.execution.contract``) and the settings workers are
built from: a plug-in lacking a piece, or defining one of the wrong kind, is refused in one line
that names it (exit code 2 through the CLI); every built-in algorithm meets the contract; every
worker takes ``(context, settings)``, its settings holding only what it uses."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
import zlib
from pathlib import Path
from typing import ClassVar

import gymnasium as gym
import numpy as np
import pytest
from conftest import mpi_env

from mpirl.config.fields import ConfigHooks
from mpirl.config.parse import build
from mpirl.errors import ConfigError
from mpirl.execution.contract import (
    ALGORITHMS,
    OPTIONAL_PIECES,
    PIECES,
    AlgorithmModule,
    LearnerClass,
    LearnerSettingsClass,
    PolicyLearnerSettings,
    PolicyRolloutWorkerClass,
    RolloutSettingsClass,
    RolloutWorkerClass,
    env_spec_of,
    load_algorithm,
    matches_of,
    protocol_members,
    worker_gaps,
)

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "examples" / "plugins" / "vanilla_pg.py"


def plugin_without(piece: str, directory: Path, replacement: str = "") -> str:
    """A copy of the vanilla_pg plug-in in ``directory`` whose top-level definition of ``piece``
    is left out (or replaced by the statement ``replacement``); its module name."""
    source = PLUGIN.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    for node in reversed(tree.body):
        names = ([t.id for t in node.targets if isinstance(t, ast.Name)]
                 if isinstance(node, ast.Assign)
                 else [node.name] if isinstance(node, ast.FunctionDef | ast.ClassDef) else [])
        if piece in names:
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            lines[start - 1:node.end_lineno] = [replacement] if replacement else []
            break
    else:
        raise AssertionError(f"vanilla_pg defines no {piece}")
    # Annotations that name Config stay unevaluated once it is gone.
    lines.insert(tree.body[0].end_lineno, "from __future__ import annotations")
    # A name of its own for each variant: an imported module stays in sys.modules.
    variant = f"bad_{zlib.crc32(replacement.encode())}" if replacement else "without"
    name = f"vanilla_pg_{variant}_{piece.lower()}"
    (directory / f"{name}.py").write_text("\n".join(lines) + "\n")
    return name


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_the_pieces_are_the_protocols_names():
    members = set(AlgorithmModule.__annotations__) | {
        name for name, value in vars(AlgorithmModule).items()
        if inspect.isfunction(value) and not name.startswith("_")}
    assert [piece.name for piece in PIECES] == [
        "Config", "loss", "ROLLOUT_WORKER", "LEARNER", "RECURRENT", "model_spec", "check_config",
        "setup", "training_step"]
    assert [piece.name for piece in OPTIONAL_PIECES] == ["env_spec", "MATCHES"]
    assert {piece.name for piece in PIECES + OPTIONAL_PIECES} == members


def test_the_docs_table_lists_every_piece():
    text = (REPO / "docs" / "plugins.md").read_text()
    for piece in PIECES + OPTIONAL_PIECES:
        assert f"| `{piece.name}`" in text, f"docs/plugins.md has no row for {piece.name}"


def test_the_example_plugin_and_every_builtin_meet_the_contract(plugins):
    sys.path.insert(0, str(PLUGIN.parent))
    try:
        assert load_algorithm("vanilla_pg").Config.__name__ == "Config"
    finally:
        sys.path.remove(str(PLUGIN.parent))
    for name in ALGORITHMS:
        load_algorithm(name)


@pytest.mark.parametrize("piece", [piece.name for piece in PIECES])
def test_a_plugin_lacking_a_piece_is_refused_naming_it(plugins, piece):
    name = plugin_without(piece, plugins)
    with pytest.raises(ConfigError) as caught:
        load_algorithm(name)
    message = str(caught.value)
    should_be = next(p.should_be for p in PIECES if p.name == piece)
    assert message == (f"algorithm module {name!r} does not define {piece}: {should_be}; see "
                       f"docs/plugins.md")
    assert "\n" not in message


@pytest.mark.parametrize(("piece", "replacement", "shown"), [
    ("ROLLOUT_WORKER", "ROLLOUT_WORKER = 3", "3"),
    ("LEARNER", "LEARNER = dict", "<class 'dict'>"),
    # A Worker without the settings the trainer builds it from.
    ("LEARNER", "from mpirl.runtime.core import Worker as LEARNER",
     "<class 'mpirl.runtime.core.Worker'>"),
    ("RECURRENT", "RECURRENT = 'no'", "'no'"),
    ("Config", "Config = dict", "<class 'dict'>"),
    ("loss", "loss = 0.5", "0.5"),
    ("setup", "setup = None", "None"),
    ("training_step", "training_step = 'ppo'", "'ppo'"),
])
def test_a_piece_of_the_wrong_kind_is_refused_naming_it(plugins, piece, replacement, shown):
    name = plugin_without(piece, plugins, replacement)
    with pytest.raises(ConfigError, match="see docs/plugins.md") as caught:
        load_algorithm(name)
    assert str(caught.value).startswith(
        f"algorithm module {name!r} defines {piece} as {shown}, but it should be ")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_builtins_workers_meet_the_worker_protocols(name):
    """What shared code calls on any algorithm's workers, spelled out in contract.py's
    Protocols: a plug-in's workers need exactly this (and its plan's own methods)."""
    module = load_algorithm(name)
    rollout, learner = module.ROLLOUT_WORKER, module.LEARNER
    assert isinstance(rollout, RolloutWorkerClass)
    assert isinstance(rollout.Settings, RolloutSettingsClass)
    assert isinstance(learner, LearnerClass)
    assert isinstance(learner.Settings, LearnerSettingsClass)
    if rollout.SERVES_A_POLICY:
        assert isinstance(rollout, PolicyRolloutWorkerClass)
    if learner.SERVES_A_POLICY:
        assert isinstance(learner.Settings, PolicyLearnerSettings)
    # The methods shared code calls by name must be callable by name.
    assert {"get_weights", "set_weights", "receive_weights", "finish_dump", "save_state",
            "load_state"} <= set(rollout.MESSAGES)
    assert {"get_weights", "set_weights", "broadcast_weights", "histograms", "save_state",
            "load_state"} <= set(learner.MESSAGES)
    assert worker_gaps(module) == []
    assert isinstance(module.Config(), ConfigHooks)


def test_the_protocols_name_what_shared_code_calls():
    assert protocol_members(RolloutWorkerClass) == [
        "MESSAGES", "SERVES_A_POLICY", "Settings", "finish_dump", "get_weights", "load_state",
        "receive_weights", "save_state", "set_weights"]
    assert protocol_members(PolicyRolloutWorkerClass) == [
        "ACTING", *protocol_members(RolloutWorkerClass)]
    assert protocol_members(LearnerClass) == [
        "MESSAGES", "SERVES_A_POLICY", "Settings", "broadcast_weights", "get_state",
        "get_weights", "histograms", "load_state", "save_state", "set_weights"]
    assert protocol_members(RolloutSettingsClass) == ["from_config"]
    assert protocol_members(LearnerSettingsClass) == ["from_config"]
    assert protocol_members(PolicyLearnerSettings) == ["for_policy"]


def test_a_plugin_whose_worker_lacks_a_called_method_is_refused_naming_it(plugins):
    name = plugin_without("ROLLOUT_WORKER", plugins, (
        "class ROLLOUT_WORKER(RolloutWorker):\n"
        "    MESSAGES = tuple(m for m in RolloutWorker.MESSAGES if m != 'finish_dump')"))
    with pytest.raises(ConfigError) as caught:
        load_algorithm(name)
    assert str(caught.value) == (
        f"algorithm module {name!r}: its ROLLOUT_WORKER.MESSAGES lacks 'finish_dump', which "
        f"mpirl calls on every algorithm's workers (mpirl.execution.contract."
        f"RolloutWorkerClass, LearnerClass); see docs/plugins.md")


def test_configs_answer_what_shared_code_asks_instead_of_being_probed():
    """Shared code asks a config (``ConfigHooks``) rather than probing its fields; a key
    behind an answer stays valid only where it means something."""
    from mpirl.algorithms import a3c, bc, impala, marwil, ppo, sac
    from mpirl.algorithms.evolution import es
    from mpirl.algorithms.q_learning import apex, dqn

    config = ppo.Config(gamma=0.9, gae_lambda=0.7, normalize_observations=True,
                        centralized_critic=True, learner_backend="gloo")
    assert (config.discount(), config.advantage_lambda()) == (0.9, 0.7)
    assert config.observation_normalization() and config.centralizes_critic()
    assert config.allreduce_options() == ("gloo", "")
    assert config.samples_per_iteration(3) == 3 * config.rollout_fragment_length
    assert impala.Config(gamma=0.9).advantage_lambda() == 1.0
    assert a3c.Config().allreduce_options() == ("auto", "")  # no allreduce keys
    assert (dqn.Config().discount(), dqn.Config().observation_normalization()) == (0.99, False)
    assert bc.Config().discount() == 1.0 and marwil.Config(gamma=0.5).discount() == 0.5
    offline = bc.Config(train_batch_size=10, num_sgd_steps_per_iteration=3)
    assert offline.samples_per_iteration(8) == 30
    assert es.Config(train_batch_size=500).samples_per_iteration(8) == 500
    assert es.Config().observation_normalization()
    assert sac.Config(custom_model="a:B", custom_q_model="c:D").custom_models() == ["a:B", "c:D"]
    assert (apex.Config(num_replay_shards=3).replay_ranks(), ppo.Config().replay_ranks()) == (3, 0)
    assert dqn.Config(target_network_update_freq=7).target_updates() == (7, 1.0)
    assert sac.Config(tau=0.01).target_updates() == (1, 0.01)
    assert ppo.Config().target_updates() == (1, 1.0)
    with pytest.raises(ConfigError, match="normalize_observations"):
        build(dqn.Config, {"normalize_observations": True})


def plugin_with(statements: str, directory: Path, name: str) -> str:
    """A copy of the vanilla_pg plug-in in ``directory`` with ``statements`` appended; its
    module name."""
    (directory / f"{name}.py").write_text(f"{PLUGIN.read_text()}\n{statements}\n")
    return name


def test_optional_pieces_take_their_defaults_or_the_modules_own(plugins):
    from mpirl.workers.env_spec import EnvSpec

    plain = load_algorithm(plugin_with("", plugins, "vanilla_pg_plain"))
    config = plain.Config()
    assert env_spec_of(plain, "CartPole-v1", None, config) == EnvSpec("CartPole-v1")
    assert matches_of(plain) is None
    own = load_algorithm(plugin_with(
        "def env_spec(env_id, env_module, config):\n"
        "    from mpirl.workers.env_spec import EnvSpec\n\n"
        "    return EnvSpec('CartPole-v1', env_config={'given': env_id})\n",
        plugins, "vanilla_pg_own_env_spec"))
    assert env_spec_of(own, "my-board", None, config).env_config == {"given": "my-board"}
    assert matches_of(load_algorithm("AlphaZero")) is not None


@pytest.mark.parametrize(("piece", "statement"), [
    ("MATCHES", "MATCHES = 3"), ("env_spec", "env_spec = 'CartPole-v1'")])
def test_an_optional_piece_of_the_wrong_kind_is_refused_naming_it(plugins, piece, statement):
    name = plugin_with(statement, plugins, f"vanilla_pg_bad_{piece.lower()}")
    with pytest.raises(ConfigError, match="see docs/plugins.md") as caught:
        load_algorithm(name)
    assert str(caught.value).startswith(f"algorithm module {name!r} defines {piece} as ")


def test_a_spec_may_name_its_network_by_path():
    from mpirl.models.torch_model import build_torch_model

    @dataclasses.dataclass(frozen=True)
    class IdentitySpec:
        NETWORK: ClassVar[str] = "torch.nn:Identity"

    @dataclasses.dataclass(frozen=True)
    class MisnamedSpec:
        NETWORK: ClassVar[str] = "torch.nn:NoSuchNetwork"

    assert type(build_torch_model(IdentitySpec())).__name__ == "Identity"
    with pytest.raises(ConfigError, match="MisnamedSpec.NETWORK"):
        build_torch_model(MisnamedSpec())


def test_a_config_that_subclasses_no_base_is_refused(plugins):
    name = plugin_without("Config", plugins, "from dataclasses import dataclass as _dc\n"
                                             "Config = _dc(type('Config', (), {}))")
    with pytest.raises(ConfigError, match="defines Config as .* subclasses one of mpirl.config"):
        load_algorithm(name)


def train_plugin(name: str, plugins: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """``mpirl train --algo name`` in local mode, with ``plugins`` on PYTHONPATH."""
    return subprocess.run([sys.executable, "-m", "mpirl", "train", "--algo", name, "--env",
                           "CartPole-v1", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=mpi_env({"PYTHONPATH": str(plugins), "CI": "true"}))


def test_the_cli_refuses_a_plugin_lacking_a_piece_in_one_line(plugins, tmp_path):
    name = plugin_without("ROLLOUT_WORKER", plugins)
    proc = train_plugin(name, plugins, tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"mpirl: error: algorithm module {name!r} does not define ROLLOUT_WORKER: the rollout "
        f"worker class its plan calls (mpirl.workers.rollout.RolloutWorker for on-policy plans); "
        f"see docs/plugins.md"], proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_setup_that_returns_no_plan_state_ends_the_run_in_one_line(plugins, tmp_path):
    name = plugin_without("setup", plugins, "def setup(trainer):\n    return {}")
    proc = train_plugin(name, plugins, tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"mpirl: algorithm module {name!r}: setup(trainer) returned {{}}, not a "
        f"mpirl.execution.PlanState"], proc.stderr


# Settings: each worker takes (context, settings), a frozen keyword-only dataclass of its own.


def worker_classes() -> list[type]:
    from mpirl.algorithms.evolution.driver_weights import DriverWeights
    from mpirl.algorithms.evolution.perturbation_worker import PerturbationWorker
    from mpirl.algorithms.model_based.mbpo_learner import MBPOLearner
    from mpirl.algorithms.model_based.pets_learner import DynamicsLearner
    from mpirl.algorithms.model_based.rollout_workers import ModelRolloutWorker, RealStepWorker
    from mpirl.algorithms.q_learning.apex_learner import ApexLearner

    from mpirl.workers.env_runner import EnvRunner
    from mpirl.workers.learner import Learner
    from mpirl.workers.q_workers import QLearner, TransitionWorker
    from mpirl.workers.replay_shard import ReplayShard
    from mpirl.workers.rollout import RolloutWorker

    return [RolloutWorker, TransitionWorker, Learner, QLearner, ApexLearner, ReplayShard,
            PerturbationWorker, DriverWeights, EnvRunner, RealStepWorker, ModelRolloutWorker,
            DynamicsLearner, MBPOLearner]


@pytest.mark.parametrize("cls", worker_classes(), ids=lambda cls: cls.__name__)
def test_every_worker_is_built_from_its_settings_alone(cls):
    # A rollout worker may also be given the rank's sampling core (a multi-agent policy's); a
    # keyword-only argument with a default serves in-process callers only (mpirl evaluate's
    # models): a spawned worker gets its settings and nothing else.
    signature = inspect.signature(cls.__init__).parameters.values()
    parameters = [p.name for p in signature if p.kind is not p.KEYWORD_ONLY]
    assert parameters in (["self", "context", "settings"],
                          ["self", "context", "settings", "beside"])
    assert all(p.default is not p.empty for p in signature if p.kind is p.KEYWORD_ONLY)
    settings = cls.Settings
    assert dataclasses.is_dataclass(settings) and settings.__dataclass_params__.frozen
    assert settings.__name__.endswith("Settings")
    with pytest.raises(TypeError):
        settings(*[None] * len(dataclasses.fields(settings)))  # keyword-only


def cartpole():
    from mpirl.workers.env_spec import EnvSpec

    return EnvSpec("CartPole-v1")


def pendulum():
    from mpirl.workers.env_spec import EnvSpec

    return EnvSpec("Pendulum-v1")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithms_workers_take_settings_from_its_config(name):
    module = load_algorithm(name)
    games = name == "AlphaZero"  # a board game
    config = module.Config()
    continuous = name in ("PETS", "MBPO")  # Box actions only
    env = (env_spec_of(module, "openspiel/tic_tac_toe", None, config) if games
           else pendulum() if continuous else cartpole())
    spec = module.model_spec(*env.spaces(), config)
    rollout = module.ROLLOUT_WORKER.Settings.from_config(config, env=env, policy=spec)
    learner = module.LEARNER.Settings.from_config(config, policy=spec, loss=module.loss)
    assert rollout.seed == config.seed
    if games:
        assert rollout.games_per_worker == config.games_per_worker
    else:
        assert rollout.num_envs == config.num_envs_per_worker
    assert rollout.policy is spec and learner.policy is spec


def test_rollout_and_learner_settings_hold_the_configs_values():
    from mpirl.algorithms import ppo
    from mpirl.algorithms.q_learning import dqn

    from mpirl.workers.learner import LearnerSettings
    from mpirl.workers.rollout import RolloutSettings

    config = ppo.Config(num_envs_per_worker=3, seed=7, normalize_observations=True,
                        learner_backend="gloo", callbacks="my_package:MyCallbacks")
    spec = ppo.model_spec(*cartpole().spaces(), config)
    rollout = RolloutSettings.from_config(config, env=cartpole(), policy=spec)
    assert (rollout.gamma, rollout.lam, rollout.normalize_observations) == (0.98, 0.8, True)
    assert (rollout.num_envs, rollout.seed, rollout.callbacks, rollout.dump) == (
        3, 7, "my_package:MyCallbacks", None)
    learner = LearnerSettings.from_config(config, policy=spec, loss=ppo.loss)
    assert (learner.lr, learner.grad_clip, learner.backend, learner.loss_config) == (
        config.lr, config.grad_clip, "gloo", config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        learner.lr = 1.0
    # A replay config samples no advantages: its rollout workers keep the neutral lambda.
    replay = RolloutSettings.from_config(dqn.Config(), env=cartpole(), policy=spec)
    assert (replay.lam, replay.normalize_observations) == (1.0, False)


def test_replay_shard_settings_split_the_buffer_and_streams():
    from mpirl.algorithms.q_learning import dqn

    from mpirl.workers.replay_shard import ReplayShardSettings

    config = dqn.Config(buffer_size=10_000, num_envs_per_worker=4, n_step=3)
    settings = ReplayShardSettings.from_config(config, env=cartpole(), num_shards=2,
                                               num_rollout_workers=3)
    assert settings.capacity == 5_000 and settings.num_streams == 2 * 4
    assert settings.replay.n_step == 3 and settings.replay.frame_stack == 0
    assert isinstance(settings.observation_space, gym.spaces.Box)


def test_search_worker_settings_hold_no_discount_nor_gae():
    from mpirl.algorithms.evolution import ars
    from mpirl.algorithms.evolution.driver_weights import DriverWeightsSettings
    from mpirl.algorithms.evolution.perturbation_worker import PerturbationWorkerSettings

    config = ars.Config(normalize_observations=False, num_envs_per_worker=2)
    spec = ars.model_spec(*cartpole().spaces(), config)
    settings = PerturbationWorkerSettings.from_config(config, env=cartpole(), policy=spec)
    fields = {f.name for f in dataclasses.fields(PerturbationWorkerSettings)}
    assert not fields & {"gamma", "lam", "dump", "callbacks"}, fields
    assert settings.normalize_observations is False and settings.num_envs == 2
    with pytest.raises(TypeError, match="gamma"):
        PerturbationWorkerSettings(env=cartpole(), policy=spec, num_envs=1, seed=0, gamma=0.99)
    weights = DriverWeightsSettings.from_config(config, policy=spec)
    assert weights.zero_init is True and {f.name for f in dataclasses.fields(weights)} == {
        "policy", "seed", "zero_init"}


def test_a_worker_built_from_settings_samples():
    from mpirl.algorithms import ppo
    from test_env_failures import local_context

    from mpirl.workers.rollout import RolloutSettings, RolloutWorker

    config = ppo.Config(num_envs_per_worker=2, hidden_sizes=(8,))
    spec = ppo.model_spec(*cartpole().spaces(), config)
    worker = RolloutWorker(local_context("rollout"),
                           RolloutSettings.from_config(config, env=cartpole(), policy=spec))
    batch = worker.sample(4)["batch"]
    assert len(batch["obs"]) == 8 and np.isfinite(batch["advantages"]).all()
