"""``mpirl slurm``: a Slurm job script for an mpirl command, printed or submitted.

``mpirl slurm --nodes N --time T [options] [--submit] -- train --algo PPO --env ...`` fills
``templates/job.sbatch`` (installed with the package) and prints the script, or writes it to
``RUN_DIR/job.sbatch`` and submits it with ``sbatch --parsable``, printing the job id. The
scripts in the repository's ``slurm/`` directory are renderings of it (``EXAMPLES``).

Three shapes of job:

* homogeneous (default): ``--nodes`` x ``--ntasks-per-node`` ranks in one step. Rank 0 drives,
  the layout in ``--config`` decides the rest (learners take the last ranks).
* ``--het steps``: a heterogeneous job. Component 0 has ``--nodes`` CPU nodes for the driver and
  the rollout (and replay) ranks; component 1 has ``--learner-nodes`` GPU nodes with
  ``--learners-per-node`` learner ranks each. ``srun --het-group=0,1`` starts both as one MPI
  world, component 0's ranks first, so ``num_learners`` (set here) puts the learners on the GPUs.
* ``--het nodes``: the same roles for sites without heterogeneous steps: one allocation of
  ``--nodes`` + ``--learner-nodes`` nodes; srun's arbitrary distribution (a host file) puts the
  driver and rollout ranks on the first nodes and the learners on the last ones.

``--solver 'CMD ARGS'`` adds an MPMD solver program (a C or Fortran simulation built on
``mpirl_solver.h``) to the one MPI world, after mpirl's ranks (``runtime/apps.py`` needs them
first): in a homogeneous job the last ``--solver-tasks`` of its tasks run it (``mpiexec -n A
mpirl ... : -n S CMD``, or an ``srun --multi-prog`` file the script writes); with ``--het
steps`` it is a component of its own (``srun --het-group=0,1 mpirl ... : --het-group=2 CMD``).

Site specifics come from flags or a small TOML/JSON site file (``SITE_KEYS``); flags win.
Everything a user can get wrong is a ``ConfigError`` (exit 2), reported in one line.

The script is code, so every value in it is quoted: ``shell_word`` for what bash reads (one word,
on one line, ``$'...'`` where a character is not printable), ``sbatch_word`` for what sbatch
reads in the ``#SBATCH`` lines (its own quoting; a control character is refused there, since a
newline would end the line and start shell code). Site ``setup`` lines are shell code on purpose;
each runs through ``eval`` of its quoted text, so one cannot change how the rest is read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

# Only errors and launch (which import nothing of MPI): mpirl slurm runs on a login node.
from mpirl.errors import ConfigError, MpirlError
from mpirl.jobs.arguments import command_parser
from mpirl.jobs.launch import find_train, first_command, option_value, restart_command
from mpirl.jobs.run_dir import PARAMS_FILE, TUNE_STATE_FILE

LAUNCHERS = ("srun-pmix", "srun-pmi2", "mpiexec")
HET_MODES = ("steps", "nodes")
#: Subcommands that join an MPMD solver program (``cli.MPMD_COMMANDS`` that make a batch job).
SOLVER_SUBCOMMANDS = ("train", "doctor")
DEFAULT_LAUNCHER = "srun-pmix"
DEFAULT_MAX_REQUEUES = 5
DEFAULT_SIGNAL_LEAD_S = 120
DEFAULT_OUTPUT = "%x-%j.out"
#: Subcommands that make sense as a batch job.
JOB_SUBCOMMANDS = ("train", "tune", "doctor")
TEMPLATE = Path(__file__).parent / "templates" / "job.sbatch"
#: The file --submit writes into the run directory before handing it to sbatch.
SCRIPT_NAME = "job.sbatch"


class SubmitError(MpirlError):
    """sbatch refused the job; its message says why."""


@dataclass
class Site:
    """What differs between clusters. Every field is a key of the site file (TOML or JSON)."""

    launcher: str | None = None
    """srun-pmix, srun-pmi2 or mpiexec (--launcher wins)."""
    modules: list[str] = field(default_factory=list)
    """Environment modules to load, e.g. ["openmpi/5.0.3", "cuda/12.4"]."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables to export in the job, e.g. {"OMP_NUM_THREADS": "1"}."""
    setup: list[str] = field(default_factory=list)
    """Shell commands run before the step, each complete in itself (checked with bash -n), e.g.
    ["source ~/venvs/rl/bin/activate"]."""
    sbatch: list[str] = field(default_factory=list)
    """Extra sbatch options, one option word per #SBATCH line, e.g. ["--constraint=a100",
    "--qos=high"]."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun options for the job step, e.g. ["--cpu-bind=cores"]."""
    mpiexec_args: list[str] = field(default_factory=list)
    """Extra mpiexec options (launcher mpiexec), e.g. ["--oversubscribe"]."""
    mpirl: str | None = None
    """The mpirl command the job runs (--mpirl wins; default: the one rendering the script)."""
    mpiexec: str | None = None
    """The mpiexec the job runs (launcher mpiexec; default: the one next to this Python)."""
    partition: str | None = None
    account: str | None = None


