"""The process's memory as the tests measure it, apart from ``otbrl.engine.memory``: its
resident set read from ``/proc/self/status``, and whether its peak can be reset there."""

from __future__ import annotations

import ctypes

import pytest


def rss_gb() -> float:
    """The process's resident set size now (``VmRSS``), in GB (10⁹ bytes)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("no VmRSS")


def trim() -> None:
    """Give free heap pages back to the OS: memory a measured call reuses would not count."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def can_reset_peak() -> bool:
    """Whether ``/proc/self/clear_refs`` takes the ``5`` that resets the peak (``VmHWM``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


needs_peak_reset = pytest.mark.skipif(
    not can_reset_peak(), reason="needs Linux's /proc/self/clear_refs"
)
