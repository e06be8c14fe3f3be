"""``mpirl export``: a checkpoint's policy as plain arrays, safe to share.

A checkpoint is code: its files are pickles and its manifest names a module to import, so
loading one runs whatever its author put there. An exported file is data only: a ``.npz`` of
named float arrays, read back with ``np.load(..., allow_pickle=False)``. It holds

* ``weights/<name>``: learner 0's parameters, one array per named tensor of the model (the
  policy of PPO, A2C, IMPALA, A3C, BC and MARWIL; the Q network of DQN and Ape-X; SAC's actor
  and critics);
* ``flat_weights``: the model's whole weight vector, only where it holds more than its
  parameters (PETS's planner: the ensemble's normalizers and elites too);
* ``obs_filter/mean``, ``obs_filter/var``, ``obs_filter/count``: the observation normalizer's
  statistics, when the run normalized observations;
* ``spaces/<observation|action>/<low|high>``: the bounds of Box spaces;
* ``header``: UTF-8 JSON as a uint8 array: format and version, algorithm, environment, config
  (hidden_sizes, activation and the rest), spaces and the iteration it came from.

Nothing crosses ranks: export and evaluation run in one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from mpirl.errors import CheckpointError, ConfigError
from mpirl.jobs.checkpoint import CHECKPOINTS
from mpirl.jobs.run_dir import flat_name
from mpirl.models.encoders import StructuredBox
from mpirl.models.policy import RunningMeanStd
from mpirl.models.torch_model import build_torch_model

FORMAT = "mpirl-policy"
FORMAT_VERSION = 1
HEADER = "header"
FLAT_WEIGHTS = "flat_weights"


def _space_to_json(space: gym.Space, prefix: str, arrays: dict[str, np.ndarray]
                   ) -> dict[str, Any]:
    # Dict and Tuple observations: the model cuts its flat vector by their structure.
    if isinstance(space, StructuredBox):
        return {"type": "StructuredBox",
                "structure": _space_to_json(space.structure, f"{prefix}/structure", arrays)}
    if isinstance(space, gym.spaces.Dict):
        return {"type": "Dict", "spaces": {key: _space_to_json(sub, f"{prefix}/{key}", arrays)
                                           for key, sub in space.spaces.items()}}
    if isinstance(space, gym.spaces.Tuple):
        return {"type": "Tuple", "spaces": [_space_to_json(sub, f"{prefix}/{i}", arrays)
                                            for i, sub in enumerate(space.spaces)]}
    if isinstance(space, gym.spaces.MultiBinary):
        return {"type": "MultiBinary", "n": np.asarray(space.n).tolist()}
    if isinstance(space, gym.spaces.Box):
        arrays[f"{prefix}/low"], arrays[f"{prefix}/high"] = space.low, space.high
        return {"type": "Box", "shape": list(space.shape), "dtype": str(space.dtype)}
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": space.nvec.tolist(),
                "start": np.asarray(getattr(space, "start", 0)).tolist()}
    raise CheckpointError(f"cannot export a policy on a {type(space).__name__} space")


def _space_from_json(entry: dict[str, Any], prefix: str, arrays: dict[str, np.ndarray]
                     ) -> gym.Space:
    kind = entry.get("type")
    if kind == "StructuredBox":
        return StructuredBox(_space_from_json(entry["structure"], f"{prefix}/structure", arrays))
    if kind == "Dict":
        return gym.spaces.Dict({key: _space_from_json(sub, f"{prefix}/{key}", arrays)
                                for key, sub in entry["spaces"].items()})
    if kind == "Tuple":
        return gym.spaces.Tuple([_space_from_json(sub, f"{prefix}/{i}", arrays)
                                 for i, sub in enumerate(entry["spaces"])])
    if kind == "MultiBinary":
        return gym.spaces.MultiBinary(entry["n"])
    if kind == "Box":
        return gym.spaces.Box(arrays[f"{prefix}/low"], arrays[f"{prefix}/high"],
                              tuple(entry["shape"]), np.dtype(entry["dtype"]))
    if kind == "Discrete":
        return gym.spaces.Discrete(int(entry["n"]), start=int(entry.get("start", 0)))
    if kind == "MultiDiscrete":
        return gym.spaces.MultiDiscrete(entry["nvec"], start=entry.get("start"))
    raise CheckpointError(f"unknown space type {kind!r} in the exported file")


def default_output(checkpoint: Path, manifest: dict[str, Any], policy: str | None = None
                   ) -> Path:
    """Where ``mpirl export`` writes without ``-o``: ``ALGO-ENV[-POLICY]-ITERATION.npz`` in the
    checkpoint's run directory (beside a checkpoint that is not in one)."""
    folder = checkpoint.parent
    if folder.name == CHECKPOINTS:
        folder = folder.parent
    name = "-".join([manifest["algo"], manifest["env"]["env_id"], *([policy] if policy else []),
                     f"{manifest['iteration']:06d}"])
    return folder / f"{flat_name(name)}.npz"


