"""Run outputs: the run directory, TensorBoard event files, the progress display, the plots."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpirl.errors import ConfigError
from mpirl.jobs import run_dir as run_dir_module
from mpirl.jobs.run_dir import RunRecorder, default_run_dir
from mpirl.report.output_log import OutputLog
from mpirl.report.plot import find_runs, plot_runs
from mpirl.report.progress import ProgressDisplay, returns_reached, terminal_columns
from mpirl.report.tensorboard import EventWriter

# --- TensorBoard files, read by TensorBoard's own EventAccumulator -----------------------------


def read_tensorboard(path: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def scalars(path: Path) -> list[tuple[str, float, int]]:
    """Every scalar of the event file (or directory) ``path``: (tag, value, step)."""
    accumulator = read_tensorboard(path)
    return [(tag, event.value, event.step) for tag in accumulator.Tags()["scalars"]
            for event in accumulator.Scalars(tag)]


def event_file(logdir: Path) -> Path:
    (path,) = logdir.glob("events.out.tfevents.*")
    return path


# --- EventWriter -------------------------------------------------------------------------------


def test_event_writer_round_trip(tmp_path):
    with EventWriter(tmp_path) as writer:
        writer.add_scalar("loss", 0.5, step=1, wall_time=1000.25)
        writer.add_scalar("episode_return_mean", -187.25, step=2**40)
        writer.add_scalar("ünïcode/tag", 3.0, step=5)
        writer.add_scalar("huge", 1e300, step=3)
        writer.add_scalar("nan", math.nan, step=4)
        writer.add_histogram("weights/w", [1.0, 2.0, 2.0, math.nan], step=6)
    path = event_file(tmp_path)
    assert path.name.startswith("events.out.tfevents.")
    accumulator = read_tensorboard(path)
    got = scalars(path)
    assert ("loss", 0.5, 1) in got and ("episode_return_mean", -187.25, 2**40) in got
    assert ("ünïcode/tag", 3.0, 5) in got and ("huge", math.inf, 3) in got  # float32
    (nan,) = accumulator.Scalars("nan")
    assert math.isnan(nan.value)
    assert accumulator.Scalars("loss")[0].wall_time == 1000.25
    (histogram,) = accumulator.Histograms("weights/w")
    assert histogram.step == 6
    value = histogram.histogram_value
    assert (value.num, value.min, value.max, value.sum) == (3, 1.0, 2.0, 5.0)  # NaN dropped


def test_add_scalars_writes_a_row_as_one_event(tmp_path):
    row = {"iteration": 3, "perf/driver_cpu_ms_per_iter": 1.25, "return mean:last": -2.0,
           "/leading": 7.0}
    with EventWriter(tmp_path) as writer:
        writer.add_scalars(row, step=300)
        writer.add_scalars({"iteration": 4}, step=400)
    path = event_file(tmp_path)
    assert sorted(scalars(path)) == sorted([
        ("iteration", 3.0, 300), ("iteration", 4.0, 400),
        ("perf/driver_cpu_ms_per_iter", 1.25, 300),
        ("return_mean_last", -2.0, 300),  # characters TensorBoard's tags may not hold
        ("leading", 7.0, 300)])
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    events = [event for event in EventFileLoader(str(path)).Load() if event.HasField("summary")]
    assert [len(event.summary.value) for event in events] == [4, 1]


def test_two_event_writers_in_one_directory_get_separate_files(tmp_path):
    with EventWriter(tmp_path) as first, EventWriter(tmp_path) as second:
        first.add_scalar("a", 1.0, step=0)
        second.add_scalar("b", 2.0, step=0)
    assert first.path != second.path
    assert scalars(first.path) == [("a", 1.0, 0)]
    assert scalars(second.path) == [("b", 2.0, 0)]


# --- RunRecorder -------------------------------------------------------------------------------


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_result_json_lags_at_most_its_interval_and_is_current_after_sync_and_close(
        tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir_module, "RESULT_WRITE_S", 3600.0)

    def result() -> dict:
        return json.loads((tmp_path / "result.json").read_text())

    recorder = RunRecorder(tmp_path, {})
    recorder.record({"iteration": 1})
    assert result() == {"iteration": 1}  # the first row at once: a run shows it has begun
    recorder.record({"iteration": 2})
    assert result() == {"iteration": 1}
    recorder.sync()  # as before a checkpoint
    assert result() == {"iteration": 2}
    recorder.record({"iteration": 3})
    assert result() == {"iteration": 2}
    recorder.close()
    assert result() == {"iteration": 3}
    assert [r[0] for r in read_csv(tmp_path / "progress.csv")] == ["iteration", "1", "2", "3"]


def test_rows_written_in_the_background_are_on_disk_after_sync_in_order(tmp_path):
    recorder = RunRecorder(tmp_path, {}, in_background=True)
    for i in range(1, 51):
        recorder.record({"iteration": i, "loss": 1 / i})
    recorder.sync()  # as before a checkpoint: every row handed over is written
    rows = read_csv(tmp_path / "progress.csv")
    assert [r[0] for r in rows] == ["iteration", *map(str, range(1, 51))]
    assert json.loads((tmp_path / "result.json").read_text())["iteration"] == 50
    recorder.record({"iteration": 51, "loss": 0.0})
    recorder.close()
    assert read_csv(tmp_path / "progress.csv")[-1] == ["51", "0.0"]
    assert json.loads((tmp_path / "result.json").read_text())["iteration"] == 51


def test_a_row_that_fails_in_the_background_is_raised_on_the_callers_thread(tmp_path):
    class FailingLogger:
        def log(self, row, step):
            if row["iteration"] == 3:
                raise OSError("the logger's disk is full")

        def close(self):
            pass

    recorder = RunRecorder(tmp_path, {}, loggers=[FailingLogger()], in_background=True)
    for i in range(1, 4):
        recorder.record({"iteration": i})
    with pytest.raises(OSError, match="disk is full"):
        recorder.sync()
    recorder.close()  # raised once; closing then works
    assert [r[0] for r in read_csv(tmp_path / "progress.csv")] == ["iteration", "1", "2", "3"]


def test_run_recorder_writes_params_progress_result_and_events(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir_module, "RESULT_WRITE_S", 0.0)  # result.json at every row
    run_dir = tmp_path / "runs" / "ppo_0"
    params = {"lr": 3e-4, "env": "CartPole-v1", "algo": {"gamma": 0.99}}
    rows = [
        {"iteration": 1, "timesteps_total": 2048, "episode_return_mean": math.nan,
         "loss": 0.1 + 0.2, "note": "warm, up"},
        {"iteration": 2, "timesteps_total": 4096, "episode_return_mean": 21.5, "loss": 0.25,
         "note": None, "kl": 0.01},  # "kl" comes late: a column at the end, empty before
        {"iteration": 3, "timesteps_total": 6144, "loss": 1 / 3},  # two keys missing
    ]
    with RunRecorder(run_dir, params) as recorder:
        assert recorder.run_dir == run_dir
        for row in rows:
            recorder.record(row)
            # A key per line, for people reading it.
            assert len((run_dir / "result.json").read_text().splitlines()) == len(row) + 2
            assert json.loads((run_dir / "result.json").read_text()) == {
                key: None if isinstance(value, float) and math.isnan(value) else value
                for key, value in row.items()
            }

    # In the order given: a multi-agent run's policies are set up in theirs.
    assert (run_dir / "params.json").read_text() == json.dumps(params, indent=2) + "\n"
    assert read_csv(run_dir / "progress.csv") == [
        ["iteration", "timesteps_total", "episode_return_mean", "loss", "note", "kl"],
        ["1", "2048", "nan", "0.30000000000000004", "warm, up", ""],
        ["2", "4096", "21.5", "0.25", "", "0.01"],
        ["3", "6144", "", repr(1 / 3), "", ""],
    ]
    assert not list(run_dir.glob(".progress.csv*"))  # the widened copy was renamed into place
    assert float(read_csv(run_dir / "progress.csv")[3][3]) == 1 / 3  # floats round-trip exactly

    got = scalars(event_file(run_dir))
    assert ("kl", pytest.approx(0.01), 4096) in got
    assert ("episode_return_mean", 21.5, 4096) in got
    assert ("iteration", 3.0, 6144) in got
    assert not any(tag == "note" for tag, _, _ in got)
    assert len(got) == 4 + 5 + 3  # numbers only: no str, no None


def test_rows_are_fsynced_at_sync_not_per_row_and_tensorboard_lags_at_most_a_few_s(
        tmp_path, monkeypatch):
    import os

    import mpirl.jobs.run_dir as run_dir_module

    synced, clock = [], [1000.0]
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    monkeypatch.setattr(run_dir_module.time, "monotonic", lambda: clock[0])
    recorder = RunRecorder(tmp_path, {})
    csv_fd = recorder._csv_file.fileno()
    flushes = []
    monkeypatch.setattr(recorder._events, "flush", lambda: flushes.append(clock[0]))
    for i in range(1, 4):
        recorder.record({"iteration": i, "loss": 0.5})
    # Each row is in progress.csv at once (a killed process loses none), without an fsync each.
    assert len(read_csv(tmp_path / "progress.csv")) == 4 and csv_fd not in synced
    # TensorBoard's writer fsyncs its file at each flush: one every EVENTS_FLUSH_S at most.
    assert flushes == []
    clock[0] += run_dir_module.EVENTS_FLUSH_S
    recorder.record({"iteration": 4, "loss": 0.5})
    recorder.record({"iteration": 5, "loss": 0.5})
    assert len(flushes) == 1
    recorder.sync()  # before a checkpoint: every row on disk
    assert synced.count(csv_fd) == 1 and len(flushes) == 2
    recorder.close()
    assert synced.count(csv_fd) == 2
    assert len([tag for tag, _, _ in scalars(tmp_path) if tag == "loss"]) == 5


def test_run_recorder_accepts_numpy_scalars(tmp_path):
    np = pytest.importorskip("numpy")
    with RunRecorder(tmp_path, {"n": np.int64(4)}) as recorder:
        recorder.record({"iteration": np.int64(1), "loss": np.float32(1.5)})
    assert read_csv(tmp_path / "progress.csv")[1] == ["1", "1.5"]
    assert json.loads((tmp_path / "result.json").read_text()) == {"iteration": 1, "loss": 1.5}
    assert json.loads((tmp_path / "params.json").read_text()) == {"n": 4}


def test_step_falls_back_to_iteration(tmp_path):
    with RunRecorder(tmp_path, {}) as recorder:
        recorder.record({"iteration": 7, "loss": 2.0})
    assert ("loss", 2.0, 7) in scalars(event_file(tmp_path))


def test_resume_appends_under_the_existing_header(tmp_path):
    with RunRecorder(tmp_path, {"lr": 1}) as recorder:
        recorder.record({"iteration": 1, "timesteps_total": 10, "loss": 0.5})
    with open(tmp_path / "progress.csv", "a") as file:
        file.write("2,20,0.")  # a row cut short by a kill

    with RunRecorder(tmp_path, {"lr": 2}, resume=True) as recorder:
        assert recorder.columns == ["iteration", "timesteps_total", "loss"]
        # A different key order: the existing header's wins; a new key goes at its end.
        recorder.record({"loss": 0.25, "new": 1.0, "timesteps_total": 20, "iteration": 2})
        assert recorder.columns == ["iteration", "timesteps_total", "loss", "new"]

    # params.json holds what the run goes on with, so that the next --resume keeps it.
    assert json.loads((tmp_path / "params.json").read_text()) == {"lr": 2}
    assert read_csv(tmp_path / "progress.csv") == [
        ["iteration", "timesteps_total", "loss", "new"],
        ["1", "10", "0.5", ""],
        ["2", "20", "0.25", "1.0"],
    ]
    assert json.loads((tmp_path / "result.json").read_text())["new"] == 1.0


def test_a_late_column_survives_a_resume_that_drops_rows_and_a_kill_mid_rewrite(tmp_path):
    with RunRecorder(tmp_path, {}, in_background=True) as recorder:
        for i in range(1, 5):
            recorder.record({"iteration": i, **({"late": i / 2} if i >= 3 else {})})
    # A kill while a widened copy was being written leaves its temporary file, not a torn CSV.
    (tmp_path / ".progress.csv.tmp").write_text("iteration,late,la")
    # The checkpoint was at iteration 3: the resumed run does iteration 4 again.
    with RunRecorder(tmp_path, {}, resume=True, keep_iterations=3) as recorder:
        assert recorder.columns == ["iteration", "late"]
        recorder.record({"iteration": 4, "late": 2.0})
        recorder.record({"iteration": 5, "late": 2.5, "later": 1})
    assert read_csv(tmp_path / "progress.csv") == [
        ["iteration", "late", "later"], ["1", "", ""], ["2", "", ""], ["3", "1.5", ""],
        ["4", "2.0", ""], ["5", "2.5", "1"]]
    assert not (tmp_path / ".progress.csv.tmp").exists()


def test_resume_without_existing_files_starts_fresh(tmp_path):
    with RunRecorder(tmp_path / "new", {"a": 1}, resume=True) as recorder:
        recorder.record({"iteration": 1})
    assert json.loads((tmp_path / "new" / "params.json").read_text()) == {"a": 1}
    assert read_csv(tmp_path / "new" / "progress.csv") == [["iteration"], ["1"]]


def test_without_resume_an_old_progress_csv_is_replaced(tmp_path):
    with RunRecorder(tmp_path, {"a": 1}) as recorder:
        recorder.record({"iteration": 1, "old": 1})
    with RunRecorder(tmp_path, {"a": 2}) as recorder:
        recorder.record({"iteration": 1, "new": 2})
    assert read_csv(tmp_path / "progress.csv") == [["iteration", "new"], ["1", "2"]]
    assert json.loads((tmp_path / "params.json").read_text()) == {"a": 2}


def test_record_after_close_raises(tmp_path):
    recorder = RunRecorder(tmp_path, {})
    recorder.close()
    recorder.close()
    with pytest.raises(ValueError, match="closed"):
        recorder.record({"iteration": 1})


# --- ProgressDisplay ---------------------------------------------------------------------------

ROW = {"iteration": 12, "timesteps_total": 24576, "env_steps_per_s": 2340.4,
       "episode_return_mean": 187.25, "episode_len_mean": 187.3, "time_total_s": 10.52}


def test_plain_progress_prints_one_line_per_update():
    stream = io.StringIO()
    with ProgressDisplay("ppo", total_steps=150_000, stream=stream) as display:
        assert not display.live  # a StringIO is no terminal
        display.update(ROW)
        display.update({**ROW, "iteration": 13, "episode_return_mean": None})
        display.update({**ROW, "iteration": 14, "episode_return_mean": math.nan})
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("iter 12  steps 24,576/150,000  2,340 steps/s  return 187.2  "
                        "len 187.3  time 10.5s")
    assert len(lines) == 3
    assert "return -  " in lines[1] and "iter 13" in lines[1]
    assert "return -  " in lines[2] and "iter 14" in lines[2]


def test_plain_progress_without_total_or_length():
    stream = io.StringIO()
    display = ProgressDisplay("ppo", stream=stream, mode="plain")
    row = {key: value for key, value in ROW.items() if key != "episode_len_mean"}
    display.update(row)
    display.close()
    assert stream.getvalue() == ("iter 12  steps 24,576  2,340 steps/s  return 187.2  "
                                 "time 10.5s\n")


def test_live_mode_is_chosen_on_a_terminal_but_not_in_ci(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("CI", raising=False)
    display = ProgressDisplay("ppo", stream=Terminal())
    assert display.live
    display.close()
    monkeypatch.setenv("CI", "true")
    assert not ProgressDisplay("ppo", stream=Terminal()).live


def test_the_line_shows_what_the_run_stops_on_and_labels_memory():
    stream = io.StringIO()
    # --stop values arrive as floats; a multi-agent run stops on its weakest policy's return.
    stop = {"timesteps_total": 20000.0, "policy_return_mean_min": 50.0,
            "training_iteration": 30.0, "time_total_s": 90.5}
    display = ProgressDisplay("ppo", stream=stream, mode="plain", stop=stop)
    display.update({**ROW, "policy_return_mean_min": 12.25, "perf/driver_rss_mb": 371.4,
                    "perf/max_worker_rss_mb": 76.2})
    display.update({**ROW, "perf/driver_rss_mb": 371.4, "perf/max_worker_rss_mb": math.nan})
    first, second = stream.getvalue().splitlines()
    assert first == ("iter 12/30  steps 24,576/20,000  2,340 steps/s  return 187.2  "
                     "policy_return_mean_min 12.2/50  len 187.3  "
                     "mem driver 371 MB, workers \u2264 76 MB  time 10.5s/90.5s")
    assert "policy_return_mean_min -/50" in second and "mem driver 371 MB  " in second
    stream = io.StringIO()
    ProgressDisplay("ppo", stream=stream, mode="plain",
                    stop={"episode_return_mean": 475.0}).update(ROW)
    assert "return 187.2/475  " in stream.getvalue()


@pytest.mark.parametrize("mode", ["plain", "live", "off"])
def test_the_log_gets_plain_lines_whatever_is_shown(mode, monkeypatch):
    import sys

    stream, log = io.StringIO(), io.StringIO()
    before = sys.stdout, sys.stderr
    with ProgressDisplay("ppo", mode=mode, stream=stream, log=log) as display:
        display.update(ROW)
        print("a line printed meanwhile")
        display.update({**ROW, "iteration": 13})
    assert "\x1b" not in log.getvalue()
    lines = log.getvalue().splitlines()
    assert [line.split()[1] for line in lines if line.startswith("iter")] == ["12", "13"]
    # While the live display runs, what is printed goes to the log too (above the bar).
    assert ("a line printed meanwhile" in lines) == (mode == "live")
    assert (sys.stdout, sys.stderr) == before


def test_output_log_copies_what_is_printed_and_is_shared_by_a_nested_run(tmp_path, capsys):
    import sys

    with OutputLog(tmp_path, header="mpirl train, pid 1") as output:
        print("to both")
        print("an error", file=sys.stderr)
        output.write("to the file alone\n")
        with OutputLog(tmp_path) as nested:  # a run inside: the same file, no second header
            assert nested.file is output.file
            nested.write("never written: the outer log had it\n")
            print("nested")
        assert output.terminal is not None
    print("after")
    shown = capsys.readouterr()
    assert shown.out == "to both\nnested\nafter\n" and shown.err == "an error\n"
    lines = (tmp_path / "output.log").read_text().splitlines()
    assert lines[0].startswith("--- ") and lines[0].endswith(" mpirl train, pid 1")
    assert lines[1:] == ["to both", "an error", "to the file alone", "nested"]
    # echo=False (a tune trial's segment): the file only.
    with OutputLog(tmp_path, echo=False) as output:
        print("quiet")
        assert output.terminal is None
    assert capsys.readouterr().out == ""
    assert (tmp_path / "output.log").read_text().endswith("nested\nquiet\n")


@pytest.mark.parametrize("total_steps", [150_000, None])
def test_live_progress_renders(total_steps):
    stream = io.StringIO()
    with ProgressDisplay("ppo CartPole", total_steps=total_steps, mode="live",
                         stream=stream) as display:
        assert display.live
        display.update({**ROW, "episode_return_mean": None, "timesteps_total": None})
        display.update(ROW)
    output = stream.getvalue()
    assert "ppo CartPole" in output
    assert "24,576" in output and "187.2" in output and "iter 12" in output
    assert "return -" in output


WIDE_ROW = {**ROW, "perf/driver_rss_mb": 371.4, "perf/max_worker_rss_mb": 76.2,
            "num_env_failures": 3, "model_error": 0.0123, "eval_return_mean": -151.25}


def _screen_lines(output: str) -> list[str]:
    """What a terminal shows of ``output``, line by line: escape codes gone, and a carriage
    return (the live display redrawing) starting a line of its own."""
    import re

    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output)
    return [line for line in re.split(r"[\r\n]", plain) if line]


def test_the_live_line_fits_80_columns_and_the_log_keeps_every_field(monkeypatch):
    """At 80 columns every live line wrapped: the stats line was 110-150 characters."""
    monkeypatch.setenv("COLUMNS", "80")
    stream, log = io.StringIO(), io.StringIO()
    stop = {"timesteps_total": 1_000_000.0, "episode_return_mean": 475.0, "time_total_s": 600.0}
    with ProgressDisplay("PPO CartPole-v1", mode="live", stream=stream, stop=stop,
                         log=log) as display:
        display.update(WIDE_ROW)
    lines = _screen_lines(stream.getvalue())
    assert max(map(len, lines)) <= 80, lines
    # The lower-priority fields went, what decides stays.
    assert lines[-1] == ("iter 12  steps 24,576/1,000,000  return 187.2/475  eval -151.2  "
                         "time 10.5s/600s"), lines
    assert "mem driver 371 MB, workers \u2264 76 MB" in log.getvalue()
    assert "env failures 3" in log.getvalue() and "len 187.3" in log.getvalue()
    # Wide enough, nothing is dropped; far too narrow, the line is cut, never wrapped.
    monkeypatch.setenv("COLUMNS", "200")
    stream = io.StringIO()
    with ProgressDisplay("PPO", mode="live", stream=stream) as display:
        display.update(WIDE_ROW)
    assert "mem driver 371 MB" in _screen_lines(stream.getvalue())[-1]
    monkeypatch.setenv("COLUMNS", "30")
    stream = io.StringIO()
    with ProgressDisplay("PPO", mode="live", stream=stream) as display:
        display.update(WIDE_ROW)
    assert max(map(len, _screen_lines(stream.getvalue()))) <= 30


def test_under_mpiexec_the_width_is_that_of_the_launchers_terminal(tmp_path, monkeypatch):
    """The width is that of the terminal mpiexec writes to (asked at every update: it may be
    resized), unless $COLUMNS says; nothing when mpiexec writes to a file."""
    import fcntl
    import os
    import struct
    import termios

    monkeypatch.delenv("COLUMNS", raising=False)
    master, slave = os.openpty()
    try:
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
        launcher = tmp_path / str(os.getppid())
        (launcher / "fd").mkdir(parents=True)
        (launcher / "comm").write_text("mpiexec\n")
        (launcher / "fd" / "1").symlink_to(os.ttyname(slave))
        assert terminal_columns(tmp_path) == 132
        (launcher / "fd" / "1").unlink()
        (launcher / "fd" / "1").symlink_to(tmp_path / "output.log")  # > output.log
        (tmp_path / "output.log").write_text("")
        assert terminal_columns(tmp_path) is None
        monkeypatch.setenv("COLUMNS", "90")  # the user's own setting wins
        assert terminal_columns(tmp_path) == 90
    finally:
        os.close(master)
        os.close(slave)


def test_a_multi_agent_line_shows_each_policys_return_not_the_zero_sum():
    """A self-play run of a zero-sum game (NumberDuel) showed ``return 0.0`` for 50 iterations:
    the env's return sums both seats. Each policy's own return is what moves."""
    stream = io.StringIO()
    row = {**ROW, "episode_return_mean": 0.0, "episode_return_mean/main": 0.43,
           "policy_return_mean_min": 0.43}
    ProgressDisplay("PPO NumberDuel", stream=stream, mode="plain").update(row)
    assert "  return main 0.4  " in stream.getvalue(), stream.getvalue()
    assert "return 0.0" not in stream.getvalue()
    # Several policies, each its own; a per-policy criterion shows its target there, and the
    # summed return, when it is a criterion, as one.
    stream = io.StringIO()
    stop = {"episode_return_mean/a": 50.0, "episode_return_mean": 80.0}
    ProgressDisplay("PPO", stream=stream, mode="plain", stop=stop).update(
        {**ROW, "episode_return_mean/a": 20.06, "episode_return_mean/b": math.nan})
    line = stream.getvalue()
    assert "  return a 20.1/50 b -  episode_return_mean 187.2/80  " in line, line
    assert line.count("episode_return_mean") == 1


def test_an_evaluation_the_run_stops_on_is_shown_once():
    """MBPO stopping on eval_return_mean showed ``eval_return_mean -133.2/-150`` and then
    ``eval -133.2``."""
    stream = io.StringIO()
    display = ProgressDisplay("mbpo", stream=stream, mode="plain",
                              stop={"eval_return_mean": -150.0})
    display.update({**ROW, "eval_return_mean": -133.25})
    display.update({**ROW, "eval_return_mean": math.nan})
    first, second = stream.getvalue().splitlines()
    assert first.count("-133.2") == 1 and "  eval -133.2/-150  " in first, first
    assert "  eval -/-150  " in second, second


def test_the_closing_line_names_each_return_once():
    """``stopped: episode_return_mean reached (451.85) ...; episode_return_mean 451.9`` said it
    twice; a self-play run's summed return (0 in a zero-sum game) said nothing."""
    row = {**ROW, "eval_return_mean": -133.25}
    assert returns_reached(row, "episode_return_mean") == "eval_return_mean -133.2"
    assert returns_reached(row, "eval_return_mean") == "episode_return_mean 187.2"
    assert returns_reached(row, "training_iteration") == ("episode_return_mean 187.2, "
                                                          "eval_return_mean -133.2")
    assert returns_reached({**ROW, "episode_return_mean": math.nan}, "timesteps_total") == ""
    duel = {**ROW, "episode_return_mean": 0.0, "episode_return_mean/main": 0.61}
    assert returns_reached(duel, "training_iteration") == "episode_return_mean/main 0.6"


