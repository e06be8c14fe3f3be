"""The learner on a GPU: batches through pinned buffers, PPO learning with a CUDA learner, and
two learners on one GPU (NCCL refused with a clear error, MPI and Gloo through host memory).

Each test skips without CUDA, saying so: CI has no GPU. They ran on an NVIDIA H200
(benchmarks/RESULTS.md says when)."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
from conftest import doctor_learner_rows, run_mpi

from mpirl.runtime.layout import parse_layout_row

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the GPU learner needs one (CI has none)")
MPIRL = [sys.executable, "-m", "mpirl"]
one_gpu = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() != 1,
                             reason="two learners share a GPU only where there is one")


def test_pinned_transfer_delivers_every_batch_exactly_and_reuses_its_buffers():
    from mpirl.workers.batch_transfer import BatchTransfer

    assert BatchTransfer("cuda:0").mode == "pageable"  # measured faster (RESULTS.md)
    transfer = BatchTransfer("cuda:0", "pinned")
    rng = np.random.default_rng(0)

    def batch(rows):
        return {"obs": rng.integers(0, 256, (rows, 4, 84, 84), dtype=np.uint8),
                "actions": rng.integers(0, 6, rows), "logp": rng.normal(size=rows),
                "mask": rng.random(rows) > 0.5, "empty": np.zeros((0, 3), np.float32)}

    for rows in (64, 256, 100, 256):  # grows, then fits in what it has
        sent = batch(rows)
        got = transfer(sent)
        for key, value in sent.items():
            assert got[key].device.type == "cuda" and got[key].shape == value.shape
            np.testing.assert_array_equal(got[key].cpu().numpy(), value)
    held = transfer.pinned_bytes()
    transfer(batch(200))
    assert transfer.pinned_bytes() == held
    assert all(buffer.is_pinned() for buffer in transfer.buffers.values())


def test_ppo_learns_cartpole_with_its_learner_on_the_gpu(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_mpi(4, *MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1",
                   "--config", '{"num_learners": 1}', "--run-dir", str(run_dir),
                   "--stop", '{"episode_return_mean": 450, "timesteps_total": 200000}',
                   timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr}"
    rows = [row for line in proc.stdout.splitlines() if (row := parse_layout_row(line))]
    assert [row["device"] for row in rows if row["role"] == "learner"] == ["cuda:0"], proc.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert result["episode_return_mean"] >= 450, result


@one_gpu
def test_nccl_refuses_two_learners_on_one_gpu_with_the_remedy():
    proc = run_mpi(4, *MPIRL, "doctor", "--pings", "2", "--config",
                   '{"num_learners": 2, "learner_backend": "nccl"}', timeout=120)
    assert proc.returncode != 0
    assert re.search(r"learners 0 and 1 share one GPU on host \S+\. Give each learner rank its "
                     r"own GPU", proc.stderr + proc.stdout), proc.stderr
    assert "Traceback" not in proc.stderr


@one_gpu
@pytest.mark.parametrize("backend, used", [("mpi", "mpi"), ("gloo", "gloo"), ("auto", "mpi")])
def test_two_learners_share_one_gpu_through_host_memory(backend, used):
    # auto takes MPI here, not NCCL: NCCL refuses two ranks on one GPU.
    proc = run_mpi(4, *MPIRL, "doctor", "--pings", "2", "--config",
                   f'{{"num_learners": 2, "learner_backend": "{backend}"}}', timeout=180)
    assert proc.returncode == 0, proc.stderr
    rows = doctor_learner_rows(proc.stdout)
    assert [(row[0], row[2], row[4]) for row in rows] == [("2", "cuda:0", used),
                                                          ("3", "cuda:0", used)], proc.stdout
    assert re.search(rf"learner allreduce \({used}, 2 learners\), 64 MiB: [\d.]+ ms",
                     proc.stdout), proc.stdout
