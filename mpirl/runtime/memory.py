"""This process's resident memory and open file descriptors, for leak-watching on long runs.

Each worker's heartbeat carries its RSS to the driver (see ``mpirl.runtime.heartbeat``), so the
driver knows every rank's memory, at most one heartbeat interval old, without a call of its own;
the
run reports it per role (``perf/driver_rss_mb``, ``perf/max_worker_rss_mb``, ...). Reading
``/proc/self/statm`` takes microseconds.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MIB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set size now. Where there is no ``/proc`` (macOS), its peak
    resident size instead, which never falls but still shows growth."""
    rss = process_rss_bytes("self")
    if rss is not None:
        return rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def open_fd_count(pid: int | str = "self") -> int | None:
    """Open file descriptors of process ``pid`` (this one by default); None where ``/proc``
    cannot tell."""
    try:
        return len(os.listdir(Path("/proc") / str(pid) / "fd"))
    except OSError:
        return None


def process_rss_bytes(pid: int | str) -> int | None:
    """The resident set size of process ``pid`` on this node (``"self"``: this one), or None
    once it has gone or where there is no ``/proc``."""
    try:
        return int((Path("/proc") / str(pid) / "statm").read_text().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None
