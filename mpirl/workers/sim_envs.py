"""A rollout rank's env groups as one gymnasium vector env: what ``VectorEnvs`` steps when its
envs are simulations with ranks of their own (``ranks_per_env`` >= 1).

``SimEnvs`` talks to G groups over a *link* communicator, each through the group's root rank on
it (``mpirl.runtime.sim_link``): env ranks of the run's world (the link is a duplicate of the
run's communicator) or a solver program's ranks (the link is the MPMD intercommunicator). Per
step, one COMMAND to each root and one REPLY back, in preallocated float64 rows through
persistent requests: no pickle, no allocation. It autoresets as gymnasium's same-step mode does
(a finished env's first observation comes with the step that ended it, its last one in
``infos["final_obs"]``), so the sampling core, dumps, callbacks and evaluate treat it as any
vector env. Simulations keep their state in their ranks: checkpoints do not save it, and a
resume starts fresh episodes with RESETs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from mpi4py import MPI

from mpirl.errors import EnvFailureError, SimulationError, SimulationStuck
from mpirl.runtime import sim_link
from mpirl.runtime.waiting import Backoff
from mpirl.workers.env_guard import EPISODE_DROPPED, ERROR, FAILURES

__all__ = ["LinkedGroup", "SimEnvs"]

#: Why a checkpoint holds no env group's episodes (the trainer says it once, as a note).
SIMULATION_NOT_SAVED = ("an env group's simulation keeps its state on its own ranks, which "
                        "checkpoints do not hold")


@dataclass(frozen=True)
class LinkedGroup:
    """One env group as its rollout rank reaches it: its index in the run, its root's rank on
    the link and its members' ranks there (root first), and how messages name it."""

    index: int
    root: int
    members: tuple[int, ...]
    name: str


