"""``mpirl evaluate``: run a checkpoint's or an exported file's policy for some episodes and
report its returns.

One process, no MPI traffic: the policy is learner 0's weights, observations are normalized with
the run's statistics when the run normalized them, and actions are the policy's most likely ones
unless ``stochastic`` is set. A checkpoint is code (pickles, and a module its manifest names is
imported); an exported file (``mpirl.commands.export``) is plain arrays, read without unpickling.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from mpirl.config.parse import build
from mpirl.errors import CheckpointError, ConfigError
from mpirl.execution.contract import WEIGHTS_KEY, load_algorithm
from mpirl.jobs.checkpoint import CHECKPOINTS, MANIFEST, CheckpointStore, verify
from mpirl.models.policy import RunningMeanStd
from mpirl.models.torch_model import build_torch_model
from mpirl.runtime.state_files import read_state_file
from mpirl.workers.env_spec import EnvSpec, env_spec_for


@dataclass
class Evaluation:
    checkpoint: Path
    manifest: dict[str, Any]
    returns: list[float]
    lengths: list[int]
    #: multi-agent checkpoints: each policy's agents' returns
    policy_returns: dict[str, list[float]] | None = None

    def summary(self) -> dict[str, Any]:
        r = np.asarray(self.returns)
        per_policy = {f"return_mean/{pid}": float(np.mean(v)) if v else math.nan
                      for pid, v in (self.policy_returns or {}).items()}
        return per_policy | {
            "checkpoint": str(self.checkpoint), "algo": self.manifest["algo"],
            "env": self.manifest["env"]["env_id"], "iteration": self.manifest["iteration"],
            "episodes": len(r), "return_mean": float(r.mean()), "return_std": float(r.std()),
            "return_min": float(r.min()), "return_max": float(r.max()),
            "length_mean": float(np.mean(self.lengths)),
        }


#: Episodes played at once (one env each); more are played in turn, this many at a time.
MAX_BATCH = 64


def find_checkpoint(path: str | Path, warn=None) -> tuple[Path, dict[str, Any]]:
    """A checkpoint directory, or a run directory's newest valid checkpoint, with its
    manifest; CheckpointError if there is none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path, verify(path)
    if (path / CHECKPOINTS).is_dir():
        found = CheckpointStore(path).newest_valid(warn=warn)
        if found is not None:
            return found
        raise CheckpointError(f"{path} has no checkpoints yet")
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    raise CheckpointError(f"{path} is neither a checkpoint (no {MANIFEST}) nor a run directory "
                          f"(no {CHECKPOINTS}/)")


