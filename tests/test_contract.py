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

import gymnasium as gym
import numpy as np
import pytest
from conftest import mpi_env

from mpirl.errors import ConfigError
from mpirl.execution.contract import (
    ALGORITHMS,
    PIECES,
    AlgorithmModule,
    load_algorithm,
    plays_games,
)
from mpirl.workers.env_spec import game_env_spec

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
    assert {piece.name for piece in PIECES} == members


def test_the_docs_table_lists_every_piece():
    text = (REPO / "docs" / "plugins.md").read_text()
    for piece in PIECES:
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
    from mpirl.algorithms.model_based.mbpo_learner import MBPOLearner
    from mpirl.algorithms.model_based.pets_learner import DynamicsLearner
    from mpirl.algorithms.model_based.rollout_workers import ModelRolloutWorker, RealStepWorker

    from mpirl.workers.env_runner import EnvRunner
    from mpirl.workers.es_worker import PerturbationWorker, SearchWeights
    from mpirl.workers.learner import Learner
    from mpirl.workers.q_workers import QLearner, TransitionWorker
    from mpirl.workers.replay_shard import ReplayShard
    from mpirl.workers.rollout import RolloutWorker

    return [RolloutWorker, TransitionWorker, Learner, QLearner, ReplayShard, PerturbationWorker,
            SearchWeights, EnvRunner, RealStepWorker, ModelRolloutWorker, DynamicsLearner,
            MBPOLearner]


@pytest.mark.parametrize("cls", worker_classes(), ids=lambda cls: cls.__name__)
def test_every_worker_is_built_from_its_settings_alone(cls):
    # A rollout worker may also be given the rank's sampling core (a multi-agent policy's).
    parameters = list(inspect.signature(cls.__init__).parameters)
    assert parameters in (["self", "context", "settings"],
                          ["self", "context", "settings", "beside"])
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
    games = plays_games(module)  # AlphaZero: a board game
    config = module.Config()
    continuous = name in ("PETS", "MBPO")  # Box actions only
    env = (game_env_spec("openspiel/tic_tac_toe", None, {}, name) if games
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
    from mpirl.algorithms import dqn, ppo

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
    from mpirl.algorithms import dqn

    from mpirl.workers.replay_shard import ReplayShardSettings

    config = dqn.Config(buffer_size=10_000, num_envs_per_worker=4, n_step=3)
    settings = ReplayShardSettings.from_config(config, env=cartpole(), num_shards=2,
                                               num_rollout_workers=3)
    assert settings.capacity == 5_000 and settings.num_streams == 2 * 4
    assert settings.replay.n_step == 3 and settings.replay.frame_stack == 0
    assert isinstance(settings.observation_space, gym.spaces.Box)


def test_search_worker_settings_hold_no_discount_nor_gae():
    from mpirl.algorithms import ars

    from mpirl.workers.es_worker import SearchWeightsSettings, SearchWorkerSettings

    config = ars.Config(normalize_observations=False, num_envs_per_worker=2)
    spec = ars.model_spec(*cartpole().spaces(), config)
    settings = SearchWorkerSettings.from_config(config, env=cartpole(), policy=spec)
    fields = {f.name for f in dataclasses.fields(SearchWorkerSettings)}
    assert not fields & {"gamma", "lam", "dump", "callbacks"}, fields
    assert settings.normalize_observations is False and settings.num_envs == 2
    with pytest.raises(TypeError, match="gamma"):
        SearchWorkerSettings(env=cartpole(), policy=spec, num_envs=1, seed=0, gamma=0.99)
    weights = SearchWeightsSettings.from_config(config, policy=spec)
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
