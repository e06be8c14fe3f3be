"""The rollout ranks' answers to a synchronous sampling round reach rank 0 through one gather on
weights_comm, not a message each (``sample_with_new_weights``); the fake-worker side of it is in
test_sample_with_weights."""

from __future__ import annotations

import csv
import json
import pickle
import sys

import numpy as np
from conftest import run_mpi

MPIRL = [sys.executable, "-m", "mpirl"]

GATHER_PROGRAM = r"""
import json
from mpi4py import MPI
from mpirl.runtime.ulfm import gather_bytes
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
# Sizes differ, one is empty (a call that raised sends no metrics) and one is over 16 kB.
payload = bytes([rank]) * {0: 0, 1: 3, 2: 0, 3: 40_000}.get(rank, rank)
parts = gather_bytes(comm, payload, 60.0, "the test gather")
if rank == 0:
    print(json.dumps([[len(p), sorted(set(p))] for p in parts]))
else:
    assert parts is None
"""


def test_gather_bytes_hands_rank_0_every_payload_in_rank_order():
    proc = run_mpi(5, sys.executable, "-c", GATHER_PROGRAM, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        [0, []], [3, [1]], [0, []], [40_000, [3]], [4, [4]]]


def test_ppo_rank_0_sends_and_takes_no_message_per_rollout_rank(tmp_path):
    """With the learner on rank 0 the answers and the batches come in the gather, and under
    ``mpirl train`` the rollout ranks' calls stand from one iteration to the next
    (``execution.standing_rounds``): rank 0 sends and takes no message per rollout rank per
    iteration. A checkpoint ends the rounds (its calls reach the ranks) and the next iteration
    starts them again, with one call per rank; every round's steps are counted."""
    run_dir = tmp_path / "run"
    # 2 rollout ranks: zero messages per rollout rank is zero for any number of them.
    proc = run_mpi(3, *MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1", "--run-dir",
                   str(run_dir), "--progress", "off", "--config",
                   json.dumps({"num_epochs": 1, "rollout_fragment_length": 32,
                               "checkpoint_every": 3}),
                   "--stop", '{"training_iteration": 5}', timeout=240)
    assert proc.returncode == 0, proc.stderr
    with open(run_dir / "progress.csv") as file:
        rows = list(csv.DictReader(file))
    rollout_ranks = int(float(rows[-1]["num_rollout_workers"]))
    assert rollout_ranks == 2
    messages = [float(row["perf/driver_msgs_per_iter"]) for row in rows]
    # Iteration 1 has the start-up's messages; 4 follows the checkpoint after 3.
    assert messages[1] == messages[2] == messages[4] == 0, messages
    assert messages[3] >= rollout_ranks, messages
    assert float(rows[-1]["timesteps_total"]) == 5 * 2 * 32 * int(
        json.loads((run_dir / "params.json").read_text())["config"]["num_envs_per_worker"])


