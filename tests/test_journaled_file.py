"""A dump file survives its writer's kill -9 at any moment: JournaledFile and recover(). No MPI."""

from __future__ import annotations

import fcntl
import json
import os
import random
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from conftest import fill_disk

from mpirl.data import journaled_file
from mpirl.data.dump_format import FORMAT_ATTR, serialize_space
from mpirl.data.episode_file import EpisodeFile
from mpirl.data.journaled_file import JOURNAL_SUFFIX, recover
from mpirl.data.reader import open_dataset
from mpirl.testing import kill_a_busy_dump_writer

ATTRS = {FORMAT_ATTR: 1, "observation_space": serialize_space(gym.spaces.Box(-1e6, 1e6, (4,))),
         "action_space": serialize_space(gym.spaces.Discrete(2)), "env_id": "Fake-v0"}

def _episodes(start: int, count: int) -> list[tuple[int, dict]]:
    return [(k, {"observations": np.full((21, 4), k, np.float32),
                 "actions": np.zeros(20, np.int64), "rewards": np.ones(20),
                 "terminations": np.arange(20) == 19, "truncations": np.zeros(20, bool),
                 "action_logp": np.zeros(20, np.float32)}) for k in range(start, start + count)]


def _read_back(path: Path) -> list[int]:
    """The episodes' local ids, each episode checked."""
    with open_dataset(path) as dataset:
        assert dataset.damaged == [], dataset.damaged
        ids = []
        for episode in dataset.iterate_episodes():
            assert episode.observations.shape == (21, 4) and len(episode.rewards) == 20
            ids.append(int(episode.observations[0, 0]))
        return sorted(ids)


def test_a_writer_killed_at_random_moments_leaves_every_confirmed_batch(tmp_path):
    # Before the journal, about 1 in 20 random kills, and most kills within a millisecond of
    # the close starting, left a file that HDF5 could not read.
    rng = random.Random()
    for trial in range(24):
        path = tmp_path / f"rollout-s0-w{trial}.hdf5"
        confirmed = kill_a_busy_dump_writer(path, ATTRS, lambda k: _episodes(k, 10),
                                            near_close=trial % 2 == 0, rng=rng)
        ids = _read_back(path)
        # Every confirmed batch is there, whole, and at most the batch in flight besides.
        assert ids == list(range(len(ids))), f"trial {trial}"
        assert len(ids) >= confirmed and len(ids) % 10 == 0, f"trial {trial}"
        assert not list(tmp_path.glob("*.journal*")), f"trial {trial}: a journal left behind"


