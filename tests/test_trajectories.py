"""Trajectory dumps: per-rank HDF5 files in Minari's layout, the mpirl.data.reader reader, mpirl
inspect."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from conftest import BIN, LiveRun, mpi_env, run_mpi

from mpirl.data.dump_format import FORMAT_ATTR, serialize_space
from mpirl.data.episode_file import EpisodeFile
from mpirl.data.reader import DatasetError, open_dataset

MPIRL = str(BIN / "mpirl")
SMALL = {"num_envs_per_worker": 4, "rollout_fragment_length": 64}


def _train(n: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    if n == 1:  # world size 1 without a launcher: the embedded local mode
        return subprocess.run([MPIRL, "train", *args], capture_output=True, text=True,
                              timeout=timeout, env=mpi_env())
    return run_mpi(n, MPIRL, "train", *args, timeout=timeout)


def _inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MPIRL, "inspect", *args], capture_output=True, text=True, timeout=60,
                          env=mpi_env())


def _check_episode(episode, action_space: gym.Space) -> None:
    steps = len(episode.rewards)
    assert steps >= 1
    assert len(episode.observations) == steps + 1
    assert len(episode.actions) == steps
    assert len(episode.terminations) == len(episode.truncations) == steps
    ends = episode.terminations | episode.truncations
    assert ends[-1] and not ends[:-1].any(), "an episode ends at its last step only"
    assert not (episode.terminations[-1] and episode.truncations[-1])
    logp = episode.infos["action_logp"]
    assert logp.shape == (steps,) and np.isfinite(logp).all()
    if isinstance(action_space, gym.spaces.Discrete | gym.spaces.MultiDiscrete):
        assert (logp <= 0).all()
    for action in episode.actions:
        assert action_space.contains(np.asarray(action, dtype=action_space.dtype)), action


@pytest.fixture(scope="module")
def cartpole_dump(tmp_path_factory):
    """PPO on CartPole, 2 rollout ranks, 3 iterations, dumping; shared by several tests."""
    tmp = tmp_path_factory.mktemp("cartpole")
    run_dir, dump = tmp / "run", tmp / "dump"
    proc = _train(3, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run_dir),
                  "--config", json.dumps(SMALL), "--stop", '{"training_iteration": 3}',
                  "--dump-trajectories", str(dump))
    assert proc.returncode == 0, proc.stderr
    return run_dir, dump


def test_ppo_cartpole_dump_matches_the_run(cartpole_dump):
    run_dir, dump = cartpole_dump
    files = sorted(p.name for p in dump.iterdir())
    assert files == ["main_data.hdf5", "metadata.json", "rollout-s0-w0.hdf5",
                     "rollout-s0-w1.hdf5"]
    result = json.loads((run_dir / "result.json").read_text())
    params = json.loads((run_dir / "params.json").read_text())
    assert params["dumps"]["dump_trajectories"] == str(dump)
    with open_dataset(dump) as dataset:
        # The run ended with finish_dumps: every episode it counted is written and indexed.
        assert dataset.num_episodes == result["episodes_total"] > 0
        assert [f.name for f in dataset.files] == ["rollout-s0-w0.hdf5", "rollout-s0-w1.hdf5"]
        assert dataset.env_id == "CartPole-v1"
        assert dataset.observation_space == gym.spaces.Box(
            -np.inf, np.inf, (4,), np.float32) or dataset.observation_space.shape == (4,)
        assert dataset.action_space == gym.spaces.Discrete(2)
        episodes = list(dataset.iterate_episodes())
        assert [e.id for e in episodes] == list(range(dataset.num_episodes))
        assert dataset.total_steps == sum(len(e.rewards) for e in episodes)
        for episode in episodes:
            _check_episode(episode, dataset.action_space)
            # CartPole's physics: x' = x + 0.02 * x_dot, so rows are consecutive observations.
            obs = episode.observations
            np.testing.assert_allclose(obs[1:, 0], obs[:-1, 0] + 0.02 * obs[:-1, 1], atol=1e-5)
        returns = np.array([e.rewards.sum() for e in episodes])
        assert returns.mean() == pytest.approx(result["episode_return_mean"])
        assert returns.min() == result["episode_return_min"]
        assert returns.max() == result["episode_return_max"]
    metadata = json.loads((dump / "metadata.json").read_text())
    assert metadata["total_episodes"] == result["episodes_total"]
    assert metadata["total_steps"] == sum(len(e.rewards) for e in episodes)
    assert metadata["data_format"] == "hdf5"
    assert metadata["action_space"] == serialize_space(gym.spaces.Discrete(2))
    # Episode groups carry the attributes Minari writes.
    with h5py.File(dump / "rollout-s0-w1.hdf5", "r") as file:
        group = file["episode_0"]
        assert group.attrs["id"] == 0
        assert group.attrs["total_steps"] == len(group["rewards"])
        assert "action_logp" in group["infos"]


def test_minari_reads_the_dump(cartpole_dump, tmp_path, monkeypatch):
    minari = pytest.importorskip("minari")
    _, dump = cartpole_dump
    mine = list(open_dataset(dump).iterate_episodes())
    # load_dataset looks in $MINARI_DATASETS_PATH/<dataset_id>/data.
    metadata = json.loads((dump / "metadata.json").read_text())
    root = tmp_path / "datasets"
    (root / metadata["dataset_id"]).mkdir(parents=True)
    (root / metadata["dataset_id"] / "data").symlink_to(dump)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    for dataset in (minari.MinariDataset(dump), minari.load_dataset(metadata["dataset_id"])):
        assert dataset.total_episodes == len(mine)
        assert dataset.total_steps == sum(len(e.rewards) for e in mine)
        theirs = list(dataset.iterate_episodes())
        assert len(theirs) == len(mine)
        for a, b in zip(theirs, mine, strict=True):
            assert a.id == b.id
            for key in ("observations", "actions", "rewards", "terminations", "truncations"):
                np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
            np.testing.assert_array_equal(a.infos["action_logp"], b.infos["action_logp"])


def test_inspect_summarizes_and_plots(cartpole_dump, tmp_path):
    run_dir, dump = cartpole_dump
    result = json.loads((run_dir / "result.json").read_text())
    png = tmp_path / "returns.png"
    proc = _inspect(str(dump), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert f"episodes     {result['episodes_total']}" in proc.stdout
    assert "rollout-s0-w0.hdf5" in proc.stdout and "Discrete(2)" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = _inspect(str(dump / "main_data.hdf5"), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["episodes"] == result["episodes_total"]
    assert summary["return_mean"] == pytest.approx(result["episode_return_mean"])
    assert summary["return_max"] == result["episode_return_max"]
    assert summary["size_bytes"] > 0 and len(summary["files"]) == 2


@pytest.mark.parametrize("env_id, space", [
    ("Pendulum-v1", gym.spaces.Box),
    ("mpirl.testing:MultiCorridorEnv", gym.spaces.MultiDiscrete),
], ids=["box", "multidiscrete"])
def test_box_and_multidiscrete_actions(tmp_path, env_id, space):
    dump = tmp_path / "dump"
    proc = _train(1, "--algo", "PPO", "--env", env_id, "--run-dir", str(tmp_path / "run"),
                  "--config", json.dumps({**SMALL, "rollout_fragment_length": 128}),
                  "--stop", '{"training_iteration": 2}', "--dump-trajectories", str(dump))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    with open_dataset(dump) as dataset:
        assert isinstance(dataset.action_space, space)
        assert dataset.num_episodes == result["episodes_total"] > 0
        for episode in dataset.iterate_episodes():
            _check_episode(episode, dataset.action_space)
            assert episode.actions.shape[1:] == dataset.action_space.shape
        batch = next(dataset.sample_batches(16, np.random.default_rng(0)))
        assert batch["actions"].shape == (16, *dataset.action_space.shape)


def test_episodes_cut_by_env_failures_are_not_written(tmp_path):
    # MpirlFlakyCartPole-v0 raises in step every 2000 steps of each instance.
    dump = tmp_path / "dump"
    proc = _train(1, "--algo", "PPO", "--env", "MpirlFlakyCartPole-v0", "--env-module",
                  "mpirl.testing", "--run-dir", str(tmp_path / "run"),
                  "--config", json.dumps({"num_envs_per_worker": 2,
                                          "rollout_fragment_length": 512}),
                  "--stop", '{"training_iteration": 5}', "--dump-trajectories", str(dump))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["num_env_failures"] >= 2
    with open_dataset(dump) as dataset:
        # The dropped episodes are in neither the run's count nor the dump.
        assert dataset.num_episodes == result["episodes_total"]
        for episode in dataset.iterate_episodes():
            _check_episode(episode, dataset.action_space)
            obs = episode.observations  # no rows of a rebuilt env spliced in
            np.testing.assert_allclose(obs[1:, 0], obs[:-1, 0] + 0.02 * obs[:-1, 1], atol=1e-5)


def _progress_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "progress.csv"
    if not path.is_file():
        return []
    with open(path) as file:
        return list(csv.DictReader(file))


def _writers_done(pids: list[int]) -> bool:
    """True once every writer process has exited (a writer closes its file between batches, so
    an openable file does not mean its writer is done)."""
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone
        if state != "Z":
            return False
    return True


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _indexed_episodes(dump: Path) -> int:
    try:
        return int(json.loads((dump / "metadata.json").read_text())["total_episodes"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.parametrize("writers_too", [False, True], ids=["job", "job-and-writers"])
def test_kill_9_leaves_every_completed_episode_readable(tmp_path, writers_too):
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    run = LiveRun(3, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run_dir),
                  "--config", json.dumps({**SMALL, "print_layout": True}),
                  "--stop", '{"training_iteration": 100000}', "--dump-trajectories", str(dump))
    # The index lags the writers by an iteration or more (it links what they confirmed). A
    # writer opens its file with its first batch, which under load can come iterations after
    # the other's: both files must exist before the kill, or there is one file to read back.
    run.wait_until(lambda: len(_progress_rows(run_dir)) >= 4 and _indexed_episodes(dump) > 0
                   and len(list(dump.glob("rollout-*.hdf5"))) == 2,
                   "4 iterations, an indexed episode and both writers' files")
    writers = [child for role, pid in run.pids().values() if role == "rollout"
               for child in _children(pid)]
    assert len(writers) == 2, "one writer process per rollout rank"
    if writers_too:  # the writers too, at once, wherever they are in writing a batch
        for pid in writers:
            os.kill(pid, signal.SIGKILL)
    run.kill()  # SIGKILL to mpiexec and every rank
    counted = int(_progress_rows(run_dir)[-1]["episodes_total"])
    # The writer processes see EOF and write what they were sent; wait for them to close.
    deadline = time.monotonic() + 60
    while not _writers_done(writers):
        assert time.monotonic() < deadline, "writer processes still hold their files"
        time.sleep(0.2)
    with open_dataset(dump) as dataset:  # every file reads back, the writers killed or not
        assert dataset.damaged == [] and len(dataset.files) == 2
        # Every episode of every finished iteration is on disk (and some of the next), unless
        # the writers died with their backlog.
        assert dataset.num_episodes >= (1 if writers_too else counted) > 0
        ids = [e.id for e in dataset.iterate_episodes()]
        assert ids == list(range(dataset.num_episodes))
        for episode in dataset.iterate_episodes():
            _check_episode(episode, dataset.action_space)
    # main_data.hdf5 indexes what the writers had confirmed by the driver's last iteration;
    # Minari reads that.
    minari = pytest.importorskip("minari")
    indexed = minari.MinariDataset(dump)
    assert 0 < indexed.total_episodes <= dataset.num_episodes
    assert sum(1 for _ in indexed.iterate_episodes()) == indexed.total_episodes
    assert not list(dump.glob("*.journal*")), "a journal left behind"


# Reading: synthetic dumps, no MPI.


def _synthetic(directory: Path, files: int = 2, episodes: int = 5) -> dict[int, int]:
    """Per-rank files whose observations count steps: obs[t] = 1000 * episode + t."""
    directory.mkdir(parents=True, exist_ok=True)
    attrs = {FORMAT_ATTR: 1,
             "observation_space": serialize_space(gym.spaces.Box(0, 1e6, (1,))),
             "action_space": serialize_space(gym.spaces.Discrete(3)), "env_id": "Fake-v0"}
    lengths = {}
    for w in range(files):
        file = EpisodeFile(directory / f"rollout-s0-w{w}.hdf5", attrs, 1, 4096)
        batch = []
        for k in range(episodes):
            e = w * episodes + k
            steps = 3 + e
            lengths[e] = steps
            batch.append((k, {
                "observations": (1000.0 * e + np.arange(steps + 1, dtype=np.float32))[:, None],
                "actions": np.arange(steps) % 3, "rewards": np.ones(steps),
                "terminations": np.arange(steps) == steps - 1,
                "truncations": np.zeros(steps, dtype=bool),
                "action_logp": np.full(steps, -1.0, dtype=np.float32)}))
        file.write(batch)
        file.close()
    return lengths


def test_sample_batches_shapes_and_shuffling(tmp_path):
    lengths = _synthetic(tmp_path / "dump")
    dataset = open_dataset(tmp_path / "dump")  # no main_data.hdf5: the per-rank files alone
    assert dataset.num_episodes == 10 and dataset.total_steps == sum(lengths.values())
    rng = np.random.default_rng(0)
    batches = list(dataset.sample_batches(8, rng, num_batches=40, buffer_size=32))
    assert len(batches) == 40
    for batch in batches:
        assert set(batch) == {"obs", "actions", "rewards", "next_obs", "terminations",
                              "truncations", "action_logp"}
        assert batch["obs"].shape == (8, 1) and batch["actions"].shape == (8,)
        np.testing.assert_array_equal(batch["next_obs"], batch["obs"] + 1)
        assert (batch["action_logp"] == -1).all()
    seen = np.concatenate([b["obs"][:, 0] for b in batches])
    assert not np.all(np.diff(seen) > 0), "batches are shuffled"
    # One pass covers every transition once before any repeats.
    total = dataset.total_steps
    first_pass = np.concatenate([b["obs"][:, 0] for b in dataset.sample_batches(
        1, np.random.default_rng(1), num_batches=total, buffer_size=16)])
    assert len(set(first_pass.tolist())) == total


def test_shards_partition_the_episodes(tmp_path):
    _synthetic(tmp_path / "dump", files=2, episodes=5)
    dataset = open_dataset(tmp_path / "dump")
    for count in (1, 2, 3, 4):
        parts = [[e.id for e in dataset.iterate_episodes((i, count))] for i in range(count)]
        assert sorted(sum(parts, [])) == list(range(10)), count
        if count <= 2:  # by file: every shard reads its own files
            for i, ids in enumerate(parts):
                assert {dataset.episode_refs[e][0].name for e in ids} <= {
                    f"rollout-s0-w{w}.hdf5" for w in range(2) if w % count == i}
    with pytest.raises(ValueError, match="shard"):
        list(dataset.iterate_episodes((2, 2)))


def test_truncated_and_foreign_files_are_clear_errors(tmp_path, capsys):
    from mpirl.cli import main

    _synthetic(tmp_path / "dump", files=1)
    good = tmp_path / "dump" / "rollout-s0-w0.hdf5"
    truncated = tmp_path / "truncated" / "rollout-s0-w0.hdf5"
    truncated.parent.mkdir()
    data = good.read_bytes()
    truncated.write_bytes(data[:len(data) // 3])
    foreign = tmp_path / "foreign.hdf5"
    with h5py.File(foreign, "w") as file:
        file["weights"] = np.zeros(3)
    not_hdf5 = tmp_path / "notes.hdf5"
    not_hdf5.write_text("hello")
    for path, shown in ((truncated.parent, truncated), (truncated, truncated),
                        (foreign, foreign), (not_hdf5, not_hdf5),
                        (tmp_path / "missing", tmp_path / "missing")):
        with pytest.raises(DatasetError, match=str(shown)):
            open_dataset(path)
        # mpirl inspect: end to end for the first, in process (the same code path) for the rest.
        if path == truncated.parent:
            proc = _inspect(str(path))
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        else:
            capsys.readouterr()
            code = main(["inspect", str(path)])
            stdout, stderr = capsys.readouterr()
        assert code == 2, (path, stdout, stderr)
        assert f"mpirl: error: {shown}" in stderr
        assert "Traceback" not in stderr
    # An episode group without its datasets: the error names the file and the group.
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "dump", broken)
    with h5py.File(broken / "rollout-s0-w0.hdf5", "a") as file:
        del file["episode_2/actions"]
    with pytest.raises(DatasetError, match="episode_2.*actions"):
        list(open_dataset(broken).iterate_episodes())


def test_a_dump_without_episodes_yet_reads_as_empty(tmp_path):
    _synthetic(tmp_path / "dump", files=1, episodes=0)
    with open_dataset(tmp_path / "dump") as dataset:
        assert dataset.num_episodes == dataset.total_steps == 0
        assert list(dataset.iterate_episodes()) == []
        with pytest.raises(DatasetError, match="no transitions"):
            next(dataset.sample_batches(4, np.random.default_rng(0)))
    proc = _inspect(str(tmp_path / "dump"))
    assert proc.returncode == 0 and "episodes     0" in proc.stdout, proc.stderr


def test_episodes_not_yet_indexed_come_after_the_indexed_ones(tmp_path):
    _synthetic(tmp_path / "dump", files=2, episodes=3)
    with h5py.File(tmp_path / "dump" / "main_data.hdf5", "w") as main:
        main["episode_0"] = h5py.ExternalLink("rollout-s0-w1.hdf5", "episode_0")
        main["episode_1"] = h5py.ExternalLink("rollout-s0-w0.hdf5", "episode_2")
    dataset = open_dataset(tmp_path / "dump" / "main_data.hdf5")
    firsts = [e.observations[0, 0] for e in dataset.iterate_episodes()]
    assert firsts == [3000, 2000, 0, 1000, 4000, 5000]


def test_resume_appends_a_new_session(tmp_path):
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    config = json.dumps({**SMALL, "checkpoint_every": 1})
    proc = _train(1, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(run_dir),
                  "--config", config, "--stop", '{"training_iteration": 2}',
                  "--dump-trajectories", str(dump))
    assert proc.returncode == 0, proc.stderr
    first = open_dataset(dump)
    before = [(e.observations.tolist(), e.actions.tolist()) for e in first.iterate_episodes()]
    first.close()
    proc = _train(1, "--resume", str(run_dir), "--stop", '{"training_iteration": 4}')
    assert proc.returncode == 0, proc.stderr
    assert (dump / "rollout-s1-w0.hdf5").is_file()
    result = json.loads((run_dir / "result.json").read_text())
    with open_dataset(dump) as dataset:
        after = [(e.observations.tolist(), e.actions.tolist()) for e in dataset.iterate_episodes()]
        assert after[:len(before)] == before, "earlier episodes keep their ids and contents"
        # Episodes in progress at the checkpoint are not written (their start is elsewhere).
        assert len(before) < dataset.num_episodes <= result["episodes_total"]
    assert json.loads((dump / "metadata.json").read_text())["total_episodes"] == len(after)


def test_a_dump_of_another_env_is_not_appended_to(tmp_path):
    dump = tmp_path / "dump"
    _synthetic(dump, files=1)
    proc = _train(1, "--algo", "PPO", "--env", "CartPole-v1", "--run-dir", str(tmp_path / "r"),
                  "--config", json.dumps(SMALL), "--stop", '{"training_iteration": 1}',
                  "--dump-trajectories", str(dump))
    assert proc.returncode == 2, proc.stderr
    assert f"{dump} holds a dump of Fake-v0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dump_config_errors(tmp_path):
    # In process: make_request is what mpirl train validates with before anything starts (a
    # config key's refusal runs end to end in test_cli_outputs.py, lr = -1 under mpiexec).
    from mpirl.commands.train import make_request
    from mpirl.errors import ConfigError

    config = {"dump_compression_level": 12, "dump_trajectories": str(tmp_path / "d")}
    with pytest.raises(ConfigError) as caught:
        make_request("PPO", "CartPole-v1", None, config, {}, None, str(tmp_path / "r"))
    assert ('config key "dump_compression_level" = 12 is out of range: must be an integer in '
            '[0, 9]') in str(caught.value)
    assert caught.value.exit_code == 2
    assert not (tmp_path / "d").exists() and not (tmp_path / "r").exists()


def test_killed_writer_process_is_reported(tmp_path):
    # Not under MPI: the recorder alone, its writer killed, the next flush raises clearly.
    from mpirl.data.dump_writer import DumpTarget
    from mpirl.data.episode_recorder import EpisodeRecorder

    space = gym.spaces.Box(-1, 1, (2,))
    recorder = EpisodeRecorder(DumpTarget(str(tmp_path), 0), 0, 1, "Fake-v0", space,
                               gym.spaces.Discrete(2), 0)
    recorder.begin()
    os.kill(recorder.writer.proc.pid, signal.SIGKILL)
    recorder.writer.proc.wait()
    obs = np.zeros((1, 2), np.float32)
    recorder.step(obs, np.array([1]), np.ones(1), np.array([True]), np.array([False]),
                  np.zeros(1), {0: obs[0]}, None)
    with pytest.raises(RuntimeError, match="trajectory writer"):
        for _ in range(50):  # the reader thread notices the writer's end asynchronously
            recorder.flush()
            time.sleep(0.05)
