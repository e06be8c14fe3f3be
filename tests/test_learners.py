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
