"""Files written safely: atomically (temp file in the same folder, fsync, rename), durably
(fsync of files and folders), and with the permissions the user's umask gives.

``tempfile.mkdtemp`` makes 0700 folders and ``mkstemp`` 0600 files, and safetensors'
``save_file`` writes 0600 files too; renamed into place they stay that way, and a team's
shared storage cannot read the run. No torch here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

# the run directory's log files (written by otbrl.report, named by otbrl.store.rundir)
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
GENERATIONS_FILE = "generations.jsonl"


def make_temp_dir(parent: str | Path, prefix: str) -> Path:
    """A new, uniquely named directory ``<parent>/<prefix><random>``, with the permissions the
    user's umask gives any folder (``tempfile.mkdtemp`` makes 0700, which a team's shared
    storage cannot read once the folder is renamed into place)."""
    parent = Path(parent)
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=0o777)  # the kernel applies the umask
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"make_temp_dir: no free name {prefix}* in {parent}")


def current_umask() -> int:
    """This process's umask, read without changing it where Linux reports it (``os.umask``
    can only be read by setting it, which races with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Give every folder and file under ``root`` the permissions the umask gives a new one
    (0777 / 0666 minus the umask): some writers (safetensors' ``save_file``) create 0600
    files, which a team's shared storage cannot read."""
    umask = current_umask()
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~umask)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def open_temp_file(parent: str | Path, prefix: str, suffix: str = ".tmp") -> tuple[int, Path]:
    """(fd, path) of a new file in ``parent`` opened for writing, with umask permissions
    (``tempfile.mkstemp`` makes 0600, which stays after the rename into place)."""
    parent = Path(parent)
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        return fd, path
    raise FileExistsError(f"open_temp_file: no free name {prefix}*{suffix} in {parent}")


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder, fsync, rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, rename; the file
    gets the umask's permissions."""
    path = Path(path)
    fd, tmp = open_temp_file(path.parent, f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (before renaming it into place)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def lock_file(path: str | Path, *, wait: bool = True) -> int:
    """An exclusive advisory ``flock`` on ``path`` (created if missing): the open descriptor,
    whose closing (or the process's death) releases it. ``wait=False``: ``BlockingIOError``
    at once when another process holds it; ``OSError`` when the file cannot be created."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BaseException:
        os.close(fd)
        raise
    return fd
