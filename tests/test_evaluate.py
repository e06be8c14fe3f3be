"""mpirl evaluate: a trained checkpoint plays as well as it trained; bad paths are clear errors."""

import json
import subprocess

import pytest
from conftest import BIN, mpi_env, run_mpi

MPIRL = str(BIN / "mpirl")


def _evaluate(*args):
    return subprocess.run([MPIRL, "evaluate", *args], capture_output=True, text=True,
                          timeout=120, env=mpi_env())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    proc = run_mpi(3, MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir",
                   str(run_dir), "--stop",
                   '{"episode_return_mean": 475, "timesteps_total": 150000}', timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run_dir / "result.json").read_text())["episode_return_mean"] >= 475
    return run_dir


def test_evaluate_trained_policy(trained_run):
    proc = _evaluate(str(trained_run), "--episodes", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["episodes"] == 5 and stats["algo"] == "PPO" and stats["env"] == "CartPole-v1"
    assert stats["return_mean"] >= 450, stats
    # A checkpoint directory works as well as its run directory.
    latest = (trained_run / "checkpoints" / "latest").read_text().strip()
    proc = _evaluate(str(trained_run / "checkpoints" / latest), "--episodes", "2")
    assert proc.returncode == 0, proc.stderr
    assert "2 episodes, return" in proc.stdout and latest in proc.stdout


def test_render_video_writes_one_file_per_episode(trained_run, tmp_path):
    proc = _evaluate(str(trained_run), "--episodes", "2", "--render-video", str(tmp_path / "v"))
    assert proc.returncode == 0, proc.stderr
    videos = sorted(p.name for p in (tmp_path / "v").glob("*.mp4"))
    assert len(videos) == 2, videos
    assert all((tmp_path / "v" / name).stat().st_size > 1000 for name in videos)


def test_bad_paths_are_clear_errors(trained_run, tmp_path):
    proc = _evaluate(str(tmp_path / "missing"))
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr
    proc = _evaluate(str(tmp_path))
    assert proc.returncode == 2 and "neither a checkpoint" in proc.stderr
    proc = _evaluate(str(trained_run), "--episodes", "0")
    assert proc.returncode == 2 and "--episodes must be >= 1" in proc.stderr
    broken = tmp_path / "broken"
    latest = (trained_run / "checkpoints" / "latest").read_text().strip()
    subprocess.run(["cp", "-r", str(trained_run / "checkpoints" / latest), str(broken)],
                   check=True)
    weights = broken / "learner_0.pkl"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    proc = _evaluate(str(broken))
    assert proc.returncode == 2 and "learner_0.pkl: SHA-256 does not match" in proc.stderr
    assert "Traceback" not in proc.stderr