# --- plot_runs ---------------------------------------------------------------------------------


def fake_run(path: Path, scale: float) -> Path:
    with RunRecorder(path, {"scale": scale}) as recorder:
        for i in range(1, 11):
            recorder.record({"iteration": i, "timesteps_total": 1000 * i,
                             "time_total_s": 0.5 * i * scale,
                             "episode_return_mean": math.nan if i == 1 else scale * i ** 0.5})
    return path


def test_plot_runs_writes_a_png(tmp_path):
    runs = [fake_run(tmp_path / "a" / "seed_0", 1.0), fake_run(tmp_path / "b" / "seed_0", 2.0),
            fake_run(tmp_path / "fast", 0.5)]
    out = plot_runs(runs, tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000


def test_plot_runs_errors_name_the_path(tmp_path):
    good = fake_run(tmp_path / "good", 1.0)
    with pytest.raises(ConfigError, match="missing_run"):
        plot_runs([good, tmp_path / "missing_run"], tmp_path / "out.png")

    (tmp_path / "no_csv").mkdir()
    with pytest.raises(ConfigError, match=r"no_csv has no progress\.csv"):
        plot_runs([tmp_path / "no_csv"], tmp_path / "out.png")

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "progress.csv").write_text("")
    with pytest.raises(ConfigError, match=r"empty.progress\.csv is empty"):
        plot_runs([tmp_path / "empty"], tmp_path / "out.png")

    (tmp_path / "header_only").mkdir()
    (tmp_path / "header_only" / "progress.csv").write_text(
        "timesteps_total,time_total_s,episode_return_mean\n")
    with pytest.raises(ConfigError, match="header_only.progress.csv has a header but no rows"):
        plot_runs([tmp_path / "header_only"], tmp_path / "out.png")

    (tmp_path / "no_return").mkdir()
    (tmp_path / "no_return" / "progress.csv").write_text("timesteps_total,time_total_s\n1,2\n")
    with pytest.raises(ConfigError, match="no_return.*episode_return_mean"):
        plot_runs([tmp_path / "no_return"], tmp_path / "out.png")

    with pytest.raises(ConfigError, match=r"lacks the column\(s\) x needed"):
        plot_runs([good], tmp_path / "out.png", x="x")
    assert not (tmp_path / "out.png").exists()


