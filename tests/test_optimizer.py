"""The learners' Adam: torch's update and state, bit for bit, without importing torch._dynamo
(a second of every run's start-up on rank 0)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from conftest import run_mpi

from mpirl.workers.optimizer import Adam


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs) -> None:
    for x in inputs:
        model(x).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()


def _same_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][k][f], b["state"][k][f])
               for k in a["state"] for f in a["state"][k])


def test_its_updates_and_state_are_torchs_bit_for_bit_and_checkpoints_load_both_ways():
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(5, 4, generator=generator) for _ in range(8)]
    ours_model, torch_model = _model(), _model()
    ours = Adam(ours_model.parameters(), lr=3e-3)
    reference = torch.optim.Adam(torch_model.parameters(), lr=3e-3, eps=1e-5)
    _steps(ours_model, ours, inputs[:4])
    _steps(torch_model, reference, inputs[:4])
    assert _same_state(ours.state_dict(), reference.state_dict())
    # Swap the state across the classes, as a checkpoint written before this class would be.
    ours_from_torch = Adam(ours_model.parameters(), lr=1.0)
    ours_from_torch.load_state_dict(reference.state_dict())
    torch_from_ours = torch.optim.Adam(torch_model.parameters(), lr=1.0, eps=1e-5)
    torch_from_ours.load_state_dict(ours.state_dict())
    _steps(ours_model, ours_from_torch, inputs[4:])
    _steps(torch_model, torch_from_ours, inputs[4:])
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _same_state(ours_from_torch.state_dict(), torch_from_ours.state_dict())


# torch.optim.Adam imports torch._dynamo in its constructor and again in step(); ours in neither.
NO_DYNAMO_PROGRAM = textwrap.dedent("""
    import sys, torch
    from mpirl.workers.optimizer import Adam
    model = torch.nn.Linear(3, 2)
    optimizer = Adam(model.parameters(), lr=1e-3)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.load_state_dict(optimizer.state_dict())
    print("without", "torch._dynamo" in sys.modules)
    torch.optim.Adam(model.parameters())
    print("torch's", "torch._dynamo" in sys.modules)
    # Once dynamo is imported, torch's own wrappers run again, and the update still works.
    model(torch.ones(2, 3)).sum().backward()
    before = model.weight.detach().clone()
    optimizer.step()
    print("moved", not torch.equal(before, model.weight))
""")


def test_it_does_not_import_torch_dynamo_and_still_works_once_something_else_has():
    proc = subprocess.run([sys.executable, "-c", NO_DYNAMO_PROGRAM], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["without", "False", "torch's", "True", "moved", "True"]


# A whole PPO run and its resume (a checkpoint written, then loaded) on rank 0, the learner's
# rank: nothing on the way may import torch._dynamo, or start-up pays for it again.
RUN_PROGRAM = textwrap.dedent("""
    import sys, mpirl
    run_dir = sys.argv[1]
    row = mpirl.train("PPO", "CartPole-v1", stop={"training_iteration": 1}, run_dir=run_dir,
                      progress="off")
    row = mpirl.train("PPO", "CartPole-v1", stop={"training_iteration": 2}, resume=run_dir,
                      progress="off")
    if row is not None:
        print("DYNAMO", "torch._dynamo" in sys.modules, row["iteration"], flush=True)
""")


def test_a_training_run_and_its_resume_never_import_torch_dynamo(tmp_path):
    proc = run_mpi(2, sys.executable, "-c", RUN_PROGRAM, str(tmp_path / "run"), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DYNAMO False 2" in proc.stdout, proc.stdout[-2000:]
