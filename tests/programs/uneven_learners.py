"""Learners with uneven shares of the rows against one learner with all of them.

Run under ``mpiexec -n 2``: both ranks are learners (no driver), each built by hand on a
``RankContext`` whose learner communicator is COMM_WORLD. For each backend (mpi, gloo) and each
split of one set of rows, the two learners take one SGD step together; rank 0 also takes it
alone, with every row, on COMM_SELF. Rank 0 prints ``RESULT {json}``: the largest difference
between the shared gradient and the lone learner's, per case, and likewise for MARWIL's moving
average of squared advantages, and the network interface each rank's gloo group used.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import gymnasium as gym
import numpy as np
import torch
from mpi4py import MPI
from mpirl.algorithms import impala, marwil, ppo

from mpirl.models.policy import PolicySpec
from mpirl.runtime.core import RankContext
from mpirl.runtime.layout import Layout
from mpirl.workers.learner import Learner, LearnerSettings

ROWS = 10
#: How the ROWS rows are split between learner 0 and learner 1.
SPLITS = {"uneven": 7, "empty_share": ROWS}
SPEC = PolicySpec(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2), (16,), "tanh")


def context(comm: MPI.Comm) -> RankContext:
    return RankContext(comm.Get_rank(), "learner", comm.Get_rank(), comm.Get_size(),
                       Layout().resolve(1), None, comm, None, socket.gethostname(), "cpu")


def rows(algo: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    if algo == "impala":  # a row is a fragment of 6 steps; the mask drops some steps
        shape = (ROWS, 6)
        return {"obs": rng.uniform(-1, 1, (*shape, 4)).astype(np.float32),
                "actions": rng.integers(0, 2, shape), "logp": np.full(shape, -0.69, np.float32),
                "rewards": rng.normal(size=shape).astype(np.float32),
                "dones": (rng.random(shape) < 0.2).astype(np.float32),
                "mask": (rng.random(shape) < 0.7).astype(np.float32),
                "bootstrap_obs": rng.uniform(-1, 1, (ROWS, 4)).astype(np.float32)}
    batch = {"obs": rng.uniform(-1, 1, (ROWS, 4)).astype(np.float32),
             "actions": rng.integers(0, 2, ROWS)}
    if algo == "marwil":
        return batch | {"returns": rng.normal(size=ROWS).astype(np.float32)}
    return batch | {"logp": np.full(ROWS, -0.69, np.float32),
                    "values": np.zeros(ROWS, np.float32),
                    "advantages": rng.normal(size=ROWS).astype(np.float32),
                    "value_targets": rng.normal(size=ROWS).astype(np.float32)}


def learner(comm: MPI.Comm, algo: str, backend: str) -> Learner:
    loss, config = {"ppo": (ppo.loss, ppo.Config()), "impala": (impala.loss, impala.Config()),
                    "marwil": (marwil.Loss(), marwil.Config())}[algo]
    return Learner(context(comm), LearnerSettings(policy=SPEC, loss=loss, loss_config=config,
                                                  lr=1e-3, grad_clip=0.0, seed=0,
                                                  backend=backend))


def step(worker: Learner, algo: str, batch: dict[str, np.ndarray]) -> np.ndarray:
    """One SGD step on ``batch`` (all learners together); the gradient it applied."""
    if algo == "marwil":  # train_offline's step, on given rows
        worker._sgd_step({k: torch.as_tensor(v) for k, v in batch.items()}, {})
    else:
        worker.train([], [batch], num_epochs=1, num_minibatches=1, standardize=())
    return worker.policy.get_flat_gradients()


def main() -> int:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    result = {}
    for backend in ("mpi", "gloo"):
        for algo in ("ppo", "impala", "marwil"):
            everything = rows(algo)
            for name, cut in SPLITS.items():
                if algo == "marwil" and name == "empty_share":
                    continue  # offline shares are never empty (rows_per_learner)
                share = slice(0, cut) if rank == 0 else slice(cut, ROWS)
                pair = learner(world, algo, backend)
                shared = step(pair, algo, {k: v[share] for k, v in everything.items()})
                key = f"{backend}/{algo}/{name}"
                if rank == 0:
                    alone = learner(MPI.COMM_SELF, algo, "mpi")
                    reference = step(alone, algo, everything)
                    result[key] = {"gradient_max_diff": float(np.abs(shared - reference).max()),
                                   "gradient_max_abs": float(np.abs(reference).max())}
                    if algo == "marwil":
                        result[key]["scale"] = [pair.loss.squared_advantage_mean,
                                                alone.loss.squared_advantage_mean]
                if algo == "marwil":
                    scales = world.gather(pair.loss.squared_advantage_mean)
                    if rank == 0:
                        result[key]["scales_equal"] = scales[0] == scales[1]
    interfaces = world.gather(os.environ.get("GLOO_SOCKET_IFNAME"))
    if rank == 0:
        print("RESULT " + json.dumps({"cases": result, "gloo_interfaces": interfaces}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
