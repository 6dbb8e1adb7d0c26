"""A memory and process cap over a sandboxed run's whole process tree, from a cgroup of its own.

Resource limits (``setrlimit``) bound each process: a program that forks 15 children holds up
to 16 × ``memory_mb``. A cgroup bounds them together. ``tree_caps()`` finds where this process
may make cgroups, once: cgroup v2 when its own cgroup lets it create children that have the
``memory`` and ``pids`` controllers (a delegated subtree), else cgroup v1's ``memory`` and
``pids`` hierarchies when it may write its own cgroup in each (root, most containers run as
root), else nothing — then the bound is the documented weaker one: ``memory_mb`` per process,
``processes`` processes (see ``otbrl.rewards.sandbox``).

``RunCgroup`` makes one cgroup per run, puts the run's first process in it before that process
executes anything, reports whether the cap was hit, and removes the cgroup after the run.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from pathlib import Path

_COUNTER = itertools.count()


def _own_cgroups() -> dict[str, str]:
    """``{controller or "": path}`` of this process, from ``/proc/self/cgroup``."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                out[name] = path
    return out


def _mount_points() -> dict[str, str]:
    """``{"cgroup2" or a v1 controller: mount point}`` from ``/proc/self/mountinfo``."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            if fstype == "cgroup2":
                out.setdefault("cgroup2", fields[4])
            elif fstype == "cgroup":
                for name in ("memory", "pids"):
                    if name in options:
                        out.setdefault(name, fields[4])
    return out


def _can_make_child(base: Path, limits: tuple[str, ...], needs: tuple[str, ...] = ()) -> bool:
    """A child cgroup can be made under ``base`` with the ``needs`` controllers and its
    ``limits`` files written (what ``RunCgroup`` does per run), then removed."""
    probe = base / f"otbrl-probe-{os.getpid()}-{next(_COUNTER)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        if needs:
            have = (probe / "cgroup.controllers").read_text().split()
            if not all(n in have for n in needs):
                return False
        for name in limits:
            (probe / name).write_text("max" if name.endswith(".max") else str(2**40))
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


@functools.cache
def tree_caps() -> tuple[str, dict[str, Path]] | str:
    """``("v2", {"memory": dir, "pids": dir})`` or ``("v1", ...)``: the directories under which
    a run's cgroup is made; or why no cgroup can be made here (a sentence)."""
    own, mounts = _own_cgroups(), _mount_points()
    if "cgroup2" in mounts and "" in own:
        base = Path(mounts["cgroup2"] + own[""])
        if _can_make_child(base, ("memory.max", "pids.max"), ("memory", "pids")):
            return "v2", {"memory": base, "pids": base}
    if "memory" in mounts and "pids" in mounts and "memory" in own and "pids" in own:
        bases = {n: Path(mounts[n] + own[n]) for n in ("memory", "pids")}
        limits = {"memory": ("memory.limit_in_bytes",), "pids": ("pids.max",)}
        if all(_can_make_child(b, limits[n]) for n, b in bases.items()):
            return "v1", bases
    return (
        "no cgroup can be made here (cgroup v2 without delegated memory and pids controllers, "
        "cgroup v1's not writable)"
    )


class RunCgroup:
    """One run's cgroup: ``memory_mb`` over all its processes (swap included where the kernel
    accounts it) and at most ``processes`` of them. ``enter()`` is called in the run's first
    process before it executes anything; ``close()`` after it ended says which cap it hit
    (``"memory"``, ``"processes"``) and removes the cgroup."""

    def __init__(self, memory_mb: int, processes: int):
        kind, bases = tree_caps()  # type: ignore[misc]
        name = f"otbrl-sandbox-{os.getpid()}-{next(_COUNTER)}"
        self.kind = kind
        self.dirs = {n: b / name for n, b in bases.items()}
        made: list[Path] = []
        try:
            for d in dict.fromkeys(self.dirs.values()):
                d.mkdir()
                made.append(d)
            memory, pids = self.dirs["memory"], self.dirs["pids"]
            limit = str(memory_mb * 2**20)
            if kind == "v2":
                (memory / "memory.max").write_text(limit)
                with contextlib.suppress(FileNotFoundError):
                    (memory / "memory.swap.max").write_text("0")
            else:
                (memory / "memory.limit_in_bytes").write_text(limit)
                with contextlib.suppress(FileNotFoundError, PermissionError):
                    (memory / "memory.memsw.limit_in_bytes").write_text(limit)
            (pids / "pids.max").write_text(str(processes))
        except OSError:
            for d in made:
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        # opened now: enter() runs between fork and exec, where it should not allocate much
        self._procs = [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def enter(self) -> None:
        """Move the calling process into the cgroup (its children follow it). Runs between
        fork and exec: a failure leaves the run with its per-process limits, never fails it."""
        pid = str(os.getpid()).encode()
        for path in self._procs:
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

    def close(self) -> list[str]:
        """The caps the run hit, then the cgroup removed (waiting up to 2 s for the killed
        processes to leave it)."""
        hit = []
        memory, pids = self.dirs["memory"], self.dirs["pids"]
        with contextlib.suppress(OSError):
            events = memory / ("memory.events" if self.kind == "v2" else "memory.oom_control")
            counts = dict(line.split() for line in events.read_text().splitlines())
            if int(counts.get("oom_kill", 0)) or int(counts.get("oom", 0)):
                hit.append("memory")
        with contextlib.suppress(OSError):
            counts = dict(line.split() for line in (pids / "pids.events").read_text().splitlines())
            if int(counts.get("max", 0)):
                hit.append("processes")
        deadline = time.monotonic() + 2.0
        for d in dict.fromkeys(self.dirs.values()):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break  # left behind: empty cgroups cost nothing and hold nobody
                    time.sleep(0.02)
        return hit
