"""What rank 0 prints per iteration: plain lines in a file even though Open MPI gives every rank a
pseudo-terminal, a live display only on the user's own terminal, and --progress to override."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading

import pytest
from conftest import mpi_env, mpiexec_command, run_mpi

from mpirl.errors import ConfigError
from mpirl.report.progress import launcher_stdout_is_terminal, progress_mode

MPIRL = [sys.executable, "-m", "mpirl"]
ESC = b"\x1b"
#: The width of the terminal made for mpiexec: what every iteration's line used to pass.
COLUMNS = 64


def train_args(run_dir, *extra):
    return [*MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run_dir),
            "--stop", '{"training_iteration": 3}', *extra]


def no_ci():
    env = mpi_env()
    env.pop("CI", None)
    env.pop("COLUMNS", None)
    env.pop("MPIRL_PROGRESS", None)
    return env


def test_output_sent_to_a_file_has_plain_lines_and_no_escape_codes(tmp_path):
    # `mpiexec ... > log`: rank 0's stdout is Open MPI's pseudo-terminal, mpiexec's is the file.
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.run(mpiexec_command(2, *train_args(tmp_path / "run")), stdout=out,
                              stderr=subprocess.PIPE, timeout=120, env=no_ci())
    data = log.read_bytes()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert ESC not in data, data[-2000:]
    lines = data.decode().splitlines()
    assert [line.split()[1] for line in lines if line.startswith("iter ")] == [
        "1/3", "2/3", "3/3"]  # --stop training_iteration 3: its target shown
    assert lines[-1].startswith("stopped: training_iteration reached")


def test_the_live_display_is_kept_on_the_users_terminal(tmp_path):
    # mpiexec's stdout is a terminal (a pty made here): the live display is drawn, and each
    # line fits that terminal.
    master, slave = pty.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 24, COLUMNS, 0, 0))
    proc = subprocess.Popen(mpiexec_command(2, *train_args(tmp_path / "run")), stdout=slave,
                            stderr=subprocess.PIPE, env=no_ci())
    os.close(slave)
    chunks = []

    def read():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-3000:]
    finally:
        proc.kill()
        reader.join(timeout=10)
        os.close(master)
    data = b"".join(chunks)
    assert ESC in data, data[-2000:]
    assert b"PPO CartPole-v1" in data
    screen = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", data.decode()))
    live = [line for line in screen if line.startswith(("iter ", "PPO CartPole-v1"))]
    assert any(line.startswith("iter 3/3") for line in live), screen
    assert max(map(len, live)) <= COLUMNS, live
    # Each iteration's line is one line: it used to wrap, its last fields on a line of their own.
    stats = [line for line in screen if "steps/s" in line or "time " in line]
    assert all(line.startswith("iter ") and " time " in line for line in stats), stats


@pytest.mark.parametrize("mode, iteration_lines", [("plain", 3), ("off", 0)])
def test_progress_plain_prints_one_line_per_iteration_and_off_none(tmp_path, mode,
                                                                   iteration_lines):
    proc = run_mpi(2, *train_args(tmp_path / "run", "--progress", mode), timeout=120,
                   env={"CI": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\x1b" not in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == iteration_lines, proc.stdout
    assert "stopped: training_iteration reached" in proc.stdout
    # The run records every iteration whatever is shown.
    assert len((tmp_path / "run" / "progress.csv").read_text().splitlines()) == 1 + 3
    # ... and rank 0's output, in output.log: every line either mode, plain text (this was
    # test_cli_outputs.py's test_every_run_keeps_rank_0s_output_in_output_log, the same run).
    log = (tmp_path / "run" / "output.log").read_text().splitlines()
    assert log[0].startswith("--- ") and " mpirl train, pid " in log[0]
    assert log[1].startswith("mpirl layout: driver 1, rollout 1")
    assert [line.split()[1] for line in log if line.startswith("iter ")] == ["1/3", "2/3", "3/3"]
    assert log[-1].startswith("stopped: training_iteration reached (3)")
    assert "\x1b" not in "\n".join(log)
    for line in proc.stdout.splitlines():  # what the terminal got is in it
        assert line in log


def test_progress_live_is_drawn_even_into_a_file(tmp_path):
    proc = run_mpi(2, *train_args(tmp_path / "run", "--progress", "live"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\x1b" in proc.stdout


def test_mpirl_progress_sets_the_default_and_a_bad_value_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIRL_PROGRESS", "off")
    assert progress_mode(None) == "off"
    assert progress_mode("plain") == "plain"  # the flag wins
    monkeypatch.setenv("MPIRL_PROGRESS", "fancy")
    with pytest.raises(ConfigError, match=r"\$MPIRL_PROGRESS must be one of auto, live, plain, "
                                          r"off, got 'fancy'"):
        progress_mode(None)
    # End to end under mpiexec; one rank is enough for the line checked.
    proc = run_mpi(1, *train_args(tmp_path / "run"), timeout=90, env={"MPIRL_PROGRESS": "fancy"})
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == ("mpirl: error: $MPIRL_PROGRESS must be one of auto, "
                                           "live, plain, off, got 'fancy'")


def test_outside_a_launcher_the_own_terminal_decides(monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert launcher_stdout_is_terminal() is None  # pytest was not started by mpiexec
    monkeypatch.setenv("PMI_RANK", "0")  # a launcher this process cannot see: plain
    assert launcher_stdout_is_terminal() is False