SITE_KEYS = tuple(f.name for f in fields(Site))
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Words sbatch and bash both read as they stand (shlex's safe characters).
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_C_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _utf8(value: str, what: str) -> bytes:
    """The bytes of ``value`` (an argument that was not UTF-8 comes back as its own bytes)."""
    if "\0" in value:
        raise ConfigError(f"{what} {value!r} holds a NUL character, which no shell word or "
                          f"program argument can carry")
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise ConfigError(f"{what} {value!r} is not valid text (a lone surrogate)") from None


def shell_word(value: str, what: str) -> str:
    """``value`` as one bash word on one line that bash reads back byte for byte.

    Printable text gets shlex's single quotes; text with a newline, tab or other character that
    is not printable gets ``$'...'`` with ``\\n``, ``\\t``, ``\\r`` or the character's bytes as
    ``\\xHH`` (locale-free), so that it cannot end a comment line or put a carriage return into
    the script. ``what`` names the value in the ConfigError for what cannot be carried (a NUL, a
    lone surrogate).
    """
    _utf8(value, what)
    if value.isprintable():
        return shlex.quote(value)
    parts = []
    for char in value:
        if char in "\\'":
            parts.append("\\" + char)
        elif char.isprintable():
            parts.append(char)
        elif char in _C_ESCAPES:
            parts.append(_C_ESCAPES[char])
        else:
            parts += (f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogateescape"))
    return "$'" + "".join(parts) + "'"


def shell_join(words: list[str], what: str) -> str:
    return " ".join(shell_word(word, what) for word in words)


def sbatch_word(value: str, what: str, hint: str = "") -> str:
    """``value`` quoted for an ``#SBATCH`` line as sbatch splits it (Slurm's get_argument in
    src/sbatch/opt.c: double quotes group, a backslash escapes the next character, an unquoted
    ``#`` starts a comment). A line ends at a newline whatever the quotes, and bash would run
    what follows, so a value with a character that is not printable is refused."""
    _utf8(value, what)
    if not value.isprintable():
        raise ConfigError(f"{what} {value!r} holds a control character (newline, tab, ...); "
                          f"an #SBATCH line cannot carry it{hint}")
    if _PLAIN_WORD.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def load_site(path: str | Path) -> Site:
    """Read a site file: JSON if it ends in .json, else TOML. ConfigError on anything wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"--site {path}: {error.strerror or error}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ConfigError(f"--site {path}: not valid {kind}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--site {path}: must hold a table of keys, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SITE_KEYS))
    if unknown:
        raise ConfigError(f"--site {path}: unknown key(s) {', '.join(unknown)}; the keys are "
                          f"{', '.join(SITE_KEYS)}")
    site = Site()
    for key, value in data.items():
        default = getattr(site, key)
        if isinstance(default, list):
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ConfigError(f"--site {path}: {key} must be a list of strings")
        elif isinstance(default, dict):
            if not (isinstance(value, dict) and all(isinstance(v, str | int | float)
                                                    and not isinstance(v, bool)
                                                    for v in value.values())):
                raise ConfigError(f"--site {path}: {key} must map names to strings or numbers")
            value = {str(k): str(v) for k, v in value.items()}
        elif not isinstance(value, str):
            raise ConfigError(f"--site {path}: {key} must be a string")
        setattr(site, key, value)
    if site.launcher is not None and site.launcher not in LAUNCHERS:
        raise ConfigError(f"--site {path}: launcher must be one of {', '.join(LAUNCHERS)}, "
                          f"got {site.launcher!r}")
    for name in site.env:
        if not _SHELL_NAME.fullmatch(name):
            raise ConfigError(f"--site {path}: env name {name!r} is not a shell variable name")
    return site


_DAYS_FORM = re.compile(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?")
_PLAIN_FORM = re.compile(r"(\d+)(?::(\d+))?(?::(\d+))?")


def time_limit_seconds(text: str) -> int:
    """Seconds in a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S.

    Slurm counts limits in whole minutes and rounds seconds up, so ``1:30`` is 120 s.
    """
    if match := _DAYS_FORM.fullmatch(text):
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        parts_below_hour = (minutes, seconds)
    elif match := _PLAIN_FORM.fullmatch(text):
        numbers = [int(g) for g in match.groups() if g is not None]
        days = 0
        if len(numbers) == 3:
            hours, minutes, seconds = numbers
            parts_below_hour = (minutes, seconds)
        else:
            hours = 0
            minutes, seconds = (numbers + [0])[:2]
            parts_below_hour = (seconds,)
    else:
        raise ConfigError(f"--time {text!r} is not a Slurm time limit: use HH:MM:SS, "
                          f"D-HH:MM:SS or MM (minutes), e.g. --time 04:00:00")
    if any(part >= 60 for part in parts_below_hour) or (match.re is _DAYS_FORM and hours >= 24):
        raise ConfigError(f"--time {text!r}: minutes and seconds must be below 60, hours below "
                          f"24 after a day count")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ConfigError(f"--time {text!r} must be longer than zero")
    return math.ceil(total / 60) * 60


@dataclass
class JobSpec:
    """A checked ``mpirl slurm`` command line."""

    command: list[str]
    time: str
    nodes: int = 1
    ntasks_per_node: int = 4
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    output: str = DEFAULT_OUTPUT
    launcher: str = DEFAULT_LAUNCHER
    max_requeues: int = DEFAULT_MAX_REQUEUES
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S
    run_dir: str | None = None
    het: str | None = None
    learner_nodes: int = 1
    learners_per_node: int | None = None
    mpirl: str | None = None
    solver: str | None = None
    """The MPMD solver's command line, one string as a shell would split it ('CMD ARGS')."""
    solver_tasks: int | None = None
    solver_nodes: int | None = None
    """Nodes of the solver's component (``--het steps`` only; default 1)."""
    solver_tasks_per_node: int | None = None
    rendered_by: tuple[str, ...] = ("mpirl", "slurm")
    """The command line that rendered the script, for its header."""

    @property
    def learner_tasks_per_node(self) -> int:
        return self.learners_per_node or max(self.gpus_per_node, 1)

    @property
    def num_learners(self) -> int:
        """Learner ranks of a heterogeneous job (0 for a homogeneous one)."""
        return self.learner_nodes * self.learner_tasks_per_node if self.het else 0

    @property
    def num_solver_tasks(self) -> int:
        """The solver program's processes (0 without ``--solver``)."""
        if self.solver is None:
            return 0
        if self.het == "steps" and self.solver_tasks is None:
            return (self.solver_nodes or 1) * (self.solver_tasks_per_node or 0)
        return self.solver_tasks or 0

    @property
    def num_mpirl_tasks(self) -> int:
        """mpirl's ranks: world ranks 0 to this minus 1. A homogeneous job's solver takes its
        last tasks; a heterogeneous job's has a component of its own."""
        cpu_tasks = self.nodes * self.ntasks_per_node
        if self.het:
            return cpu_tasks + self.num_learners
        return cpu_tasks - self.num_solver_tasks

    @property
    def num_tasks(self) -> int:
        """Every task of the job step, mpirl's and the solver's."""
        return self.num_mpirl_tasks + self.num_solver_tasks


def _check_spec(spec: JobSpec) -> None:
    for name in ("nodes", "ntasks_per_node", "cpus_per_task", "learner_nodes"):
        if getattr(spec, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be 1 or more, "
                              f"got {getattr(spec, name)}")
    for name in ("gpus_per_node", "max_requeues"):
        if getattr(spec, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, "
                              f"got {getattr(spec, name)}")
    if spec.learners_per_node is not None and spec.learners_per_node < 1:
        raise ConfigError(f"--learners-per-node must be 1 or more, got {spec.learners_per_node}")
    if spec.het not in (None, *HET_MODES):
        raise ConfigError(f"--het must be one of {', '.join(HET_MODES)}, got {spec.het!r}")
    if spec.launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher must be one of {', '.join(LAUNCHERS)}, "
                          f"got {spec.launcher!r}")
    if spec.het and spec.launcher == "mpiexec":
        raise ConfigError(f"--het {spec.het} needs srun (--launcher srun-pmix or srun-pmi2): "
                          f"mpiexec cannot start a heterogeneous step or place ranks by node")
    limit = time_limit_seconds(spec.time)
    if not 0 < spec.signal_lead_s < limit:
        raise ConfigError(f"--signal-lead {spec.signal_lead_s} s must be above 0 and below the "
                          f"time limit ({limit} s for --time {spec.time}; Slurm rounds up to "
                          f"whole minutes)")
    for name, value in (("--output", spec.output), ("--job-name", spec.job_name)):
        if value is not None and not value:
            raise ConfigError(f"{name} must not be empty")
    for name, value in (("--partition", spec.partition), ("--account", spec.account)):
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ConfigError(f"{name} {value!r} must be one word without spaces")


def _solver_words(spec: JobSpec, check_program: bool = True) -> list[str]:
    """The solver's command line as words, checked with the job's shape ([] without one).
    ``check_program``: that the program is an executable file or on PATH, here."""
    if spec.solver is None:
        for name in ("solver_tasks", "solver_nodes", "solver_tasks_per_node"):
            if getattr(spec, name) is not None:
                raise ConfigError(f"--{name.replace('_', '-')} needs --solver 'CMD ARGS', the "
                                  f"solver program it sizes")
        return []
    try:
        words = shlex.split(spec.solver)
    except ValueError as error:
        raise ConfigError(f"--solver {spec.solver!r} cannot be split into words as a shell "
                          f"would: {error}") from None
    if not words:
        raise ConfigError("--solver is empty; give the program and its arguments, e.g. "
                          "--solver './rd_solver --flag'")
    if check_program:
        _check_program(words[0])
    if spec.command[:1] and spec.command[0] not in SOLVER_SUBCOMMANDS:
        raise ConfigError(f"--solver works with -- {' or -- '.join(SOLVER_SUBCOMMANDS)}, "
                          f"which join an MPMD solver; not with {spec.command[0]}")
    if spec.het == "nodes":
        raise ConfigError("--solver with --het nodes is not supported: use --het steps (the "
                          "solver as a component of its own) or no --het (the solver's tasks "
                          "share the job's nodes)")
    for name in ("solver_tasks", "solver_nodes", "solver_tasks_per_node"):
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be 1 or more, got {value}")
    if spec.het == "steps":
        _check_solver_component(spec)
    else:
        for name in ("solver_nodes", "solver_tasks_per_node"):
            if getattr(spec, name) is not None:
                raise ConfigError(f"--{name.replace('_', '-')} sizes the solver's own "
                                  f"component of --het steps; without it the solver's "
                                  f"--solver-tasks share the job's nodes")
        if spec.solver_tasks is None:
            raise ConfigError("--solver needs --solver-tasks N: how many of the job's tasks "
                              "run the solver")
        total = spec.nodes * spec.ntasks_per_node
        if spec.num_mpirl_tasks < 1:
            raise ConfigError(f"--solver-tasks {spec.solver_tasks} leaves no task for mpirl: "
                              f"the job has --nodes {spec.nodes} x --ntasks-per-node "
                              f"{spec.ntasks_per_node} = {total} tasks, mpirl's and the "
                              f"solver's together; for 3 mpirl ranks, say, give "
                              f"{spec.solver_tasks + 3} in all")
    _check_group_size(spec)
    return words


def _check_solver_component(spec: JobSpec) -> None:
    nodes = spec.solver_nodes or 1
    if spec.solver_tasks is None and spec.solver_tasks_per_node is None:
        raise ConfigError("--solver with --het steps needs --solver-tasks-per-node (or "
                          "--solver-tasks): the solver's component has --solver-nodes "
                          f"{nodes} node(s)")
    if spec.solver_tasks is not None and spec.solver_tasks_per_node is not None and (
            spec.solver_tasks != nodes * spec.solver_tasks_per_node):
        raise ConfigError(f"--solver-tasks {spec.solver_tasks} disagrees with --solver-nodes "
                          f"{nodes} x --solver-tasks-per-node {spec.solver_tasks_per_node}; "
                          f"give one of them")
    if spec.num_solver_tasks < nodes:
        raise ConfigError(f"--solver-tasks {spec.num_solver_tasks} cannot fill --solver-nodes "
                          f"{nodes}: every node needs one task at least")


def _check_program(program: str) -> None:
    """ConfigError unless ``program`` is an executable file (a path) or found on PATH: on the
    login node, not after the job has waited in the queue."""
    if "/" in program:
        path = Path(program)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"--solver {program} is not an executable file")
    elif shutil.which(program) is None:
        raise ConfigError(f"--solver {program} is not on PATH; give its path, e.g. "
                          f"--solver ./{program}")


