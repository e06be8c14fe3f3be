"""The fault tests' background job (conftest.LiveRun) launches again when Open MPI's launcher
failed before starting any rank, and only then."""

from __future__ import annotations

import pytest
from conftest import LiveRun

FAIL_ONCE = (
    'if [ ! -e "$1" ]; then touch "$1"; '
    "echo \"The PMIx server's listener thread failed to start\" >&2; exit 213; fi; "
    "echo started; sleep 0.2"
)


def test_a_launch_that_failed_before_any_rank_is_tried_again(tmp_path):
    run = LiveRun(1, command=["bash", "-c", FAIL_ONCE, "-", str(tmp_path / "marker")])
    run.wait_until(lambda: "started" in run.stdout, "the second launch", timeout=30)
    assert run.finish() == 0


def test_any_other_early_end_fails_the_test(tmp_path):
    run = LiveRun(1, command=["bash", "-c", "echo broken >&2; exit 3"])
    with pytest.raises(pytest.fail.Exception, match="exit 3"):
        run.wait_until(lambda: False, "a checkpoint", timeout=30)