def test_a_folder_of_runs_or_a_tune_directory_plots_every_run_below_it(tmp_path):
    # What `mpirl tune` leaves: trial run directories beside the population's own files.
    tune_dir = tmp_path / "runs" / "tune-PPO-CartPole-v1-1"
    trials = [fake_run(tune_dir / f"trial_{i:03d}", 1.0 + i) for i in range(3)]
    (tune_dir / "tune.csv").write_text("trial\n")
    (tune_dir / "result.json").write_text("{}\n")
    lone = fake_run(tmp_path / "runs" / "PPO-CartPole-v1-2", 0.5)
    assert find_runs([tune_dir]) == trials
    assert find_runs([tmp_path / "runs"]) == [lone, *trials]
    assert find_runs([tmp_path / "runs", lone]) == [lone, *trials]  # each run once
    # Without an output: curve.png in the folder given, or in the one holding all given.
    assert plot_runs([tune_dir]) == tune_dir / "curve.png"
    assert (tune_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_runs([lone, trials[0]]) == tmp_path / "runs" / "curve.png"
    assert plot_runs([lone]) == lone / "curve.png"
    with pytest.raises(ConfigError, match=r"curve\.png is a file, not a run directory"):
        plot_runs([tune_dir / "curve.png"])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ConfigError, match=r"nothing has no progress\.csv, nor any run directory "
                                          r"below it"):
        plot_runs([tmp_path / "nothing"])


