"""Run outputs: the run directory, TensorBoard event files, the progress display, the plots."""

from __future__ import annotations

import csv
import io
import json
import math
import struct
from pathlib import Path

import pytest

from mpirl.errors import ConfigError
from mpirl.jobs.run_dir import RunRecorder
from mpirl.report.plot import plot_runs
from mpirl.report.progress import ProgressDisplay
from mpirl.report.tensorboard import EventWriter, crc32c

# --- an independent reader of event files: bitwise CRC-32C, hand-decoded protobuf -------------


def bitwise_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 * (crc & 1))
    return crc ^ 0xFFFFFFFF


def unmasked(masked: int) -> int:
    rotated = (masked - 0xA282EAD8) % 2**32
    return ((rotated << 15) | (rotated >> 17)) & 0xFFFFFFFF


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def decode_fields(data: bytes) -> list[tuple[int, int, object]]:
    """(field number, wire type, raw value) for each field of a protobuf message."""
    fields = []
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = read_varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = read_varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        fields.append((field, wire, value))
    assert pos == len(data)
    return fields


def read_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    records = []
    pos = 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        assert unmasked(header_crc) == bitwise_crc32c(header), "length CRC mismatch"
        payload = data[pos + 12:pos + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        assert unmasked(payload_crc) == bitwise_crc32c(payload), "data CRC mismatch"
        records.append(payload)
        pos += 16 + length
    return records


def read_events(path: Path) -> list[dict]:
    events = []
    for record in read_records(path):
        event: dict = {"scalars": []}
        for field, wire, value in decode_fields(record):
            if (field, wire) == (1, 1):
                event["wall_time"] = struct.unpack("<d", value)[0]
            elif (field, wire) == (2, 0):
                # int64 as two's complement
                event["step"] = value - 2**64 if value >= 2**63 else value
            elif (field, wire) == (3, 2):
                event["file_version"] = value.decode()
            elif (field, wire) == (5, 2):
                for summary_field, _, summary_value in decode_fields(value):
                    assert summary_field == 1
                    parts = {f: v for f, _, v in decode_fields(summary_value)}
                    event["scalars"].append(
                        (parts[1].decode(), struct.unpack("<f", parts[2])[0]))
            else:
                raise AssertionError(f"unexpected Event field {field}")
        events.append(event)
    return events


def scalars(events: list[dict]) -> list[tuple[str, float, int]]:
    return [(tag, value, event["step"]) for event in events for tag, value in event["scalars"]]


def event_file(logdir: Path) -> Path:
    (path,) = logdir.glob("events.out.tfevents.*")
    return path


# --- EventWriter -------------------------------------------------------------------------------


def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720, B.4
    for data in (b"a", b"hello world", bytes(range(256))):
        assert crc32c(data) == bitwise_crc32c(data)


def test_event_writer_round_trip(tmp_path):
    with EventWriter(tmp_path) as writer:
        writer.add_scalar("loss", 0.5, step=1, wall_time=1000.25)
        writer.add_scalar("episode_return_mean", -187.25, step=2**40)
        writer.add_scalar("ünïcode/tag", 3.0, step=-1)
        writer.add_scalar("huge", 1e300, step=3)
        writer.add_scalar("nan", math.nan, step=4)
    path = event_file(tmp_path)
    assert path.name.startswith("events.out.tfevents.")
    events = read_events(path)
    assert events[0]["file_version"] == "brain.Event:2"
    assert events[0]["scalars"] == []
    got = scalars(events[1:])
    assert got[:4] == [("loss", 0.5, 1), ("episode_return_mean", -187.25, 2**40),
                       ("ünïcode/tag", 3.0, -1), ("huge", math.inf, 3)]
    assert got[4][0] == "nan" and math.isnan(got[4][1])
    assert events[1]["wall_time"] == 1000.25
    assert all(event["wall_time"] > 1e9 for i, event in enumerate(events) if i != 1)


def test_two_event_writers_in_one_directory_get_separate_files(tmp_path):
    with EventWriter(tmp_path) as first, EventWriter(tmp_path) as second:
        first.add_scalar("a", 1.0, step=0)
        second.add_scalar("b", 2.0, step=0)
    assert first.path != second.path
    assert scalars(read_events(first.path)) == [("a", 1.0, 0)]
    assert scalars(read_events(second.path)) == [("b", 2.0, 0)]


# --- RunRecorder -------------------------------------------------------------------------------


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_run_recorder_writes_params_progress_result_and_events(tmp_path):
    run_dir = tmp_path / "runs" / "ppo_0"
    params = {"lr": 3e-4, "env": "CartPole-v1", "algo": {"gamma": 0.99}}
    rows = [
        {"iteration": 1, "timesteps_total": 2048, "episode_return_mean": math.nan,
         "loss": 0.1 + 0.2, "note": "warm, up"},
        {"iteration": 2, "timesteps_total": 4096, "episode_return_mean": 21.5, "loss": 0.25,
         "note": None, "kl": 0.01},  # "kl" comes late: result.json and TensorBoard only
        {"iteration": 3, "timesteps_total": 6144, "loss": 1 / 3},  # two keys missing
    ]
    with RunRecorder(run_dir, params) as recorder:
        assert recorder.run_dir == run_dir
        for row in rows:
            recorder.record(row)
            assert json.loads((run_dir / "result.json").read_text()) == {
                key: None if isinstance(value, float) and math.isnan(value) else value
                for key, value in row.items()
            }

    assert (run_dir / "params.json").read_text() == json.dumps(params, indent=2,
                                                                sort_keys=True) + "\n"
    assert read_csv(run_dir / "progress.csv") == [
        ["iteration", "timesteps_total", "episode_return_mean", "loss", "note"],
        ["1", "2048", "nan", "0.30000000000000004", "warm, up"],
        ["2", "4096", "21.5", "0.25", ""],
        ["3", "6144", "", repr(1 / 3), ""],
    ]
    assert float(read_csv(run_dir / "progress.csv")[3][3]) == 1 / 3  # floats round-trip exactly

    got = scalars(read_events(event_file(run_dir)))
    assert ("kl", pytest.approx(0.01), 4096) in got
    assert ("episode_return_mean", 21.5, 4096) in got
    assert ("iteration", 3.0, 6144) in got
    assert not any(tag == "note" for tag, _, _ in got)
    assert len(got) == 4 + 5 + 3  # numbers only: no str, no None


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
    assert ("loss", 2.0, 7) in scalars(read_events(event_file(tmp_path)))


def test_resume_appends_under_the_existing_header(tmp_path):
    with RunRecorder(tmp_path, {"lr": 1}) as recorder:
        recorder.record({"iteration": 1, "timesteps_total": 10, "loss": 0.5})
    with open(tmp_path / "progress.csv", "a") as file:
        file.write("2,20,0.")  # a row cut short by a kill

    with RunRecorder(tmp_path, {"lr": 2}, resume=True) as recorder:
        assert recorder.columns == ["iteration", "timesteps_total", "loss"]
        # A different key order and a new key: the existing header wins.
        recorder.record({"loss": 0.25, "new": 1.0, "timesteps_total": 20, "iteration": 2})

    assert json.loads((tmp_path / "params.json").read_text()) == {"lr": 1}
    assert read_csv(tmp_path / "progress.csv") == [
        ["iteration", "timesteps_total", "loss"],
        ["1", "10", "0.5"],
        ["2", "20", "0.25"],
    ]
    assert json.loads((tmp_path / "result.json").read_text())["new"] == 1.0


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
