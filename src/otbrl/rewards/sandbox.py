"""Running model-written Python in a sandbox: one process per run, no network, works without root.

``run_program(code, inputs, fn_name=..., config=...)`` starts ``sandbox_harness.py`` under
``unshare --net --mount --pid --ipc --uts --fork --kill-child --mount-proc`` (fresh network,
mount, PID, System V IPC and host-name namespaces: even 127.0.0.1 is unreachable, shared memory
segments die with the run, and when the harness ends or is killed the kernel kills every
process it started, a fork bomb included). As root the harness then drops to a uid of its own
(``mode() == "root"``); as a normal user — or as root where the container withholds
``CAP_SYS_ADMIN`` — the same namespaces are made inside an unprivileged user namespace
(``unshare --user --map-root-user``: ``mode() == "userns"``), where the harness is root only
over its own namespaces and gives up every capability before the program runs. Either way the
harness enters a root of its own (read-only system and interpreter directories, a minimal
``/dev``, a tmpfs ``/tmp``: the host's files are not there) and sets resource limits (see its
module doc). Its environment is scrubbed (no inherited variables, so no secrets); its reply
goes to a file the caller owns, bounded by the file-size limit.

Memory and processes are capped over the run's whole process tree by a cgroup of its own where
this process may make one (``otbrl.rewards.cgroup``: cgroup v2 with delegated controllers, or
v1 as root); elsewhere the bound is per process (``memory_mb`` each, at most ``processes``).

Where no namespace can be made (not Linux, no ``unshare``, user namespaces disabled) a run is
refused with the reason, unless ``allow_unsandboxed``: then the program runs as this user, in a
temporary directory, under the time, memory, CPU, file-size and open-file limits but with the
host's network and files; ``sandbox_problem()`` says why, and the run plan checks it (and warns
once per run when allowed) before any model loads.
"""

from __future__ import annotations

import contextlib
import fcntl
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
from otbrl.rewards.cgroup import RunCgroup, tree_caps
from otbrl.settings import setting

HARNESS = Path(__file__).with_name("sandbox_harness.py")
NAMESPACES = ("--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child")
UNSHARE = {
    "root": ("unshare", *NAMESPACES, "--mount-proc"),
    "userns": ("unshare", "--user", "--map-root-user", *NAMESPACES, "--mount-proc"),
}
# As root, one unprivileged uid per concurrent run, so that process limits do not mix: each
# process (a torchrun rank, a reward worker) holds a block of its own, claimed with a lock
# (two processes whose pids agree modulo BLOCKS never share one). A user namespace needs none:
# its limits are counted per namespace.
FIRST_UID = 61000
UIDS_PER_PROCESS = 64
BLOCKS = 4000
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

    cpu_s: float = setting(10.0, gt=0, resume="fixed")  # CPU seconds
    # seconds per test input (the whole run: one more)
    wall_s: float = setting(10.0, gt=0, resume="fixed")
    memory_mb: int = setting(1024, gt=0, resume="fixed")  # address space
    # sandboxed runs at once in this process
    max_workers: int = setting(4, gt=0, le=UIDS_PER_PROCESS, resume="may_differ")
    # run model code without namespaces where the OS cannot make them (as this user, with
    # only a time limit); false: such a run is refused, before any model loads
    allow_unsandboxed: bool = setting(False, resume="may_differ")


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
def _probe() -> tuple[str | None, str | None]:
    """``(mode, None)`` with the first mode a trivial program runs in, or ``(None, why)``."""
    if not sys.platform.startswith("linux"):
        return None, f"the sandbox needs Linux namespaces (this is {sys.platform})"
    if shutil.which("unshare") is None:
        return None, "the sandbox needs util-linux's `unshare` on PATH"
    tried = []
    for mode in ("root", "userns") if os.geteuid() == 0 else ("userns",):
        config = SandboxConfig(cpu_s=5, wall_s=15, memory_mb=512, max_workers=1)
        run = _run(
            "print(6 * 7)",
            [""],
            None,
            config,
            FIRST_UID + BLOCKS * UIDS_PER_PROCESS,
            mode,
            cgroup=False,
        )
        if run.cases == [{"status": "ok", "output": "42\n"}]:
            return mode, None
        tried.append(
            f"{UNSHARE[mode][1] if mode == 'userns' else 'as root'}: {run.error or run.cases}"[:240]
        )
    hint = (
        ""
        if os.geteuid() == 0
        else " (unprivileged user namespaces may be disabled: "
        "sysctl user.max_user_namespaces, kernel.apparmor_restrict_unprivileged_userns)"
    )
    return None, f"no namespace could be made ({'; '.join(tried)}){hint}"


def mode() -> str | None:
    """How runs are sandboxed here: ``"root"`` (namespaces made as root, the program under a
    uid of its own), ``"userns"`` (inside an unprivileged user namespace, every capability
    dropped) or None (no sandbox: see ``sandbox_problem()``). Probed once per process by
    running a trivial program."""
    return _probe()[0]


def sandbox_problem() -> str | None:
    """Why model code cannot be sandboxed here (None: it can). Checked once per process."""
    return _probe()[1]


