"""``mpirl.tune.population_link.receive``, every wait of ``mpirl tune``: one with a deadline ends
with a TaskTimeout that says what it waited for and from whom; a message comes with its sender,
and the idle callback (the controller's check for stop signals) runs between polls."""

from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from mpirl.errors import TaskTimeout
from mpirl.runtime.dispatch import CHECKPOINT, RESULT
from mpirl.runtime.transport import Channel
from mpirl.tune.population_link import receive


def test_a_wait_with_a_deadline_says_what_it_waited_for():
    channel = Channel(MPI.COMM_SELF)
    started = time.monotonic()
    with pytest.raises(TaskTimeout, match=r"^mpirl tune: no checkpoint from rank 0 within "
                                          r"0\.05 s \(task_timeout_s\)$"):
        receive(channel, 0, CHECKPOINT, 0.05, "checkpoint")
    assert 0.05 <= time.monotonic() - started < 2


def test_a_message_comes_with_its_sender_and_idle_runs_between_polls():
    channel = Channel(MPI.COMM_SELF)
    polls = []

    def idle() -> None:
        polls.append(time.monotonic())
        if len(polls) == 3:
            channel.isend({"code": 0}, 0, RESULT)

    assert receive(channel, MPI.ANY_SOURCE, RESULT, None, "outcome", idle) == ({"code": 0}, 0)
    assert len(polls) == 3