class SimEnvs(gym.vector.VectorEnv):
    """G env groups stepped in lockstep (every group's step in flight at once) over ``link``.

    ``seed`` is this rollout rank's: group j's first RESET carries ``seed + j``, and each
    member's SETUP the same. A group that fails (its simulation raised; ERROR) ends the run
    with ``SimulationError``, one whose reply has the wrong size too; one that does not answer
    within ``timeout_s``, or whose non-root member failed (its root may wait for good), with
    ``SimulationStuck``, on which the driver aborts the job. Non-finite numbers in a reply
    are an env failure: the group is reset and its episode dropped, and ``max_failures`` of
    them in a row end the run (``EnvFailureError``)."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
    #: Checkpoints cannot hold what lives on other ranks (``VectorEnvs.set_envs``).
    picklable = False

    def __init__(self, link: MPI.Comm, groups: Sequence[LinkedGroup],
                 observation_space: gym.spaces.Box, action_space: gym.spaces.Space,
                 env_config: dict[str, Any], seed: int, *, num_groups: int, timeout_s: float,
                 backoff: tuple[float, float] | None, where: str, max_failures: int = 10
                 ) -> None:
        self.link, self.groups, self.where = link, list(groups), where
        self.timeout_s, self.max_failures = timeout_s, max_failures
        self.num_envs = len(self.groups)
        self.single_observation_space = observation_space
        self.single_action_space = action_space
        self.observation_space = gym.vector.utils.batch_space(observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(action_space, self.num_envs)
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        self.obs_size = int(np.prod(observation_space.shape))
        self.action_size = 1 if self.discrete else int(np.prod(action_space.shape))
        self.backoff = Backoff() if backoff is None else Backoff(max_sleep_s=backoff[0],
                                                                 sleep_share=backoff[1])
        g, width = self.num_envs, sim_link.REPLY_HEADER + self.obs_size
        self.command = np.zeros((g, sim_link.COMMAND_HEADER + self.action_size))
        # One spare column: a reply one number too long arrives and is named, not truncated.
        self.reply = np.zeros((g, width + 1))
        self.obs = np.zeros((g, *observation_space.shape), observation_space.dtype)
        self._statuses = [MPI.Status() for _ in range(2 * g)]
        self._requests = (
            [link.Recv_init([self.reply[j], MPI.DOUBLE], grp.root, sim_link.TAG_REPLY)
             for j, grp in enumerate(self.groups)]
            + [link.Send_init([self.command[j], MPI.DOUBLE], grp.root, sim_link.TAG_COMMAND)
               for j, grp in enumerate(self.groups)])
        #: each group's steps so far: its STEP's sequence number
        self.seqs = np.zeros(g, np.int64)
        #: stepping whichever group is ready: the groups with a step in flight, since when
        self.in_flight = np.zeros(g, bool)
        self.sent_at = np.zeros(g)
        self._counts: dict[int, int] = {}
        self.failures_in_row = np.zeros(g, np.int64)
        self.seed, self.resets = seed, np.zeros(g, np.int64)
        self.closed = False
        #: a group's other members (not its root) on the link: one that fails tells this rank
        #: itself (TAG_ERROR), as its root may be stuck in a collective the member left
        self._member_groups = {rank: j for j, grp in enumerate(self.groups)
                               for rank in grp.members[1:]}
        self._setup(env_config, seed, num_groups)

    def _setup(self, env_config: dict[str, Any], seed: int, num_groups: int) -> None:
        text = np.frombuffer(json.dumps(env_config).encode(), np.uint8)
        setups, requests = [], []
        for j, group in enumerate(self.groups):
            for member, rank in enumerate(group.members):
                setup = np.zeros(sim_link.SETUP_LEN, np.int64)
                setup[[sim_link.SETUP_MAGIC, sim_link.SETUP_VERSION, sim_link.SETUP_GROUP,
                       sim_link.SETUP_MEMBER, sim_link.SETUP_GROUP_SIZE, sim_link.SETUP_OBS_SIZE,
                       sim_link.SETUP_ACTION_SIZE, sim_link.SETUP_ACTION_KIND,
                       sim_link.SETUP_SEED, sim_link.SETUP_ROLLOUT_RANK,
                       sim_link.SETUP_JSON_BYTES, sim_link.SETUP_NUM_GROUPS]] = (
                    sim_link.MAGIC, sim_link.VERSION, group.index, member, len(group.members),
                    self.obs_size, self.action_size,
                    sim_link.ACTION_DISCRETE if self.discrete else sim_link.ACTION_BOX,
                    seed + j, self.link.Get_rank(), text.size, num_groups)
                setups.append(setup)
                requests.append(self.link.Isend([setup, MPI.INT64_T], rank, sim_link.TAG_SETUP))
                requests.append(self.link.Isend([text, MPI.BYTE], rank,
                                                sim_link.TAG_SETUP_JSON))
        self._wait(lambda: MPI.Request.Testall(requests), "its SETUP", requests)

    # The vector env.

    def _next_seed(self, j: int) -> int:
        # Every RESET carries a seed: a reply echoes it as its seq, and NO_SEED (-1) would read
        # as ERROR_SEQ. Drawn from the rank's seed, the group and its resets so far, so a rerun
        # sees the same episodes.
        self.resets[j] += 1
        entropy = (self.seed & 0xFFFFFFFF, self.groups[j].index, int(self.resets[j]))
        return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        for j in range(self.num_envs):
            self.command[j, :2] = (sim_link.RESET,
                                   self._next_seed(j) if seed is None else seed + j)
        self._exchange("a reset")
        self._check_replies("a reset", False)
        self.obs[:] = self.reply[:, sim_link.REPLY_HEADER:-1].reshape(self.obs.shape)
        return self.obs.copy(), {}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                          dict[str, Any]]:
        self.seqs += 1
        self.command[:, 0] = sim_link.STEP
        self.command[:, 1] = self.seqs
        self.command[:, 2:] = np.reshape(actions, (self.num_envs, self.action_size))
        what = f"step {int(self.seqs.max())}"
        self._exchange(what)
        bad = self._check_replies(what, True)
        return self._outcome(np.ones(self.num_envs, bool), bad)

    # Stepping whichever group is ready (``EnvRunner``'s per-slot clocks).

    def start(self, rows: np.ndarray, actions: np.ndarray) -> None:
        """Send STEP with ``actions[i]`` to group ``rows[i]``, each of them idle."""
        now = time.monotonic()
        g = self.num_envs
        for i, j in enumerate(rows.tolist()):
            self.seqs[j] += 1
            self.command[j, :2] = (sim_link.STEP, self.seqs[j])
            self.command[j, 2:] = np.reshape(actions[i], self.action_size)
            self._requests[j].Start()
            self._requests[g + j].Start()
        self.in_flight[rows] = True
        self.sent_at[rows] = now

    def wait_ready(self) -> np.ndarray:
        """Wait for at least one group in flight to reply; a mask of those that did (their
        outcome comes from ``finish``). Each group's deadline runs from its own STEP."""
        g = self.num_envs
        self.backoff.reset()
        while True:
            ready = np.zeros(g, bool)
            for j in np.flatnonzero(self.in_flight).tolist():
                try:
                    if self._requests[j].Test(self._statuses[j]):
                        ready[j] = True
                except MPI.Exception as error:
                    if error.Get_error_class() != MPI.ERR_TRUNCATE:
                        raise
                    raise self._too_long(j, f"step {int(self.seqs[j])}") from None
            if ready.any():
                for j in np.flatnonzero(ready).tolist():
                    while not self._requests[g + j].Test():  # sent: the reply came after it
                        self.backoff.sleep()
                    self._counts[j] = self._statuses[j].Get_count(MPI.DOUBLE)
                self.in_flight[ready] = False
                return ready
            late = self.in_flight & (time.monotonic() > self.sent_at + self.timeout_s)
            if late.any():
                j = int(np.flatnonzero(late)[0])
                raise SimulationStuck(f"{self.groups[j].name} of {self.where} did not answer "
                                      f"step {int(self.seqs[j])} within env_step_timeout_s "
                                      f"{self.timeout_s:g} s")
            self._member_failure(lambda j: f"step {int(self.seqs[j])}")
            self.backoff.sleep()

    def finish(self, ready: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                  np.ndarray, dict[str, Any]]:
        """The outcome of the ``ready`` groups' steps, as ``step`` gives it for all (the other
        rows: no reward, not ended, their observation unchanged)."""
        rows = np.flatnonzero(ready).tolist()
        bad = self._check_replies(f"step {int(self.seqs[rows].max())}", True, rows)
        return self._outcome(ready, bad & ready)

    # Episodes played one by one (ES, ARS: ``VectorEnvs.step`` with ``held``).

    def step_held(self, actions: np.ndarray, held: np.ndarray) -> tuple:
        """Step the groups not ``held``; none is reset: one whose episode ends keeps its last
        observation until ``reset_one``. A non-finite reply is an env failure (the group is
        reset, its episode dropped)."""
        rows = np.flatnonzero(~held)
        self.start(rows, np.asarray(actions)[rows])
        stepped = np.zeros(self.num_envs, bool)
        while self.in_flight.any():
            stepped |= self.wait_ready()
        bad = self._check_replies("a step", True, rows.tolist()) & stepped
        header = self.reply[:, :sim_link.REPLY_HEADER]
        rewards = np.where(stepped & ~bad, header[:, 1], 0.0)
        terminated = (header[:, 2] != 0) & stepped & ~bad
        truncated = (header[:, 3] != 0) & stepped & ~bad
        view = self.reply[:, sim_link.REPLY_HEADER:-1].reshape(self.obs.shape)
        self.obs[stepped] = view[stepped]
        infos: dict[str, Any] = {}
        if bad.any():
            infos = self._recover(bad)
        self.failures_in_row[stepped & ~bad] = 0
        done = terminated | truncated
        if done.any():
            final = np.full(self.num_envs, None, dtype=object)
            for j in np.flatnonzero(done).tolist():
                final[j] = self.obs[j].copy()
            infos.update({"final_obs": final, "_final_obs": done})
        return self.obs.copy(), rewards, terminated, truncated, infos

    def reset_one(self, index: int) -> np.ndarray:
        """A fresh episode in group ``index``; its first observation."""
        which = np.zeros(self.num_envs, bool)
        which[index] = True
        self._reset_some(which, "a reset")
        return self.obs[index].copy()

    def _outcome(self, rows: np.ndarray, bad: np.ndarray) -> tuple:
        header = self.reply[:, :sim_link.REPLY_HEADER]
        rewards = np.where(rows, header[:, 1], 0.0)
        terminated, truncated = (header[:, 2] != 0) & rows, (header[:, 3] != 0) & rows
        view = self.reply[:, sim_link.REPLY_HEADER:-1].reshape(self.obs.shape)
        self.obs[rows] = view[rows]
        infos: dict[str, Any] = {}
        if bad.any():
            rewards[bad], terminated[bad], truncated[bad] = 0.0, False, False
            infos = self._recover(bad)
        self.failures_in_row[rows & ~bad] = 0
        done = terminated | truncated
        if done.any():
            final = np.full(self.num_envs, None, dtype=object)
            for j in np.flatnonzero(done).tolist():
                final[j] = self.obs[j].copy()
            self._reset_some(done, "the reset after an episode's end")
            infos.update({"final_obs": final, "_final_obs": done})
        return self.obs.copy(), rewards, terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        """END to every group (the driver's END at shutdown reaches each member too)."""
        if self.closed:
            return
        self.closed = True
        self.command[:, :2] = (sim_link.END, 0)
        # A group with a step in flight (the run failed meanwhile) gets the driver's END only.
        sends = [self._requests[self.num_envs + j] for j in range(self.num_envs)
                 if not self.in_flight[j]]
        MPI.Prequest.Startall(sends)
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
            self.backoff.sleep()
        for request in self._requests:
            if request.Test() is False:
                request.Cancel()
            request.Free()

    def __getstate__(self) -> Any:
        raise TypeError(SIMULATION_NOT_SAVED)

    # The exchange.

    def _exchange(self, what: str, only: np.ndarray | None = None) -> None:
        """Every group's (or ``only``'s) command out and reply in, within ``timeout_s``."""
        g = self.num_envs
        if only is None:
            requests = self._requests
        else:
            chosen = np.flatnonzero(only).tolist()
            requests = [self._requests[j] for j in chosen] + \
                [self._requests[g + j] for j in chosen]
        MPI.Prequest.Startall(requests)
        statuses = self._statuses[:len(requests)]
        rows = list(range(g)) if only is None else np.flatnonzero(only).tolist()
        try:
            self._wait(lambda: MPI.Request.Testall(requests, statuses), what, requests)
        except MPI.Exception as error:
            if error.Get_error_class() not in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS):
                raise
            # The receives come first in ``requests``, one per row.
            truncated = [j for i, j in enumerate(rows) if statuses[i].Get_error() != MPI.SUCCESS
                         and MPI.Get_error_class(statuses[i].Get_error()) == MPI.ERR_TRUNCATE]
            raise self._too_long(truncated[0] if truncated else None, what) from None
        self._counts.update({j: statuses[i].Get_count(MPI.DOUBLE) for i, j in enumerate(rows)})

    def _too_long(self, j: int | None, what: str) -> SimulationError:
        """A reply longer than the row's spare column (MPI truncated it), from group ``j``."""
        name = "an env group" if j is None else self.groups[j].name
        width = sim_link.REPLY_HEADER + self.obs_size
        return SimulationError(
            f"{name} of {self.where} sent more than {width + 1} numbers per reply at {what}; "
            f"observation_size {self.obs_size} needs {width} (seq, reward, terminated, "
            f"truncated, obs)")

    def _member_failure(self, what: Any) -> None:
        """Raise ``SimulationError`` with the message of a group member (not its root) that
        failed, if one came; ``what(j)`` says what group j was doing."""
        if not self._member_groups:
            return
        status = MPI.Status()
        if not self.link.Iprobe(MPI.ANY_SOURCE, sim_link.TAG_ERROR, status):
            return
        j = self._member_groups.get(status.Get_source())
        if j is None:  # a root's, read after its ERROR reply
            return
        text = bytearray(status.Get_count(MPI.BYTE))
        self.link.Recv([text, MPI.BYTE], status.Get_source(), sim_link.TAG_ERROR)
        # Its root may wait for good in the collective the member left: a stuck group.
        raise SimulationStuck(f"{self.groups[j].name} of {self.where} failed at {what(j)}: "
                              f"{text.decode(errors='replace').strip()}")

    def _wait(self, test: Any, what: str, requests: list[MPI.Request]) -> None:
        self.backoff.reset()
        deadline = time.monotonic() + self.timeout_s
        while not test():
            self._member_failure(lambda j: what)
            if time.monotonic() > deadline:
                late = [grp.name for j, grp in enumerate(self.groups)
                        if any(not r.Get_status() for r in requests
                               if r in (self._requests[j], self._requests[self.num_envs + j]))]
                names = ", ".join(late) or "an env group"
                raise SimulationStuck(f"{names} of {self.where} did not answer {what} within "
                                      f"env_step_timeout_s {self.timeout_s:g} s")
            self.backoff.sleep()

    def _check_replies(self, what: str, stepped: bool,
                       rows: list[int] | None = None) -> np.ndarray:
        """Raise for a failed group or a reply of the wrong size; the rows with non-finite
        numbers (an env failure each)."""
        width = sim_link.REPLY_HEADER + self.obs_size
        rows = list(range(self.num_envs)) if rows is None else rows
        for j in rows:
            if self.reply[j, 0] == sim_link.ERROR_SEQ:
                at = f"step {int(self.seqs[j])}" if stepped else what
                raise SimulationError(f"{self.groups[j].name} of {self.where} failed at {at}: "
                                      f"{self._error_text(j)}")
            count = self._counts[j]
            if count != width:
                raise SimulationError(
                    f"{self.groups[j].name} of {self.where} sent {count} numbers per reply at "
                    f"{what}; observation_size {self.obs_size} needs {width} (seq, reward, "
                    f"terminated, truncated, obs)")
            if stepped and self.reply[j, 0] != self.seqs[j]:
                raise SimulationError(f"{self.groups[j].name} of {self.where} answered step "
                                      f"{int(self.seqs[j])} with the reply to step "
                                      f"{self.reply[j, 0]:g}")
        return ~np.isfinite(self.reply[:, :width]).all(axis=1)

    def _error_text(self, j: int) -> str:
        status = MPI.Status()
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        root = self.groups[j].root
        while not self.link.Iprobe(root, sim_link.TAG_ERROR, status):
            if time.monotonic() > deadline:
                return "(its message did not arrive)"
            self.backoff.sleep()
        text = bytearray(status.Get_count(MPI.BYTE))
        self.link.Recv([text, MPI.BYTE], root, sim_link.TAG_ERROR)
        return text.decode(errors="replace").strip()

    def _reset_some(self, which: np.ndarray, what: str) -> None:
        for j in np.flatnonzero(which).tolist():
            self.command[j, :2] = (sim_link.RESET, self._next_seed(j))
        self._exchange(what, which)
        rows = np.flatnonzero(which).tolist()
        bad = self._check_replies(what, False, rows)
        if bad[rows].any():
            j = rows[int(np.flatnonzero(bad[rows])[0])]
            raise EnvFailureError(f"{self.groups[j].name} of {self.where} sent non-finite "
                                  f"numbers right after a reset")
        view = self.reply[:, sim_link.REPLY_HEADER:-1].reshape(self.obs.shape)
        self.obs[which] = view[which]

    def _recover(self, bad: np.ndarray) -> dict[str, Any]:
        """Non-finite replies: count each as an env failure, reset those groups."""
        self.failures_in_row[bad] += 1
        worst = int(np.argmax(self.failures_in_row))
        if self.failures_in_row[worst] >= self.max_failures:
            raise EnvFailureError(
                f"{self.groups[worst].name} of {self.where} sent non-finite numbers (NaN or "
                f"inf) {int(self.failures_in_row[worst])} times in a row; fix the simulation, "
                f"or allow more with max_env_failures (now {self.max_failures})")
        self._reset_some(bad, "the reset after non-finite numbers")
        errors = np.full(self.num_envs, None, dtype=object)
        errors[bad] = "non-finite numbers in its reply"
        return {FAILURES: bad.astype(np.int64), ERROR: errors, EPISODE_DROPPED: bad.copy()}