def evaluate(path: str | Path, episodes: int, seed: int = 0, stochastic: bool = False,
             video_dir: str | None = None, warn=None, env_id: str | None = None,
             env_module: str | None = None) -> Evaluation:
    """Run ``episodes`` episodes of a checkpoint's or an exported file's policy on its
    environment (``env_id`` and ``env_module`` replace the one it was trained on).

    A checkpoint is unpickled and its manifest's ``env_module`` imported: load only your own.
    An exported file (``mpirl export``) is read without unpickling, and no module it names is
    imported: give ``--env``/``--env-module`` for an environment outside gymnasium's registry.
    """
    if episodes < 1:
        raise ConfigError(f"--episodes must be >= 1, got {episodes}")
    if Path(path).is_file():
        from mpirl.commands.export import load_exported

        manifest, policy, obs_filter = load_exported(path)
        checkpoint = Path(path)
        if manifest.get("policy_id") is not None:
            raise ConfigError(f"{path} is policy {manifest['policy_id']!r} of a multi-agent run; "
                              f"evaluate the run's checkpoint instead (mpirl evaluate RUN_DIR), "
                              f"which plays every policy")
        saved = manifest["env"]
        if env_id is None and (saved.get("env_module") or ":" in saved["env_id"]):
            raise ConfigError(
                f"{path} was trained on {saved['env_id']!r}"
                + (f" (module {saved['env_module']})" if saved.get("env_module") else "")
                + "; an exported file imports no module it names: pass --env (and --env-module) "
                  "to say which environment to run")
        spaces = manifest["gym_spaces"]
    else:
        checkpoint, manifest = find_checkpoint(path, warn)
        saved = manifest["env"]
        policy = obs_filter = spaces = None
        if env_id is None and video_dir is None:
            spec = EnvSpec(saved["env_id"], saved.get("env_module"),
                           dict(saved.get("env_config") or {}))
            if spec.is_multi_agent():
                return _evaluate_multiagent(checkpoint, manifest, spec, episodes, seed,
                                            stochastic)
    env_config = dict(saved.get("env_config") or {}) if env_id is None else {}
    if video_dir is not None:
        try:
            import moviepy  # noqa: F401 - gymnasium's RecordVideo needs it
        except ImportError:
            raise ConfigError("--render-video needs moviepy: pip install 'mpirl[video]'") from None
        env_config["render_mode"] = "rgb_array"
        # Frames are drawn off-screen: no display, no sound card, no greeting from pygame.
        for key, value in (("SDL_VIDEODRIVER", "dummy"), ("SDL_AUDIODRIVER", "dummy"),
                           ("PYGAME_HIDE_SUPPORT_PROMPT", "1")):
            os.environ.setdefault(key, value)
    # The run's preprocessing (Atari's) from its config, on one gymnasium env even where the
    # run sampled through EnvPool.
    spec = env_spec_for(env_id or saved["env_id"],
                        env_module if env_id or policy is not None else saved.get("env_module"),
                        {**manifest.get("config", {}), "env_config": env_config,
                         "env_backend": "gymnasium"})
    # The run's rollout ranks acted on torch_threads threads (1 by default); torch's default, a
    # thread per core, only contends on a busy machine (10 PETS episodes under load 50 on 2
    # cores: 28 CPU-s with 2 threads, 1 CPU-s with one).
    threads = torch.get_num_threads()
    torch.set_num_threads(int(manifest.get("config", {}).get("torch_threads", 1)))
    runner = None
    try:
        probe = spec.make()
        here = (probe.observation_space, probe.action_space)
        probe.close()
        if spaces is not None and here != spaces:
            raise ConfigError(f"{spec.env_id} has spaces {here[0]} and {here[1]}; the policy in "
                              f"{path} was trained on {spaces[0]} and {spaces[1]}")
        if policy is None:
            policy, obs_filter = _checkpoint_policy(checkpoint, manifest, *here)
        groups = _solver_groups(spec, manifest)
        config = manifest.get("config", {})
        runner = _policy_runner(spec, here, policy, obs_filter,
                                groups or min(episodes, MAX_BATCH), seed,
                                ranks_per_env=config.get("ranks_per_env", 0) if groups else 0,
                                env_step_timeout_s=config.get("env_step_timeout_s"))
        playing = [0]  # the envs that play in this round: only their episodes are filmed
        if video_dir is not None:
            _record_videos(runner, video_dir, f"{manifest['algo']}-{checkpoint.name}", playing)
        returns, lengths = [], []
        for begin in range(0, episodes, runner.envs.num_envs):
            playing[0] = min(runner.envs.num_envs, episodes - begin)
            played = runner.evaluate(playing[0], deterministic=not stochastic,
                                     seed=seed + begin, standalone=True)
            returns += played["episode_returns"]
            lengths += played["episode_lengths"]
    except gym.error.DependencyNotInstalled as error:
        raise ConfigError(f"rendering {spec.env_id} needs a package that is missing: "
                          f"{error}") from None
    finally:
        torch.set_num_threads(threads)
        if runner is not None:
            runner.envs.close()
    if env_id is not None:  # the report names the environment that was run
        manifest = {**manifest, "env": {**saved, "env_id": env_id, "env_module": env_module}}
    return Evaluation(checkpoint, manifest, returns, lengths)