def test_a_journal_left_half_applied_is_applied_by_the_reader(tmp_path, monkeypatch):
    path = tmp_path / "rollout-s0-w0.hdf5"
    file = EpisodeFile(path, ATTRS, 1, 4096)
    file.write(_episodes(0, 5))

    def killed_halfway(fd, size, patches):
        for offset, data in patches[:len(patches) // 2]:
            os.pwrite(fd, data, offset)
        raise KeyboardInterrupt  # where a kill -9 would stop the writer

    monkeypatch.setattr(journaled_file, "_apply", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        file.write(_episodes(5, 5))
    monkeypatch.undo()
    journal = path.with_name(path.name + JOURNAL_SUFFIX)
    assert journal.exists()
    assert _read_back(path) == list(range(10))  # the reader applied it
    assert not journal.exists()
    file.write(_episodes(10, 5))  # and the file goes on
    assert _read_back(path) == list(range(15))


def test_a_journal_never_committed_is_dropped_and_the_last_batch_stays(tmp_path, monkeypatch):
    path = tmp_path / "rollout-s0-w0.hdf5"
    file = EpisodeFile(path, ATTRS, 1, 4096)
    file.write(_episodes(0, 5))
    before = path.read_bytes()

    def killed_before_the_rename(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(journaled_file.os, "replace", killed_before_the_rename)
    with pytest.raises(KeyboardInterrupt):
        file.write(_episodes(5, 5))
    monkeypatch.undo()
    tmp = path.with_name(path.name + JOURNAL_SUFFIX + ".tmp")
    assert tmp.exists()
    # The batch's new end may be on disk; what the old metadata points at is unchanged.
    assert path.read_bytes()[:len(before)] == before
    assert _read_back(path) == list(range(5))
    assert not tmp.exists()


def test_the_reader_leaves_a_live_writers_journal_alone(tmp_path):
    path = tmp_path / "rollout-s0-w0.hdf5"
    EpisodeFile(path, ATTRS, 1, 4096).write(_episodes(0, 3))
    journal = path.with_name(path.name + JOURNAL_SUFFIX)
    journal.write_bytes(b"not a journal")
    with open(journal, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a writer holds it while it applies it
        assert recover(path) is False
        assert journal.exists()
    assert recover(path) is False  # unlocked and torn: dropped, nothing applied
    assert not journal.exists()
    assert _read_back(path) == [0, 1, 2]


def test_the_dump_writer_process_answers_each_batch_after_its_commit(tmp_path):
    # The driver indexes what the writer confirmed; the journal must be gone by then.
    from mpirl.data.dump_writer import _WriterProcess

    path = tmp_path / "rollout-s0-w0.hdf5"
    writer = _WriterProcess(path, ATTRS, 1, 4096)
    lo, steps = 0, 20
    block = {"lo": lo, "ends": [(0, 0, 0, steps - 1, None)],
             "finals": [np.zeros(4, np.float32)],
             "obs": np.zeros((steps, 1, 4), np.float32), "actions": np.zeros((steps, 1), np.int64),
             "rewards": np.ones((steps, 1)), "terminated": np.arange(steps)[:, None] == steps - 1,
             "truncated": np.zeros((steps, 1), bool), "logp": np.zeros((steps, 1), np.float32)}
    writer.send(block)
    assert writer.take_acked(wait=True, timeout=60) == [(0, steps)]
    assert not list(tmp_path.glob("*.journal*"))
    writer.close()
    assert json.loads(json.dumps(_read_back(path))) == [0]


def test_the_dump_writer_on_a_full_disk_ends_quietly_and_its_rank_raises_enospc(small_disk,
                                                                                  capfd):
    # Found by benchmarks/chaos.py: on ENOSPC the writer process printed a traceback. It now
    # exits with its own code, and the rank raises ENOSPC, which the driver reports in one line.
    import errno

    from mpirl.data.dump_writer import _WriterProcess

    disk = small_disk
    writer = _WriterProcess(disk / "rollout-s0-w0.hdf5", ATTRS, 1, 4096)
    steps = 200
    block = {"lo": 0, "ends": [(0, 0, 0, steps - 1, None)], "finals": [np.zeros(4, np.float32)],
             "obs": np.random.default_rng(0).random((steps, 1, 4), np.float32),
             "actions": np.zeros((steps, 1), np.int64), "rewards": np.ones((steps, 1)),
             "terminated": np.arange(steps)[:, None] == steps - 1,
             "truncated": np.zeros((steps, 1), bool), "logp": np.zeros((steps, 1), np.float32)}
    writer.send(block)
    assert writer.take_acked(wait=True, timeout=60) == [(0, steps)]
    fill_disk(disk)
    with pytest.raises(OSError) as raised:
        for k in range(1, 1000):
            block["lo"] = k * steps
            block["ends"] = [(k, 0, k * steps, (k + 1) * steps - 1, None)]
            writer.send(block)
            writer.take_acked(wait=True, timeout=60)
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert "Traceback" not in capfd.readouterr().err


def test_the_tensorboard_file_on_a_full_disk_raises_enospc_in_the_writer_s_thread(small_disk,
                                                                                   capfd):
    # Found by benchmarks/chaos.py: tensorboardX's own writer thread died on ENOSPC with a
    # traceback, and the next writes blocked forever on its full queue (IMPALA hung). The events
    # are now written in the caller's thread, so the run gets the OSError and ends in one line.
    import errno
    import threading

    from mpirl.report.tensorboard import EventWriter

    writer = EventWriter(small_disk / "run")
    writer.add_scalars({"episode_return_mean": 1.0}, 1)
    writer.flush()
    fill_disk(small_disk)
    raised: list[BaseException] = []

    def write_rows():  # as the run's recorder does: rows, and a flush only now and then
        try:
            for step in range(2, 100_000):
                writer.add_scalars({f"value_{k}": float(k) for k in range(30)}, step)
                writer.add_histogram("weights", np.arange(100.0), step)
        except OSError as error:
            raised.append(error)

    rows = threading.Thread(target=write_rows, daemon=True)
    rows.start()
    rows.join(timeout=60)
    assert not rows.is_alive(), "the writes blocked on a full disk"
    assert raised and raised[0].errno == errno.ENOSPC, raised
    assert "Traceback" not in capfd.readouterr().err