def describe() -> str:
    """One line: how model code is isolated on this machine (for logs and warnings)."""
    how = {
        "root": "namespaces made as root, a uid of its own",
        "userns": "an unprivileged user namespace, no capabilities",
    }.get(mode() or "")
    if how is None:
        return f"no sandbox: {sandbox_problem()}"
    caps = tree_caps()
    tree = (
        f"memory and processes capped over the tree (cgroup {caps[0]})"
        if isinstance(caps, tuple)
        else "memory and processes capped per process"
    )
    return f"sandboxed ({how}; {tree})"


_GATES: dict[int, threading.BoundedSemaphore] = {}
_UIDS: queue.SimpleQueue[int] = queue.SimpleQueue()
_LOCK = threading.Lock()
_ALLOCATED = [0]
_BLOCK: list[int] = []


_HELD_LOCKS: list[int] = []


def _claim_uid_block(start: int) -> int:
    """The first uid of a block of ``UIDS_PER_PROCESS`` no other live process holds, trying
    blocks from ``start``: a lock file per block (root-owned directory), released when this
    process ends."""
    root = Path("/run" if os.access("/run", os.W_OK) else tempfile.gettempdir())
    folder = root / "otbrl-sandbox-uids"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = os.lstat(folder)
    if (
        not os.path.isdir(folder)
        or os.path.islink(folder)
        or info.st_uid != os.geteuid()
        or info.st_mode & 0o077
    ):
        raise SandboxUnavailable(f"{folder} is not a private directory of this user: remove it")
    for i in range(BLOCKS):
        block = (start + i) % BLOCKS
        fd = os.open(folder / f"{block}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _HELD_LOCKS.append(fd)
        return FIRST_UID + block * UIDS_PER_PROCESS
    raise SandboxUnavailable(f"all {BLOCKS} sandbox uid blocks are held by live processes")


def _gate(max_workers: int) -> threading.BoundedSemaphore:
    """The semaphore of ``max_workers`` concurrent runs, and that many more uids to run as."""
    with _LOCK:
        if max_workers not in _GATES:
            if _ALLOCATED[0] + max_workers > UIDS_PER_PROCESS:
                raise ValueError(
                    f"max_workers: at most {UIDS_PER_PROCESS} sandboxed runs at once per "
                    f"process, got {max_workers} more after {_ALLOCATED[0]}"
                )
            if mode() == "root" and not _BLOCK:
                _BLOCK.append(_claim_uid_block(os.getpid() % BLOCKS))
            block = _BLOCK[0] if _BLOCK else FIRST_UID
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
            "without the sandbox (as this user, with the host's network and files)"
        )
    with _gate(config.max_workers):
        uid = _UIDS.get()
        try:
            return _run(code, inputs, fn_name, config, uid, mode())
        finally:
            _UIDS.put(uid)


def _run(
    code, inputs, fn_name, config: SandboxConfig, uid: int, how: str | None, cgroup: bool = True
) -> RunResult:
    limits = {
        "uid": uid,
        "drop": "uid" if how == "root" else "caps",
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
        "sandboxed": how is not None,
        "case_timeout_s": config.wall_s,
        "limits": limits,
    }
    command = [sys.executable, "-I", str(HARNESS)]
    tree = None
    if cgroup and how is not None and isinstance(tree_caps(), tuple):
        # probed once; a cgroup that cannot be made now leaves the per-process bound
        with contextlib.suppress(OSError):
            tree = RunCgroup(config.memory_mb, config.processes)
    parent_death = die_with_parent()

    def before_exec():  # in the child: into the run's cgroup, dies with the trainer
        if tree is not None:
            tree.enter()
        if parent_death is not None:
            parent_death()

    hit: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="otbrl-sandbox-") as tmp:
            reply_path = Path(tmp) / "reply.json"
            with open(reply_path, "wb") as reply:
                proc = subprocess.Popen(
                    [*UNSHARE[how], *command] if how else command,
                    stdin=subprocess.PIPE,
                    stdout=reply,
                    stderr=subprocess.DEVNULL,
                    # unsandboxed, HOME is the temporary directory: "~" must not reach ours
                    env=_ENV if how else {**_ENV, "HOME": tmp},
                    cwd="/" if how else tmp,
                    start_new_session=True,
                    # killed with the trainer: unshare --kill-child then takes the harness's tree
                    preexec_fn=before_exec,
                )
                try:
                    proc.communicate(json.dumps(request).encode(), timeout=config.wall_s + 1.0)
                except subprocess.TimeoutExpired:
                    _kill(proc)
                    return RunResult(violations=["wall_time"], error="ran past its wall-time limit")
            text = reply_path.read_bytes()[: (config.file_mb + 1) * 2**20]
    finally:
        if tree is not None:
            hit = tree.close()
    try:
        out = json.loads(text.decode(errors="replace"))
    except (ValueError, RecursionError):
        status = proc.returncode
        why = "cpu_time" if status in (-24, -9, 128 + 24, 128 + 9, 152, 137) else "killed"
        return RunResult(violations=hit or [why], error=f"the run ended with status {status}")
    result = _reply(out)
    result.violations += [v for v in hit if v not in result.violations]
    return result


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
