"""A checked ``mpirl tune`` command line, and the trials it asks for.

Every rank parses the same command line and draws the same trial configs from the same seed,
so a mistake is one clear error on every rank before anything starts (only world rank 0
prints it), and no rank waits for another that has already given up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from mpirl.config.parse import parse_json_object
from mpirl.errors import ConfigError, MpirlError
from mpirl.jobs.arguments import TUNE_OWNED
from mpirl.jobs.run_dir import TUNE_STATE_FILE
from mpirl.tune.space import Domain, grid_configs, parse_space, sample_config

STATE_FILE = TUNE_STATE_FILE
#: Config keys that change a trial's layout of roles.
LAYOUT_KEYS = {"num_learners", "num_rollout_workers", "num_replay_shards"}


@dataclasses.dataclass
class TuneRequest:
    """What a population runs: the train command every trial shares, the space, the scheduler."""

    algo: str
    env: str
    env_module: str | None
    config: dict[str, Any]
    stop: dict[str, Any]
    seed: int
    scheduler: str
    search: str
    num_samples: int
    population: int
    ranks_per_trial: int
    space: dict[str, Any]
    perturbation_interval: float
    time_attr: str
    quantile_fraction: float
    resample_probability: float
    metric: str
    mode: str
    max_failures: int
    tune_dir: str

    @property
    def domains(self) -> dict[str, Domain]:
        return parse_space(self.space, "--mutations" if self.scheduler == "pbt" else "--space")

    def score(self, row: dict[str, Any] | None) -> float:
        """The metric of ``row``, signed so that higher is better (NaN if it has none)."""
        value = math.nan if row is None else float(row.get(self.metric, math.nan))
        return value if self.mode == "max" else -value

    def trial_configs(self) -> list[dict[str, Any]]:
        """The varying keys of each trial, in trial order."""
        rng = np.random.default_rng(self.seed)
        domains = self.domains
        if self.scheduler == "pbt":
            # Keys fixed on the command line start every member there (PBT then moves them).
            drawn = {k: d for k, d in domains.items() if k not in self.config}
            return [{**{k: self.config[k] for k in domains if k in self.config},
                     **sample_config(drawn, rng)} for _ in range(self.population)]
        if self.search == "grid":
            return [config for _ in range(self.num_samples)
                    for config in grid_configs(domains, rng)]
        return [sample_config(domains, rng) for _ in range(self.num_samples)]


def make_tune_request(args: argparse.Namespace, default_dir: str
                      ) -> tuple[TuneRequest, dict[str, Any] | None]:
    """Check the command line (or, with --resume, the saved one); (request, the saved state to
    resume from, or None for a new population)."""
    if args.resume is not None:
        saved, state = load_state(Path(args.resume))
        if args.run_dir is not None and Path(args.run_dir) != Path(args.resume):
            raise ConfigError(f"--resume {args.resume} and --run-dir {args.run_dir} differ; "
                              f"leave out --run-dir when resuming")
        if _train_words(args):
            # mpirl launch and mpirl slurm restart the first command with --resume added: the
            # same train options are fine, different ones are a mistake.
            train = _parse_train(_train_words(args))
            for name, given, recorded in (
                    ("--algo", train.algo, saved.algo), ("--env", train.env, saved.env),
                    ("--config", parse_json_object(train.config, "--config"), saved.config),
                    ("--stop", parse_json_object(train.stop, "--stop"), saved.stop)):
                if given != recorded:
                    raise ConfigError(
                        f"--resume {args.resume} continues a population as it was started, with "
                        f"{name} {json.dumps(recorded)}; {name} {json.dumps(given)} was given. "
                        f"Leave out the train options when resuming, or start a new population")
        # Wherever the job runs from now, the directory is the one given.
        saved.tune_dir = str(args.resume)
        return saved, state
    train = _parse_train(_train_words(args))
    config = parse_json_object(train.config, "--config")
    stop = parse_json_object(train.stop, "--stop")
    if train.algo is None or train.env is None:
        raise ConfigError("mpirl tune needs the train command after --, with --algo and --env: "
                          "mpirl tune --population 4 -- --algo PPO --env CartPole-v1")
    for name, value, low in (("--population", args.population, 1),
                             ("--ranks-per-trial", args.ranks_per_trial, 1),
                             ("--num-samples", args.num_samples, 1),
                             ("--max-failures", args.max_failures, 0)):
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if args.scheduler == "pbt":
        if args.space is not None:
            raise ConfigError("--space is for --scheduler fifo; PBT explores the keys of "
                              "--mutations (its members start from draws of them)")
        if args.mutations is None:
            raise ConfigError('--scheduler pbt needs --mutations, e.g. \'{"lr": [1e-4, 3e-4, '
                              '1e-3]}\': the config keys PBT may change')
        if not args.perturbation_interval > 0:
            raise ConfigError(f"--perturbation-interval must be > 0, got "
                              f"{args.perturbation_interval:g}")
        if not 0 < args.quantile_fraction <= 0.5:
            raise ConfigError(f"--quantile-fraction must be in (0, 0.5], got "
                              f"{args.quantile_fraction:g}")
        if not 0 <= args.resample_probability <= 1:
            raise ConfigError(f"--resample-probability must be in [0, 1], got "
                              f"{args.resample_probability:g}")
        if args.population < 2:
            raise ConfigError(f"--population must be >= 2 for PBT (members exploit each other), "
                              f"got {args.population}")
        space_text, flag = args.mutations, "--mutations"
    else:
        if args.mutations is not None:
            raise ConfigError("--mutations is PBT's (--scheduler pbt); give a search space with "
                              "--space")
        space_text, flag = args.space or "{}", "--space"
    space = parse_json_object(space_text, flag)
    parse_space(space, flag)
    layout_keys = sorted(set(space) & LAYOUT_KEYS)
    if layout_keys and config.get("learner_backend") in ("gloo", "nccl"):
        raise ConfigError(
            f"{flag} varies {', '.join(layout_keys)} with learner_backend "
            f"{config['learner_backend']!r}: a slot's runs reuse the process group of its first "
            f"run, which must keep its shape. Search the layout with learner_backend 'mpi', or "
            f"keep the layout fixed")
    request = TuneRequest(
        algo=train.algo, env=train.env, env_module=train.env_module, config=config, stop=stop,
        seed=train.seed if train.seed is not None else int(config.get("seed", 0)),
        scheduler=args.scheduler, search=args.search, num_samples=args.num_samples,
        population=args.population, ranks_per_trial=args.ranks_per_trial, space=space,
        perturbation_interval=args.perturbation_interval, time_attr=args.time_attr,
        quantile_fraction=args.quantile_fraction,
        resample_probability=args.resample_probability, metric=args.metric, mode=args.mode,
        max_failures=args.max_failures, tune_dir=args.run_dir or default_dir)
    return request, None


def _train_words(args: argparse.Namespace) -> list[str]:
    words = list(args.train_args or [])
    return words[1:] if words[:1] == ["--"] else words


def _parse_train(words: list[str]) -> argparse.Namespace:
    from mpirl.jobs.arguments import command_parser

    for word in words:
        flag = word.split("=", 1)[0]
        if flag in TUNE_OWNED:
            raise ConfigError(f"{flag} is set by mpirl tune for each trial (trial_000, ... in the "
                              f"tune directory); leave it out of the train options"
                              + (": give --run-dir before --" if flag == "--run-dir" else ""))
    try:
        return command_parser().parse_args(["train", *words])
    except SystemExit:
        raise ConfigError(f"the train options after -- are not valid mpirl train options: "
                          f"{' '.join(words)}") from None


def check_world(request: TuneRequest, world_size: int, num_trials: int) -> int:
    """The number of trial slots the job's world makes; ConfigError if it does not fit."""
    per = request.ranks_per_trial
    slots = (world_size - 1) // per
    fitting = 1 + per * (request.population if request.scheduler == "pbt" else
                         max(1, min(num_trials, slots or 1)))
    if slots < 1 or (world_size - 1) % per:
        raise ConfigError(
            f"mpirl tune runs a controller on rank 0 and each trial on --ranks-per-trial {per} "
            f"ranks, so the job needs 1 + a multiple of {per} ranks; it has {world_size}. "
            f"Launch it with e.g. mpiexec -n {fitting}")
    if request.scheduler == "pbt" and slots < request.population:
        raise ConfigError(
            f"PBT runs every member at once: --population {request.population} with "
            f"--ranks-per-trial {per} needs {fitting} ranks (1 + {request.population} x {per}); "
            f"the job has {world_size}")
    return slots


