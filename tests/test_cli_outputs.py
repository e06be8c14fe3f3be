"""What a newcomer's runs leave and say, through the real CLI: Ctrl-C checkpoints and names the
command that continues, every run keeps its output in output.log, run directories of namespaced
env ids are one folder, plot and export write into the run directory, local mode says what it
folded, and $MPIRL_MAX_ITERATIONS caps train and every tune member."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import BIN, mpi_env, mpiexec_command, run_mpi

from mpirl.errors import EXIT_INTERRUPTED

MPIRL = str(BIN / "mpirl")
CARTPOLE = ["--algo", "PPO", "--env", "CartPole-v1"]


def iterations(run_dir: Path) -> list[int]:
    with open(run_dir / "progress.csv") as file:
        return [int(row["iteration"]) for row in csv.DictReader(file)]


def interrupt_when_training(command: list[str], run_dir: Path, send,
                            capture: bool = True) -> subprocess.Popen:
    """Start ``command`` in a session of its own; once ``run_dir`` has a result, ``send(proc)``
    the interrupt; return the process, ended (with ``capture``, its output in ``proc.out`` and
    ``proc.err``; without, its stdin is left open, as a terminal's would be)."""
    output = subprocess.PIPE if capture else subprocess.DEVNULL
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=output, stderr=output,
                            text=True, env=mpi_env({"CI": ""}), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "result.json").exists():
            assert proc.poll() is None, proc.communicate() if capture else proc.returncode
            assert time.monotonic() < deadline, "no first iteration within 120 s"
            time.sleep(0.1)
        send(proc)
        if capture:
            proc.out, proc.err = proc.communicate(timeout=120)
        else:
            proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc


def resume_command(stderr: str, run_dir: Path) -> list[str]:
    """The checkpoint and the command that rank 0's one line names."""
    line, = [line for line in stderr.splitlines() if "Continue with: " in line]
    assert re.search(rf"SIGINT on rank 0 \(driver 0\): wrote {run_dir}/checkpoints/checkpoint_"
                     rf"\d{{6}} at iteration \d+ and stopped \(exit code 130\)", line), line
    return shlex.split(line.split("Continue with: ")[1])