def _check_group_size(spec: JobSpec) -> None:
    """The solver's processes must make whole env groups of ``ranks_per_env`` from --config
    (the run checks the rest of the layout at start-up)."""
    args = spec.command[1:]
    text = option_value(args, "--config")
    try:
        config = json.loads(text) if text is not None else {}
    except json.JSONDecodeError:
        return  # mpirl's own check names it, with the run's words
    k = config.get("ranks_per_env") if isinstance(config, dict) else None
    flag = option_value(args, "--ranks-per-env")
    if flag is not None and flag.isdigit():
        k = int(flag)
    solver = spec.num_solver_tasks
    if isinstance(k, int) and not isinstance(k, bool) and k > 0 and solver % k:
        raise ConfigError(f"{solver} solver tasks do not make whole env groups of "
                          f"ranks_per_env {k}; give a multiple of {k}")


def _job_commands(spec: JobSpec) -> tuple[list[str], list[str], str | None]:
    """The first attempt's and the resumed attempts' mpirl arguments, and the run directory."""
    if not spec.command:
        raise ConfigError("no mpirl command given: put it after --, e.g. mpirl slurm --nodes 1 "
                          "--time 01:00:00 -- train --algo PPO --env CartPole-v1")
    if spec.command[0] not in JOB_SUBCOMMANDS:
        raise ConfigError(f"the command after -- must be an mpirl subcommand, one of "
                          f"{', '.join(JOB_SUBCOMMANDS)}, without 'mpirl' itself; "
                          f"got {shell_join(spec.command[:3], 'the command after --')}")
    _parse_job_command(spec.command)
    command = ["mpirl", *spec.command]
    if spec.het:
        command = _with_learners(command, spec)
    call = find_train(command)
    if call is None:  # doctor: nothing to resume
        return command[1:], command[1:], None
    given = call.run_dir or call.resume_dir
    if spec.run_dir is not None:
        if given is not None and Path(given) != Path(spec.run_dir):
            raise ConfigError(f"--run-dir {spec.run_dir} and the train command's run directory "
                              f"{given} differ; give it once")
        if given is None:
            at = call.train_index + 1
            command = [*command[:at], "--run-dir", spec.run_dir, *command[at:]]
    elif given is None and not (call.algo and call.env):
        raise ConfigError("train needs --algo and --env (or --resume RUN_DIR)")
    first, run_dir = first_command(command)
    return first[1:], restart_command(first)[1:], run_dir


