"""``mpirl train``: one algorithm, one environment, one run directory; checkpoints and resume."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI

import mpirl
from mpirl.config.fields import Range, check_key
from mpirl.config.parse import build, check_known_keys, split_by_dataclass
from mpirl.data.dump_writer import DumpSettings
from mpirl.envs.simulation import Solver
from mpirl.errors import CheckpointError, ConfigError, DiskFull, MpirlError, no_room_cause
from mpirl.execution.contract import algorithm_name, env_spec_of, load_algorithm
from mpirl.execution.multiagent import MultiAgentTrainer
from mpirl.execution.multiagent_setup import MultiAgentSetup, check_stop_keys, resolve
from mpirl.execution.trainer import MAX_ITERATIONS_ENV, STOP_KEYS, Trainer, stop_reached
from mpirl.jobs.checkpoint import CheckpointSettings, CheckpointStore
from mpirl.jobs.run_dir import PARAMS_FILE, RunLock, RunRecorder, default_run_dir
from mpirl.models.torch_model import check_model
from mpirl.report.loggers import check_logger_packages, make_loggers
from mpirl.report.output_log import OutputLog
from mpirl.report.progress import ProgressDisplay, launcher_process, progress_mode, returns_reached
from mpirl.runtime import apps, startup
from mpirl.runtime import signals as stop_signals
from mpirl.runtime.driver import Driver, RuntimeSettings, run
from mpirl.runtime.layout import Layout
from mpirl.runtime.world import nested
from mpirl.workers.callbacks import callbacks_class
from mpirl.workers.env_spec import EnvSpec

#: Used when --stop is not given.
DEFAULT_STOP = {"timesteps_total": 1_000_000}


@dataclasses.dataclass
class TrainRequest:
    """A checked ``mpirl train`` command line, the same on every rank."""

    algo: str
    env: EnvSpec
    config: Any
    settings: RuntimeSettings
    checkpoints: CheckpointSettings
    dump: DumpSettings
    stop: dict[str, float]
    run_dir: Path
    resume: bool = False
    #: On resume, the config keys given on the command line that change the run's values.
    changes: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    #: How rank 0 shows progress: one of mpirl.report.progress.PROGRESS_MODES.
    progress: str = "auto"
    #: Rank 0, once the run has ended: its last row (what ``mpirl.train`` returns).
    final_row: dict[str, Any] | None = None
    #: Rank 0, where the run ended on a full disk: what said so (a tune population ends on it).
    no_room: str | None = None
    #: A multi-agent run's policies (None for a single-agent env).
    multiagent: MultiAgentSetup | None = None
    #: The cap on training iterations from outside (``$MPIRL_MAX_ITERATIONS``), on top of
    #: ``stop``; None: no cap.
    max_iterations: int | None = None

    def build_trainer(self, driver: Driver) -> Trainer:
        """The driver side of this run: multi-agent or single-agent."""
        module = load_algorithm(self.algo)
        if self.multiagent is not None:
            return MultiAgentTrainer(driver, module, self.config, self.env, self.dump,
                                     self.multiagent)
        return Trainer(driver, module, self.config, self.env, self.dump)

    @property
    def layout(self) -> Layout:
        return Layout(num_rollout_workers=self.config.num_rollout_workers,
                      num_replay_shards=self.config.replay_ranks(),
                      num_learners=self.config.num_learners,
                      ranks_per_env=self.config.ranks_per_env,
                      envs_per_rollout=self.config.num_envs_per_worker)


def make_request(algo: str | None, env_id: str | None, env_module: str | None,
                 config: dict[str, Any], stop: dict[str, Any], seed: int | None,
                 run_dir: str | None, resume: str | None = None,
                 progress: str | None = None, max_iterations: int | None = None
                 ) -> TrainRequest:
    """Validate everything that can be checked without starting anything; ConfigError if not.

    With ``resume`` the run's own params.json supplies every value the command line leaves out;
    values that are given must agree with it (algorithm, environment) or override it (config keys,
    --stop). ``max_iterations`` caps the run's training iterations on top of its stop criteria
    (the CLI's ``$MPIRL_MAX_ITERATIONS``: ``max_iterations_from_env``); it is not kept for a
    resume.
    """
    saved: dict[str, Any] = {}
    if resume is not None:
        saved = _saved_params(Path(resume))
        _check_agrees_with_saved(saved, resume, algo, env_id, run_dir)
        algo, env_id, run_dir = saved["algo"], saved["env"], resume
        env_module = env_module or saved.get("env_module")
        stop = stop or saved.get("stop", {})
    if algo is None or env_id is None:
        raise ConfigError("mpirl train needs --algo and --env (or --resume RUN_DIR)")
    module = load_algorithm(algo)
    given_keys, runtime_keys, checkpoint_keys, dump_keys = split_by_dataclass(
        config, module.Config, RuntimeSettings, CheckpointSettings, DumpSettings)
    if seed is not None:
        given_keys["seed"] = seed
    algo_config = build(module.Config, {**saved.get("config", {}), **given_keys})
    settings = build(RuntimeSettings, {**saved.get("runtime", {}), **runtime_keys})
    checkpoints = build(CheckpointSettings, {**saved.get("checkpoints", {}), **checkpoint_keys})
    dump = build(DumpSettings, {**saved.get("dumps", {}), **dump_keys})
    env = env_spec_of(module, env_id, env_module, algo_config)
    _check_ranks_per_env(algo_config, env)
    setup = _multiagent_setup(algo, env_id, algo_config, env, stop)
    _check_stop(stop, setup, algo_config)
    if algo_config.callbacks:
        callbacks_class(algo_config.callbacks)  # ConfigError here, before anything starts
    check_logger_packages(algo_config)
    if setup is None:
        module.check_config(algo_config, env)  # the checks that need the env
        check_model(module.model_spec, module.RECURRENT, algorithm_name(algo), algo_config,
                    *env.spaces())
    if run_dir is None:
        # Rank 0's clock names the directory; the other ranks never use it.
        run_dir = default_run_dir(algorithm_name(algo), env_id)
    changes = {}
    if resume is None:
        _check_fresh_run_dir(Path(run_dir))
    else:
        changes = _resume_changes(saved, stop, algo_config, settings, checkpoints, dump)
    return TrainRequest(algorithm_name(algo), env, algo_config, settings, checkpoints, dump,
                        stop or dict(DEFAULT_STOP), Path(run_dir), resume is not None, changes,
                        progress_mode(progress), multiagent=setup, max_iterations=max_iterations)


def _check_agrees_with_saved(saved: dict[str, Any], resume: str, algo: str | None,
                             env_id: str | None, run_dir: str | None) -> None:
    """--algo, --env and --run-dir given with --resume must name the saved run's own."""
    for flag, given, recorded in (("--algo", algo and algorithm_name(algo), saved["algo"]),
                                  ("--env", env_id, saved["env"]),
                                  ("--run-dir", run_dir and str(Path(run_dir)),
                                   str(Path(resume)))):
        if given is not None and given != recorded:
            raise ConfigError(
                f"{resume} holds a {saved['algo']} run on {saved['env']}, but {flag} "
                f"{given} was given. Leave out --algo, --env and --run-dir when resuming, or "
                f"start a new run without --resume."
            )


def _check_ranks_per_env(algo_config: Any, env: EnvSpec) -> None:
    """ranks_per_env gives env instances ranks of their own: only a Simulation has a use for
    them, and only one agent steps on them (multi-agent simulations are not there yet)."""
    k = algo_config.ranks_per_env
    solvers = apps.solver_ranks()
    if not k and not solvers and "Solver" not in env.env_id:
        return  # an ordinary run: its env's module is not imported here
    simulation = env.simulation_class()
    if simulation is not None and issubclass(simulation, Solver):
        if not solvers:
            raise ConfigError(f"{env.env_id!r} stands for a solver program launched beside the "
                              f"run, but none was: launch it after ':' (mpiexec -n N mpirl "
                              f"train ... : -n S ./solver), with ranks_per_env its ranks per "
                              f"env instance")
    elif solvers:
        ranks = f"{solvers} solver rank{'s' if solvers != 1 else ''}"
        raise ConfigError(f"this MPMD launch has a solver program ({ranks}), but "
                          f"{env.env_id!r} is not mpirl.envs.simulation:Solver (the env that "
                          f"stands for it); use --env mpirl/Solver-v0, or launch without the "
                          f"program after ':'")
    if not k:
        return
    if env.is_multi_agent():
        raise ConfigError(f"ranks_per_env {k}: env groups drive single-agent simulations only; "
                          f"a multi-agent env ({env.env_id!r}) steps in the rollout process. "
                          f"Leave ranks_per_env at 0 (SimulationAgents runs its simulation "
                          f"there, k = 1), or train the single-agent simulation on env groups")
    if simulation is None:
        raise ConfigError(f"ranks_per_env {k} gives each env instance ranks of its own, which "
                          f"only an mpirl.Simulation env uses; {env.env_id!r} is not one. Leave "
                          f"ranks_per_env at 0.")


def _multiagent_setup(algo: str, env_id: str, algo_config: Any, env: EnvSpec,
                      stop: dict[str, Any]) -> MultiAgentSetup | None:
    """A multi-agent env's policies, checked against the config and --stop; None for one agent."""
    if env.is_multi_agent():
        if algo_config.clip_rewards is True:
            raise ConfigError("config key 'clip_rewards' is for single-agent runs; multi-agent "
                              "rollouts train on the rewards as the env gives them")
        setup = resolve(algorithm_name(algo), algo_config, env)
        check_stop_keys(stop, setup)
        setup.learner_slices(algo_config.num_learners)  # ConfigError if they don't fit
        return setup
    if algo_config.multiagent:
        raise ConfigError(f"config key 'multiagent' is for multi-agent envs; {env_id!r} is a "
                          f"single-agent env. Give a PettingZoo env (module:ParallelEnvClass, or "
                          f"a module with parallel_env()), or leave 'multiagent' out.")
    return None


def _check_stop(stop: dict[str, Any], setup: MultiAgentSetup | None, algo_config: Any) -> None:
    """--stop's keys and values; per-policy keys (``return/POLICY``) only for multi-agent runs."""
    per_policy = {k for k in stop if "/" in k} if setup is not None else set()
    check_known_keys({k: v for k, v in stop.items() if k not in per_policy}, list(STOP_KEYS),
                     "--stop")
    for key, value in stop.items():
        check_key(key, value, "float", STOP_KEYS.get(key.partition("/")[0], Range()),
                  what="--stop criterion")
    if setup is None and "policy_return_mean_min" in stop:
        raise ConfigError("--stop policy_return_mean_min is for multi-agent runs; this env has "
                          "one agent: stop on episode_return_mean")
    if "eval_return_mean" in stop and not algo_config.reports_eval_return():
        raise ConfigError("--stop eval_return_mean needs evaluations: set the config key "
                          "evaluation_interval (PETS, MBPO)")


def _check_fresh_run_dir(run_dir: Path) -> None:
    """A new run's directory: absent, or a directory without a run in it."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a directory; nothing was "
                          f"written. Give a directory (it is made if missing), or leave "
                          f"--run-dir out for a fresh timestamped one.")
    existing = [name for name in ("progress.csv", "result.json") if (run_dir / name).exists()]
    if existing:
        raise ConfigError(
            f"run directory {run_dir} already holds a run ({', '.join(existing)}); nothing "
            f"was overwritten. Continue it with --resume {run_dir}, choose a new --run-dir, "
            f"or leave it out for a fresh timestamped one."
        )


def _resume_changes(saved: dict[str, Any], stop: dict[str, Any], algo_config: Any,
                    settings: RuntimeSettings, checkpoints: CheckpointSettings,
                    dump: DumpSettings) -> dict[str, tuple[Any, Any]]:
    """What a resume changes: each key whose value differs from the saved run's, (before, after)."""
    before = {**saved.get("config", {}), **saved.get("runtime", {}),
              **saved.get("checkpoints", {}),
              # Runs from before dumps existed had the defaults.
              **dataclasses.asdict(DumpSettings()), **saved.get("dumps", {})}
    after = {**dataclasses.asdict(algo_config), **dataclasses.asdict(settings),
             **dataclasses.asdict(checkpoints), **dataclasses.asdict(dump)}
    changes = {key: (before.get(key), value) for key, value in after.items()
               if _comparable(before.get(key)) != _comparable(value)}
    # A --stop given on resume replaces the saved criteria as a whole (docs: checkpoints).
    saved_stop = saved.get("stop") or {}
    changes.update({f"--stop {key}": (saved_stop.get(key), stop.get(key))
                    for key in sorted({*saved_stop, *stop})
                    if stop and saved_stop.get(key) != stop.get(key)})
    return changes


def _comparable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _saved_params(run_dir: Path) -> dict[str, Any]:
    path = run_dir / PARAMS_FILE
    if not run_dir.is_dir():
        raise ConfigError(f"--resume {run_dir}: no such directory")
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: not a run directory ({PARAMS_FILE} is missing)")
    try:
        params = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"--resume {run_dir}: {path} is not valid JSON ({error})") from None
    missing = [key for key in ("algo", "env", "config") if key not in params]
    if missing:
        raise ConfigError(f"--resume {run_dir}: {path} lacks {', '.join(missing)}")
    return params