def _evaluate_multiagent(checkpoint: Path, manifest: dict[str, Any], env: EnvSpec,
                         episodes: int, seed: int, stochastic: bool) -> Evaluation:
    """A multi-agent checkpoint: every policy (trained, frozen and scripted) plays, in one
    sampling core built here with rollout worker 0's weights and observation statistics."""
    from mpirl.execution.multiagent import MultiAgentTrainer, runner_policy
    from mpirl.execution.multiagent_setup import resolve
    from mpirl.workers.env_runner import RunnerSettings

    module = load_algorithm(manifest["algo"])
    config = build(module.Config, manifest["config"])
    setup = resolve(manifest["algo"], config, env)
    slots = MultiAgentTrainer.slot_agents_of(setup)
    runner = _local_runner(RunnerSettings(
        env=env, num_envs=1, seed=seed, mapping=setup.mapping,
        possible_agents=tuple(setup.possible_agents), state_size=setup.state_size,
        policies=tuple(runner_policy(plan, slots[pid])
                       for pid, plan in setup.policies.items())))
    state = read_state_file(checkpoint / "rollout_0.pkl", manifest["files"]["rollout_0.pkl"])
    state["envs"] = None  # fresh envs from this seed, not the run's episodes in progress
    runner.set_state(state)
    played = runner.evaluate(episodes, deterministic=not stochastic)
    return Evaluation(checkpoint, manifest, played["episode_returns"],
                      played["episode_lengths"], played["policy_returns"])


def _solver_groups(spec: EnvSpec, manifest: dict[str, Any]) -> int:
    """The env groups a Solver checkpoint plays on: the solver program launched beside this
    evaluate (``mpiexec -n 1 mpirl evaluate CKPT : -n S ./solver``), S / ranks_per_env of
    them; 0 for any other env. A Solver without its program, or with a count that does not
    divide, is one line."""
    from mpirl.envs.simulation import Solver
    from mpirl.runtime import apps

    simulation = spec.simulation_class()
    solvers = apps.solver_ranks()
    if simulation is None or not issubclass(simulation, Solver):
        if solvers:
            raise ConfigError(f"this MPMD launch has a solver program ({solvers} solver ranks), "
                              f"but the policy plays {spec.env_id!r} in-process; launch "
                              f"without the program after ':', or evaluate a Solver checkpoint")
        return 0
    k = int(manifest.get("config", {}).get("ranks_per_env") or 1)
    if not solvers or solvers % k:
        raise ConfigError(f"{spec.env_id!r} is a solver program beside the run: evaluate it in "
                          f"an MPMD launch, mpiexec -n 1 mpirl evaluate ... : -n S ./solver "
                          f"with S a multiple of the run's ranks_per_env {k} (got {solvers})")
    return solvers // k


def _local_runner(settings: Any, models: dict[str, Any] | None = None) -> Any:
    """A sampling core in this process alone (rollout worker 0 of one, no MPI traffic but to
    a solver program's env groups, when ``settings.ranks_per_env`` says it drives some)."""
    from mpi4py import MPI

    from mpirl.runtime.core import RankContext
    from mpirl.workers.env_runner import EnvRunner

    placement = link = None
    if settings.ranks_per_env:
        from mpirl.runtime import apps
        from mpirl.runtime.layout import Layout

        placement = Layout(num_rollout_workers=1, envs_per_rollout=settings.num_envs,
                           ranks_per_env=settings.ranks_per_env).resolve(
            1, solver_ranks=apps.solver_ranks())
        link = apps.solver_link()
    context = RankContext(0, "rollout", 0, 1, placement, None, MPI.COMM_SELF, None, "local",
                          "cpu", sim_link=link)
    return EnvRunner(context, settings, models=models)