def _parse_job_command(command: list[str]) -> None:
    """Parse the job's mpirl arguments with mpirl's own parser, so that a mistake is reported
    here, on the login node, and not after the job has waited in the queue; and so that the
    options read here by their exact spelling (--run-dir, --resume, --config) are the ones the
    job's mpirl will use (its parser takes no abbreviations)."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            command_parser().parse_args(command)
    except SystemExit as exit:
        # argparse printed its usage and, last, "mpirl: error: PROBLEM" (or the help: exit 0).
        problem = (said.getvalue().strip().splitlines()[-1].removeprefix("mpirl: error: ")
                   if exit.code else "it only prints the help")
        raise ConfigError(f"the command after -- is not a valid mpirl {command[0]} command: "
                          f"{problem}") from None


def _with_learners(command: list[str], spec: JobSpec) -> list[str]:
    """``command`` (``["mpirl", SUBCOMMAND, ...]``) with ``num_learners`` in its --config set to
    the learner ranks' count."""
    args = command[2:]
    text = option_value(args, "--config")
    try:
        config = json.loads(text) if text is not None else {}
    except json.JSONDecodeError as error:
        raise ConfigError(f"--config is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError("--config must be a JSON object")
    learners = spec.num_learners
    if config.get("num_learners", learners) != learners:
        raise ConfigError(f"--config num_learners {config['num_learners']} disagrees with "
                          f"--het {spec.het}: {spec.learner_nodes} learner node(s) x "
                          f"{spec.learner_tasks_per_node} = {learners} learner ranks")
    replay = config.get("num_replay_shards", 0)
    rollouts = spec.nodes * spec.ntasks_per_node - 1 - replay
    if rollouts < 1:
        raise ConfigError(f"{spec.nodes} node(s) x {spec.ntasks_per_node} ranks cannot hold "
                          f"the driver, {replay} replay shard(s) and a rollout rank")
    if config.get("num_rollout_workers", -1) not in (-1, rollouts):
        raise ConfigError(f"--config num_rollout_workers {config['num_rollout_workers']} does "
                          f"not fit: {spec.nodes} node(s) x {spec.ntasks_per_node} ranks hold "
                          f"the driver, {replay} replay shard(s) and {rollouts} rollout ranks; "
                          f"leave it out or give {rollouts}")
    config["num_learners"] = learners
    # Drop every --config (argparse keeps the last one), then give the merged one once.
    kept, skip = [], False
    for word in args:
        if skip:
            skip = False
        elif word == "--config":
            skip = True
        elif not word.startswith("--config="):
            kept.append(word)
    return [*command[:2], *kept, "--config", json.dumps(config, separators=(", ", ": "))]


def _default_tool(name: str) -> str:
    """``name`` next to this Python (the venv's) if it is there, else ``name`` from PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _sbatch_lines(spec: JobSpec, site: Site, run_dir: str | None) -> tuple[list[str], list[str]]:
    """The #SBATCH lines of the job (of component 0), and those of a heterogeneous job's
    component 1 (after the template's job-wide lines: everything after ``hetjob`` belongs to
    component 1)."""
    if spec.job_name:
        name = sbatch_word(spec.job_name, "--job-name")
    else:
        default = f"mpirl-{Path(run_dir).name}" if run_dir else f"mpirl-{spec.command[0]}"
        name = sbatch_word(default, "the job name made from the run directory's name",
                           "; choose another with --job-name")
    shared = [f"--time={spec.time}"]
    for key, flag, value in (("partition", spec.partition, site.partition),
                             ("account", spec.account, site.account)):
        if flag or value:
            what = f"--{key}" if flag else f"site file {key}"
            shared.append(f"--{key}={sbatch_word(flag or value, what)}")
    extra = []
    for option in site.sbatch:
        # One option word per entry: "hetjob" or a bare word would start another component.
        if not option.startswith("-"):
            raise ConfigError(f"site file sbatch entry {option!r} is not an sbatch option; each "
                              f"entry is one option such as --qos=high")
        extra.append(sbatch_word(option, "site file sbatch entry"))
    gpus = [f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []
    cpu_part = [f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.ntasks_per_node}",
                f"--cpus-per-task={spec.cpus_per_task}"]
    options, learner_part = [f"--job-name={name}"], []
    if spec.het == "steps":
        # Component 0: driver and rollout ranks on CPU nodes; component 1: one learner per GPU.
        options += [*cpu_part, *shared, *extra]
        learner_part = ["hetjob", f"--nodes={spec.learner_nodes}",
                        f"--ntasks-per-node={spec.learner_tasks_per_node}",
                        f"--cpus-per-task={spec.cpus_per_task}", *gpus, *shared]
        if spec.solver is not None:
            # Component 2: the solver's processes, after every mpirl rank in the MPI world.
            tasks = (f"--ntasks-per-node={spec.solver_tasks_per_node}"
                     if spec.solver_tasks_per_node else f"--ntasks={spec.num_solver_tasks}")
            learner_part += ["hetjob", f"--nodes={spec.solver_nodes or 1}", tasks,
                             "--cpus-per-task=1", *shared]
    elif spec.het == "nodes":
        # One allocation; the host file below decides which node runs which ranks.
        per_node = max(spec.ntasks_per_node, spec.learner_tasks_per_node)
        options += [f"--nodes={spec.nodes + spec.learner_nodes}",
                    f"--ntasks-per-node={per_node}", f"--cpus-per-task={spec.cpus_per_task}",
                    *gpus, *shared, *extra]
    else:
        options += [*cpu_part, *gpus, *shared, *extra]
    return ([f"#SBATCH {option}" for option in options],
            [f"#SBATCH {option}" for option in learner_part])


def _launcher_lines(spec: JobSpec, site: Site) -> list[str]:
    if spec.launcher == "mpiexec":
        mpiexec = shell_word(site.mpiexec or _default_tool("mpiexec"), "site file mpiexec")
        extra = "".join(f" {shell_word(a, 'site file mpiexec_args entry')}"
                        for a in site.mpiexec_args)
        # Inside the allocation mpiexec reads the nodes and slots from Slurm; --bind-to none
        # keeps each rank's torch threads from being pinned to one core.
        ranks = str(spec.num_mpirl_tasks) if spec.solver is not None else '"$SLURM_NTASKS"'
        return [f"launcher=({mpiexec} -n {ranks} --bind-to none{extra})"]
    mpi = spec.launcher.removeprefix("srun-")
    extra = "".join(f" {shell_word(a, 'site file srun_args entry')}" for a in site.srun_args)
    if spec.het == "steps":
        # Both components in one step: one MPI world, component 0's ranks first.
        return [f"launcher=(srun --mpi={mpi} --het-group=0,1{extra})"]
    if spec.het == "nodes":
        return [
            f"# Roles by node: the first {spec.nodes} node(s) run the driver and rollout ranks "
            f"({spec.ntasks_per_node} each),",
            f"# the last {spec.learner_nodes} the {spec.num_learners} learner ranks "
            f"({spec.learner_tasks_per_node} each): srun places rank i on line i of the file.",
            'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            'SLURM_HOSTFILE=$(mktemp "${TMPDIR:-/tmp}/mpirl-hosts.XXXXXX")',
            "export SLURM_HOSTFILE",
            "trap 'rm -f \"$SLURM_HOSTFILE\"' EXIT",
            f'for node in "${{nodes[@]:0:{spec.nodes}}}"; do',
            f'    for _ in $(seq {spec.ntasks_per_node}); do echo "$node"; done',
            'done >"$SLURM_HOSTFILE"',
            f'for node in "${{nodes[@]:{spec.nodes}}}"; do',
            f'    for _ in $(seq {spec.learner_tasks_per_node}); do echo "$node"; done',
            'done >>"$SLURM_HOSTFILE"',
            "unset SLURM_NTASKS_PER_NODE  # the allocation's; the host file decides per node",
            f"launcher=(srun --mpi={mpi} --distribution=arbitrary --ntasks={spec.num_tasks}"
            f"{extra})",
        ]
    return [f"launcher=(srun --mpi={mpi}{extra})"]


#: Writes one line of srun's --multi-prog file: a task range, then the words, each in single
#: quotes (a quote inside as '\''). srun reads a quoted word back as it is: no %t or %o
#: substitution, no backslash escapes, spaces kept.
_MULTI_PROG_LINE = """\
multi_prog_line() {
    local line=$1 word q="'" escaped="'\\\\''"
    shift
    for word in "$@"; do line+=" '${word//$q/$escaped}'"; done
    printf '%s\\n' "$line"
}"""


def _solver_lines(spec: JobSpec, solver: list[str], words: list[list[str]]) -> list[str]:
    """Bash that adds the solver program to the job step, after ``command`` is chosen.
    ``words``: the mpirl command lines (program first) that may reach srun's --multi-prog
    file, to check."""
    if not solver:
        return []
    mpirl, count = spec.num_mpirl_tasks, spec.num_solver_tasks
    program = shell_join(solver, "a word of --solver")
    intro = (f"# MPMD: {count} solver process(es) after mpirl's {mpirl} rank(s), one MPI world "
             f"(world ranks {_task_range(mpirl, mpirl + count)}: mpirl's must come first).")
    if spec.launcher == "mpiexec":
        return [intro, f"command+=(: -n {count} {program})"]
    if spec.het == "steps":
        return [intro, f"command+=(: --het-group=2 {program})"]
    tasks = _task_range(0, mpirl)
    solver_tasks = _task_range(mpirl, mpirl + count)
    for range_, group in [*((tasks, command) for command in words), (solver_tasks, solver)]:
        _check_multi_prog_line(range_, group)
    return [
        intro,
        f"# srun --multi-prog runs tasks {tasks} as mpirl and {solver_tasks} as the solver; "
        f"the script writes its file",
        "# for the command chosen above.",
        _MULTI_PROG_LINE,
        'MULTI_PROG=$(mktemp "${TMPDIR:-/tmp}/mpirl-multi-prog.XXXXXX")',
        "trap 'rm -f \"$MULTI_PROG\"' EXIT",
        "{",
        f'    multi_prog_line {tasks} "${{command[@]}}"',
        f"    multi_prog_line {solver_tasks} {program}",
        '} >"$MULTI_PROG"',
        'while IFS= read -r line; do say "multi-prog: $line"; done <"$MULTI_PROG"',
        'command=(--multi-prog "$MULTI_PROG")',
    ]


#: What srun --multi-prog takes (Slurm 22.05, measured): a line below 16,383 bytes with its
#: newline (a longer one is an error), and 126 arguments after the program: it drops the rest
#: without a word.
MULTI_PROG_MAX_LINE = 16381
MULTI_PROG_MAX_ARGS = 126


def multi_prog_line(tasks: str, words: list[str]) -> str:
    """The line the job script's ``multi_prog_line`` writes (without its newline)."""
    return tasks + "".join(" '" + word.replace("'", "'\\''") + "'" for word in words)


def _check_multi_prog_line(tasks: str, words: list[str]) -> None:
    """ConfigError for what srun's --multi-prog file cannot carry, before the job queues."""
    what = f"srun --multi-prog (tasks {tasks}: {shell_join(words[:2], 'a program word')} ...)"
    for word in words:
        if "\n" in word or "\r" in word:
            raise ConfigError(f"{what} reads its file line by line and cannot carry the "
                              f"argument {word!r} (a line break); put it on one line, or use "
                              f"--launcher mpiexec")
    if len(words) - 1 > MULTI_PROG_MAX_ARGS:
        raise ConfigError(f"{what} passes at most {MULTI_PROG_MAX_ARGS} arguments to a "
                          f"program and drops the rest; this one has {len(words) - 1}. Merge "
                          f"--config values into one, or use --launcher mpiexec")
    size = len(_utf8(multi_prog_line(tasks, words), "an argument"))
    if size > MULTI_PROG_MAX_LINE:
        raise ConfigError(f"{what} takes lines of at most {MULTI_PROG_MAX_LINE} bytes; this one "
                          f"has {size}. Shorten the command, or use --launcher mpiexec")


def _task_range(first: int, end: int) -> str:
    return str(first) if end - first == 1 else f"{first}-{end - 1}"


def _setup_lines(site: Site) -> list[str]:
    lines = [f"module load {shell_word(module, 'site file module')}" for module in site.modules]
    for name, value in site.env.items():
        if not _SHELL_NAME.fullmatch(name):
            raise ConfigError(f"site file env name {name!r} is not a shell variable name")
        lines.append(f"export {name}={shell_word(value, f'site file env {name}')}")
    for command in site.setup:
        _check_setup_command(command)
        # eval of the quoted text: shell code on purpose, but confined to itself.
        lines.append(f"eval {shell_word(command, 'site file setup line')}")
    return ["# Site set-up", *lines, ""] if lines else []


def _check_setup_command(command: str) -> None:
    """ConfigError unless ``command`` is complete shell code (bash -n), e.g. no open quote."""
    bash = shutil.which("bash")
    if bash is None:
        return  # no bash to ask here; eval in the job reports it
    _utf8(command, "site file setup line")
    proc = subprocess.run([bash, "-n"], input=command.encode("utf-8", "surrogateescape"),
                          capture_output=True, timeout=30)
    if proc.returncode != 0:
        said = " ".join(proc.stderr.decode(errors="replace").split())
        raise ConfigError(f"site file setup line {command!r} is not complete shell code: {said}")


def _describe(spec: JobSpec) -> str:
    what = f"mpirl {spec.command[0]}"
    if spec.solver is not None:
        solver = shell_join(shlex.split(spec.solver)[:1], "the solver program")
        if spec.het == "steps":
            return (f"{what} as a heterogeneous job: {spec.nodes} CPU node(s) x "
                    f"{spec.ntasks_per_node} ranks (driver and rollout), "
                    f"{spec.learner_nodes} GPU node(s) x {spec.learner_tasks_per_node} "
                    f"learner ranks, then {spec.solver_nodes or 1} node(s) with the solver "
                    f"{solver} ({spec.num_solver_tasks} processes); one MPI world.")
        return (f"{what} on {spec.nodes} node(s) x {spec.ntasks_per_node} tasks, launched "
                f"with {spec.launcher}: {spec.num_mpirl_tasks} mpirl ranks, then the solver "
                f"{solver} ({spec.num_solver_tasks} processes); one MPI world.")
    if spec.het == "steps":
        return (f"{what} as a heterogeneous job: {spec.nodes} CPU node(s) x "
                f"{spec.ntasks_per_node} ranks (driver and rollout), {spec.learner_nodes} GPU "
                f"node(s) x {spec.learner_tasks_per_node} learner ranks; one MPI world.")
    if spec.het == "nodes":
        return (f"{what} with roles by node: {spec.nodes} node(s) x {spec.ntasks_per_node} "
                f"ranks (driver and rollout), then {spec.learner_nodes} node(s) x "
                f"{spec.learner_tasks_per_node} learner ranks; one allocation, one MPI world.")
    return (f"{what} on {spec.nodes} node(s) x {spec.ntasks_per_node} ranks, launched with "
            f"{spec.launcher}.")


def render(spec: JobSpec, site: Site | None = None,
           check_program: bool = True) -> tuple[str, str | None]:
    """The job script for ``spec`` and its run directory (None for doctor).
    ``check_program``: that --solver's program exists here (not for the examples, whose
    programs are built where they run)."""
    site = site or Site()
    _check_spec(spec)
    first, resume, run_dir = _job_commands(spec)
    solver = _solver_words(spec, check_program)
    mpirl = spec.mpirl or site.mpirl or _default_tool("mpirl")
    job_lines, component_lines = _sbatch_lines(spec, site, run_dir)
    values = {
        "sbatch": "\n".join(job_lines),
        "het_component": "\n".join(component_lines),
        "signal_lead": str(spec.signal_lead_s),
        "output": sbatch_word(spec.output, "--output"),
        "description": _describe(spec),
        "rendered_by": shell_join(list(spec.rendered_by), "the mpirl slurm command line"),
        "run_dir": shell_word(run_dir or "", "the run directory"),
        "max_requeues": str(spec.max_requeues),
        "mpirl": shell_word(mpirl, "the mpirl command (--mpirl)"),
        "setup": "\n".join(_setup_lines(site)),
        "first_command": '"$MPIRL" ' + shell_join(first, "an argument of the mpirl command"),
        "resume_command": '"$MPIRL" ' + shell_join(resume, "an argument of the mpirl command"),
        "launcher": "\n".join(_launcher_lines(spec, site)),
        "solver": "\n".join(_solver_lines(spec, solver, [[mpirl, *first], [mpirl, *resume]])),
    }
    template = TEMPLATE.read_text(encoding="utf-8")
    # A placeholder alone on its line that renders empty takes its line with it.
    template = re.sub(r"(?m)^\{\{(\w+)\}\}\n",
                      lambda m: m.group(0) if values[m.group(1)] else "", template)
    script = re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], template)
    return script, run_dir


