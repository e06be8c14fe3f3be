"""``mpirl slurm`` renders job scripts from hostile values without running any of them.

Every script is rendered from values built to break out of their quotes (newlines, ``$(...)``,
backticks, both quotes, backslashes, ``#``, spaces, control and non-UTF-8 bytes), checked with
``bash -n``, and then run by bash with srun, mpiexec, scontrol and module replaced by stub
scripts that record the arguments they get: each must arrive byte for byte, and no ``touch``
hidden in a value may have made its file. The ``#SBATCH`` lines are split as sbatch splits them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, mpi_env

from mpirl.errors import ConfigError
from mpirl.jobs.slurm import JobSpec, Site, load_site, render

MPIRL = str(BIN / "mpirl")

#: Each one would create the file pwned-N in the job's directory if it were run as code.
HOSTILE = [
    "$(touch pwned-1)", "`touch pwned-2`", "; touch pwned-3", "x'; touch pwned-4; '",
    'x"; touch pwned-5; "', "\ntouch pwned-6\n", "a  b\tc", "back\\slash\\", "cr\r\nlf",
    "# not a comment", "$HOME ${PATH} $'x' !! * ~", "ünï ☃", "line\u2028sep\x85", "\x1b[31mred",
]
#: A pretty-printed --config: valid JSON, several lines.
CONFIG = {"num_learners": 1, "lr": 0.0003, "note": "$(touch pwned-20) `touch pwned-21`\n'\""}
RUN_DIR = "runs/my run $(touch pwned-7) `touch pwned-8` 'sq' \"dq\" # x \\ end"


def train_command(run_dir: str = RUN_DIR) -> list[str]:
    hostile = [word for value in HOSTILE for word in ("--env-module", value)]
    return ["train", "--run-dir", run_dir, "--algo", "PPO", "--env", "CartPole-v1", *hostile,
            "--config", json.dumps(CONFIG, indent=2, ensure_ascii=False),
            "--dump-trajectories", "dumps/a b/$(touch pwned-22)"]


SITE = {
    "modules": ["openmpi/5 $(touch pwned-13)"],
    "env": {"TAG": "multi\nline $(touch pwned-14) 'q' \"dq\" \\"},
    # Shell code on purpose: it must run, and see TAG as exported.
    "setup": ["printf '%s' \"$TAG\" > setup-saw"],
    "sbatch": ["--comment=it's \"quoted\" $(touch pwned-11) # and `touch pwned-12`", "--qos=high"],
    "srun_args": ["--export=ALL,NOTE=$(touch pwned-15)", "--label"],
    "mpiexec_args": ["-x", "NOTE=`touch pwned-16`"],
    "partition": "gpu,`touch pwned-10`",
}

STUB = r"""#!/bin/sh
name=$(basename "$0")
printf '%s\0' "$@" > "$STUB_LOG/$name.argv"
printf '%s' "${TAG-}" > "$STUB_LOG/$name.tag"
if [ "$name" = scontrol ] && [ "$1" = show ]; then printf 'n1\nn2\nn3\n'; fi
exit 0
"""


def sbatch_arguments(script: str) -> list[str]:
    """The arguments sbatch reads from the script's #SBATCH lines, split as Slurm's
    get_argument (src/sbatch/opt.c) splits them: whitespace separates, single or double quotes
    group, a backslash takes the next character as it is, an unquoted # ends the line, and a
    line ends at a newline whatever the quotes. Reading stops at the first command line."""
    arguments = []
    for line in script.split("\n")[1:]:
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.lstrip().startswith("#"):
                break
            continue
        rest, at = line[len("#SBATCH"):], 0
        while True:
            while at < len(rest) and rest[at] in " \t\v\f\r":
                at += 1
            if at == len(rest):
                break
            word, quote, escaped = [], "", False
            while at < len(rest) and (quote or rest[at] not in " \t\v\f\r"):
                char = rest[at]
                at += 1
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                    continue
                elif quote:
                    if char == quote:
                        quote = ""
                        continue
                elif char in "\"'":
                    quote = char
                    continue
                elif char == "#":
                    at = len(rest)
                    break
                word.append(char)
            assert not quote, f"sbatch would stop at an unmatched quote in {line!r}"
            if word:
                arguments.append("".join(word))
    return arguments


def check_script_text(script: str, tmp_path: Path) -> Path:
    """bash -n passes, and every line is printable text (no CR, no stray line breaks)."""
    for line in script.split("\n"):
        assert line.isprintable(), f"not printable: {line!r}"
    path = tmp_path / "job.sbatch"
    path.write_text(script, encoding="utf-8")
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return path


def stubs(tmp_path: Path, *names: str) -> Path:
    directory = tmp_path / "stubs"
    directory.mkdir(exist_ok=True)
    for name in ("srun", "scontrol", "module", *names):
        (directory / name).write_text(STUB)
        (directory / name).chmod(0o755)
    return directory


def job_environment(tmp_path: Path, log: Path) -> dict[str, str]:
    """A first run of a 4-task job under Slurm, with the stubs first on PATH logging to log."""
    env = dict(os.environ, PATH=f"{tmp_path / 'stubs'}:{os.environ['PATH']}", STUB_LOG=str(log),
               SLURM_JOB_ID="7", SLURM_NTASKS="4", SLURM_JOB_NODELIST="n[1-3]",
               TMPDIR=str(tmp_path))
    env.pop("SLURM_RESTART_COUNT", None)
    return env


def run_job(path: Path, tmp_path: Path) -> dict[str, bytes]:
    """Run the job script with the stubs first on PATH; what each stub recorded."""
    log = tmp_path / "log"
    log.mkdir(exist_ok=True)
    for old in log.iterdir():
        old.unlink()
    proc = subprocess.run(["bash", str(path)], cwd=tmp_path, env=job_environment(tmp_path, log),
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return {p.name: p.read_bytes() for p in log.iterdir()}


def argv(recorded: bytes) -> list[bytes]:
    assert recorded.endswith(b"\0")
    return recorded[:-1].split(b"\0")


def encoded(words: list[str]) -> list[bytes]:
    return [os.fsencode(word) for word in words]


def assert_nothing_ran(tmp_path: Path) -> None:
    pwned = [p for p in tmp_path.rglob("*") if re.fullmatch(r"pwned-\d+", p.name)]
    assert not pwned, f"a value ran as a command: {pwned}"


SHAPES = {
    "srun": ({}, ["--mpi=pmix", *SITE["srun_args"]]),
    "het-steps": ({"het": "steps", "nodes": 1, "ntasks_per_node": 2},
                  ["--mpi=pmix", "--het-group=0,1", *SITE["srun_args"]]),
    "het-nodes": ({"het": "nodes", "nodes": 2, "ntasks_per_node": 2},
                  ["--mpi=pmix", "--distribution=arbitrary", "--ntasks=5", *SITE["srun_args"]]),
    "mpiexec": ({"launcher": "mpiexec"},
                ["-n", "4", "--bind-to", "none", *SITE["mpiexec_args"]]),
}


def test_the_job_script_leaves_no_process_holding_its_output(tmp_path):
    """The step's watchdog is stopped with its sleep when the step ends. A sleep left behind
    kept the job's output open for up to 5 s after the script exited (each run_job above took
    5 s for a launcher stub that exits at once)."""
    stubs(tmp_path)
    script, _ = render(JobSpec(command=train_command("runs/plain"), time="00:10:00"))
    path = check_script_text(script, tmp_path)
    proc = subprocess.Popen(["bash", str(path)], cwd=tmp_path,
                            env=job_environment(tmp_path, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        assert proc.wait(timeout=60) == 0
        # Whatever the script started ended with it: its output reaches its end at once.
        try:
            output, _ = proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            pytest.fail("a process the job script started still holds its output")
    finally:
        proc.kill()  # a hung script fails the test, not CI
        proc.stdout.close()
    assert b"the job step exited with 0" in output, output


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_hostile_values_arrive_intact_and_never_run(tmp_path, shape):
    changes, launcher_args = SHAPES[shape]
    mpiexec_name = "my mpiexec $(touch pwned-17)"
    stub_dir = stubs(tmp_path, mpiexec_name)
    site_file = tmp_path / "site.json"
    site_file.write_text(json.dumps({**SITE, "mpiexec": str(stub_dir / mpiexec_name)}))
    mpirl = "/opt/my mpirl/`touch pwned-18`/mpirl"
    spec = JobSpec(command=train_command(), time="01:00:00", mpirl=mpirl, account="proj$(x)",
                   output="logs dir/%x $(touch pwned-9)-%j.out", **changes)
    script, run_dir = render(spec, load_site(site_file))
    assert run_dir == RUN_DIR
    path = check_script_text(script, tmp_path)

    options = sbatch_arguments(script)
    for option in (f"--job-name=mpirl-{Path(RUN_DIR).name}", f"--partition={SITE['partition']}",
                   "--account=proj$(x)", *SITE["sbatch"],
                   "--output=logs dir/%x $(touch pwned-9)-%j.out"):
        assert option in options, (option, options)
    assert options.count("hetjob") == (shape == "het-steps")

    recorded = run_job(path, tmp_path)
    launcher = mpiexec_name if shape == "mpiexec" else "srun"
    got = argv(recorded[f"{launcher}.argv"])
    assert got[:len(launcher_args)] == encoded(launcher_args)
    job = got[len(launcher_args):]
    expected = [mpirl, *train_command()]
    if shape.startswith("het"):  # the config is merged and given once, at the end
        assert json.loads(job[-1]) == {**CONFIG, "num_learners": 1}
        at = expected.index("--config")
        expected = [*expected[:at], *expected[at + 2:], "--config"]
        job = job[:-1]
    assert job == encoded(expected)
    assert argv(recorded["module.argv"]) == encoded(["load", *SITE["modules"]])
    assert recorded[f"{launcher}.tag"] == SITE["env"]["TAG"].encode()
    assert (tmp_path / "setup-saw").read_bytes() == SITE["env"]["TAG"].encode()

    # A requeued job finds params.json and resumes: the same words, after --resume RUN_DIR.
    (tmp_path / RUN_DIR).mkdir(parents=True)
    (tmp_path / RUN_DIR / "params.json").write_text("{}")
    resumed = argv(run_job(path, tmp_path)[f"{launcher}.argv"])[len(launcher_args):]
    assert resumed[:4] == encoded([mpirl, "train", "--resume", RUN_DIR])
    assert_nothing_ran(tmp_path)


PLAIN = ["train", "--run-dir", "runs/x", "--algo", "PPO", "--env", "CartPole-v1"]
CLI_CASES = {
    # A pretty-printed --config used to end the "# Rendered by:" comment: bash -n failed.
    "pretty-config": [*PLAIN, "--config", json.dumps(CONFIG, indent=2)],
    # ... and a crafted argument ran as a command from that comment.
    "crafted": [*PLAIN, "--env-module", "x\ntouch pwned-23 #"],
    "everything": train_command(),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_the_cli_round_trips_every_byte_and_its_header_is_one_line(tmp_path, case):
    """Through ``mpirl slurm`` itself: the words (a non-UTF-8 byte among them) come back from
    the script's command and from its ``# Rendered by:`` line exactly as they were given."""
    stubs(tmp_path)
    words = encoded(["--time", "10", "--mpirl", "mpirl", "--", *CLI_CASES[case]])
    if case == "everything":
        words += [b"--env-module", b"not utf-8 \xff\xfe $(touch pwned-19)"]
    proc = subprocess.run([MPIRL.encode(), b"slurm", *words], capture_output=True, timeout=60,
                          env=mpi_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    script = proc.stdout.decode("utf-8", "surrogateescape")
    path = check_script_text(script, tmp_path)
    got = argv(run_job(path, tmp_path)["srun.argv"])
    assert_nothing_ran(tmp_path)
    assert got == [b"--mpi=pmix", b"mpirl", *words[words.index(b"--") + 1:]]

    header = [line for line in script.split("\n") if line.startswith("# Rendered by: ")]
    assert len(header) == 1
    echo = subprocess.run(["bash", "-c", "printf '%s\\0' " + header[0].removeprefix(
        "# Rendered by: ")], capture_output=True, timeout=30, cwd=tmp_path)
    assert argv(echo.stdout) == [b"mpirl", b"slurm", *words]
    assert_nothing_ran(tmp_path)


def test_a_run_dir_with_a_newline_needs_a_job_name(tmp_path):
    run_dir = "runs/a\nb"
    spec = JobSpec(command=["train", "--run-dir", run_dir, "--algo", "PPO", "--env", "E"],
                   time="10", mpirl="mpirl")
    with pytest.raises(ConfigError, match="job name made from the run directory's name .*"
                                          "choose another with --job-name"):
        render(spec)
    spec.job_name = "ok name"
    script, _ = render(spec)
    assert "RUN_DIR=$'runs/a\\nb'" in script
    assert "--job-name=ok name" in sbatch_arguments(script)
    check_script_text(script, tmp_path)


@pytest.mark.parametrize(("spec", "site", "message"), [
    ({"job_name": "a\nb"}, {}, "--job-name 'a\\nb' holds a control character"),
    ({"output": "x\r.out"}, {}, "--output 'x\\r.out' holds a control character"),
    ({}, {"partition": "gpu\n#SBATCH --x"}, "site file partition"),
    ({}, {"sbatch": ["--qos=high\nrm -rf ~"]}, "site file sbatch entry"),
    ({}, {"sbatch": ["hetjob"]}, "site file sbatch entry 'hetjob' is not an sbatch option"),
    ({}, {"sbatch": ["--comment=\ttab"]}, "holds a control character"),
    ({}, {"setup": ["echo 'open quote"]}, "site file setup line \"echo 'open quote\" is not "
                                          "complete shell code"),
    ({}, {"setup": ["if true; then"]}, "is not complete shell code"),
    ({}, {"env": {"A;B": "1"}}, "site file env name 'A;B' is not a shell variable name"),
    ({}, {"env": {"A": "nul\0"}}, "site file env A 'nul\\x00' holds a NUL character"),
    ({}, {"modules": ["\ud800"]}, "site file module '\\ud800' is not valid text"),
    ({"het": "steps; x"}, {}, "--het must be one of steps, nodes"),
])
def test_values_that_cannot_be_made_safe_are_refused(spec, site, message):
    job = JobSpec(**{"command": ["train", "--algo", "PPO", "--env", "E"], "time": "10",
                     "run_dir": "runs/x", **spec})
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        render(job, Site(**site))
    assert "\n" not in str(caught.value)


def test_cli_refuses_an_unsafe_value_in_one_line_with_exit_2(tmp_path):
    proc = subprocess.run([MPIRL, "slurm", "--time", "10", "--", "train", "--algo", "PPO",
                           "--env", "CartPole-v1", "--run-dir", "runs/a\n$(touch pwned-1)"],
                          capture_output=True, text=True, timeout=60, env=mpi_env(),
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("mpirl slurm: error: the job name made from the run "
                                  "directory's name"), proc.stderr
    assert_nothing_ran(tmp_path)