def export_checkpoint(checkpoint: Path, manifest: dict[str, Any], output: str | Path,
                      policy_id: str | None = None) -> Path:
    """Write ``checkpoint``'s policy (verified, with its ``manifest``) to ``output`` as .npz;
    of a multi-agent checkpoint, policy ``policy_id``'s.

    This reads the checkpoint's pickles and imports its environment: export only your own."""
    from mpirl.config.parse import build
    from mpirl.execution.contract import WEIGHTS_KEY, load_algorithm
    from mpirl.runtime.state_files import read_state_file
    from mpirl.workers.env_spec import env_spec_for

    module = load_algorithm(manifest["algo"])
    config = build(module.Config, manifest["config"])
    saved = manifest["env"]
    files = manifest["files"]
    env = env_spec_for(saved["env_id"], saved.get("env_module"),
                       {**manifest["config"], "env_config": saved.get("env_config") or {},
                        "env_backend": "gymnasium"})
    driver = read_state_file(checkpoint / "driver.pkl", files["driver.pkl"])
    if env.is_multi_agent():
        from mpirl.execution.multiagent_setup import resolve

        setup = resolve(manifest["algo"], config, env)
        if policy_id is None and len(setup.policies) > 1:
            raise ConfigError(f"{checkpoint} holds policies {sorted(setup.policies)}: name the "
                              f"one to export with --policy ID")
        plan = setup.policy(policy_id)
        if plan.scripted:
            raise ConfigError(f"policy {plan.policy_id!r} is scripted ({plan.policy_class}): "
                              f"it has no weights to export")
        observation_space, action_space = plan.observation_space, plan.action_space
        model = build_torch_model(plan.model)
        rollout = read_state_file(checkpoint / "rollout_0.pkl", files["rollout_0.pkl"])
        model.set_flat_weights(rollout["weights"][plan.policy_id])  # frozen ones live there
        trained = driver.get("plan", {}).get("policies", {}).get(plan.policy_id)
        obs_filter = None if trained is None else trained["obs_filter"]
        # The file is the policy's alone: its algorithm, its config, its model.
        config, algo, critic_inputs = plan.config, plan.algo, plan.critic_inputs
    else:
        if policy_id is not None:
            raise ConfigError(f"--policy is for multi-agent checkpoints; {checkpoint} holds "
                              f"one policy")
        observation_space, action_space = env.spaces()
        algo, critic_inputs = manifest["algo"], 0
        model = build_torch_model(module.model_spec(observation_space, action_space, config))
        model.set_flat_weights(read_state_file(checkpoint / "learner_0.pkl",
                                               files["learner_0.pkl"])[WEIGHTS_KEY])
        obs_filter = driver["obs_filter"]
    arrays = {f"weights/{name}": tensor.detach().numpy().copy()
              for name, tensor in model.named_parameters()}
    flat = model.get_flat_weights()
    if flat.size != sum(array.size for array in arrays.values()):
        # The model acts on more than its parameters (PETS's planner: the ensemble's
        # normalizers and elites), so the file keeps its whole broadcast vector too.
        arrays[FLAT_WEIGHTS] = np.asarray(flat, np.float32)
    normalized = False
    if config.observation_normalization():
        if obs_filter is not None:
            mean, var, count = obs_filter
            arrays["obs_filter/mean"], arrays["obs_filter/var"] = mean, var
            arrays["obs_filter/count"] = np.asarray(count, np.float64)
            normalized = True
    header = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "algo": algo,
        "env": saved, "config": dataclasses.asdict(config), "iteration": manifest["iteration"],
        "critic_inputs": critic_inputs,
        "timesteps_total": manifest["timesteps_total"],
        "mpirl_version": manifest.get("mpirl_version"), "normalize_observations": normalized,
        "policy_id": policy_id if env.is_multi_agent() else None,
        "spaces": {"observation": _space_to_json(observation_space, "spaces/observation", arrays),
                   "action": _space_to_json(action_space, "spaces/action", arrays)},
    }
    arrays[HEADER] = np.frombuffer(json.dumps(header).encode("utf-8"), np.uint8)
    output = Path(output)
    tmp = output.with_name(f".{output.name}.tmp")
    with open(tmp, "wb") as file:
        np.savez(file, **arrays)
    os.replace(tmp, output)
    return output