def train(request: TrainRequest, comm: MPI.Comm | None = None) -> int:
    """Run on every rank; rank 0 trains until a stop criterion is met (exit code 0), or until a
    stop signal, after which it checkpoints and returns ``EXIT_RESUME`` (``EXIT_INTERRUPTED``
    after a SIGINT). ``comm`` is the run's
    world, as for ``mpirl.run`` (default: the current one, normally COMM_WORLD)."""
    return run(lambda driver: _drive(driver, request), request.layout, request.settings,
               stop_signals_enabled=True, comm=comm)


def prepared(request: TrainRequest) -> tuple[Callable[[Driver], int], Layout, RuntimeSettings]:
    """What ``mpirl.runtime.driver.run_prepared`` runs: rank 0's ``main`` for ``request``, and
    the layout and settings every rank starts with."""
    return (lambda driver: _drive(driver, request)), request.layout, request.settings


def _warn(message: str) -> None:
    print(f"mpirl: {message}", file=sys.stderr, flush=True)


def _drive(driver: Driver, request: TrainRequest) -> int:
    """Rank 0's run (``_drive_holding_lock``), with a full disk reported in one line wherever it
    strikes: also while taking the lock or opening the log, as a restart onto a disk still
    full does."""
    try:
        return _drive_holding_lock(driver, request)
    except Exception as error:
        no_room = no_room_cause(error)
        if no_room is None:
            raise
        request.no_room = no_room
        if isinstance(error, DiskFull):
            raise
        raise DiskFull(request.run_dir, no_room) from None