def test_ctrl_c_checkpoints_and_names_the_command_that_continues(tmp_path):
    # No launcher: Ctrl-C reaches the process group of the run itself, as a terminal sends it.
    run_dir = tmp_path / "run"
    proc = interrupt_when_training(
        [MPIRL, "train", *CARTPOLE, "--run-dir", str(run_dir), "--progress", "live",
         "--stop", '{"training_iteration": 100000}'],
        run_dir, lambda p: os.killpg(p.pid, signal.SIGINT))
    assert proc.returncode == EXIT_INTERRUPTED, proc.err
    assert "Traceback" not in proc.err
    command = resume_command(proc.err, run_dir)
    assert command == ["mpirl", "train", "--resume", str(run_dir)]
    # The live display's last line was finished (then the cursor shown again).
    assert proc.out.removesuffix("\x1b[?25h").endswith("\n"), proc.out[-300:]
    stopped_at = json.loads((run_dir / "result.json").read_text())["iteration"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == \
        f"checkpoint_{stopped_at:06d}"
    # output.log: plain lines, the iterations up to the interrupt, and the line that continues.
    log = (run_dir / "output.log").read_text()
    assert "\x1b" not in log and "mpirl layout:" in log
    assert [int(line.split()[1].split("/")[0]) for line in log.splitlines()
            if line.startswith("iter ")] == list(range(1, stopped_at + 1))
    assert log.splitlines()[-1].endswith(f"Continue with: mpirl train --resume {run_dir}")

    resumed = subprocess.run([MPIRL, *command[1:], "--stop",
                              json.dumps({"training_iteration": stopped_at + 2})],
                             capture_output=True, text=True, timeout=120, env=mpi_env())
    assert resumed.returncode == 0, resumed.stderr
    assert iterations(run_dir) == list(range(1, stopped_at + 3))
    log = (run_dir / "output.log").read_text()
    assert " (resuming)" in log and f"resumed from {run_dir}/checkpoints" in log


def test_ctrl_c_on_the_ranks_of_an_mpiexec_job_ends_it_with_130(tmp_path):
    """A SIGINT that reaches the ranks (srun's Ctrl-C, kill -INT): here to rank 0 alone, which
    stops every rank. (Open MPI's mpiexec, sent a SIGINT itself, kills the ranks within 0.5 s and
    exits 1: see mpirl.jobs.launch.)"""
    run_dir = tmp_path / "run"

    def interrupt_rank_0(_):
        holder = json.loads((run_dir / "run.lock").read_text())
        os.kill(holder["pid"], signal.SIGINT)

    proc = interrupt_when_training(
        mpiexec_command(2, MPIRL, "train", *CARTPOLE, "--run-dir", str(run_dir),
                        "--progress", "plain", "--stop", '{"training_iteration": 100000}'),
        run_dir, interrupt_rank_0)
    assert proc.returncode == EXIT_INTERRUPTED, proc.err
    assert resume_command(proc.err, run_dir) == ["mpiexec", "-n", "2", "mpirl", "train",
                                                 "--resume", str(run_dir)]


#: The session leader of the terminal test: runs its command in its own process group, as a
#: shell without job control does, then says what the command exited with and whether the
#: terminal's foreground group is its own again (a shell would wait on a stolen one).
_TERMINAL_LEADER = (
    "import os, signal, subprocess, sys\n"
    "signal.signal(signal.SIGINT, lambda *_: None)  # a Ctrl-C that reaches the shell\n"
    "code = subprocess.call(sys.argv[1:])\n"
    "print(f'exit code {code}; terminal given back: {os.tcgetpgrp(0) == os.getpgrp()}',"
    " flush=True)\n")


def run_in_terminal(command: list[str], run_dir: Path) -> str:
    """Run ``command`` as the foreground job of a new pseudo-terminal, type Ctrl-C (^C, which
    the terminal turns into SIGINT to its foreground process group) once ``run_dir`` has a
    result, and return everything the terminal showed."""
    import fcntl
    import select
    import termios

    main, tty = os.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-c", _TERMINAL_LEADER, *command], stdin=tty,
                            stdout=tty, stderr=tty, preexec_fn=own_terminal,
                            env=mpi_env({"CI": ""}))
    os.close(tty)
    shown = bytearray()

    def read_until(done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            if select.select([main], [], [], 0.05)[0]:
                try:
                    shown.extend(os.read(main, 65536))
                except OSError:  # the terminal's last process has gone
                    return

    try:
        read_until(lambda: (run_dir / "result.json").exists(), 120)
        assert (run_dir / "result.json").exists(), shown.decode(errors="replace")[-3000:]
        os.write(main, b"\x03")
        read_until(lambda: proc.poll() is not None, 120)
        read_until(lambda: False, 0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        os.close(main)
    return shown.decode(errors="replace")


def test_ctrl_c_in_a_terminal_running_mpiexec_checkpoints_and_says_the_true_exit_code(tmp_path):
    """A real Ctrl-C typed into the terminal that ``mpiexec -n 2 mpirl train`` runs in. mpiexec
    alone would end the job on it within 0.5 s (exit 1, often no checkpoint); rank 0 holds the
    terminal's foreground instead, so the SIGINT reaches it, every rank stops after a
    checkpoint, and the job exits 130, as its one line says."""
    run_dir = tmp_path / "run"
    shown = run_in_terminal(mpiexec_command(2, MPIRL, "train", *CARTPOLE, "--run-dir",
                                            str(run_dir), "--stop",
                                            '{"training_iteration": 100000}'), run_dir)
    visible = re.sub(r"\x1b\[\?25[hl]", "", shown)  # the live display's cursor off and on
    ended = re.search(r"(?m)^exit code (\d+); terminal given back: (\w+)", visible)
    assert ended, visible[-3000:]
    code = int(ended.group(1))
    assert (code, ended.group(2)) == (EXIT_INTERRUPTED, "True"), visible[-3000:]
    lines = [line for line in visible.splitlines() if "Continue with: " in line]
    assert len(lines) == 1, visible[-3000:]
    assert f"(exit code {code})" in lines[0]
    assert shlex.split(lines[0].split("Continue with: ")[1]) == [
        "mpiexec", "-n", "2", "mpirl", "train", "--resume", str(run_dir)]
    stopped_at = json.loads((run_dir / "result.json").read_text())["iteration"]
    assert f"wrote {run_dir}/checkpoints/checkpoint_{stopped_at:06d} " in lines[0]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == \
        f"checkpoint_{stopped_at:06d}"
    # Nothing after the line: the live display ended its last line before it, and mpiexec adds
    # no note of the non-zero exit (the ranks but rank 0 exit 0, rank 0 last).
    after = visible[visible.index(lines[0]) + len(lines[0]):visible.index(ended.group(0))]
    assert after.endswith("\n") and "non-zero status" not in after, repr(after)


def test_a_newcomers_atari_run_is_one_folder_with_its_log_plot_and_export(tmp_path, capsys,
                                                                         monkeypatch):
    """An ALE/ id, local mode with a layout of several workers, the iteration cap: one run
    directory under runs/, output.log, the folded roles said and recorded; then plot and export
    without -o write into it (in process: the CLI's main, as the console script calls it; both
    commands run end to end in the PBT test below and in test_models.py)."""
    from mpirl.cli import main

    config = {"num_rollout_workers": 2, "num_learners": 2, "num_envs_per_worker": 1,
              "rollout_fragment_length": 8, "minibatch_size": 8}
    proc = subprocess.run([MPIRL, "train", "--algo", "PPO", "--env", "ALE/Pong-v5",
                           "--config", json.dumps(config), "--progress", "plain"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=mpi_env({"MPIRL_MAX_ITERATIONS": "2"}))
    assert proc.returncode == 0, proc.stderr
    run_dir, = (tmp_path / "runs").iterdir()
    assert run_dir.is_dir() and run_dir.name.startswith("PPO-ALE-Pong-v5-"), run_dir
    assert iterations(run_dir) == [1, 2]
    folded = ("mpirl: local mode (world size 1) runs one in-process worker per role: "
              "num_rollout_workers 2 -> 1, num_learners 2 -> 1; launch 5 ranks (mpiexec -n 5) "
              "to run the layout as configured")
    capped = ("mpirl: MPIRL_MAX_ITERATIONS=2: this run stops after at most 2 training "
              "iterations, whatever --stop says")
    assert proc.stderr.count(folded) == 1 and proc.stderr.count(capped) == 1, proc.stderr
    params = json.loads((run_dir / "params.json").read_text())
    assert params["config"]["num_learners"] == 2  # what was asked for, and what ran:
    assert params["layout"]["folded"] == {"rollout": 2, "learner": 2}
    assert params["layout"]["ranks"]["learner"] == [0] and params["max_iterations"] == 2
    log = (run_dir / "output.log").read_text()
    for expected in (folded, capped, "iter 1  steps 8/1,000,000", "iter 2  steps 16/1,000,000",
                     "stopped: MPIRL_MAX_ITERATIONS reached (2)"):
        assert expected in log, log

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["plot", "runs"]) == 0
    plotted = capsys.readouterr()
    assert (tmp_path / "runs" / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["export", str(run_dir)]) == 0
    exported = capsys.readouterr()
    assert (run_dir / "PPO-ALE-Pong-v5-000002.npz").is_file(), exported.err
    # What a command made is its result, on stdout as evaluate's report is (they went to stderr).
    assert plotted.out == f"wrote {Path('runs') / 'curve.png'}\n", plotted.out
    assert exported.out.startswith(f"wrote {run_dir / 'PPO-ALE-Pong-v5-000002.npz'} (from "), \
        exported.out


def test_the_iteration_cap_ends_every_pbt_member_and_the_tune_directory_plots(tmp_path):
    """PBT to a --stop far away: the members end at the cap (the controller counts them done,
    rather than giving them segments that end at once for ever), each with its output.log;
    mpirl plot of the tune directory draws every member."""
    tune_dir = tmp_path / "pbt"
    proc = run_mpi(3, MPIRL, "tune", "--scheduler", "pbt", "--population", "2",
                   "--ranks-per-trial", "1", "--perturbation-interval", "2",
                   "--mutations", '{"lr": [1e-4, 1e-3]}', "--run-dir", str(tune_dir), "--",
                   *CARTPOLE, "--config", '{"num_envs_per_worker": 1}',
                   "--stop", '{"training_iteration": 50}', timeout=240,
                   env={"MPIRL_MAX_ITERATIONS": "3"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PPO on CartPole-v1, 2 slots of 1 rank; results in" in proc.stdout, proc.stdout
    assert proc.stderr.count("mpirl tune: MPIRL_MAX_ITERATIONS=3: every trial stops after at "
                             "most 3 training iterations") == 1, proc.stderr
    result = json.loads((tune_dir / "result.json").read_text())
    assert [(t["status"], t["last"]["iteration"]) for t in result["trials"]] == [
        ("TERMINATED", 3), ("TERMINATED", 3)], result
    for trial in ("trial_000", "trial_001"):
        assert iterations(tune_dir / trial) == [1, 2, 3]
        assert json.loads((tune_dir / trial / "params.json").read_text())["max_iterations"] == 3
        log = (tune_dir / trial / "output.log").read_text()
        assert "iter 3/4" in log and "stopped: MPIRL_MAX_ITERATIONS reached (3)" in log, log

    plotted = subprocess.run([MPIRL, "plot", str(tune_dir)], capture_output=True, text=True,
                             timeout=120, env=mpi_env())
    assert plotted.returncode == 0, plotted.stderr
    assert (tune_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# That every run keeps rank 0's output in output.log (--progress plain and off) is checked on
# test_progress_output.py's plain/off runs (the same command): one launch each instead of two.


def test_train_help_says_how_to_stop_a_run_its_exit_codes_and_its_variables():
    from mpirl.jobs.arguments import command_parser

    train = command_parser()._subparsers._group_actions[0].choices["train"]
    help_text = " ".join(train.format_help().split())
    for expected in ("Ctrl-C exit 130, also at a terminal running mpiexec",
                     "Ctrl-C under mpirl launch -- mpiexec -n N mpirl train ...: exit 75",
                     "0 a --stop criterion was met", "70 a rank was lost",
                     "75 stopped on request after a checkpoint",
                     "130 stopped by Ctrl-C after a checkpoint",
                     "MPIRL_MAX_ITERATIONS=N stop after at most N training iterations"):
        assert expected in help_text, help_text


def test_a_second_ctrl_c_ends_the_live_line_and_quits_at_once():
    """The second SIGINT kills the process as it would without mpirl, once the live display's
    partial line is ended (else the shell's prompt lands on it) and its cursor shown again."""
    program = (
        "import os, signal, sys\n"
        "from mpirl.report.progress import ProgressDisplay\n"
        "from mpirl.runtime import signals\n"
        "signals.install()\n"
        "with ProgressDisplay('PPO', mode='live', stream=sys.stdout) as display, "
        "signals.before_quitting(display.end_line):\n"
        "    display.update({'iteration': 1, 'timesteps_total': 10})\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    assert signals.received() == signal.SIGINT  # the first: a request, no more\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('still running')\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, env=mpi_env({"CI": ""}))
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert proc.stdout.endswith("\n\x1b[?25h"), repr(proc.stdout[-80:])


def test_live_display_end_line_ends_the_partial_line_and_shows_the_cursor():
    import io

    from mpirl.report.progress import ProgressDisplay

    stream = io.StringIO()
    display = ProgressDisplay("PPO CartPole-v1", mode="live", stream=stream)
    display.update({"iteration": 3, "timesteps_total": 300})
    assert not stream.getvalue().endswith("\n")  # the live line waits for its next redraw
    display.end_line()
    assert stream.getvalue().endswith("\n\x1b[?25h"), repr(stream.getvalue()[-60:])


def test_an_error_under_mpiexec_is_one_line_without_open_mpis_note():
    """Open MPI's mpiexec follows a rank's non-zero exit with a 7-line note unless that rank ends
    the job last: the other ranks exit 0 and rank 0 exits with the code once they are gone."""
    proc = run_mpi(3, MPIRL, "train", *CARTPOLE, "--config", '{"lr": -1}', timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        'mpirl: error: config key "lr" = -1 is out of range: must be a finite number > 0'], \
        proc.stderr
    assert proc.stdout == ""