def read_exported(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and arrays of an exported file; CheckpointError for anything else. Never
    unpickles: a file holding a pickled (object) array is refused."""
    path = Path(path)
    try:
        npz = np.load(path, allow_pickle=False)
    except ValueError:  # a pickle, or a .npy of objects
        raise CheckpointError(f"{path} holds pickled data; mpirl evaluates exported policies "
                              f"only as plain arrays (write one with mpirl export)") from None
    except (OSError, zipfile.BadZipFile, EOFError) as error:
        raise CheckpointError(f"{path} is not an exported policy (.npz): {error}") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise CheckpointError(f"{path} is a single array, not an exported policy (.npz from "
                              f"mpirl export)")
    arrays = {}
    with npz:
        for key in npz.files:
            try:
                arrays[key] = npz[key]
            except ValueError:
                raise CheckpointError(f"{path}: array {key!r} is pickled objects; mpirl "
                                      f"evaluates exported policies only as plain arrays") from None
            except (OSError, zipfile.BadZipFile, EOFError) as error:
                raise CheckpointError(f"{path}: array {key!r} cannot be read ({error})") from None
    raw = arrays.pop(HEADER, None)
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise CheckpointError(f"{path} has no mpirl header; it was not written by mpirl export")
    try:
        header = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: its header is not valid JSON ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{path} was not written by mpirl export")
    if header.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has export format {header.get('format_version')!r}; this "
                              f"mpirl reads format {FORMAT_VERSION}")
    return header, arrays


def load_exported(path: str | Path) -> tuple[dict[str, Any], Any, RunningMeanStd | None]:
    """The header, the model with its weights, and the observation normalizer (None if the run
    did not normalize) of an exported file, built from the file alone. The header's
    ``gym_spaces`` is the (observation, action) spaces the file was trained on."""
    from mpirl.config.parse import build
    from mpirl.execution.contract import load_algorithm

    header, arrays = read_exported(path)
    try:
        module = load_algorithm(header["algo"])
        config = build(module.Config, header["config"])
        spaces = header["spaces"]
        observation_space = _space_from_json(spaces["observation"], "spaces/observation", arrays)
        action_space = _space_from_json(spaces["action"], "spaces/action", arrays)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: its header or space arrays are incomplete ({error!r})"
                              ) from None
    spec = module.model_spec(observation_space, action_space, config)
    if header.get("critic_inputs"):  # a multi-agent policy's centralized critic
        spec = dataclasses.replace(spec, critic_inputs=header["critic_inputs"])
    model = build_torch_model(spec)
    expected = dict(model.named_parameters())
    stored = {key[len("weights/"):] for key in arrays if key.startswith("weights/")}
    if stored != set(expected):
        raise CheckpointError(f"{path}: its weights {sorted(stored)} do not match the "
                              f"{header['algo']} model's {sorted(expected)}")
    with torch.no_grad():
        for name, tensor in expected.items():
            value = arrays[f"weights/{name}"]
            if value.shape != tuple(tensor.shape):
                raise CheckpointError(f"{path}: weights/{name} has shape {value.shape}, the "
                                      f"model's is {tuple(tensor.shape)}")
            tensor.copy_(torch.from_numpy(np.asarray(value, np.float32)))
    if FLAT_WEIGHTS in arrays:
        if arrays[FLAT_WEIGHTS].size != model.num_weights():
            raise CheckpointError(f"{path}: {FLAT_WEIGHTS} has {arrays[FLAT_WEIGHTS].size} "
                                  f"values, the {header['algo']} model's vector "
                                  f"{model.num_weights()}")
        model.set_flat_weights(arrays[FLAT_WEIGHTS])
    header["gym_spaces"] = (observation_space, action_space)
    obs_filter = None
    if header.get("normalize_observations"):
        obs_filter = RunningMeanStd(arrays["obs_filter/mean"].shape)
        obs_filter.mean = arrays["obs_filter/mean"]
        obs_filter.var = arrays["obs_filter/var"]
        obs_filter.count = float(arrays["obs_filter/count"])
    return header, model, obs_filter