def _drive_holding_lock(driver: Driver, request: TrainRequest) -> int:
    """Rank 0: hold the run directory's lock for the whole run (exit 2 if a live job has it),
    copy what is printed into its output.log, and put back what a job killed inside a
    checkpoint commit left, before anything is read."""
    lock = RunLock(request.run_dir)
    notes = lock.acquire()
    try:
        with OutputLog(request.run_dir, header=f"mpirl train, pid {os.getpid()}"
                       + (" (resuming)" if request.resume else "")) as output:
            output.write(driver.layout_report)  # printed before the run directory was known
            try:
                for note in notes + CheckpointStore(request.run_dir).recover():
                    _warn(note)
                with stop_signals.holding_terminal(_mpiexec_pid()):
                    return _train_locked(driver, request, output)
            except Exception as error:
                if (no_room := no_room_cause(error)) is not None:
                    error = DiskFull(request.run_dir, no_room)
                    text = f"mpirl: {error}\n"
                elif isinstance(error, MpirlError):
                    text = f"mpirl: {error}\n"
                else:
                    text = f"mpirl: the driver failed:\n{traceback.format_exc()}"
                with contextlib.suppress(OSError):  # the log may sit on the full disk itself
                    output.write(text)
                if isinstance(error, DiskFull):
                    # The runtime prints it once this returns, after the log is closed.
                    raise error from None
                raise
    finally:
        lock.release()


