"""Slurm: ``mpirl slurm`` job scripts, the world-size check, and jobs on a real Slurm.

The first part needs no Slurm. The second starts a throw-away cluster of two emulated nodes on
this machine (slurm/local-cluster.sh: munged, slurmctld, two slurmd) for the session, installs
Debian's packages first when they are missing and apt-get can, and stops it at the end. Where it
cannot start, those tests skip with the reason, except on CI (CI=true), where they fail.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    PROGRAMS,
    latest_checkpoint_iteration,
    mpi_env,
    parse_result,
    run_mpi,
)

from mpirl.errors import ConfigError, LaunchError
from mpirl.jobs.slurm import (
    EXAMPLES,
    MULTI_PROG_MAX_ARGS,
    JobSpec,
    example_scripts,
    load_site,
    multi_prog_line,
    render,
    time_limit_seconds,
)
from mpirl.runtime import signals as stop_signals
from mpirl.runtime.driver import pick_device
from mpirl.runtime.layout import (
    HET_EXIT_STAGGER_S,
    SKIP_WORLD_SIZE_CHECK,
    check_slurm_step,
    het_exit_delay,
    parse_layout_row,
    srun_version,
)

REPO = Path(__file__).resolve().parent.parent
CLUSTER_SCRIPT = REPO / "slurm" / "local-cluster.sh"
MPIRL = str(BIN / "mpirl")
TRAIN = ["train", "--algo", "PPO", "--env", "CartPole-v1"]


def mpirl_slurm(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([MPIRL, "slurm", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or mpi_env(), cwd=cwd)


def bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr


# --- rendering, no Slurm needed -------------------------------------------------------------

@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("1:30", 120), ("01:00:00", 3600), ("1-00:00:00", 86400), ("2-12", 216000),
    ("0-01:30", 5400), ("00:00:59", 60),
])
def test_time_limits_in_slurms_forms(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("text", ["1h", "", "00:61:00", "1-25:00:00", "0", "1:2:3:4", "-5"])
def test_bad_time_limits_are_refused(text):
    with pytest.raises(ConfigError, match="--time"):
        time_limit_seconds(text)


def test_homogeneous_script(tmp_path):
    spec = JobSpec(command=[*TRAIN, "--stop", '{"training_iteration": 3}'], time="01:00:00",
                   nodes=2, ntasks_per_node=4, cpus_per_task=8, gpus_per_node=4,
                   partition="gpu", account="proj", run_dir="runs/x", mpirl="mpirl")
    script, run_dir = render(spec)
    assert run_dir == "runs/x"
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --gpus-per-node=4", "#SBATCH --time=01:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj",
                 "#SBATCH --signal=B:USR2@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --job-name=mpirl-x", "RUN_DIR=runs/x", "MAX_REQUEUES=5",
                 "launcher=(srun --mpi=pmix)",
                 """command=("$MPIRL" train --run-dir runs/x --algo PPO --env CartPole-v1 """
                 """--stop '{"training_iteration": 3}')""",
                 """command=("$MPIRL" train --resume runs/x --run-dir runs/x --algo PPO """
                 """--env CartPole-v1 --stop '{"training_iteration": 3}')""",
                 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in script.splitlines() or line in script, line
    assert "{{" not in script and "hetjob" not in script
    bash_syntax_ok(script, tmp_path)


def test_run_dir_comes_from_the_train_command_or_a_default():
    script, run_dir = render(JobSpec(command=[*TRAIN, "--run-dir=r/given"], time="10"))
    assert run_dir == "r/given" and "RUN_DIR=r/given" in script
    _, run_dir = render(JobSpec(command=TRAIN, time="10"))
    assert re.fullmatch(r"runs/PPO-CartPole-v1-\d{8}-\d{6}", run_dir)
    script, run_dir = render(JobSpec(command=["train", "--resume", "runs/old"], time="10"))
    assert run_dir == "runs/old"
    assert 'command=("$MPIRL" train --resume runs/old)' in script
    script, run_dir = render(JobSpec(command=["doctor"], time="10"))
    assert run_dir is None and 'command=("$MPIRL" doctor)' in script


def test_heterogeneous_job_puts_the_learners_last(tmp_path):
    spec = JobSpec(command=[*TRAIN, "--config", '{"lr": 0.001}'], time="02:00:00", het="steps",
                   nodes=2, ntasks_per_node=16, learner_nodes=1, gpus_per_node=4,
                   run_dir="runs/h", mpirl="mpirl")
    script, _ = render(spec)
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    split = header.index("#SBATCH hetjob")
    assert "#SBATCH --nodes=2" in header[:split] and "#SBATCH --ntasks-per-node=16" in header
    assert header[split + 1:split + 3] == ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=4"]
    assert "#SBATCH --gpus-per-node=4" in header[split:]
    assert "#SBATCH --gpus-per-node=4" not in header[:split]
    assert "launcher=(srun --mpi=pmix --het-group=0,1)" in script
    assert """--config '{"lr": 0.001, "num_learners": 4}'""" in script
    bash_syntax_ok(script, tmp_path)

    by_node, _ = render(JobSpec(command=TRAIN, time="02:00:00", het="nodes", nodes=2,
                                ntasks_per_node=16, learner_nodes=1, gpus_per_node=4,
                                run_dir="runs/h", launcher="srun-pmi2"))
    assert "#SBATCH --nodes=3" in by_node and "hetjob" not in by_node
    assert "--distribution=arbitrary --ntasks=36" in by_node and "--mpi=pmi2" in by_node
    bash_syntax_ok(by_node, tmp_path)


@pytest.mark.parametrize(("changes", "message"), [
    ({"het": "steps", "launcher": "mpiexec"}, "needs srun"),
    ({"het": "steps", "command": [*TRAIN, "--config", '{"num_learners": 2}']},
     "num_learners 2 disagrees"),
    ({"het": "nodes", "command": [*TRAIN, "--config", '{"num_rollout_workers": 9}']},
     "num_rollout_workers 9 does not fit"),
    ({"signal_lead_s": 600}, "--signal-lead 600 s"),
    ({"command": []}, "no mpirl command"),
    ({"command": ["mpiexec", "-n", "2", "mpirl", "train"]}, "must be an mpirl subcommand"),
    ({"command": ["train", "--algo", "PPO"]}, "needs --algo and --env"),
    ({"run_dir": "a", "command": [*TRAIN, "--run-dir", "b"]}, "differ"),
    ({"nodes": 0}, "--nodes must be 1 or more"),
    ({"partition": "two words"}, "--partition"),
])
def test_bad_job_specs_are_refused(changes, message):
    spec = JobSpec(**{"command": TRAIN, "time": "10", **changes})
    with pytest.raises(ConfigError, match=re.escape(message)):
        render(spec)


def test_site_file_toml_and_json(tmp_path):
    toml = tmp_path / "site.toml"
    toml.write_text('launcher = "mpiexec"\nmodules = ["openmpi/5.0"]\n'
                    'env = { OMP_NUM_THREADS = 1, TAG = "a b" }\n'
                    'setup = ["source /opt/rl/bin/activate"]\nsbatch = ["--qos=high"]\n'
                    'mpiexec_args = ["--oversubscribe"]\nmpiexec = "/opt/ompi/bin/mpiexec"\n'
                    'partition = "cpu"\n')
    site = load_site(toml)
    script, _ = render(JobSpec(command=TRAIN, time="10", launcher=site.launcher), site)
    for line in ("module load openmpi/5.0", "export OMP_NUM_THREADS=1", "export TAG='a b'",
                 "eval 'source /opt/rl/bin/activate'", "#SBATCH --qos=high",
                 "#SBATCH --partition=cpu",
                 'launcher=(/opt/ompi/bin/mpiexec -n "$SLURM_NTASKS" --bind-to none '
                 '--oversubscribe)'):
        assert line in script.splitlines(), line
    as_json = tmp_path / "site.json"
    as_json.write_text(json.dumps({"srun_args": ["--cpu-bind=cores"], "mpirl": "/x/mpirl"}))
    script, _ = render(JobSpec(command=TRAIN, time="10"), load_site(as_json))
    assert "launcher=(srun --mpi=pmix --cpu-bind=cores)" in script
    assert "MPIRL=/x/mpirl" in script


@pytest.mark.parametrize(("text", "message"), [
    ('modules = "openmpi"', "modules must be a list of strings"),
    ('launcher = "ssh"', "launcher must be one of"),
    ('module = ["x"]', "unknown key(s) module"),
    ("launcher = ", "not valid TOML"),
    ('env = { "A-B" = "1" }', "not a shell variable name"),
])
def test_bad_site_files_are_refused(tmp_path, text, message):
    path = tmp_path / "site.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_site(path)


@pytest.mark.parametrize(("args", "message"), [
    (["--time", "1h", "--", *TRAIN], "--time '1h' is not a Slurm time limit"),
    (["--time", "10"], "no mpirl command given"),
    (["--time", "10", "--site", "/no/such.toml", "--", *TRAIN], "--site /no/such.toml"),
    (["--time", "10", "--submit", "--", *TRAIN], "--submit needs Slurm's sbatch on PATH"),
])
def test_cli_errors_are_one_line_and_exit_2(tmp_path, args, message):
    env = mpi_env({"PATH": str(tmp_path)})  # no sbatch here
    proc = mpirl_slurm(*args, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith("mpirl slurm: error: ")


def test_cli_prints_the_script_it_renders(tmp_path):
    proc = mpirl_slurm("--time", "00:30:00", "--nodes", "1", "--ntasks-per-node", "3",
                       "--run-dir", "runs/c", "--", *TRAIN, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash\n")
    assert f"MPIRL={BIN / 'mpirl'}" in proc.stdout  # this venv's mpirl, by full path
    assert "# Rendered by: mpirl slurm --time 00:30:00 --nodes 1" in proc.stdout
    assert not (tmp_path / "runs").exists()  # printing creates nothing


def test_help_lists_the_options():
    proc = mpirl_slurm("--help")
    assert proc.returncode == 0, proc.stderr
    for option in ("--signal-lead", "--max-requeues", "--het", "--site", "%x-%j.out",
                   "--solver", "--solver-tasks", "--solver-nodes", "--solver-tasks-per-node"):
        assert option in proc.stdout


# --- an MPMD solver program in the job ----------------------------------------------------------

#: Words that srun's --multi-prog parser would change unless quoted: a quote, %t and %o (task
#: numbers), a backslash, a tab, an empty word, shell syntax.
AWKWARD = ["it's %t & %o", "back\\slash", "", "tab\tin", "$HOME", '"dq"', "#x"]


@pytest.fixture
def solver(tmp_path) -> str:
    """An executable file standing in for a solver program."""
    path = tmp_path / "solver"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def solver_job(program: str, **changes) -> JobSpec:
    return JobSpec(**{"command": [*TRAIN, "--config", '{"ranks_per_env": 2}'], "time": "10",
                      "nodes": 1, "ntasks_per_node": 6, "solver": f"{program} --size 'a b'",
                      "solver_tasks": 4, "run_dir": "runs/m", "mpirl": "/x/mpirl", **changes})


def test_mpmd_job_with_mpiexec_and_with_a_het_component(tmp_path, solver):
    """mpirl's ranks first, then the solver's: one mpiexec with two app contexts, or a
    heterogeneous step whose third component runs the solver. The job's tasks count both."""
    spec = solver_job(solver, launcher="mpiexec")
    assert (spec.num_mpirl_tasks, spec.num_solver_tasks, spec.num_tasks) == (2, 4, 6)
    script, _ = render(spec)
    lines = script.splitlines()
    assert "#SBATCH --ntasks-per-node=6" in lines  # the allocation holds both programs
    assert any(line.endswith(" -n 2 --bind-to none)") for line in lines
               if line.startswith("launcher=(")), script
    assert f"command+=(: -n 4 {solver} --size 'a b')" in lines
    bash_syntax_ok(script, tmp_path)

    het = solver_job(solver, het="steps", nodes=1, ntasks_per_node=3, learner_nodes=1,
                     learners_per_node=2, solver_tasks=None, solver_nodes=2,
                     solver_tasks_per_node=8)
    assert (het.num_mpirl_tasks, het.num_solver_tasks, het.num_tasks) == (5, 16, 21)
    script, _ = render(het)
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    components = [i for i, line in enumerate(header) if line == "#SBATCH hetjob"]
    assert len(components) == 2, header
    assert header[components[1] + 1:components[1] + 4] == [
        "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --cpus-per-task=1"]
    assert "launcher=(srun --mpi=pmix --het-group=0,1)" in script
    assert f"command+=(: --het-group=2 {solver} --size 'a b')" in script
    bash_syntax_ok(script, tmp_path)
    by_count, _ = render(solver_job(solver, het="steps", ntasks_per_node=3, solver_tasks=6))
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=6\n" in by_count


