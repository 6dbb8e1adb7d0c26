"""Running model-written Python in a sandbox: one process per run, no network, no root.

``run_program(code, inputs, fn_name=..., config=...)`` starts ``sandbox_harness.py`` under
``unshare --net --mount --pid --fork --kill-child --mount-proc`` (fresh network, mount and PID
namespaces: even 127.0.0.1 is unreachable, and when the harness ends or is killed the kernel
kills every process it started, a fork bomb included). The harness enters a root of its own
(read-only system and interpreter directories, a tmpfs ``/tmp``: the host's files are not
there), sets the resource limits, drops root to a uid of its own and then runs the program
(see its module doc). Its environment is scrubbed (no inherited variables,
so no secrets); its reply goes to a file the caller owns, bounded by the file-size limit.

Where namespaces are not available (not Linux, not root, no ``unshare``) a run is refused with
the reason, unless ``allow_unsandboxed`` (then the program runs as this user, in a temporary
directory, with only the time limit): ``sandbox_problem()`` says why, and the run plan checks
it before any model loads.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from otbrl.children import die_with_parent
from otbrl.settings import setting

HARNESS = Path(__file__).with_name("sandbox_harness.py")
UNSHARE = ("unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc")
# One unprivileged uid per concurrent run, so that process limits do not mix: each process
# (a torchrun rank, a reward worker) draws from a block of its own, chosen by its pid.
FIRST_UID = 61000
UIDS_PER_PROCESS = 64
MAX_WORKERS = UIDS_PER_PROCESS  # reward.code.max_workers, over all configs of one process
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


class SandboxUnavailable(RuntimeError):
    """Model code cannot be sandboxed here, and running it unsandboxed was not allowed."""


@dataclass
class CodeRewardConfig:
    """The sandbox model-written code runs in (``codecontests``, ``apps``, ``codeforces``,
    ``taco`` rows; ``otbrl.rewards.sandbox``): limits of one run of one solution."""

    cpu_s: float = setting(10.0, gt=0)  # CPU seconds
    wall_s: float = setting(10.0, gt=0)  # seconds per test input (the whole run: one more)
    memory_mb: int = setting(1024, gt=0)  # address space
    # sandboxed runs at once in this process
    max_workers: int = setting(4, gt=0, le=UIDS_PER_PROCESS)
    # run model code without namespaces where the OS cannot make them (as this user, with
    # only a time limit); false: such a run is refused, before any model loads
    allow_unsandboxed: bool = False


@dataclass
class SandboxConfig(CodeRewardConfig):
    """Limits of one sandboxed run: the user's (``reward.code.*``: ``cpu_s`` CPU seconds,
    ``wall_s`` seconds per test input (the whole run: one second more), ``memory_mb`` address
    space, at most ``max_workers`` runs at once in this process) and the sandbox's own:
    ``processes`` (threads included), ``file_mb`` per written file, ``tmpfs_mb`` per writable
    mount."""

    processes: int = 16
    file_mb: int = 16
    tmpfs_mb: int = 64


@dataclass
class RunResult:
    """What one run gave: ``cases`` (per input, until the first error or timeout:
    ``{"status": "ok", "output": ...}`` or ``{"status": "error" | "timeout" |
    "compile_error", ...}``), ``violations`` (limits hit, operations refused) and ``error``
    (the harness itself failed: every case counts as failed)."""

    cases: list[dict] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    error: str | None = None


@functools.cache
def sandbox_problem() -> str | None:
    """Why model code cannot be sandboxed here (None: it can). Checked once per process."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the sandbox needs root (to create namespaces, mount tmpfs and drop to its uid)"
    if shutil.which("unshare") is None:
        return "the sandbox needs util-linux's `unshare` on PATH"
    try:
        probe = subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare` failed: {e}"
    if probe.returncode != 0:
        return f"`unshare` failed: {probe.stderr.decode(errors='replace').strip()[:200]}"
    return None


_GATES: dict[int, threading.BoundedSemaphore] = {}
_UIDS: queue.SimpleQueue[int] = queue.SimpleQueue()
_LOCK = threading.Lock()
_ALLOCATED = [0]


def _gate(max_workers: int) -> threading.BoundedSemaphore:
    """The semaphore of ``max_workers`` concurrent runs, and that many more uids to run as."""
    with _LOCK:
        if max_workers not in _GATES:
            if _ALLOCATED[0] + max_workers > UIDS_PER_PROCESS:
                raise ValueError(
                    f"max_workers: at most {UIDS_PER_PROCESS} sandboxed runs at once per "
                    f"process, got {max_workers} more after {_ALLOCATED[0]}"
                )
            block = FIRST_UID + (os.getpid() % 4000) * UIDS_PER_PROCESS
            for i in range(max_workers):
                _UIDS.put(block + _ALLOCATED[0] + i)
            _ALLOCATED[0] += max_workers
            _GATES[max_workers] = threading.BoundedSemaphore(max_workers)
        return _GATES[max_workers]


def run_program(
    code: str, inputs: list[str], *, fn_name: str | None = None, config: SandboxConfig
) -> RunResult:
    """Run ``code`` on each of ``inputs`` in one sandboxed process (see the module doc).

    ``fn_name`` None: a stdin program, each input its stdin, its stdout the output. Else the
    program defines ``fn_name`` (or ``class Solution`` with that method), each input is its
    arguments as JSON lines and the output is ``repr`` of what it returns.
    """
    problem = sandbox_problem()
    if problem is not None and not config.allow_unsandboxed:
        raise SandboxUnavailable(
            f"{problem}; set reward.code.allow_unsandboxed=true to run model-written code "
            "without the sandbox (as this user, with only a time limit)"
        )
    with _gate(config.max_workers):
        uid = _UIDS.get()
        try:
            return _run(code, inputs, fn_name, config, uid, sandboxed=problem is None)
        finally:
            _UIDS.put(uid)


def _run(code, inputs, fn_name, config: SandboxConfig, uid: int, sandboxed: bool) -> RunResult:
    limits = {
        "uid": uid,
        "cpu_s": config.cpu_s,
        "memory_mb": config.memory_mb,
        "processes": config.processes,
        "file_mb": config.file_mb,
        "tmpfs_mb": config.tmpfs_mb,
    }
    request = {
        "code": code,
        "inputs": inputs,
        "fn_name": fn_name,
        "sandboxed": sandboxed,
        "case_timeout_s": config.wall_s,
        "limits": limits,
    }
    command = [sys.executable, "-I", str(HARNESS)]
    with tempfile.TemporaryDirectory(prefix="otbrl-sandbox-") as tmp:
        reply_path = Path(tmp) / "reply.json"
        with open(reply_path, "wb") as reply:
            proc = subprocess.Popen(
                [*UNSHARE, *command] if sandboxed else command,
                stdin=subprocess.PIPE,
                stdout=reply,
                stderr=subprocess.DEVNULL,
                # unsandboxed, HOME is the temporary directory: "~" must not reach ours
                env=_ENV if sandboxed else {**_ENV, "HOME": tmp},
                cwd="/" if sandboxed else tmp,
                start_new_session=True,
                # killed with the trainer: unshare --kill-child then takes the harness's tree
                preexec_fn=die_with_parent(),
            )
            try:
                proc.communicate(json.dumps(request).encode(), timeout=config.wall_s + 1.0)
            except subprocess.TimeoutExpired:
                _kill(proc)
                return RunResult(violations=["wall_time"], error="ran past its wall-time limit")
        text = reply_path.read_bytes()[: (config.file_mb + 1) * 2**20].decode(errors="replace")
    try:
        out = json.loads(text)
    except (ValueError, RecursionError):
        status = proc.returncode
        why = "cpu_time" if status in (-24, -9, 128 + 24, 128 + 9, 152, 137) else "killed"
        return RunResult(violations=[why], error=f"the run ended with status {status}")
    return _reply(out)


def _reply(out) -> RunResult:
    """The harness's reply, read as what it may be: the program under test can write the same
    channel, so anything but ``{"cases": [{"status": str, ...}], "violations": [str]}`` is this
    sample's failure (``bad_reply``), never the run's — a ``setup_error`` too (the sandbox was
    probed before the run; one sample claiming otherwise fails alone)."""
    if isinstance(out, dict) and "setup_error" in out:
        why = str(out["setup_error"])[:200]
        return RunResult(violations=["setup"], error=f"the sandbox could not be set up: {why}")
    cases, violations = (
        out.get(k, []) if isinstance(out, dict) else None for k in ("cases", "violations")
    )
    if (
        not isinstance(cases, list)
        or not isinstance(violations, list)
        or not all(isinstance(c, dict) and isinstance(c.get("status"), str) for c in cases)
        or not all(isinstance(v, str) for v in violations)
    ):
        return RunResult(violations=["bad_reply"], error="the reply channel held no harness reply")
    return RunResult(cases=cases, violations=violations)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the run: ``unshare --kill-child`` passes it on to the harness, whose PID
    namespace then takes every process the program started with it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    proc.wait()