def _train_locked(driver: Driver, request: TrainRequest, output: OutputLog) -> int:
    trainer = request.build_trainer(driver)
    startup.mark("workers_built")
    if driver.dispatcher is not None:
        # This loop trains back to back: a synchronous round's calls may stand in between.
        driver.dispatcher.standing_calls = True
    store = CheckpointStore(request.run_dir, request.checkpoints.keep_checkpoints)
    resumed_from = None
    if request.resume:
        resumed_from = restore_newest(trainer, store, request)
    params = run_params(request, driver, trainer)
    every = request.checkpoints.checkpoint_every
    cap = request.max_iterations
    if cap is not None:
        print(f"mpirl: {MAX_ITERATIONS_ENV}={cap}: this run stops after at most {cap} training "
              f"iteration{'s' if cap > 1 else ''}, whatever --stop says", file=sys.stderr,
              flush=True)
    if trainer.last_row is not None and (
            reason := stop_reached(trainer.last_row, request.stop, cap)):
        request.final_row = trainer.last_row
        further = (f"Unset {MAX_ITERATIONS_ENV}, or raise it" if reason == MAX_ITERATIONS_ENV
                   else "Give a larger --stop")
        print(f"stopped: {reason} was already reached at iteration {trainer.iteration}; nothing to "
              f"do. {further} to train further.", flush=True)
        return 0
    title = f"{request.algo} {request.env.env_id}"
    requested = None
    first_row_written = False
    # A tune trial's log is its only output: nothing is shown, every line is logged.
    mode = request.progress if output.terminal is not None else "off"
    with open_recorder(request, params, resumed_from is not None, trainer) as recorder, \
            ProgressDisplay(title, mode=mode, stream=output.terminal, stop=request.stop,
                            log=output.file,
                            columns=request.config.live_columns(request.env),
                            values=request.config.live_values()) as display, \
            stop_signals.before_quitting(display.end_line):
        trainer.notes_to = display.note
        while True:
            row = trainer.train()
            request.final_row = row
            if not first_row_written:
                first_row_written = True
                _write_startup(driver, request.run_dir)
            recorder.record(row, trainer.histograms)
            display.update(row)
            reason = stop_reached(row, request.stop, cap)
            requested = driver.stop_requested()
            if requested or (reason and request.checkpoints.checkpoint_at_end) or (
                    every and trainer.iteration % every == 0):
                recorder.sync()
                checkpoint = trainer.save_checkpoint(store, request.checkpoints.checkpoint_replay)
            if reason or requested:
                break
    trainer.finish_dumps()
    if requested and not reason:
        code = stop_signals.exit_code(driver.stop_signal)
        resume = resume_command(request.run_dir, driver.placement.world_size)
        if stop_signals.from_launcher():
            # mpiexec is killing every rank and will exit 1, whatever this one returns.
            message = (f"mpirl: mpiexec ended the job (it got SIGINT, SIGTERM or SIGHUP, or a "
                       f"rank failed): wrote {checkpoint} at iteration {trainer.iteration}; "
                       f"mpiexec exits 1. Continue with: {resume}")
            print(message, file=sys.stderr, flush=True)
            tell_terminal_past_mpiexec(message)
            return code
        print(f"mpirl: {requested}: wrote {checkpoint} at iteration {trainer.iteration} and "
              f"stopped (exit code {code}). Continue with: {resume}", file=sys.stderr, flush=True)
        return code
    reached = returns_reached(row, reason)
    print(f"stopped: {reason} reached ({row[reason if reason in row else 'iteration']:g}) after "
          f"{row['timesteps_total']} env steps, {row['time_total_s']:.1f} s"
          f"{'; ' + reached if reached else ''}. Results in {request.run_dir}", flush=True)
    if requested:
        # Finished anyway: nothing is left to resume, so the job ends as done, not as "requeue".
        print(f"mpirl: {requested} arrived as the run finished; exit code 0", file=sys.stderr,
              flush=True)
    return 0