def submit(script: str, run_dir: str | None) -> str:
    """Write the script into the run directory and sbatch it; returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("--submit needs Slurm's sbatch on PATH, and it is not there. Run on "
                          "a login node, or leave out --submit and sbatch the printed script")
    if run_dir is None:
        directory = Path.cwd()
    else:
        directory = Path(run_dir)
        for marker, command in ((PARAMS_FILE, "train"), (TUNE_STATE_FILE, "tune")):
            if (directory / marker).exists():
                raise ConfigError(f"{run_dir} already holds a run; the job would resume it. "
                                  f"Resume it on purpose with -- {command} --resume {run_dir}, "
                                  f"or choose a new --run-dir")
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / SCRIPT_NAME if run_dir else directory / f".mpirl-{SCRIPT_NAME}"
    path.write_text(script, encoding="utf-8")
    try:
        proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        raise SubmitError("sbatch did not answer within 120 s; is slurmctld up?") from None
    if proc.returncode != 0:
        message = proc.stderr.strip() or proc.stdout.strip()
        raise SubmitError(f"sbatch refused the job (exit {proc.returncode}): {message}")
    return proc.stdout.strip().split(";")[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpirl slurm`` (cli.py calls this on its subparser)."""
    job = parser.add_argument_group("the allocation")
    job.add_argument("--nodes", type=int, default=1, metavar="N",
                     help="nodes (with --het: the CPU nodes for the driver and rollout ranks)")
    job.add_argument("--ntasks-per-node", type=int, default=4, metavar="T",
                     help="MPI ranks per node (default 4; with --solver and no --het, the "
                          "solver's processes count among them)")
    job.add_argument("--cpus-per-task", type=int, default=1, metavar="C",
                     help="CPUs per rank (default 1; rollout ranks step several envs each)")
    job.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                     help="GPUs per node (with --het steps: per learner node)")
    job.add_argument("--time", required=True, metavar="TIME",
                     help="time limit: HH:MM:SS, D-HH:MM:SS or minutes")
    job.add_argument("--partition", metavar="P")
    job.add_argument("--account", metavar="A")
    job.add_argument("--job-name", metavar="NAME",
                     help="default: mpirl-RUN_DIR's name")
    job.add_argument("--output", default=DEFAULT_OUTPUT, metavar="PATTERN",
                     # argparse %-formats help texts: Slurm's %x and %j must be doubled.
                     help=f"log file, appended across requeues (default "
                          f"{DEFAULT_OUTPUT.replace('%', '%%')}: job name and id, in the "
                          f"submission directory)")
    het = parser.add_argument_group("learners on GPU nodes, rollouts on CPU nodes")
    het.add_argument("--het", choices=HET_MODES,
                     help="steps: a heterogeneous job; nodes: one allocation, roles by node")
    het.add_argument("--learner-nodes", type=int, default=1, metavar="L",
                     help="nodes for the learner ranks (default 1)")
    het.add_argument("--learners-per-node", type=int, metavar="K",
                     help="learner ranks per learner node (default: --gpus-per-node, or 1)")
    solver = parser.add_argument_group(
        "an MPMD solver program (a C or Fortran simulation built on mpirl_solver.h)")
    solver.add_argument("--solver", metavar="'CMD ARGS'",
                        help="run this program beside mpirl in one MPI world, after mpirl's "
                             "ranks (one quoted string, split as a shell would; checked to be "
                             "an executable file, or on PATH)")
    solver.add_argument("--solver-tasks", type=int, metavar="S",
                        help="the solver's processes; without --het they are the last S of "
                             "the job's --nodes x --ntasks-per-node tasks, the rest run mpirl")
    solver.add_argument("--solver-nodes", type=int, metavar="M",
                        help="with --het steps: nodes of the solver's own component "
                             "(default 1)")
    solver.add_argument("--solver-tasks-per-node", type=int, metavar="U",
                        help="with --het steps: solver processes per solver node")
    run = parser.add_argument_group("the job")
    run.add_argument("--launcher", choices=LAUNCHERS,
                     help=f"how the step starts (default: the site file's, else "
                          f"{DEFAULT_LAUNCHER}); srun-pmix for Open MPI 5, srun-pmi2 for MPICH, "
                          f"mpiexec inside the allocation")
    run.add_argument("--max-requeues", type=int, default=DEFAULT_MAX_REQUEUES, metavar="N",
                     help=f"requeue after a checkpoint-and-stop at most N times "
                          f"(default {DEFAULT_MAX_REQUEUES})")
    run.add_argument("--signal-lead", type=int, default=DEFAULT_SIGNAL_LEAD_S, metavar="SECONDS",
                     help=f"SIGUSR2 this long before the time limit "
                          f"(default {DEFAULT_SIGNAL_LEAD_S})")
    run.add_argument("--run-dir", metavar="DIR",
                     help="the run directory, fixed in the script so a requeued job resumes "
                          "it (default: the train command's, else runs/ALGO-ENV-TIME)")
    run.add_argument("--mpirl", metavar="PATH",
                     help="the mpirl command the job runs (default: this one's full path)")
    run.add_argument("--site", metavar="FILE",
                     help=f"TOML or JSON with site specifics: {', '.join(SITE_KEYS)}")
    run.add_argument("--submit", action="store_true",
                     help="write RUN_DIR/job.sbatch, sbatch it and print the job id")
    parser.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND...",
                        help="the mpirl subcommand and its arguments, e.g. -- train --algo PPO "
                             "--env CartPole-v1")


