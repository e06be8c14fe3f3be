"""The task model under mpiexec: futures, waiting, payloads, remote errors, local mode."""

import re
import sys

import pytest
import torch
from conftest import doctor_learner_rows, run_mpi, run_scenario


def _ok(proc, result):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert result is not None, f"no RESULT line:\n{proc.stdout}\n{proc.stderr}"
    return result


def test_results_reach_their_own_futures_in_order():
    result = _ok(*run_scenario(4, "order"))
    assert result["workers"] == 3
    assert result["total"] == 180 and result["mismatches"] == 0
    assert result["fifo_per_worker"]


@pytest.mark.parametrize("fan_out_min", [None, 2], ids=["isend-each", "persistent-sends"])
def test_a_group_call_is_pickled_once_and_each_worker_keeps_its_call_order(fan_out_min):
    """4 workers: below FAN_OUT_MIN a group call is one Isend per rank; with the minimum at 2
    it goes through persistent sends (Startall) from the second message of a length on, mixed
    with single calls' Isends, more message lengths than the channel keeps sets of sends for,
    and a message too large for them."""
    from mpirl.runtime.transport import FAN_OUT_MAX_BYTES, FAN_OUTS_KEPT

    args = () if fan_out_min is None else ("--fan-out-min", str(fan_out_min))
    result = _ok(*run_scenario(5, "group_calls", *args))
    workers = result["workers"]
    assert workers == 4 and result["calls"] == 3 * (2 * workers + 2 * workers) + 26 * workers
    assert result["mismatches"] == []
    assert result["whoami"] == result["ranks"] == [1, 2, 3, 4]
    # Per round: one encode for each of the two group calls, and one per single call.
    assert result["group_encodes"] == 3 * (2 + 2 * workers) + 26
    assert "does not answer 'no_such_method'" in result["unknown"]
    assert result["fan_outs_kept"] == (0 if fan_out_min is None else FAN_OUTS_KEPT)
    assert result["largest_kept"] <= FAN_OUT_MAX_BYTES  # large messages go as plain sends
    assert result["all_sent"]


def test_wait_returns_the_first_k_of_n():
    result = _ok(*run_scenario(5, "first_k"))
    assert sorted(result["ready"]) == [1, 3]  # the two fast workers
    assert result["first_wait_s"] < 1.0  # did not wait for the 1.5 s stragglers
    assert result["short_wait_ready"] == 0 and result["short_wait_s"] < 1.0
    assert result["rest"] == [0, 2] and result["still"] == 0


def test_64_mib_arrays_arrive_bit_identical():
    result = _ok(*run_scenario(2, "bulk"))
    assert result == {"remote_sum_ok": True, "made_ok": True, "echo_ok": True,
                      "echo_writeable": True, "nest_ok": True, "small_writeable": True}