#: Open MPI's launcher, under its names (mpiexec execs prterun, same pid).
OPEN_MPI_LAUNCHERS = ("mpiexec", "mpirun", "prterun", "orterun")


def _mpiexec_pid() -> int | None:
    """The pid of the Open MPI mpiexec that started this rank; None under any other launcher, in
    a run nested in another (``mpirl tune``), or without one."""
    launcher = launcher_process()
    if launcher is None or launcher[0] not in OPEN_MPI_LAUNCHERS or nested():
        return None
    return launcher[1]


def tell_terminal_past_mpiexec(message: str) -> None:
    """Also write ``message`` to the terminal when Open MPI's mpiexec ends the job.

    A SIGINT, SIGTERM or SIGHUP to mpiexec is not forwarded: mpiexec sends the ranks SIGTERM,
    stops forwarding their output and exits 1, so the checkpoint's message would reach only
    output.log. The rank's own controlling terminal is mpiexec's, so it writes there."""
    if _mpiexec_pid() is None:
        return
    try:
        with open("/dev/tty", "w") as terminal:
            terminal.write(f"\n{message}\n(kill -USR1 <mpiexec pid> stops a run with exit code "
                           "75 instead)\n")
    except OSError:
        pass  # no terminal (a batch job or a pipe): output.log has the message


