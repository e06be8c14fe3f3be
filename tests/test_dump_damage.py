"""Trajectory dumps on real file systems: a damaged per-rank file is quarantined, not fatal, and
file systems that refuse HDF5's file locks (NFS without a lock daemon, Lustre without flock) are
written without them. Damage is done to real files; lock failures come from the kernel's answer
to flock() replaced by an errno (an LD_PRELOAD library), so HDF5 itself fails as it does there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from conftest import BIN, mpi_env, run_mpi

from mpirl.data.dump_format import MAIN_FILE, METADATA_FILE, QUARANTINE_KEY
from mpirl.data.dump_index import DumpIndex
from mpirl.data.dump_writer import DumpSettings
from mpirl.data.episode_file import EpisodeFile
from mpirl.data.reader import DatasetError, open_dataset

MPIRL = str(BIN / "mpirl")
SMALL = {"num_envs_per_worker": 4, "rollout_fragment_length": 64}
W0, W1 = "rollout-s0-w0.hdf5", "rollout-s0-w1.hdf5"


def _ppo_dump(root: Path, iterations: int = 2) -> tuple[Path, Path]:
    """A real dump: PPO on CartPole, 2 rollout ranks (two per-rank files), checkpointing."""
    run_dir, dump = root / "run", root / "dump"
    proc = run_mpi(3, MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir",
                   str(run_dir), "--config", json.dumps({**SMALL, "checkpoint_every": 1}),
                   "--stop", json.dumps({"training_iteration": iterations}),
                   "--dump-trajectories", str(dump))
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in dump.glob("rollout-*")} == {W0, W1}
    return run_dir, dump


def _episodes_by_file(dump: Path) -> dict[str, list[list[float]]]:
    """Each data file's episodes (observations as lists), in dump order."""
    found: dict[str, list[list[float]]] = {}
    with open_dataset(dump) as dataset:
        for (file, _), episode in zip(dataset.episode_refs, dataset.iterate_episodes(),
                                      strict=True):
            found.setdefault(file.name, []).append(episode.observations.tolist())
    return found


def _main_link_targets(dump: Path) -> list[str]:
    with h5py.File(dump / MAIN_FILE, "r", locking=False) as main:
        return [main.get(name, getlink=True).filename for name in main]


@pytest.fixture(scope="module")
def dumping_run(tmp_path_factory):
    """One real dumping run for the module: its run directory and dump, left for the resume test
    alone (it damages and resumes them), and a copy of the dump as it was, for every other test
    (each copies it again before damaging anything)."""
    root = tmp_path_factory.mktemp("clean")
    run_dir, dump = _ppo_dump(root)
    pristine = root / "pristine"
    shutil.copytree(dump, pristine)
    return run_dir, dump, pristine, _episodes_by_file(dump)


@pytest.fixture(scope="module")
def clean_dump(dumping_run):
    _, _, pristine, episodes = dumping_run
    return pristine, episodes