def _policy_runner(spec: EnvSpec, spaces: tuple[gym.Space, gym.Space], policy: Any,
                   obs_filter: RunningMeanStd | None, num_envs: int, seed: int,
                   ranks_per_env: int = 0, env_step_timeout_s: float | None = None) -> Any:
    """A sampling core that plays a single-agent ``policy`` (the model itself, recurrent state
    carried per episode) on ``num_envs`` envs, normalizing with ``obs_filter``: one forward
    pass a step over every env's observation, so that PETS plans the episodes in one batch,
    as its training's evaluation does."""
    from mpirl.workers.env_runner import DEFAULT_POLICY, RunnerPolicy, RunnerSettings

    runner = _local_runner(RunnerSettings(
        env=spec, num_envs=num_envs, seed=seed, ranks_per_env=ranks_per_env,
        # The run's deadline for a solver's reply: evaluate meets a stuck solver as the run did.
        **({} if env_step_timeout_s is None else {"env_step_timeout_s": env_step_timeout_s}),
        policies=(RunnerPolicy(observation_space=spaces[0], action_space=spaces[1],
                               normalize_observations=obs_filter is not None),)),
        models={DEFAULT_POLICY: policy})
    if obs_filter is not None:
        runner.set_filter(DEFAULT_POLICY, (obs_filter.mean, obs_filter.var, obs_filter.count))
    return runner


def _record_videos(runner: Any, video_dir: str, prefix: str, playing: list[int]) -> None:
    """A video file per episode: each env's recorder names its episodes after the env, and
    films those of the envs that play (``playing[0]`` of them, in this round)."""
    def wrap(i: int, env: gym.Env) -> gym.Env:
        with warnings.catch_warnings():
            if i:  # the first recorder made the folder: the others need not warn of it
                warnings.simplefilter("ignore", UserWarning)
            return gym.wrappers.RecordVideo(env, video_dir,
                                            episode_trigger=lambda _: i < playing[0],
                                            name_prefix=f"{prefix}-{i}", disable_logger=True)

    runner.envs.wrap_sub_envs(wrap)


def _checkpoint_policy(checkpoint: Path, manifest: dict[str, Any], observation_space: gym.Space,
                       action_space: gym.Space) -> tuple[Any, RunningMeanStd | None]:
    """Learner 0's model and the run's observation normalizer, unpickled from a checkpoint."""
    module = load_algorithm(manifest["algo"])
    config = build(module.Config, manifest["config"])
    files = manifest["files"]
    policy = build_torch_model(module.model_spec(observation_space, action_space, config))
    policy.set_flat_weights(read_state_file(checkpoint / "learner_0.pkl",
                                            files["learner_0.pkl"])[WEIGHTS_KEY])
    obs_filter = None
    driver = read_state_file(checkpoint / "driver.pkl", files["driver.pkl"])
    if config.observation_normalization() and driver["obs_filter"] is not None:
        mean, var, count = driver["obs_filter"]
        obs_filter = RunningMeanStd(mean.shape)
        obs_filter.mean, obs_filter.var, obs_filter.count = mean, var, count
    return policy, obs_filter


def report(evaluation: Evaluation, as_json: bool = False) -> str:
    s = evaluation.summary()
    if as_json:
        return json.dumps(s)
    spread = "" if math.isnan(s["return_std"]) else f" ± {s['return_std']:.1f}"
    per_policy = ", ".join(f"{key.partition('/')[2]} {value:.1f}" for key, value in s.items()
                           if key.startswith("return_mean/"))
    if per_policy:
        spread += f" (per policy: {per_policy})"
    return (f"{s['algo']} on {s['env']}, {Path(s['checkpoint']).name} (iteration "
            f"{s['iteration']}): {s['episodes']} episodes, return {s['return_mean']:.1f}{spread} "
            f"(min {s['return_min']:.1f}, max {s['return_max']:.1f}), length "
            f"{s['length_mean']:.1f}")
