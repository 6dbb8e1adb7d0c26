"""Child processes that do not outlive the process that started them.

A vLLM server, a sandboxed program or a training run started by ``otbrl compare`` is its own
process (group); if the trainer is killed with SIGKILL or crashes, no cleanup code runs, and
the child would live on — holding a port, a GPU or the CPU. Linux's parent-death signal
(``prctl(PR_SET_PDEATHSIG)``) makes the kernel signal the child when its parent goes. The
kernel ties it to the *thread* that forked the child: start long-lived children from
long-lived threads (the main thread, a pool's worker). Elsewhere than Linux it is a no-op.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when its parent dies
    (``None`` where the platform has no parent-death signal). Runs in the forked child before
    exec: it only calls ``prctl``, which is safe there."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl  # looked up now, in the parent: nothing to resolve in the child

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return preexec