def resume_command(run_dir: Path, world_size: int) -> str:
    """The command line that continues ``run_dir`` on ``world_size`` ranks, under the launcher
    that started this one (srun when Slurm's step daemon did, else mpiexec; none for one
    rank)."""
    command = f"mpirl train --resume {shlex.quote(str(run_dir))}"
    if world_size == 1:
        return command
    launcher = launcher_process()
    srun = launcher is not None and launcher[0] in ("srun", "slurmstepd")
    return f"{'srun' if srun else 'mpiexec'} -n {world_size} {command}"


def _write_startup(driver: Driver, run_dir: Path) -> None:
    """startup.json: this process's phases up to its first iteration, and every rank's. A run
    nested in ``mpirl tune`` shares its processes' start-up with the trials before it: none."""
    startup.mark("first_iteration")
    if nested():
        return
    ranks = [host.get("startup", {}) for host in driver.hosts] or [startup.marks()]
    placement = driver.placement
    groups = None
    if placement.env_groups:
        groups = {"groups": len(placement.env_groups), "k": placement.ranks_per_env,
                  "external": placement.env_groups[0].external}
        if groups["external"]:
            # The MPMD start-up (HELLOs, GO, the split, the intercommunicator) on rank 0.
            groups["solver_hello_s"] = round(apps.join_seconds(), 3)
    startup.write_report(run_dir, startup.marks(), ranks, groups)


def run_params(request: TrainRequest, driver: Driver, trainer: Trainer) -> dict[str, Any]:
    """What params.json records: everything a resume needs, and the layout it ran on."""
    return {
        "algo": request.algo, "env": request.env.env_id, "env_module": request.env.env_module,
        "config": dataclasses.asdict(request.config),
        "runtime": dataclasses.asdict(request.settings),
        "checkpoints": dataclasses.asdict(request.checkpoints),
        "dumps": dataclasses.asdict(request.dump), "stop": request.stop,
        "layout": driver.placement.record([h["host"] for h in driver.hosts] or None,
                                          apps.solver_table()),
        "world_size": driver.placement.world_size,
        "max_iterations": request.max_iterations,
        "train_batch_size": trainer.train_batch_size, "mpirl_version": mpirl.__version__,
    }


def open_recorder(request: TrainRequest, params: dict[str, Any], resumed: bool,
                  trainer: Trainer) -> RunRecorder:
    """Rank 0's writer of the run directory, with the loggers the config turns on."""
    return RunRecorder(request.run_dir, params, resume=resumed, keep_iterations=trainer.iteration,
                       loggers=make_loggers(request.config, request.run_dir, params),
                       in_background=True)


def restore_newest(trainer: Trainer, store: CheckpointStore, request: TrainRequest
                   ) -> Path | None:
    """Load the newest valid checkpoint of the run into ``trainer``; None if it has none yet."""
    found = store.newest_valid(warn=_warn)
    if found is None:
        _warn(f"{request.run_dir} has no checkpoint yet; starting from the beginning")
        return None
    path, manifest = found
    if manifest.get("algo") != request.algo or manifest["env"]["env_id"] != request.env.env_id:
        raise CheckpointError(
            f"{path} is a checkpoint of {manifest.get('algo')} on {manifest['env']['env_id']}, "
            f"not of {request.algo} on {request.env.env_id}; it cannot continue this run"
        )
    notes = trainer.restore(path, manifest)
    changed = [f"{key} {old!r} -> {new!r}" for key, (old, new) in request.changes.items()]
    print(f"resumed from {path} (iteration {manifest['iteration']}, "
          f"{manifest['timesteps_total']} env steps)"
          + "".join(f"\n  changed: {change}" for change in changed + notes), flush=True)
    return path
