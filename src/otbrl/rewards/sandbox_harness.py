"""Runs inside the code sandbox (``otbrl.rewards.sandbox``); standard library only.

Started inside fresh network, mount, PID, IPC and UTS namespaces (``unshare``) — as root, or
as a normal user inside a user namespace of its own where it is root only over that namespace
— it reads one request from stdin, builds the cage, gives up every privilege, and only then
runs the model's program:

1. a new root: a read-only tmpfs holding, read-only, only ``/usr``, ``/etc``, the
   interpreter's directories, a ``/dev`` of five devices (``null``, ``zero``, ``full``,
   ``random``, ``urandom``) and a fresh ``/proc``; a writable ``/tmp`` tmpfs (the host's
   world-writable places get fresh tmpfs mounts too); the working directory is ``/tmp/work``;
2. resource limits: address space, CPU seconds, processes, file size, open files, no core;
3. ``no_new_privs``, then, as root, ``setgroups([])`` / ``setgid`` / ``setuid`` to an
   unprivileged uid that owns nothing but the working directory; in a user namespace (where
   no other uid exists) every capability dropped, bounding and ambient sets included, with
   the secure bits that keep them dropped across ``exec``;
4. an audit hook refuses process creation, signals to others, sockets and file deletion
   (a ``PermissionError`` in the program, reported as a violation).

Unsandboxed (``reward.code.allow_unsandboxed`` where no namespace can be made) only steps 2
(without the process limit, which would count every process of this user) and 4 apply.

The program then runs in this very process (as verl's harness runs it: one module, called per
input). The reply (one JSON object, on a copy of the original stdout) holds, per test input,
the program's output (stdin mode: its stdout; call mode: ``repr`` of the return value) or its
error. The expected outputs never enter this process, so a program that writes the reply
itself can only report outputs it could have printed: the caller compares.
"""

import ast
import contextlib
import ctypes
import io
import json
import os
import resource
import signal
import sys
import types

# A program is run as verl's APPS harness runs it: these star imports first (a solution may
# use sqrt or deque without importing them) and a deep recursion limit.
_PRELUDE_MODULES = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
    "builtins",
    "typing",
)
_PRELUDE = (
    "".join(f"from {m} import *\n" for m in _PRELUDE_MODULES)
    + "".join(f"import {m}\n" for m in _PRELUDE_MODULES if m not in ("builtins", "typing"))
    + "sys.setrecursionlimit(6*10**5)\n"
)
_WRITABLE = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm")
_BLOCKED = {
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "subprocess.Popen",
    "os.kill",
    "os.killpg",
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "socket.sendmsg",
    "os.remove",
    "os.rmdir",
    "os.rename",
    "shutil.rmtree",
    "os.truncate",
    "os.chmod",
    "os.chown",
    "os.link",
    "os.symlink",
    "pty.spawn",
}
VIOLATIONS: list[str] = []


class CaseTimeout(BaseException):
    """One test input ran past its time limit."""


def _mount(source, target: str, fstype=None, flags: int = 0, opts: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = lambda x: None if x is None else x.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(opts)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source} on {target}")


def _mount_tmpfs(target: str, size_mb: int, mode: str = "1777") -> None:
    _mount("none", target, "tmpfs", 0, f"size={size_mb}m,mode={mode}")


def _bind_readonly(source: str, target: str) -> None:
    os.makedirs(target, mode=0o755, exist_ok=True)
    _mount(source, target, None, _MS_BIND | _MS_REC)
    # in a user namespace the source's nosuid/nodev/noexec/atime flags are locked: a remount
    # that leaves one out is refused, so it keeps them (statvfs and mount share these bits)
    kept = os.statvfs(target).f_flag & _MS_KEPT
    _mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_REC | kept)