def test_mpmd_job_under_srun_writes_a_multi_prog_file(tmp_path, solver):
    """The script writes srun's --multi-prog file for the attempt's command (first, then
    resume); every word reaches the program as it is. (Slurm 22.05 read these very lines back
    byte for byte; the real job below runs one.)"""
    run_dir = tmp_path / "run"
    spec = solver_job(f"{solver} {shlex.join(AWKWARD)}", run_dir=str(run_dir),
                      command=[*TRAIN, "--config", json.dumps({"tag": AWKWARD[0]})])
    script, _ = render(spec)
    assert "launcher=(srun --mpi=pmix)" in script
    job = tmp_path / "job.sbatch"
    job.write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A stand-in srun: keeps the file it was given (the script deletes it at exit).
    (bin_dir / "srun").write_text('#!/bin/bash\n[ "$2" = --multi-prog ] && cp "$3" "$KEEP"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": "/nowhere"}
    for attempt in ("first", "resume"):
        keep = tmp_path / f"{attempt}.conf"
        proc = subprocess.run(["bash", str(job)], capture_output=True, text=True, timeout=30,
                              env={**env, "KEEP": str(keep)}, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "srun --mpi=pmix --multi-prog" in proc.stderr
        mpirl = ["/x/mpirl", "train", *(["--resume", str(run_dir)] if attempt == "resume" else []),
                 "--run-dir", str(run_dir), "--algo", "PPO", "--env", "CartPole-v1",
                 "--config", json.dumps({"tag": AWKWARD[0]})]
        lines = keep.read_text().splitlines()
        program = [solver, *AWKWARD, "--size", "a b"]
        assert lines == [multi_prog_line("0-1", mpirl), multi_prog_line("2-5", program)]
        assert [parse_multi_prog_words(line) for line in lines] == [mpirl, program]
        assert list(tmp_path.glob("mpirl-multi-prog.*")) == []  # removed at exit
        run_dir.mkdir(exist_ok=True)
        (run_dir / "params.json").write_text("{}")  # the requeued attempt resumes


def parse_multi_prog_words(line: str) -> list[str]:
    """Words of a --multi-prog line as slurmstepd splits them (src/slurmd/slurmstepd/
    multi_prog.c): single quotes keep everything, a backslash keeps the next character, %t and
    %o outside quotes would be task numbers (none are outside quotes here)."""
    words, word, quoted, escaped, started = [], "", False, False, False
    for char in line.split(" ", 1)[1]:
        if quoted:
            quoted = char != "'"
            word += char if quoted else ""
        elif escaped:
            word, escaped = word + char, False
        elif char == "'":
            quoted = started = True
        elif char == "\\":
            escaped = started = True
        elif char.isspace():
            if started:
                words.append(word)
            word, started = "", False
        else:
            word, started = word + char, True
    return [*words, word] if started else words


@pytest.mark.parametrize(("changes", "message"), [
    ({"solver": "./rd_solvr"}, "--solver ./rd_solvr is not an executable file"),
    ({"solver": "rd_solvr_nowhere"}, "--solver rd_solvr_nowhere is not on PATH"),
    ({"solver": None}, "--solver-tasks needs --solver"),
    ({"solver_tasks": None}, "--solver needs --solver-tasks N"),
    ({"solver_tasks": 6}, "--solver-tasks 6 leaves no task for mpirl"),
    ({"solver_tasks": 3}, "3 solver tasks do not make whole env groups of ranks_per_env 2"),
    ({"solver_nodes": 2}, "--solver-nodes sizes the solver's own component of --het steps"),
    ({"het": "nodes"}, "--solver with --het nodes is not supported"),
    ({"het": "steps", "solver_tasks": None}, "needs --solver-tasks-per-node"),
    ({"het": "steps", "solver_nodes": 2, "solver_tasks_per_node": 3},
     "--solver-tasks 4 disagrees with --solver-nodes 2 x --solver-tasks-per-node 3"),
    ({"command": ["tune", "--population", "2", "--", *TRAIN[1:]]},
     "--solver works with -- train or -- doctor"),
    ({"solver": "{solver} 'two\nlines'"}, "cannot carry the argument 'two\\nlines'"),
    ({"command": [*TRAIN, "--config", '{"a":\n1}']}, "cannot carry the argument"),
    ({"solver": "{solver}" + " x" * (MULTI_PROG_MAX_ARGS + 1)},
     f"passes at most {MULTI_PROG_MAX_ARGS} arguments"),
    ({"solver": "{solver} " + "x" * 17000}, "takes lines of at most 16381 bytes"),
])
def test_bad_mpmd_jobs_are_refused(solver, changes, message):
    if isinstance(changes.get("solver"), str):
        changes["solver"] = changes["solver"].replace("{solver}", solver)
    with pytest.raises(ConfigError, match=re.escape(message)):
        render(solver_job(solver, **changes))
    # mpiexec takes any argument: no --multi-prog file.
    if "carry" in message or "arguments" in message or "16381" in message:
        render(solver_job(solver, launcher="mpiexec", **changes))


def test_solvers_leave_mpirls_stop_signals_to_mpirl(built_solvers):
    """srun and mpiexec pass a stop request (SIGUSR1/2, SIGTERM) to every process of the step.
    A solver must outlive it: mpirl's ranks finish their iteration, which needs its replies,
    then checkpoint, and END it. Signalled before their setup, the C solvers still answer."""
    proc = run_mpi(1, sys.executable, str(PROGRAMS / "solver_link_check.py"), "signals", "1",
                   "60", ":", "-n", "2", built_solvers.path("echo_solver"), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = parse_result(proc.stdout)
    assert result["signalled"] == 2 and result["steps_checked"] == 6, result


def test_a_missing_solver_is_one_line_and_exit_2(tmp_path):
    proc = mpirl_slurm("--time", "10", "--solver", "./rd_solvr", "--solver-tasks", "2", "--",
                       *TRAIN, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "mpirl slurm: error: --solver ./rd_solvr is not an executable file\n"


def test_the_scripts_in_slurm_dir_are_current():
    """slurm/*.sbatch are renderings of EXAMPLES; regenerate them with make slurm-examples."""
    for name, script in example_scripts().items():
        assert (REPO / "slurm" / name).read_text() == script, (
            f"slurm/{name} is out of date: run make slurm-examples")
    assert set(EXAMPLES) == {p.name for p in (REPO / "slurm").glob("*.sbatch")}


# --- the world-size check and the device choice, no Slurm needed -----------------------------

def test_world_size_check_catches_singletons_under_srun():
    step = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_MPI_TYPE": "pmi2"}
    check_slurm_step(4, step)
    with pytest.raises(LaunchError, match=r"srun --mpi=pmi2 started 4 tasks, but each one is"):
        check_slurm_step(1, {**step, "SLURM_PROCID": "0"})
    with pytest.raises(LaunchError) as raised:
        check_slurm_step(1, {**step, "SLURM_PROCID": "3"})
    assert not raised.value.speaker  # only task 0 reports it
    assert raised.value.exit_code == 2
    with pytest.raises(LaunchError, match="MPI's world has 2"):
        check_slurm_step(2, step)
    check_slurm_step(1, {**step, SKIP_WORLD_SIZE_CHECK: "1"})


def test_heterogeneous_pmix_components_exit_apart_under_slurm_before_24_11():
    """srun before Slurm 24.11 hangs when a het step's components end at once (the abort agents'
    race): each component after the first waits its index times the stagger after MPI_Finalize."""
    step = {"SLURM_STEP_ID": "0", "SLURM_PMIXP_ABORT_AGENT_PORT": "40079", "SLURM_HET_SIZE": "3",
            "SLURM_NTASKS_HET_GROUP_0": "3", "SLURM_NTASKS_HET_GROUP_1": "2",
            "SLURM_NTASKS_HET_GROUP_2": "1"}

    def delays(version, environ=step):
        return [het_exit_delay({**environ, "SLURM_PROCID": str(task)}, lambda: version)
                for task in range(6)]

    stagger = HET_EXIT_STAGGER_S
    assert delays((22, 5)) == [0, 0, 0, stagger, stagger, 2 * stagger]
    assert delays(None) == delays((24, 5)) == delays((22, 5))  # unknown: wait, to be safe
    assert delays((24, 11)) == delays((25, 5)) == [0] * 6  # fixed there
    assert stagger >= 1  # srun's threads must see the components end apart, even under load
    # No wait outside a het pmix step: pmi2, a homogeneous step, a batch script, or mpiexec.
    for missing in ("SLURM_PMIXP_ABORT_AGENT_PORT", "SLURM_STEP_ID", "SLURM_HET_SIZE",
                    "SLURM_NTASKS_HET_GROUP_1"):
        assert delays((22, 5), {k: v for k, v in step.items() if k != missing}) == [0] * 6
    assert delays((22, 5), {**step, "SLURM_HET_SIZE": "1"}) == [0] * 6


def test_srun_version_is_read_or_unknown(monkeypatch, tmp_path):
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\necho 'slurm 22.05.8'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert srun_version() == (22, 5)
    fake.write_text("#!/bin/sh\necho 'srun: fatal: Could not establish a configuration source'"
                    " >&2\nexit 1\n")
    assert srun_version() is None
    fake.unlink()
    assert srun_version() is None


def test_world_size_check_leaves_mpiexec_alone():
    # A batch script has no step id: SLURM_NTASKS is the allocation's, mpiexec's -n may differ.
    check_slurm_step(2, {"SLURM_NTASKS": "8", "SLURM_JOB_ID": "5", "SLURM_PROCID": "0"})
    # Open MPI's mpiexec inside a one-task step (srun --pty bash, then mpiexec -n 4).
    check_slurm_step(4, {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1",
                         "OMPI_COMM_WORLD_SIZE": "4"})
    check_slurm_step(3, {})


def test_learners_take_gpus_by_their_index_on_the_node(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [pick_device("learner", i) for i in range(4)] == ["cuda:0", "cuda:1", "cuda:0",
                                                            "cuda:1"]
    assert pick_device("rollout", 0) == "cpu" and pick_device("driver", 0) == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # --gpus-per-task: one visible
    assert pick_device("learner", 3) == "cuda:0"
    assert pick_device("learner", 0, "cpu") == "cpu"  # learner_device: the CPU despite GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert pick_device("learner", 0) == "cpu"


# --- a real Slurm -----------------------------------------------------------------------------

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class Cluster:
    """The test cluster: its environment, and the jobs the tests submitted (cancelled at the
    end, so a hung job cannot outlive the session)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.jobs: list[str] = []

    def run(self, *command: str, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout,
                              env=self.env, **kwargs)

    def submit(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
        """``mpirl slurm --submit ARGS``; ``env`` adds to the environment the job inherits."""
        proc = subprocess.run([MPIRL, "slurm", "--submit", *args], capture_output=True,
                              text=True, timeout=60, env={**self.env, **(env or {})},
                              cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        job = proc.stdout.strip()
        assert job.isdigit(), proc.stdout
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out.splitlines()[0])) if out.strip() else {}

    def wait(self, job: str, tmp_path: Path, timeout: float) -> dict[str, str]:
        """Poll until the job ends for good; fail (and cancel it) after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") in TERMINAL:
                return info
            if time.monotonic() > deadline:
                self.run("scancel", job)
                pytest.fail(f"job {job} did not end within {timeout} s ({info.get('JobState')})"
                            f":\n{job_log(tmp_path, job)}")
            time.sleep(1)

    def cancel_all(self) -> None:
        if self.jobs:
            self.run("scancel", *self.jobs)


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    """A two-node Slurm on localhost for the session; skip (fail on CI) if it cannot start.

    Its directory and ports are the session's own, so that two test sessions on one machine do
    not share (and stop) one cluster."""
    # Short: munge's socket path has a length limit.
    directory = Path(f"/tmp/mpirl-slurm-{os.getpid()}")
    port = 20000 + os.getpid() % 2000 * 4  # slurmctld, then one port per slurmd
    env = mpi_env({"MPIRL_SLURM_DIR": str(directory), "MPIRL_SLURM_PORT": str(port),
                   "SLURM_CONF": str(directory / "slurm.conf")})
    problem = None
    install = subprocess.run(["bash", str(CLUSTER_SCRIPT), "install"], capture_output=True,
                             text=True, timeout=600, env=env)
    if install.returncode != 0:
        problem = f"Slurm is not installed and could not be: {install.stderr.strip()}"
    else:
        start = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True,
                               text=True, timeout=120, env=env)
        if start.returncode != 0:
            problem = f"the local Slurm did not start: {start.stderr.strip()}"
            subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop"], capture_output=True,
                           timeout=120, env=env)  # whatever of it did start
            shutil.rmtree(directory, ignore_errors=True)
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{problem} (CI=true: the Slurm tests must run)")
        pytest.skip(problem)
    cluster = Cluster(env)
    yield cluster
    cluster.cancel_all()
    subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop"], capture_output=True, text=True,
                   timeout=120, env=env)
    shutil.rmtree(directory, ignore_errors=True)


def job_log(tmp_path: Path, job: str) -> str:
    logs = sorted(tmp_path.glob(f"*-{job}.out"))
    return "\n".join(path.read_text() for path in logs) if logs else "(no log)"


def iterations(run_dir: Path) -> list[int]:
    with open(run_dir / "progress.csv") as file:
        return [int(row["iteration"]) for row in csv.DictReader(file)]


def assert_resumed_where_it_stopped(log: str, run_dir: Path) -> list[int]:
    """Every stop wrote a checkpoint of its last iteration, the next attempt resumed from that
    very checkpoint, and progress.csv holds every iteration once. Returns the stop iterations."""
    stops = [int(i) for i in re.findall(r"wrote \S+/checkpoint_\d+ at iteration (\d+)", log)]
    resumes = [int(i) for i in re.findall(r"resumed from \S+/checkpoint_(\d+) \(iteration", log)]
    assert stops and resumes == stops, log
    rows = iterations(run_dir)
    assert rows == list(range(1, rows[-1] + 1)), rows
    return stops


def test_submitted_ppo_job_completes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = slurm.submit(tmp_path, "--nodes", "1", "--ntasks-per-node", "3", "--time", "10",
                       "--launcher", "srun-pmix", "--run-dir", str(run_dir), "--",
                       *TRAIN, "--stop", '{"training_iteration": 3}',
                       "--config", '{"checkpoint_every": 2}')
    info = slurm.wait(job, tmp_path, timeout=120)
    log = job_log(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), log
    assert "restart 0 of at most 5" in log and "srun --mpi=pmix" in log
    assert "world size 3" in log  # one MPI world of 3 ranks, not 3 singletons
    assert iterations(run_dir) == [1, 2, 3]
    assert json.loads((run_dir / "result.json").read_text())["iteration"] == 3
    assert latest_checkpoint_iteration(run_dir) == 3
    assert (run_dir / "job.sbatch").read_text().startswith("#!/bin/bash")


def test_submitted_plugin_algorithm_job_completes(slurm, tmp_path):
    # A user's own algorithm module: importable on every rank through the job's PYTHONPATH.
    run_dir = tmp_path / "run"
    job = slurm.submit(tmp_path, "--nodes", "1", "--ntasks-per-node", "3", "--time", "10",
                       "--run-dir", str(run_dir), "--", "train", "--algo", "vanilla_pg",
                       "--env", "CartPole-v1", "--stop", '{"training_iteration": 2}',
                       env={"PYTHONPATH": str(REPO / "examples" / "plugins")})
    info = slurm.wait(job, tmp_path, timeout=120)
    log = job_log(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert iterations(run_dir) == [1, 2]
    assert json.loads((run_dir / "params.json").read_text())["algo"] == "vanilla_pg"


@pytest.mark.timeout(600)  # about 95 s; each run is shorter when start-up is slow (a busy machine)
def test_time_limit_signals_checkpoints_requeues_and_completes(slurm, tmp_path):
    """--time 2 with the signal 60 s ahead: slurmctld checks every 30 s and sends it 60-90 s
    before the limit, 30-60 s into each run; 60 s of training needs at least one requeue."""
    run_dir = tmp_path / "run"
    job = slurm.submit(tmp_path, "--nodes", "1", "--ntasks-per-node", "3", "--time", "2",
                       "--signal-lead", "60", "--max-requeues", "6", "--launcher", "srun-pmix",
                       "--run-dir", str(run_dir), "--",
                       *TRAIN, "--stop", '{"time_total_s": 60}',
                       "--config", '{"checkpoint_every": 5}')
    info = slurm.wait(job, tmp_path, timeout=540)
    log = job_log(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    restarts = int(info["Restarts"])
    assert 1 <= restarts <= 6, log
    assert log.count("requeueing") == restarts, log
    # A signal may also land in the last run, as it finishes: that run still ends with 0.
    assert log.count("got SIGUSR2") in (restarts, restarts + 1), log
    assert f"restart {restarts} of at most 6" in log
    assert_resumed_where_it_stopped(log, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["time_total_s"] >= 60 and result["iteration"] == iterations(run_dir)[-1]


def test_a_late_stop_signal_is_ignored_once_the_run_is_over():
    """After run() returns, SIGUSR1/2 are ignored: at interpreter exit Python would otherwise
    give them back their default action, and a warning signal that lands while a finished job
    shuts down would kill it (exit 140, a failed job instead of a completed one)."""
    signals = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in signals}
    try:
        stop_signals.install()
        stop_signals.settle()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop_signals.received() is None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_signals.reset()


@pytest.mark.parametrize(("launcher", "scancel_args"), [
    ("mpiexec", ["--batch"]),   # the batch script passes it to mpiexec, mpiexec to the ranks
    ("srun-pmix", []),          # scancel signals the srun step's tasks directly
], ids=["mpiexec-batch", "srun-steps"])
def test_scancel_usr2_checkpoints_requeues_and_completes(slurm, tmp_path, launcher,
                                                         scancel_args):
    run_dir = tmp_path / "run"
    total = 12
    job = slurm.submit(tmp_path, "--nodes", "1", "--ntasks-per-node", "3", "--time", "10",
                       "--launcher", launcher, "--run-dir", str(run_dir), "--",
                       *TRAIN, "--stop", json.dumps({"training_iteration": total}))
    deadline = time.monotonic() + 120
    while not (run_dir / "result.json").exists():
        assert time.monotonic() < deadline, job_log(tmp_path, job)
        time.sleep(0.1)
    proc = slurm.run("scancel", *scancel_args, "--signal=USR2", job)
    assert proc.returncode == 0, proc.stderr
    info = slurm.wait(job, tmp_path, timeout=240)
    log = job_log(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    assert "restart 1 of at most 5" in log and "exited with 75" in log
    [stop] = assert_resumed_where_it_stopped(log, run_dir)
    assert stop < total and iterations(run_dir)[-1] == total


def test_a_step_that_outlives_its_ranks_is_stopped_with_rank_0s_exit_code(slurm, tmp_path):
    """srun before Slurm 24.11 can hang after every task of a heterogeneous step has exited (the
    abort agents' race, which the exit stagger makes rare but cannot rule out). An srun that
    sleeps on after its step stands in for it: the job script stops it MPIRL_EXIT_GRACE_S after
    rank 0 exited, and the job completes with rank 0's exit code, not the killed srun's."""
    site = tmp_path / "site.toml"
    site.write_text("setup = ['srun() { command srun \"$@\"; local code=$?; sleep 100; "
                    "return $code; }']\n"
                    'env = { MPIRL_EXIT_GRACE_S = "5" }\n')
    run_dir = tmp_path / "run"
    job = slurm.submit(tmp_path, "--nodes", "1", "--ntasks-per-node", "2", "--time", "10",
                       "--site", str(site), "--run-dir", str(run_dir), "--",
                       *TRAIN, "--stop", '{"training_iteration": 2}')
    info = slurm.wait(job, tmp_path, timeout=90)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "still runs 5 s after mpirl's rank 0 exited with 0; stopping it" in log, log
    assert "the job step exited with 0" in log, log
    assert json.loads((run_dir / "result.json").read_text())["iteration"] == 2


@pytest.mark.parametrize("het", ["steps", "nodes"])
def test_learners_run_on_the_learner_node(slurm, tmp_path, het):
    """A heterogeneous job (steps), and one allocation with roles by node (nodes): the driver
    and the rollout rank share one node, the learner has the other; one MPI world.

    The heterogeneous job puts its first component on the emulated node n2: with 2 tasks of
    component 0 on the first node and component 1 on n2, the Open MPI wheel's MPI_Init fails
    under this two-slurmd emulation (n2 first works; see slurm/local-cluster.sh)."""
    first = socket.gethostname().split(".")[0]
    site = tmp_path / "site.toml"
    site.write_text('sbatch = ["--nodelist=n2"]\n' if het == "steps" else "")
    run_dir = tmp_path / "run"
    job = slurm.submit(tmp_path, "--het", het, "--nodes", "1", "--ntasks-per-node", "2",
                       "--learner-nodes", "1", "--learners-per-node", "1", "--time", "10",
                       "--partition", "all", "--site", str(site), "--run-dir", str(run_dir),
                       "--",
                       *TRAIN, "--stop", '{"training_iteration": 2}')
    info = slurm.wait(job, tmp_path, timeout=150)
    log = job_log(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    table = {row["rank"]: (row["role"], row["host"]) for line in log.splitlines()
             if (row := parse_layout_row(line))}
    if het == "steps":
        rollout_node, learner_node = "n2", first
    else:  # the first node of the allocation's list (it sorts n2 before most host names)
        nodes = slurm.run("scontrol", "show", "hostnames", info["NodeList"]).stdout.split()
        rollout_node, learner_node = nodes
    assert table == {0: ("driver", rollout_node), 1: ("rollout", rollout_node),
                     2: ("learner", learner_node)}, log
    assert "world size 3" in log
    assert iterations(run_dir) == [1, 2]


def test_mpmd_job_runs_mpirl_and_the_solver_in_one_world(slurm, tmp_path, built_solvers):
    """--solver under srun: the script's --multi-prog file runs mpirl train on tasks 0-1 and the
    C reaction-diffusion solver on task 2, one MPI world: the solver's mpirl_init joins mpirl's
    start-up (a solver in a world of its own would be world rank 0 and abort), PPO trains on
    its env group, and mpirl's END ends it."""
    config = {"ranks_per_env": 1, "num_envs_per_worker": 1, "rollout_fragment_length": 32,
              "env_config": {"observation_size": 8, "action_size": 4, "max_steps": 16}}
    job = slurm.submit(tmp_path, "--nodes", "1", "--ntasks-per-node", "3", "--time", "10",
                       "--solver", built_solvers.path("rd_solver"), "--solver-tasks", "1",
                       "--", "train", "--algo", "PPO", "--env", "mpirl/Solver-v0",
                       "--config", json.dumps(config),
                       "--stop", '{"training_iteration": 2}')
    info = slurm.wait(job, tmp_path, timeout=120)
    log = job_log(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "multi-prog: 0-1 '" in log and "multi-prog: 2 '" in log, log
    assert "solver 1 (1 group x 1)" in log and "world size 2 + 1 solver ranks" in log, log
    assert "stopped: training_iteration reached (2) after 64 env steps" in log, log


def test_wrong_pmi_is_one_clear_error_not_singletons(slurm, tmp_path):
    """The Open MPI wheel under srun --mpi=pmi2 starts every task as a world of one."""
    run_dir = tmp_path / "run"
    proc = slurm.run("srun", "--mpi=pmi2", "-n", "2", MPIRL, *TRAIN, "--run-dir", str(run_dir),
                     "--stop", '{"training_iteration": 2}', timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mpirl: error:")]
    assert len(errors) == 1 and "srun --mpi=pmi2 started 2 tasks" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_no_sbatch_on_path_is_caught_before_anything_is_written(tmp_path):
    env = mpi_env({"PATH": os.path.dirname(sys.executable)})
    assert shutil.which("sbatch", path=env["PATH"]) is None
    proc = mpirl_slurm("--time", "10", "--run-dir", str(tmp_path / "r"), "--submit", "--",
                       *TRAIN, env=env)
    assert proc.returncode == 2 and not (tmp_path / "r").exists()
