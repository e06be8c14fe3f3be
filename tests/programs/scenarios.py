"""Driver programs that the runtime tests launch under mpiexec (or alone, for local mode).

``python scenarios.py NAME [options]`` runs on every rank; rank 0 runs scenario NAME and prints one
line ``RESULT {json}`` that the test asserts on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np

import mpirl
from mpirl.errors import RemoteError, TaskTimeout
from mpirl.testing import Echo, FailingConstructor, deterministic_bytes, sha256

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def report(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


@scenario
def order(driver, args):
    """Many calls with random durations on every worker; every future must get its own answer."""
    echoes = driver.spawn("rollout", Echo)
    rng = random.Random(0)
    futures, expected = [], []
    for i in range(60):
        for handle in echoes:
            value = [handle.index, i]
            futures.append(handle.call_async("sleep_then", rng.random() * 0.002, value))
            expected.append(value)
    completion = []  # (worker index, i) in the order answers were taken
    pending = list(futures)
    while pending:
        ready, pending = mpirl.wait(pending, num_returns=1, timeout=30)
        completion.extend(f.result() for f in ready)
    got = [f.result() for f in futures]
    per_worker = {}
    for index, i in completion:
        per_worker.setdefault(index, []).append(i)
    report(mismatches=sum(g != e for g, e in zip(got, expected, strict=True)), total=len(got),
           fifo_per_worker=all(seq == sorted(seq) for seq in per_worker.values()),
           workers=len(echoes))


@scenario
def group_calls(driver, args):
    """Calls to a whole group between calls to single workers: each group call is pickled once
    for all its workers, every answer reaches its own future, and each worker runs its calls in
    the order they were made (its count of echoes tells)."""
    from mpirl.runtime import transport

    echoes = driver.spawn("rollout", Echo)
    encoded = []
    real_encode = transport.encode

    def counting_encode(obj):
        encoded.append(obj[2] if isinstance(obj, tuple) and len(obj) == 5 else None)
        return real_encode(obj)

    transport.encode = counting_encode
    try:
        calls = []  # (future, what its answer must be)
        for round_ in range(3):
            for future in echoes.call_async("echo", round_):
                calls.append((future, round_))
            for handle in echoes:
                calls.append((handle.call_async("count"), 2 * round_ + 1))
                calls.append((handle.call_async("echo", handle.index), handle.index))
            for future in echoes.call_async("count"):
                calls.append((future, 2 * round_ + 2))
        # Messages of many lengths, each twice (persistent sends are set up at the second):
        # more sets of persistent sends than a channel keeps.
        for length in range(24):
            for future in echoes.call_async("echo", "x" * (length // 2)):
                calls.append((future, "x" * (length // 2)))
        # A message too large for persistent sends (it would wait for its receivers), twice.
        big = "y" * (transport.FAN_OUT_MAX_BYTES + 1)
        for _ in range(2):
            for future in echoes.call_async("echo", big):
                calls.append((future, big))
        whoami = [f.result(timeout=30)["rank"] for f in echoes.call_async("whoami")]
        mismatches = [(f.rank, f.method, f.result(timeout=30), want) for f, want in calls
                      if f.result(timeout=30) != want]
    finally:
        transport.encode = real_encode
    try:
        echoes.call_async("no_such_method")
        unknown = "no error"
    except AttributeError as error:
        unknown = str(error)
    report(workers=len(echoes), calls=len(calls), mismatches=mismatches, whoami=whoami,
           ranks=echoes.ranks, group_encodes=encoded.count("echo") + encoded.count("count"),
           unknown=unknown, fan_outs_kept=len(driver.dispatcher.channel._fan_outs),
           largest_kept=max((key[0] for key in driver.dispatcher.channel._fan_outs), default=0),
           all_sent=driver.dispatcher.channel.flush(timeout=10))


@scenario
def first_k(driver, args):
    """Wait for the first 2 of 4 calls while two workers are slow."""
    echoes = driver.spawn("rollout", Echo)
    delays = [1.5, 0.05, 1.5, 0.1]
    start = time.monotonic()
    futures = [h.call_async("sleep_then", d, h.index) for h, d in zip(echoes, delays, strict=True)]
    ready, not_ready = mpirl.wait(futures, num_returns=2, timeout=30)
    first_wait_s = time.monotonic() - start
    start = time.monotonic()
    none_ready, _ = mpirl.wait(not_ready, num_returns=1, timeout=0.05)
    short_wait_s = time.monotonic() - start
    rest, still = mpirl.wait(not_ready, num_returns=len(not_ready), timeout=30)
    report(ready=[f.result() for f in ready], not_ready=[f.rank for f in not_ready],
           first_wait_s=first_wait_s, short_wait_ready=len(none_ready), short_wait_s=short_wait_s,
           rest=sorted(f.result() for f in rest), still=len(still))


@scenario
def bulk(driver, args):
    """64 MiB both ways, and a nest of arrays of many kinds, must arrive bit-identical."""
    echo = driver.spawn("rollout", Echo)[0]
    nbytes, seed = 64 << 20, 7
    payload = deterministic_bytes(nbytes, seed)
    remote_sum = echo.call("checksum", payload)
    made = echo.call("make_array", nbytes, seed)
    back = echo.call("echo", payload)
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    nest = {
        "f64": base, "f32_fortran": np.asfortranarray(base.astype(np.float32)),
        "strided": base[:, ::2], "empty": np.zeros((0, 3), np.int64), "scalar": np.int16(-3),
        "bool": base > 10, "list": [base[0], "text", 3.5, None], "bytes": b"\x00\xff" * 1000,
    }
    nest_back = echo.call("echo", nest)
    same = all(
        np.array_equal(np.asarray(nest[k]), np.asarray(nest_back[k]))
        and np.asarray(nest[k]).dtype == np.asarray(nest_back[k]).dtype
        for k in ("f64", "f32_fortran", "strided", "empty", "scalar", "bool")
    )
    same = same and nest_back["list"][1:] == nest["list"][1:]
    same = same and nest_back["bytes"] == nest["bytes"]
    same = same and np.array_equal(nest_back["list"][0], nest["list"][0])
    digest = sha256(payload)
    report(
        remote_sum_ok=(list(remote_sum[0]), *remote_sum[1:]) == ([nbytes], "uint8", digest),
        made_ok=sha256(made) == sha256(payload), echo_ok=sha256(back) == sha256(payload),
        echo_writeable=bool(back.flags.writeable), nest_ok=bool(same),
        small_writeable=bool(nest_back["f64"].flags.writeable),  # in-band: a copy of its own
    )


@scenario
def huge(driver, args):
    """A payload over 2 GiB, both ways."""
    echo = driver.spawn("rollout", Echo)[0]
    # Over 2 GiB: three 1 GiB chunks (CHUNK_BYTES), the last one of 13 bytes.
    nbytes, seed = (2 << 30) + 13, 11
    payload = deterministic_bytes(nbytes, seed)
    digest = sha256(payload)
    start = time.monotonic()
    shape, dtype, remote_digest = echo.call("checksum", payload, timeout=300)
    del payload
    made = echo.call("make_array", nbytes, seed, timeout=300)
    report(to_worker_ok=remote_digest == digest and list(shape) == [nbytes],
           from_worker_ok=sha256(made) == digest, nbytes=nbytes,
           seconds=time.monotonic() - start)


@scenario
def errors(driver, args):
    """Remote exceptions, unknown methods, unpicklable results, bad constructors, timeouts."""
    echo = driver.spawn("rollout", Echo)[0]
    for i in range(3):
        echo.call("echo", i)
    out = {}
    try:
        echo.call("fail", "boom 42")
    except RemoteError as error:
        out["remote"] = {"rank": error.rank, "role": error.role, "method": error.method,
                         "cause_type": error.cause_type, "message": str(error)}
    for i in range(3):
        echo.call("echo", i)
    out["count_after_error"] = echo.call("count")
    try:
        echo.call_async("no_such_method")
    except AttributeError as error:
        out["unknown_method"] = str(error)
    try:
        echo.call("unpicklable_result")
    except RemoteError as error:
        out["unpicklable"] = str(error)
    try:
        driver.spawn("rollout", FailingConstructor)
    except RemoteError as error:
        out["constructor"] = str(error)
    slow = echo.call_async("sleep_then", 1.0, "late")
    try:
        slow.result(timeout=0.2)
    except TaskTimeout as error:
        out["timeout"] = str(error)
    out["late_result"] = slow.result(timeout=30)
    out["still_serving"] = echo.call("echo", "yes")
    report(**out)


@scenario
def partial_spawn(driver, args):
    """A constructor failing on one rank of three leaves no object behind on the others."""
    from mpirl.runtime.dispatch import HOST

    def objects_per_rank():
        return [driver.dispatcher.submit(rank, HOST, "count_objects", (), {}).result()
                for rank in driver.placement.ranks("rollout")]

    before = objects_per_rank()
    try:
        driver.spawn("rollout", FailingConstructor, (2,))
        error = None
    except RemoteError as e:
        error = str(e)
    report(before=before, after=objects_per_rank(), error=error)


@scenario
def in_flight(driver, args):
    """The fifth call on a worker with a bound of 4 waits for a slot."""
    echo = driver.spawn("rollout", Echo)[0]
    futures, max_seen = [], 0
    start = time.monotonic()
    for i in range(4):
        futures.append(echo.call_async("sleep_then", 0.3, i))
        max_seen = max(max_seen, echo.in_flight())
    first_four_s = time.monotonic() - start
    futures.append(echo.call_async("sleep_then", 0.0, 4))
    fifth_s = time.monotonic() - start
    max_seen = max(max_seen, echo.in_flight())
    report(first_four_s=first_four_s, fifth_s=fifth_s, max_seen=max_seen,
           results=[f.result() for f in futures])


@scenario
def busy_until_killed(driver, args):
    """Write the worker pids, then keep every worker busy until the job is ended from outside."""
    echoes = driver.spawn("rollout", Echo)
    _write_pids(driver, args.pid_file)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        echoes.call("sleep_then", 0.01, None)
    report(survived=True)


@scenario
def computing_until_killed(driver, args):
    """Write the worker pids, then compute without calling any worker (no polling of MPI)."""
    driver.spawn("rollout", Echo)
    _write_pids(driver, args.pid_file)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        np.linalg.eigvals(np.random.default_rng(0).random((200, 200)))
    report(survived=True)


@scenario
def calls_until_a_rank_is_lost(driver, args):
    """Keep every worker busy; when one's rank is lost (survived under ULFM), go on with the
    others for a while, then report what the driver saw."""
    echoes = driver.spawn("rollout", Echo)
    _write_pids(driver, args.pid_file)
    lost_errors, lost_at, calls_after = [], None, 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        futures = echoes.call_async("sleep_then", 0.01, None)
        for future in futures:
            try:
                future.result(timeout=30)
                calls_after += lost_at is not None
            except mpirl.RankLost as error:
                lost_errors.append([error.rank, str(error)])
                lost_at = lost_at or time.monotonic()
        # The loss may be handled while no call of the dead rank is in flight (it answered,
        # then died): then no future raises, and the rank is only taken out here.
        if echoes.discard_lost():
            lost_at = lost_at or time.monotonic()
        if lost_at is not None and time.monotonic() - lost_at > 1.0:
            break
    report(lost=[[h.rank, h.index] for h in echoes.lost], errors=lost_errors,
           workers=[h.rank for h in echoes], calls_after=calls_after,
           answers=echoes.call("echo", "still here"))


def _write_pids(driver, path):
    pids = {str(rank): info["pid"] for rank, info in enumerate(driver.hosts)}
    with open(path + ".tmp", "w") as f:
        json.dump(pids, f)
    os.replace(path + ".tmp", path)


@scenario
def exit_outside(driver, args):
    """A worker's method raises SystemExit: it escapes the serve loop and must end the job."""
    echoes = driver.spawn("rollout", Echo)
    echoes[-1].call_async("exit_outside_task", 3)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        echoes[0].call("sleep_then", 0.01, None)
    report(survived=True)