def test_a_rank_that_fails_in_a_later_standing_round_ends_the_run_with_its_error(tmp_path):
    """The env fails at its 100th step, after some rounds have run: that rank's round joins
    the gather with no result, the driver ends the standing rounds (the others are waiting for
    the next), and the rank's own error ends the run, with no hang and no traceback."""
    run_dir = tmp_path / "run"
    proc = run_mpi(4, *MPIRL, "train", "--algo", "PPO", "--env", "mpirl.testing:FlakyCartPoleEnv",
                   "--run-dir", str(run_dir), "--progress", "off", "--config",
                   json.dumps({"env_config": {"fail_every_steps": 100}, "max_env_failures": 2,
                               "num_envs_per_worker": 1, "rollout_fragment_length": 16,
                               "num_epochs": 1}),
                   "--stop", '{"training_iteration": 100}', timeout=120, env={"CI": "true"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "failed 2 times" in proc.stderr and "injected failure in step 100" in proc.stderr, \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "AssertionError" not in proc.stderr
    with open(run_dir / "progress.csv") as file:
        assert len(list(csv.DictReader(file))) >= 6  # 16 steps a round: the 2nd failure is later


def test_a_batch_rides_in_the_gather_only_when_it_is_small():
    from mpirl.runtime.gathered import GATHER_BATCH_BYTES, fits_in_gather

    def batch(nbytes):
        return {"obs": np.zeros(nbytes // 2, np.uint8), "actions": np.zeros(nbytes // 2, np.uint8)}

    assert fits_in_gather(batch(GATHER_BATCH_BYTES), 2)
    assert not fits_in_gather(batch(GATHER_BATCH_BYTES + 2), 2)
    # However many members: the root's buffer stays within 1 GiB.
    assert fits_in_gather(batch(64 << 10), 16_384)
    assert not fits_in_gather(batch(66 << 10), 16_384)


def test_a_batch_too_large_for_the_gather_goes_to_the_learner_as_a_message():
    from types import SimpleNamespace

    from mpirl.data.tags import BATCH
    from mpirl.runtime.gathered import PackedBatch
    from mpirl.workers.rollout import RolloutWorker

    sent = []
    channel = SimpleNamespace(flush=lambda: None,
                              isend=lambda obj, dest, tag: sent.append((obj, dest, tag)))
    context = SimpleNamespace(data_channel=channel,
                              weights_comm=SimpleNamespace(Get_size=lambda: 5))
    worker = SimpleNamespace(context=context, tags=SimpleNamespace(batch=BATCH))
    worker._send_batch = lambda batch, send_to: RolloutWorker._send_batch(worker, batch, send_to)
    small = {"obs": np.arange(8, dtype=np.float32)}
    answer = RolloutWorker._batch_in_answer(worker, {"env_steps": 8}, small, 0)
    assert not sent and isinstance(answer["batch"], PackedBatch)
    # The learner unpacks it (Learner.train), after the answer crossed as bytes.
    unpacked = pickle.loads(pickle.dumps(answer, protocol=5))["batch"].unpack()
    assert unpacked.keys() == {"obs"} and np.array_equal(unpacked["obs"], small["obs"])
    large = {"obs": np.zeros(2 << 20, np.float32)}  # 8 MiB
    answer = RolloutWorker._batch_in_answer(worker, {"env_steps": 8}, large, 3)
    assert answer == {"env_steps": 8} and sent == [(large, 3, BATCH)]


def test_the_root_expects_the_shortest_of_its_last_three_rounds():
    from mpirl.runtime.gathered import RoundWaits

    waits = RoundWaits()
    assert waits.expected_s() == 0.0  # the first round is polled as any wait
    for seconds in (1.0, 0.5, 2.0, 3.0):
        waits.add(seconds)
    assert waits.expected_s() == 0.5  # 1.0 has left the window
    waits.add(4.0)
    assert waits.expected_s() == 2.0


def test_answers_decode_with_their_batches_after_the_pickle_uncopied():
    from mpirl.runtime.gathered import PackedBatch, decode_answers, encode_answer

    batch = {"obs": np.arange(12, dtype=np.float32).reshape(3, 4), "actions": np.arange(3)}
    parts = [encode_answer(3, {"env_steps": 3, "batch": PackedBatch(batch)}),
             encode_answer(1, {"env_steps": 5, "episode_returns": [1.5]}),
             encode_answer(2, None)]  # a call that raised
    answers = decode_answers(parts)
    assert list(answers) == [3, 1, 2] and answers[2] is None
    assert answers[1] == {"env_steps": 5, "episode_returns": [1.5]}
    packed = answers[3].pop("batch")
    assert answers[3] == {"env_steps": 3}
    # The batch's bytes are the part's own, not a copy; the learner unpacks them whole.
    assert isinstance(packed.data, memoryview) and packed.data.obj is parts[0]
    unpacked = packed.unpack()
    assert unpacked.keys() == batch.keys()
    assert all(np.array_equal(unpacked[k], v) for k, v in batch.items())


AGREE_PROGRAM = r"""
import json, sys
from types import SimpleNamespace
from mpi4py import MPI
from mpirl.runtime import gathered
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
case = sys.argv[1]
context = SimpleNamespace(weights_comm=comm, rank=rank, collective_timeout_s=60.0,
                          collective_backoff=None)
if rank == 0:  # learner 0, the root
    agreed, found = gathered.agreed_or_gathered(context, gathered.RoundWaits())
    if not agreed:
        found = {str(r): v for r, v in gathered.decode_answers(found).items()}
    print(json.dumps({"root": [agreed, found]}))
else:
    result = {"checksum": "ab" if case == "differs" and rank == 3 else "aa", "norm": 0.5}
    failure = ValueError("rank 2 failed") if case == "raises" and rank == 2 else None
    try:
        out = gathered.answer_unless_agreed(context, None if failure else result, failure)
        out = "ANSWERED" if out is gathered.ANSWERED else out
    except ValueError as error:
        out = f"raised: {error}"
    print(json.dumps({"rank": rank, "out": out}))
"""


def _agree(case: str) -> tuple[list, dict[int, object]]:
    proc = run_mpi(4, sys.executable, "-c", AGREE_PROGRAM, case, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    root = next(line["root"] for line in lines if "root" in line)
    return root, {line["rank"]: line["out"] for line in lines if "rank" in line}


def test_answers_that_agree_reach_rank_0_once():
    """Every member's answer the same: the root gets it once, in a broadcast from member 1,
    and no member sends its own."""
    root, out = _agree("same")
    assert root == [True, {"checksum": "aa", "norm": 0.5}]
    assert out == {1: "ANSWERED", 2: "ANSWERED", 3: "ANSWERED"}


def test_answers_that_differ_are_gathered_whole():
    root, out = _agree("differs")
    assert root == [False, {"1": {"checksum": "aa", "norm": 0.5},
                            "2": {"checksum": "aa", "norm": 0.5},
                            "3": {"checksum": "ab", "norm": 0.5}}]
    assert out == {1: "ANSWERED", 2: "ANSWERED", 3: "ANSWERED"}


def test_a_call_that_failed_is_gathered_with_no_result_and_raises():
    root, out = _agree("raises")
    assert root == [False, {"1": {"checksum": "aa", "norm": 0.5}, "2": None,
                            "3": {"checksum": "aa", "norm": 0.5}}]
    assert out == {1: "ANSWERED", 2: "raised: rank 2 failed", 3: "ANSWERED"}


def test_a_float64_record_crosses_raw_and_decodes_without_a_copy():
    from mpirl.runtime.gathered import decode_answers, encode_answer

    record = np.array([3.0, 0.5, 2.0**52])
    parts = [encode_answer(7, record), encode_answer(2, {"env_steps": 1}),
             encode_answer(5, np.arange(3))]  # int64: pickled like any other answer
    answers = decode_answers(parts)
    assert np.array_equal(answers[7], record) and answers[7].base is not None
    assert not answers[7].flags.writeable  # a view of the part's bytes
    assert answers[2] == {"env_steps": 1} and answers[5].dtype == np.int64