def spec_from_args(args: argparse.Namespace, site: Site, argv: list[str]) -> JobSpec:
    command = list(args.job_command)
    if command[:1] == ["--"]:
        command = command[1:]
    return JobSpec(
        command=command, time=args.time, nodes=args.nodes,
        ntasks_per_node=args.ntasks_per_node, cpus_per_task=args.cpus_per_task,
        gpus_per_node=args.gpus_per_node, partition=args.partition, account=args.account,
        job_name=args.job_name, output=args.output,
        launcher=args.launcher or site.launcher or DEFAULT_LAUNCHER,
        max_requeues=args.max_requeues, signal_lead_s=args.signal_lead, run_dir=args.run_dir,
        het=args.het, learner_nodes=args.learner_nodes,
        learners_per_node=args.learners_per_node, mpirl=args.mpirl, solver=args.solver,
        solver_tasks=args.solver_tasks, solver_nodes=args.solver_nodes,
        solver_tasks_per_node=args.solver_tasks_per_node,
        rendered_by=("mpirl", "slurm", *argv),
    )


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """Run ``mpirl slurm`` with parsed arguments (``argv``: its own words, for the script's
    header); returns the exit code."""
    try:
        site = load_site(args.site) if args.site else Site()
        script, run_dir = render(spec_from_args(args, site, argv), site)
        if not args.submit:
            print(script, end="", flush=True)
            return 0
        job_id = submit(script, run_dir)
    except MpirlError as error:
        print(f"mpirl slurm: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    where = f"; run directory {run_dir}" if run_dir else ""
    print(f"mpirl slurm: submitted job {job_id}{where}", file=sys.stderr, flush=True)
    print(job_id, flush=True)
    return 0


#: The scripts in the repository's slurm/ directory: renderings of these command lines.
EXAMPLES = {
    "train.sbatch": [
        "--nodes", "2", "--ntasks-per-node", "4", "--cpus-per-task", "8", "--gpus-per-node", "4",
        "--time", "04:00:00", "--partition", "gpu", "--mpirl", "mpirl",
        "--run-dir", "runs/ppo-pendulum", "--",
        "train", "--algo", "PPO", "--env", "Pendulum-v1", "--config", '{"num_learners": 4}',
        "--stop", '{"timesteps_total": 50000000}',
    ],
    "hetjob.sbatch": [
        "--het", "steps", "--nodes", "2", "--ntasks-per-node", "32", "--cpus-per-task", "2",
        "--learner-nodes", "1", "--gpus-per-node", "4", "--time", "04:00:00",
        "--mpirl", "mpirl", "--run-dir", "runs/ppo-pendulum-het", "--",
        "train", "--algo", "PPO", "--env", "Pendulum-v1", "--stop", '{"timesteps_total": 50000000}',
    ],
    "hetjob-by-node.sbatch": [
        "--het", "nodes", "--nodes", "2", "--ntasks-per-node", "32", "--cpus-per-task", "2",
        "--learner-nodes", "1", "--gpus-per-node", "4", "--time", "04:00:00",
        "--mpirl", "mpirl", "--run-dir", "runs/ppo-pendulum-het", "--",
        "train", "--algo", "PPO", "--env", "Pendulum-v1", "--stop", '{"timesteps_total": 50000000}',
    ],
    # The reaction-diffusion solver in C (make solvers) as an MPMD program: 2 mpirl ranks
    # (driver, one rollout rank stepping 4 env groups) and 8 solver processes (4 groups x 2).
    "mpmd-reaction-diffusion.sbatch": [
        "--nodes", "1", "--ntasks-per-node", "10", "--time", "02:00:00", "--mpirl", "mpirl",
        "--solver", "examples/solvers/build/rd_solver", "--solver-tasks", "8",
        "--run-dir", "runs/ppo-rd-solver", "--",
        "train", "--algo", "PPO", "--env", "mpirl.envs.simulation:Solver",
        "--config", '{"ranks_per_env": 2, "num_envs_per_worker": 4, '
                    '"env_config": {"observation_size": 8, "action_size": 4}}',
        "--stop", '{"timesteps_total": 1000000}',
    ],
}


def example_scripts() -> dict[str, str]:
    """File name -> the script ``mpirl slurm`` renders for that example's command line."""
    parser = argparse.ArgumentParser(prog="mpirl slurm", allow_abbrev=False)
    add_arguments(parser)
    scripts = {}
    for name, argv in EXAMPLES.items():
        args = parser.parse_args(argv)
        scripts[name], _ = render(spec_from_args(args, Site(), argv), check_program=False)
    return scripts


def write_examples(directory: str | Path) -> None:
    """Rewrite the example scripts (``make slurm-examples``)."""
    for name, script in example_scripts().items():
        (Path(directory) / name).write_text(script, encoding="utf-8")