def _minimal_dev(dev: str, tmpfs_mb: int) -> None:
    """A ``/dev`` of a few harmless devices (bound from the host's: a user namespace may not
    make device nodes), the usual links and a ``shm`` tmpfs — no GPUs, disks or terminals."""
    os.makedirs(dev)
    _mount_tmpfs(dev, 1, "755")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(f"{dev}/{name}", "w").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, _MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")
    _mount_tmpfs(f"{dev}/shm", tmpfs_mb)
    _mount(None, dev, None, _MS_REMOUNT | _MS_RDONLY, "size=1m,mode=755")


def _enter_new_root(tmpfs_mb: int) -> None:
    """``chroot`` into a fresh tmpfs that holds only, read-only, the system's programs and
    libraries (``/usr``, ``/etc`` and their links), the interpreter's directories
    (``sys.prefix``, ``sys.path``: the venv, pyenv under ``/root``) and ``/dev``; a new
    ``/proc`` and a writable ``/tmp`` tmpfs. Everything else of the host — the trainer's data,
    checkpoints, home directories, ``/work`` — is not there at all."""
    new = "/tmp/.root"
    os.mkdir(new, 0o755)
    _mount_tmpfs(new, 16, "755")
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, *sys.path) if p}
    needed = sorted(p for p in needed if os.path.isdir(p))
    needed = [p for p in needed if not any(p.startswith(q + "/") for q in needed if q != p)]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc"):
        if os.path.islink(top):  # merged /usr: /lib -> usr/lib
            os.symlink(os.readlink(top), new + top)
        elif os.path.isdir(top):
            _bind_readonly(top, new + top)
    for path in needed:
        if not path.startswith(("/usr/", "/etc/")):
            _bind_readonly(path, new + path)
    _minimal_dev(new + "/dev", tmpfs_mb)
    os.makedirs(new + "/proc")
    _mount("proc", new + "/proc", "proc", 0, None)  # this PID namespace's processes only
    os.makedirs(new + "/tmp")
    _mount_tmpfs(new + "/tmp", tmpfs_mb)
    os.chroot(new)
    os.chdir("/")


_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 32, 4096, 16384
_MS_KEPT = 2 | 4 | 8 | 1024 | 2048  # nosuid, nodev, noexec, noatime, nodiratime


def _cage(limits: dict) -> None:
    for target in _WRITABLE:  # the host's, in case the new root cannot be entered
        if os.path.isdir(target):
            _mount_tmpfs(target, limits["tmpfs_mb"])
    _enter_new_root(limits["tmpfs_mb"])
    own_uid = limits["drop"] == "uid"
    os.mkdir("/tmp/work", 0o700)
    if own_uid:
        os.chown("/tmp/work", limits["uid"], limits["uid"])
    _mount(None, "/", None, _MS_REMOUNT | _MS_RDONLY, "mode=755")  # the new root itself
    os.chdir("/tmp/work")
    _set_limits(limits, processes=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if own_uid:
        os.setgroups([])
        os.setgid(limits["uid"])
        os.setuid(limits["uid"])
        if os.getuid() == 0 or os.geteuid() == 0:
            raise OSError("could not drop root")
    else:
        _drop_capabilities(libc)
    os.environ["HOME"] = "/tmp/work"


def _set_limits(limits: dict, processes: bool) -> None:
    mb = 1024 * 1024
    for which, value in (
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, limits["file_mb"] * mb),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
        *([(resource.RLIMIT_NPROC, limits["processes"])] if processes else []),
    ):
        resource.setrlimit(which, (value, value))
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL


def _drop_capabilities(libc) -> None:
    """Root of a user namespace gives up every capability for good: the bounding and ambient
    sets emptied, the secure bits that stop uid 0 from regaining them at ``exec`` set and
    locked, then the effective, permitted and inheritable sets cleared."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
    if libc.prctl(47, 4, 0, 0, 0) != 0:  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
        raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (off), NO_CAP_AMBIENT_RAISE: each set and locked
    if libc.prctl(28, 0b11101111, 0, 0, 0) != 0:  # PR_SET_SECUREBITS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECUREBITS)")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    with open("/proc/self/status") as f:
        held = [line for line in f if line.startswith(("CapEff", "CapPrm", "CapBnd"))]
    if any(int(line.split()[1], 16) for line in held):
        raise OSError(f"capabilities remain: {' '.join(held)}")


def _audit(event: str, args) -> None:
    if event in _BLOCKED or event.startswith(("os.exec", "os.spawn", "os.posix_spawn")):
        VIOLATIONS.append(event)
        raise PermissionError(f"sandbox: {event} is not allowed")


def _as_stdin_program(code: str) -> str:
    """The program as verl's APPS harness runs it: a trailing ``if __name__ == '__main__':``
    block unwrapped, and everything but the leading imports moved into ``def code():``, which
    the harness calls once per input."""
    try:
        tree = ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:  # not parsable or empty: it fails to compile below, as in verl
        pass
    is_import = lambda line: line.startswith(("from ", "import "))  # noqa: E731
    out, started = [], False
    for line in code.split("\n"):
        if not is_import(line) and not started:
            out.append("stdin = sys.stdin\nstdout = sys.stdout\ndef code():\n")
            started = True
        out.append(("\t" + line if not is_import(line) or started else line) + "\n")
    return "".join(out)


def _run(request: dict) -> list[dict]:
    fn_name = request.get("fn_name")
    source = _PRELUDE + (request["code"] if fn_name else _as_stdin_program(request["code"]))
    module = types.ModuleType("tmp_sol")
    sys.stdin = io.StringIO("")
    try:
        _with_alarm(
            request["case_timeout_s"], exec, compile(source, "<string>", "exec"), module.__dict__
        )
        sys.modules["tmp_sol"] = module
        target = module.Solution() if fn_name and "class Solution" in request["code"] else module
        method = getattr(target, fn_name or "code")
    except CaseTimeout:
        VIOLATIONS.append("time")
        return [{"status": "timeout"}]
    except BaseException as e:  # whatever the program raises while loading
        return [{"status": "compile_error", "error": repr(e)[:300]}]
    results = []
    for text in request["inputs"]:
        try:
            if fn_name:
                args = [json.loads(line) for line in text.split("\n")]
                if args and isinstance(args[0], dict):
                    with contextlib.suppress(ValueError):
                        args = [{int(k): v for k, v in args[0].items()}]
                value = _with_alarm(request["case_timeout_s"], method, *args)
                json.dumps(value)  # what verl cannot serialise fails there
                results.append({"status": "ok", "output": repr(value)})
            else:
                sys.stdin, captured, real_stdout = io.StringIO(text), io.StringIO(), sys.stdout
                sys.stdout = captured
                try:
                    _with_alarm(request["case_timeout_s"], _call_program, method)
                finally:
                    sys.stdout = real_stdout
                results.append({"status": "ok", "output": captured.getvalue()})
        except CaseTimeout:
            results.append({"status": "timeout"})
            VIOLATIONS.append("time")
            break  # the run ends here: verl's harness is killed by its alarm
        except BaseException as e:  # the program's own errors: the case fails
            results.append({"status": "error", "error": repr(e)[:300]})
            if isinstance(e, MemoryError):
                VIOLATIONS.append("memory")
            break
    return results


def _call_program(method) -> None:
    with contextlib.suppress(SystemExit):  # exit() / sys.exit() end a program normally
        method()


def _with_alarm(seconds: float, fn, *args):
    def expire(signum, frame):
        raise CaseTimeout

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    request = json.loads(sys.stdin.read())
    reply = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        if request["sandboxed"]:
            _cage(request["limits"])
        else:
            _set_limits(request["limits"], processes=False)
    except OSError as e:
        reply.write(json.dumps({"setup_error": f"{type(e).__name__}: {e}"}))
        return
    sys.addaudithook(_audit)
    cases = _run(request)
    reply.write(json.dumps({"cases": cases, "violations": VIOLATIONS[:20]}))
    reply.flush()


if __name__ == "__main__":
    main()