def test_small_arrays_travel_inside_the_control_frame():
    import pickle

    import numpy as np

    from mpirl.runtime.transport import INBAND_BYTES, encode
    small, edge = np.arange(100.0), np.ones(INBAND_BYTES, np.uint8)
    big = np.arange(INBAND_BYTES // 8 + 1, dtype=np.float64)  # one element over the limit
    head, raws = encode({"small": small, "edge": edge, "big": big})
    assert [raw.nbytes for raw in raws] == [big.nbytes]  # one bulk frame: the big array only
    assert len(head) > small.nbytes + edge.nbytes
    count = int.from_bytes(head[:4], "little")
    back = pickle.loads(memoryview(head)[4 + 8 * count:],
                        buffers=[np.frombuffer(raw, np.uint8).copy() for raw in raws])
    assert all(np.array_equal(back[k], v) for k, v in
               {"small": small, "edge": edge, "big": big}.items())
    assert back["small"].flags.writeable and back["small"].dtype == small.dtype


def test_sends_are_tested_together_not_one_by_one(monkeypatch):
    """Each test of an unfinished send is an MPI progress over every peer: a channel tests its
    pending sends in one call, every ``PENDING_TEST_AT`` sends or so: 1,000 sends make some 30
    tests, not 1,000, and a send whose receiver never takes it holds no others."""
    from collections import deque
    from types import SimpleNamespace

    from mpirl.runtime import transport

    class Request:
        def __init__(self, completes_in: int) -> None:
            self.completes_in = completes_in

        def __bool__(self) -> bool:
            return self.completes_in > 0

    tests = []

    def testsome(requests):
        tests.append(len(requests))
        for request in requests:
            request.completes_in = max(0, request.completes_in - 1)

    monkeypatch.setattr(transport, "MPI", SimpleNamespace(Request=SimpleNamespace(
        Testsome=testsome)))
    channel = transport.Channel.__new__(transport.Channel)
    channel._pending, channel._test_at = deque(), transport.PENDING_TEST_AT
    channel.messages_sent = channel.bytes_sent = 0
    stuck = Request(10**9)  # a receiver that never takes its message
    channel.comm = SimpleNamespace(Isend=lambda head, dest, tag: stuck if dest == 9 else Request(1))
    channel.isend("never taken", 9, 0)
    for i in range(1000):
        channel.isend({"call": i}, 1, 0)
    assert len(tests) <= 1000 // (transport.PENDING_TEST_AT - 1) + 1
    assert channel.pending_sends < transport.PENDING_TEST_AT
    assert channel.flush() is False and channel.pending_sends == 1  # the stuck one only


def test_payload_over_2_gib():
    result = _ok(*run_scenario(2, "huge", timeout=280))
    assert result["nbytes"] > 2 << 30
    assert result["to_worker_ok"] and result["from_worker_ok"]


def test_remote_exception_reaches_driver_and_worker_keeps_serving():
    result = _ok(*run_scenario(2, "errors"))
    remote = result["remote"]
    assert remote["rank"] == 1 and remote["role"] == "rollout" and remote["method"] == "fail"
    assert remote["cause_type"] == "ValueError"
    assert "boom 42" in remote["message"] and "Remote traceback (rank 1)" in remote["message"]
    assert 'in fail' in remote["message"]  # the remote frame is in the traceback
    assert result["count_after_error"] == 6  # state kept across the failure
    assert "does not answer 'no_such_method'" in result["unknown_method"]
    assert "could not be sent back" in result["unpicklable"]
    assert "constructor refused on rank 1" in result["constructor"]
    assert "sleep_then() on rollout rank 1" in result["timeout"]
    assert result["late_result"] == "late" and result["still_serving"] == "yes"


def test_a_spawn_that_fails_on_one_rank_leaves_no_objects_behind():
    result = _ok(*run_scenario(4, "partial_spawn"))
    assert "constructor refused on rank 2" in result["error"]
    assert result["before"] == result["after"] == [0, 0, 0]


def test_calls_beyond_the_in_flight_bound_wait_for_a_slot():
    result = _ok(*run_scenario(2, "in_flight", "--max-in-flight", "4"))
    assert result["max_seen"] == 4
    assert result["first_four_s"] < 0.2  # four calls leave at once
    assert result["fifth_s"] >= 0.25  # the fifth waited for the first 0.3 s call
    assert result["results"] == [0, 1, 2, 3, 4]


def test_local_mode_runs_the_same_driver_code():
    local_proc, local = run_scenario(1, "same_code")
    dist_proc, dist = run_scenario(3, "same_code")
    local, dist = _ok(local_proc, local), _ok(dist_proc, dist)
    assert local["local"] is True and dist["local"] is False
    assert local["workers"] == 1 and dist["workers"] == 2
    for result in (local, dist):
        assert result["values_ok"]
        assert result["waited"] == [10 * i for i in range(result["workers"])]
        assert result["error"] == ["fail", "ValueError", True]
        assert result["labels"] == ["L"] and result["roles"] == ["rollout"]
        assert result["count"] == 1


def test_clean_shutdown_exits_zero_on_every_rank():
    # mpiexec exits 0 only if every rank did.
    proc = run_mpi(4, sys.executable, "-m", "mpirl", "doctor", "--pings", "20", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "doctor: 3 worker(s) answered, 0 payload error(s)" in proc.stdout
    assert proc.stdout.count("mpirl layout:") == 1  # only rank 0 prints


def test_doctor_reports_each_learner_and_times_the_gradient_allreduce():
    config = '{"num_learners": 2, "learner_backend": "gloo"}'
    proc = run_mpi(4, sys.executable, "-m", "mpirl", "doctor", "--pings", "5", "--config", config,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr
    learner_rows = doctor_learner_rows(proc.stdout)
    assert [row[0] for row in learner_rows] == ["2", "3"], proc.stdout
    # A learner takes the GPU where there is one (both share it here: gloo stages through host).
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert all(row[2] == device and row[4] == "gloo"
               and row[5].startswith(torch.__version__.split("+")[0])
               for row in learner_rows), proc.stdout
    timed = re.findall(r"learner allreduce \(gloo, 2 learners\), (\d+) MiB: ([\d.]+) ms, "
                       r"([\d.]+) GB/s alg, ([\d.]+) GB/s bus", proc.stdout)
    assert [t[0] for t in timed] == ["1", "64"], proc.stdout
    assert all(float(ms) > 0 and float(alg) > 0 and float(bus) == float(alg)  # n = 2: equal
               for _, ms, alg, bus in timed), timed


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA here: the doctor's NCCL report needs a GPU learner")
def test_doctor_reports_a_gpu_learner_and_its_nccl_version():
    proc = run_mpi(3, sys.executable, "-m", "mpirl", "doctor", "--pings", "5", "--config",
                   '{"num_learners": 1}', timeout=120)
    assert proc.returncode == 0, proc.stderr
    [row] = doctor_learner_rows(proc.stdout)
    assert row[0] == "2" and row[2] == "cuda:0" and row[3] != "-", proc.stdout  # a GPU's name
    assert row[4] == "nccl" and row[-1] != "-", proc.stdout  # the NCCL version is known



@pytest.mark.parametrize("n, config, expected", [
    pytest.param(4, '{"num_learners": 2, "learner_backend": "nccl"}',
                 "learner_backend 'nccl' needs CUDA learners; learner 0 runs on the CPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
    (3, '{"num_learners": 1, "learner_backend": "ncl"}',  # driver, rollout, learner
     "learner_backend must be one of auto, mpi, gloo, nccl, got 'ncl'"),
])
def test_doctor_refuses_a_learner_backend_it_cannot_test(n, config, expected):
    proc = run_mpi(n, sys.executable, "-m", "mpirl", "doctor", "--pings", "5", "--config", config,
                   timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("config, expected", [
    ('{"num_rollout_workers": 2, "num_learners": 2}', "needs 5 ranks (1 driver + 2 rollout"),
    ('{"num_learner": 2}', "Did you mean 'num_learners'"),
    ('{"num_learners": 2', "is not valid JSON"),
    ('{"poll_sleep_share": 2}', '"poll_sleep_share" = 2 is out of range: must be a finite number '
                                "in [0, 1]"),
])
def test_bad_layout_or_config_is_one_clear_error(config, expected):
    proc = run_mpi(4, sys.executable, "-m", "mpirl", "doctor", "--config", config, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.count("mpirl: error:") == 1, proc.stderr  # rank 0 alone reports it
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_persistent_sends_can_be_turned_off_for_mpi_monitoring():
    """Open MPI's pml monitoring does not count persistent sends: scale.py's traffic runs turn
    them off with MPIRL_PERSISTENT_SENDS=0."""
    import os
    import subprocess

    probe = "from mpirl.runtime import transport; print(transport.FAN_OUT_MIN)"
    values = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env={**os.environ, "MPIRL_PERSISTENT_SENDS": setting},
                             check=True).stdout.strip() for setting in ("1", "0")]
    assert int(values[0]) == 8 and int(values[1]) > 1 << 40, values