@pytest.mark.parametrize("algo, env, name", [
    ("IMPALA", "ALE/Breakout-v5", "IMPALA-ALE-Breakout-v5-"),
    ("PPO", "my_envs.grid:GridEnv", "PPO-my_envs.grid_GridEnv-"),
    ("my_package.my_algo", "CartPole-v1", "my_package.my_algo-CartPole-v1-"),
])
def test_default_run_directories_are_one_folder_under_runs(algo, env, name):
    path = Path(default_run_dir(algo, env))
    assert path.parent == Path("runs") and path.name.startswith(name), path
    assert Path(default_run_dir(algo, env, prefix="tune-")).name.startswith(f"tune-{name}")


def test_the_line_shows_evaluation_and_model_error_when_a_run_reports_them():
    """PETS and MBPO report a learned model's held-out error and an evaluation's return; the
    line shows both (the model error because their configs' ``live_values`` name it), and
    leaves them out while they are NaN (no evaluation yet)."""
    from mpirl.algorithms.model_based.pets import Config as PETSConfig

    stream = io.StringIO()
    display = ProgressDisplay("pets", stream=stream, mode="plain",
                              values=PETSConfig().live_values())
    display.update({**ROW, "eval_return_mean": -151.25, "model_error": 0.004567})
    display.update({**ROW, "eval_return_mean": math.nan, "model_error": 0.25})
    first, second = stream.getvalue().splitlines()
    assert "len 187.3  eval -151.2  model err 0.00457  time 10.5s" in first
    assert "eval" not in second and "model err 0.25  " in second
    # Another plan's row with the same key: shared code shows only what a config names.
    other = io.StringIO()
    ProgressDisplay("ppo", stream=other, mode="plain").update({**ROW, "model_error": 0.25})
    assert "model err" not in other.getvalue()
