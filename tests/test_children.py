"""otbrl.children: a child started with ``die_with_parent`` goes when its parent is killed with
SIGKILL (no cleanup code runs then); one started without it lives on (the control)."""

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = """
import subprocess, sys, time
from otbrl.children import die_with_parent
guard = sys.argv[1] == "guarded"
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(60)"],
    preexec_fn=die_with_parent() if guard else None,
    start_new_session=True,
)
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not yet reaped by init) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux parent-death signal")
@pytest.mark.parametrize("mode", ["guarded", "plain"])
def test_a_child_dies_with_its_killed_parent(mode):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # the guarded child goes within moments; the plain one is looked at after 0.5 s
        deadline = time.monotonic() + (5 if mode == "guarded" else 0.5)
        while (_alive(child) or mode == "plain") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _alive(child) == (mode == "plain")
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
