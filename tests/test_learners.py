"""Data-parallel learners: after every update all learners hold identical weights."""

import pytest
from conftest import run_scenario


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_two_learners_hold_identical_weights_after_updates(backend):
    # Each learner trains on its own batch; the averaged gradients must keep them in lockstep.
    # Gloo also exercises the torch.distributed bootstrap (TCPStore over the learner comm).
    proc, result = run_scenario(3, "learners_agree", "--layout", '{"num_learners": 2}',
                                "--backend", backend, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert result["learners"] == 2 and result["initial_equal"]
    assert result["moved"] and result["identical"]
    assert result["sgd_steps"] == [8, 8]


def test_gpu_learners_use_nccl():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the NCCL learner path needs a GPU (CI has none)")
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per learner; this machine has fewer than 2")
    proc, result = run_scenario(3, "learners_agree", "--layout", '{"num_learners": 2}',
                                "--backend", "nccl", timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert result["identical"] and result["moved"]


def test_the_backend_is_chosen_alike_for_every_learner_from_where_they_all_run():
    from mpirl.errors import ConfigError
    from mpirl.workers.learner import resolve_backend

    own_gpus = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a")]  # told apart by host and UUID
    shared = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n1", "GPU-a")]
    mixed = [("n1", "GPU-a"), ("n2", "")]
    assert resolve_backend("auto", own_gpus) == "nccl"
    # auto falls back to MPI (through host memory) rather than let NCCL fail or hang.
    assert resolve_backend("auto", shared) == "mpi" and resolve_backend("auto", mixed) == "mpi"
    assert resolve_backend("auto", [("n1", ""), ("n2", "")]) == "mpi"
    assert resolve_backend("auto", [("n1", "GPU-a")]) == "nccl"  # one learner: no group anyway
    assert resolve_backend("gloo", shared) == "gloo" and resolve_backend("mpi", own_gpus) == "mpi"
    assert resolve_backend("nccl", own_gpus) == "nccl"
    with pytest.raises(ConfigError, match=r"learners 0 and 2 share one GPU on host n1\. Give "
                                          r"each learner rank its own GPU .* 'mpi' or 'gloo'"):
        resolve_backend("nccl", shared)
    with pytest.raises(ConfigError, match="needs CUDA learners; learner 1 runs on the CPU"):
        resolve_backend("nccl", mixed)
    with pytest.raises(ConfigError, match="needs CUDA learners; this learner runs on cpu"):
        resolve_backend("nccl", [("n1", "")], "cpu")


def test_batch_transfer_on_the_cpu_hands_the_arrays_over_unchanged():
    import numpy as np
    import torch

    from mpirl.workers.batch_transfer import BatchTransfer

    transfer = BatchTransfer("cpu")
    assert transfer.mode == "pageable"
    batch = {"obs": np.arange(12, dtype=np.uint8).reshape(3, 4), "done": np.array([0, 1, 0.5])}
    tensors = transfer(batch)
    assert tensors["obs"].dtype == torch.uint8 and tensors["obs"].tolist() == batch["obs"].tolist()
    assert tensors["done"].dtype == torch.float64 and transfer.pinned_bytes() == 0
    with pytest.raises(ValueError, match="pinned transfers need a CUDA device, not cpu"):
        BatchTransfer("cpu", "pinned")
    with pytest.raises(ValueError, match="one of auto, pinned, pageable, got 'pin'"):
        BatchTransfer("cpu", "pin")