def load_state(tune_dir: Path) -> tuple[TuneRequest, dict[str, Any]]:
    """The request and the whole saved state of the population in ``tune_dir``."""
    path = tune_dir / STATE_FILE
    if not tune_dir.is_dir():
        raise ConfigError(f"--resume {tune_dir}: no such directory")
    if not path.is_file():
        raise ConfigError(f"--resume {tune_dir}: not a tune directory ({STATE_FILE} is missing)")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        return TuneRequest(**state["request"]), state
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise ConfigError(f"--resume {tune_dir}: {path} is not a valid tune state ({error})"
                          ) from None


def check_trials(request: TuneRequest, configs: list[dict[str, Any]]) -> None:
    """Every trial's train command, checked as ``mpirl train`` would check it, and its layout
    against --ranks-per-trial."""
    for index, varying in enumerate(configs):
        problem = config_problem(request, varying, request.seed + index)
        if problem is not None:
            where = f"trial {index} ({json.dumps(varying)})" if varying else "the trials"
            raise ConfigError(f"{where}: {problem}")


def config_problem(request: TuneRequest, varying: dict[str, Any], seed: int) -> str | None:
    """What ``mpirl train`` would refuse in a trial with ``varying``, or None."""
    from mpirl.commands.train import make_request

    probe = Path(request.tune_dir) / "trial_check_never_written"
    try:
        train = make_request(request.algo, request.env, request.env_module,
                             trial_config(request, varying), dict(request.stop), seed,
                             str(probe), None, "off")
        train.layout.resolve(request.ranks_per_trial)
    except MpirlError as error:
        return str(error) + (f" (each trial runs on --ranks-per-trial "
                             f"{request.ranks_per_trial} ranks)" if "rank" in str(error) else "")
    return None


def trial_config(request: TuneRequest, varying: dict[str, Any]) -> dict[str, Any]:
    """A trial's --config: the shared keys, its own values, and a checkpoint at every segment's
    end (PBT copies it, and a failed trial is retried from it)."""
    return {**request.config, **varying, "checkpoint_at_end": True, "print_layout": False}