@scenario
def driver_raises(driver, args):
    echoes = driver.spawn("rollout", Echo)
    echoes.call("ping")
    raise RuntimeError("a bug in the driver program")


@scenario
def same_code(driver, args):
    """One program for every world size: results must not depend on the layout."""
    echoes = driver.spawn("rollout", Echo, label="L")
    values = echoes.call("echo", {"x": np.arange(5)})
    futures = [h.call_async("sleep_then", 0.01, h.index * 10) for h in echoes]
    ready, _ = mpirl.wait(futures, num_returns=len(futures), timeout=30)
    try:
        echoes[0].call("fail", "nope")
        error = None
    except RemoteError as e:
        error = [e.method, e.cause_type, "nope" in str(e)]
    who = echoes.call("whoami")
    report(
        local=driver.local, workers=len(echoes),
        values_ok=all(np.array_equal(v["x"], np.arange(5)) for v in values),
        waited=sorted(f.result() for f in ready), error=error,
        labels=sorted({w["label"] for w in who}), roles=sorted({w["role"] for w in who}),
        count=echoes[0].call("count"),
    )


@scenario
def learners_agree(driver, args):
    """Two learners train on different batches; afterwards their weights must be identical."""
    import gymnasium as gym
    from mpirl.algorithms import ppo

    from mpirl.models.policy import PolicySpec
    from mpirl.workers.learner import Learner, LearnerSettings

    spec = PolicySpec(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
    config = ppo.Config()
    learners = driver.spawn("learner", Learner, LearnerSettings(
        policy=spec, loss=ppo.loss, loss_config=config, lr=1e-2, grad_clip=0.5, seed=0,
        backend=args.backend))
    initial = [w.tolist() for w in learners.call("get_weights")]
    rng = np.random.default_rng(0)

    def batch(n):
        return {"obs": rng.uniform(-1, 1, (n, 4)).astype(np.float32),
                "actions": rng.integers(0, 2, n), "logp": np.full(n, -0.69, np.float32),
                "values": np.zeros(n, np.float32),
                "advantages": rng.normal(size=n).astype(np.float32),
                "value_targets": rng.normal(size=n).astype(np.float32)}

    for _ in range(3):
        futures = [h.call_async("train", [], [batch(64)], 2, 4) for h in learners]
        stats = [f.result() for f in futures]
    weights = learners.call("get_weights")
    report(learners=len(learners), initial_equal=initial[0] == initial[1],
           moved=weights[0].tolist() != initial[0],
           identical=bool(np.array_equal(weights[0], weights[1])),
           sgd_steps=[s["sgd_steps"] for s in stats])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=sorted(SCENARIOS))
    parser.add_argument("--pid-file")
    parser.add_argument("--heartbeat-timeout", type=float, default=20.0)
    parser.add_argument("--max-in-flight", type=int, default=16)
    parser.add_argument("--layout", default="{}")
    parser.add_argument("--backend", default="mpi")
    # Off by default: most fault scenarios check that a lost rank ends the job.
    parser.add_argument("--survive-rollout-loss", action="store_true")
    parser.add_argument("--fan-out-min", type=int, help="transport.FAN_OUT_MIN on rank 0")
    args = parser.parse_args()
    if args.fan_out_min is not None:
        from mpirl.runtime import transport
        transport.FAN_OUT_MIN = args.fan_out_min
    settings = mpirl.RuntimeSettings(
        heartbeat_timeout_s=args.heartbeat_timeout, max_calls_in_flight=args.max_in_flight,
        print_layout=False, survive_rollout_loss=args.survive_rollout_loss,
    )
    layout = mpirl.Layout(**json.loads(args.layout))
    return mpirl.run(lambda driver: SCENARIOS[args.name](driver, args), layout, settings)


if __name__ == "__main__":
    sys.exit(main())