def damage(path: Path, kind: str) -> None:
    """Damage a per-rank file for real, as a file system or a killed job leaves it."""
    data = path.read_bytes()
    if kind == "truncated":  # cut in the middle (a copy or a job that ran out of quota)
        path.write_bytes(data[:len(data) // 2])
    elif kind == "header-only":  # cut inside its first block
        path.write_bytes(data[:100])
    elif kind == "zeros":  # blocks never written (a node crash on some file systems)
        path.write_bytes(bytes(len(data)))
    elif kind == "garbage":
        path.write_bytes(np.random.default_rng(0).bytes(len(data)))
    elif kind == "checksum":  # the episode index overwritten: HDF5's checksums see it
        path.write_bytes(data[:200] + b"\xff" * 2000 + data[2200:])
    elif kind == "dangling":  # a name in the index with no group behind it (killed mid-flush)
        with h5py.File(path, "r+", locking=False) as handle:
            last = max((n for n in handle if n.startswith("episode_")),
                       key=lambda n: int(n.split("_")[1]))
            del handle[last]
            handle[last] = h5py.SoftLink("/never_written")
    elif kind == "directory":  # cannot be opened at all (as root, chmod 000 does not stop reads)
        path.unlink()
        path.mkdir()
    else:
        raise ValueError(kind)


KINDS = ["truncated", "header-only", "zeros", "garbage", "checksum", "dangling", "directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_file_is_left_out_with_its_episodes(clean_dump, tmp_path, capsys, kind):
    from mpirl.cli import main

    source, clean = clean_dump
    dump = tmp_path / "dump"
    shutil.copytree(source, dump)
    damage(dump / W1, kind)
    for path in (dump, dump / MAIN_FILE):
        with open_dataset(path) as dataset:
            assert [f.name for f in dataset.files] == [W0]
            assert [e.observations.tolist() for e in dataset.iterate_episodes()] == clean[W0]
            assert [e.id for e in dataset.iterate_episodes()] == list(range(len(clean[W0])))
            [damaged] = dataset.damaged
            assert damaged.path == (dump / W1).resolve()
            assert damaged.reason.startswith(str(dump / W1))
            # main_data.hdf5 counted the episodes it had linked into the damaged file.
            assert damaged.episodes_lost == len(clean[W1])
            batch = next(dataset.sample_batches(32, np.random.default_rng(0)))
            assert batch["obs"].shape == (32, 4)
    assert (dump / W1).exists(), "a reader never changes the dump"
    # mpirl inspect: end to end for the first kind, in process (the same code) for the others.
    if kind == KINDS[0]:
        proc = subprocess.run([MPIRL, "inspect", str(dump)], capture_output=True, text=True,
                              timeout=60, env=mpi_env())
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        capsys.readouterr()
        code = main(["inspect", str(dump)])
        stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert f"episodes     {len(clean[W0])}\n" in stdout
    [line] = [x for x in stdout.splitlines() if x.startswith("damaged")]
    assert f"({len(clean[W1])} indexed episodes lost): {dump / W1}" in line


def test_an_episode_named_in_the_index_without_its_group_is_called_corrupt(clean_dump, tmp_path):
    source, _ = clean_dump
    dump = tmp_path / "dump"
    shutil.copytree(source, dump)
    damage(dump / W1, "dangling")
    with pytest.raises(DatasetError) as caught:
        open_dataset(dump / W1)
    message = str(caught.value)
    assert message.startswith(f"{dump / W1}: episode_") and "truncated or corrupt" in message
    assert "linked from" not in message


def test_a_file_the_index_does_not_count_loses_an_unknown_number(clean_dump, tmp_path):
    source, clean = clean_dump
    dump = tmp_path / "dump"
    shutil.copytree(source, dump)
    (dump / MAIN_FILE).unlink()
    damage(dump / W1, "truncated")
    with open_dataset(dump) as dataset:
        assert dataset.num_episodes == len(clean[W0])
        [damaged] = dataset.damaged
        assert damaged.episodes_lost is None and "unknown number" in damaged.describe()


def _one_line_error(proc: subprocess.CompletedProcess, *names: Path) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("mpirl: ")]
    for name in names:
        assert str(name) in line, line
    return line


def test_a_dump_with_no_readable_file_is_one_clear_error(clean_dump, tmp_path):
    source, _ = clean_dump
    dump = tmp_path / "dump"
    shutil.copytree(source, dump)
    damage(dump / W0, "zeros")
    damage(dump / W1, "truncated")
    with pytest.raises(DatasetError, match="none of its 2 trajectory files is readable") as caught:
        open_dataset(dump)
    assert str(dump / W0) in str(caught.value) and str(dump / W1) in str(caught.value)
    inspect = subprocess.run([MPIRL, "inspect", str(dump)], capture_output=True, text=True,
                             timeout=60, env=mpi_env())
    _one_line_error(inspect, dump / W0, dump / W1)
    # Neither a dumping run nor an offline one starts on it (world size 1: no launcher).
    dumping = subprocess.run(
        [MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir",
         str(tmp_path / "ppo"), "--config", json.dumps(SMALL), "--stop",
         '{"training_iteration": 1}', "--dump-trajectories", str(dump)],
        capture_output=True, text=True, timeout=120, env=mpi_env())
    assert "holds no readable trajectory file" in _one_line_error(dumping, dump / W0, dump / W1)
    offline = subprocess.run(
        [MPIRL, "train", "--algo", "BC", "--env", "CartPole-v1", "--run-dir",
         str(tmp_path / "bc"), "--config", json.dumps({"input": str(dump)}), "--stop",
         '{"training_iteration": 1}'], capture_output=True, text=True, timeout=120,
        env=mpi_env())
    _one_line_error(offline, dump / W0, dump / W1)
    assert sorted(p.name for p in dump.iterdir()) == sorted(p.name for p in source.iterdir())


def test_resume_of_a_dumping_run_quarantines_the_file_and_keeps_dumping(dumping_run):
    run_dir, dump, _, clean = dumping_run
    damage(dump / W1, "truncated")
    proc = run_mpi(3, MPIRL, "train", "--resume", str(run_dir), "--stop",
                   '{"training_iteration": 4}')
    assert proc.returncode == 0, proc.stderr
    # One warning (only rank 0 prints), naming the file and what was lost.
    warnings = [x for x in proc.stderr.splitlines() if "quarantined" in x]
    assert len(warnings) == 1, proc.stderr
    assert str(dump / W1) in warnings[0]
    assert f"lost: {len(clean[W1])} indexed episodes" in warnings[0]
    assert "renamed to rollout-s0-w1.hdf5.damaged" in warnings[0]
    assert not (dump / W1).exists() and (dump / (W1 + ".damaged")).is_file()
    # The resumed session dumped on both rollout ranks; nothing points at the damaged file.
    after = _episodes_by_file(dump)
    assert after[W0] == clean[W0]
    assert set(after) == {W0, "rollout-s1-w0.hdf5", "rollout-s1-w1.hdf5"}
    assert all(after[name] for name in after)
    total = sum(map(len, after.values()))
    metadata = json.loads((dump / METADATA_FILE).read_text())
    assert metadata["total_episodes"] == total
    [record] = metadata[QUARANTINE_KEY]
    assert record["file"] == W1 and record["renamed_to"] == W1 + ".damaged"
    assert record["episodes_lost"] == len(clean[W1])
    assert W1 not in _main_link_targets(dump) and len(_main_link_targets(dump)) == total
    with open_dataset(dump) as dataset:
        assert dataset.damaged == [] and dataset.num_episodes == total
    minari = pytest.importorskip("minari")
    indexed = minari.MinariDataset(dump)
    assert indexed.total_episodes == total
    assert sum(1 for _ in indexed.iterate_episodes()) == total


def test_a_later_quarantine_keeps_the_earlier_records_and_session_numbers(clean_dump, tmp_path,
                                                                          capsys):
    source, clean = clean_dump
    dump = tmp_path / "dump"
    shutil.copytree(source, dump)
    env = gym.make("CartPole-v1")
    space = (env.observation_space, env.action_space)
    settings = DumpSettings(dump_trajectories=str(dump))
    damage(dump / W1, "garbage")
    index = DumpIndex(settings, "CartPole-v1", *space, "PPO")
    assert index.session == 1 and index.total_episodes == len(clean[W0])
    assert capsys.readouterr().err.count("quarantined") == 1
    # Opening it again finds nothing to warn about.
    index = DumpIndex(settings, "CartPole-v1", *space, "PPO")
    assert index.session == 1 and capsys.readouterr().err == ""
    # The newest session's only file damaged: a new session must not reuse its number.
    w0 = (dump / W0).read_bytes()
    (dump / W0).rename(dump / "rollout-s1-w0.hdf5")
    damage(dump / "rollout-s1-w0.hdf5", "zeros")
    (dump / W0).write_bytes(w0)  # session 0 readable again
    index = DumpIndex(settings, "CartPole-v1", *space, "PPO")
    assert index.session == 2, "rollout-s1-* names stay taken by the quarantined file"
    records = json.loads((dump / METADATA_FILE).read_text())[QUARANTINE_KEY]
    assert [r["renamed_to"] for r in records] == [W1 + ".damaged",
                                                  "rollout-s1-w0.hdf5.damaged"]
    assert records[1]["episodes_lost"] == 0, "main_data.hdf5 linked nothing into it"


def test_bc_trains_on_the_rest_of_a_damaged_dump(clean_dump, tmp_path):
    source, clean = clean_dump
    dump = tmp_path / "dump"
    shutil.copytree(source, dump)
    damage(dump / W1, "garbage")
    run_dir = tmp_path / "bc"
    proc = run_mpi(4, MPIRL, "train", "--algo", "BC", "--env", "CartPole-v1", "--run-dir",
                   str(run_dir), "--config",
                   json.dumps({"input": str(dump), "num_learners": 2, "evaluation_episodes": 2,
                               "num_sgd_steps_per_iteration": 20}),
                   "--stop", '{"training_iteration": 2}')
    assert proc.returncode == 0, proc.stderr
    warnings = [x for x in proc.stderr.splitlines() if "warning" in x]
    assert len(warnings) == 1, proc.stderr
    assert str(dump / W1) in warnings[0] and "training on the rest" in warnings[0]
    assert f"lost: {len(clean[W1])} indexed episodes" in warnings[0]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["iteration"] == 2 and result["sgd_steps"] == 20
    assert np.isfinite(result["policy_loss"])


# File locks.

NOFLOCK_C = """
#include <errno.h>
#include <stdlib.h>
/* flock() as a file system without it answers: NFS without a lock daemon (ENOLCK), Lustre
   mounted without flock (ENOSYS). */
int flock(int fd, int operation) {
    (void)fd; (void)operation;
    const char *value = getenv("NOFLOCK_ERRNO");
    errno = value ? atoi(value) : ENOLCK;
    return -1;
}
"""


@pytest.fixture(scope="module")
def noflock(tmp_path_factory) -> str:
    """A library that makes every flock() fail, for LD_PRELOAD."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the flock() stand-in")
    root = tmp_path_factory.mktemp("noflock")
    (root / "noflock.c").write_text(NOFLOCK_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(root / "noflock.so"),
                    str(root / "noflock.c")], check=True, timeout=60)
    return str(root / "noflock.so")


def test_the_lock_failure_is_real(noflock, tmp_path):
    # What the writer meets on NFS without a lock daemon: h5py's default open fails.
    script = f"import h5py; h5py.File({str(tmp_path / 'x.hdf5')!r}, 'w')"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env=mpi_env({"LD_PRELOAD": noflock,
                                                   "NOFLOCK_ERRNO": "37"}))
    assert proc.returncode != 0
    assert "unable to lock file, errno = 37" in proc.stderr


def test_a_dumping_run_without_file_locks(noflock, tmp_path):
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    proc = run_mpi(3, MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir",
                   str(run_dir), "--config", json.dumps(SMALL), "--stop",
                   '{"training_iteration": 2}', "--dump-trajectories", str(dump),
                   env={"LD_PRELOAD": noflock, "NOFLOCK_ERRNO": "37"})
    assert proc.returncode == 0, proc.stderr
    warnings = [x for x in proc.stderr.splitlines() if "warning" in x]
    assert len(warnings) == 1, proc.stderr
    assert "refuses HDF5's file locks" in warnings[0] and "errno = 37" in warnings[0]
    metadata = json.loads((dump / METADATA_FILE).read_text())
    with open_dataset(dump) as dataset:
        assert dataset.damaged == [] and len(dataset.files) == 2
        assert dataset.num_episodes == metadata["total_episodes"] > 0
        for episode in dataset.iterate_episodes():
            assert len(episode.observations) == len(episode) + 1
    minari = pytest.importorskip("minari")
    assert minari.MinariDataset(dump).total_episodes == metadata["total_episodes"]


WRITE_AND_READ = """
import sys
from pathlib import Path
import numpy as np
from mpirl.data.reader import open_dataset
from mpirl.data.dump_format import FORMAT_ATTR
from mpirl.data.episode_file import EpisodeFile

path = Path(sys.argv[1])
file = EpisodeFile(path, {FORMAT_ATTR: 1}, 1, 4096)
for k in range(3):  # every batch reopens the file
    file.write([(k, {"observations": np.zeros((k + 3, 2)), "actions": np.zeros(k + 2),
                     "rewards": np.ones(k + 2), "terminations": np.arange(k + 2) == k + 1,
                     "truncations": np.zeros(k + 2, bool),
                     "action_logp": np.zeros(k + 2, np.float32)})])
with open_dataset(path) as dataset:
    print(dataset.num_episodes, dataset.total_steps)
"""


@pytest.mark.parametrize("error", ["37", "38", "95"], ids=["ENOLCK", "ENOSYS", "EOPNOTSUPP"])
def test_the_writer_and_reader_fall_back_without_flock(noflock, tmp_path, error):
    proc = subprocess.run([sys.executable, "-c", WRITE_AND_READ, str(tmp_path / "r.hdf5")],
                          capture_output=True, text=True, timeout=60,
                          env=mpi_env({"LD_PRELOAD": noflock, "NOFLOCK_ERRNO": error}))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "9"]
    assert proc.stderr == "", "writers and readers fall back silently; the driver warns"


def test_a_reader_holding_its_lock_does_not_stop_the_writer(tmp_path):
    """mpirl inspect, Minari or a BC run reading a dump while its run writes: the reader's
    shared lock made the writer's next open fail (errno 11) and ended the rollout rank."""
    path = tmp_path / "rollout-s0-w0.hdf5"
    episode = {"observations": np.zeros((3, 2)), "actions": np.zeros(2), "rewards": np.ones(2),
               "terminations": np.array([False, True]), "truncations": np.zeros(2, bool),
               "action_logp": np.zeros(2, np.float32)}
    writer = EpisodeFile(path, {}, 1, 4096)
    writer.write([(0, episode)])
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, h5py
            with h5py.File({str(path)!r}, "r") as f:  # HDF5's default: locked
                print(list(f), flush=True)
                sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=mpi_env())
    try:
        assert reader.stdout.readline().strip() == "['episode_0']"
        assert writer.write([(1, episode)]) == [(1, 2)]
    finally:
        reader.communicate("", timeout=30)
    with open_dataset(path) as dataset:
        assert dataset.num_episodes == 2
    assert os.path.getsize(path) > 0


def test_the_dataset_size_counts_a_file_renamed_while_it_is_counted_as_gone(tmp_path,
                                                                            monkeypatch):
    # Found by benchmarks/chaos.py: the driver summed the dump's file sizes while a rollout
    # rank's writer renamed its journal's temporary file, and the run ended with
    # FileNotFoundError. The file seen listed, then gone before its stat, counts 0.
    from mpirl.data import dump_index

    (tmp_path / "rollout-s0-w0.hdf5").write_bytes(b"\0" * 2_000_000)
    gone = tmp_path / "rollout-s0-w1.hdf5.journal.tmp"
    listed = [tmp_path / "rollout-s0-w0.hdf5", gone]
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(listed))
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # it was there when listed
    assert dump_index._size_mb(tmp_path) == 2.0
