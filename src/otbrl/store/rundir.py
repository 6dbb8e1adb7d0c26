"""A run directory belongs to one run: a manifest, a lock, and the checkpoint to resume from.

``claim_run_dir(path, identity, resume=..., overwrite=...)`` runs before any model loads (the run
layer's ``otbrl.run.claim.claim_run_dir(cfg)`` calls it right after ``plan_run`` with the run's
``RunIdentity``: no configuration is read here) and, on rank 0:

1. checks ``trainer.output_dir`` (not a file, creatable, writable);
2. takes an exclusive ``flock`` on ``<output_dir>/run.lock`` for the run's life and writes its
   pid there: a second process on the same directory stops with a ``ConfigError`` naming the
   holder;
3. decides what the directory's contents mean for this run. ``trainer.resume=never`` on a
   directory that holds a run is refused unless ``trainer.overwrite=true``, which moves the old
   contents to ``<output_dir>.old-<time>`` (never deletes them). ``resume=auto`` or a path on a
   directory that holds a run compares the configuration with the one the run was started
   with (``identity.differences``): a difference outside ``identity.may_differ`` is a
   ``ConfigError`` naming the keys;
4. picks the checkpoint to resume from: ``auto`` takes the newest one whose files match their
   manifest, says on stderr which newer ones were damaged and moves those to
   ``checkpoints/corrupt-step_<k>``; an explicit path that does not verify is a
   ``ConfigError`` naming the file;
5. writes ``<output_dir>/run.json`` atomically: the resolved config and its SHA-256, the otbrl
   version, when the run was created, and one entry per start (pid, host, resumed from,
   changed keys, damaged checkpoints passed over).

Other ranks of a ``torchrun`` job touch nothing: rank 0 decides, and the trainer broadcasts its
checkpoint choice once the process group exists. Messages name the keys a user sets
(``trainer.output_dir``, ``trainer.resume``, ``trainer.overwrite``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import otbrl
from otbrl.errors import ConfigError
from otbrl.store import checkpoint
from otbrl.store.files import (
    GENERATIONS_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    atomic_write_text,
    lock_file,
)

MANIFEST = "run.json"
LOCK = "run.lock"
CHECKPOINTS = "checkpoints"
# What otbrl writes into a run directory (named in messages).
_RUN_ENTRIES = (MANIFEST, METRICS_FILE, SUMMARY_FILE, GENERATIONS_FILE, CHECKPOINTS, "config.yaml")


@dataclass
class RunDir:
    """A claimed run directory. ``resume_from``: the verified checkpoint this run continues
    from (None: start at step 0; always None on ranks other than 0, which claim nothing)."""

    path: Path
    resume_from: Path | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    _lock_fd: int | None = None

    @property
    def owner(self) -> bool:
        """This process holds the lock (rank 0 while the run lives)."""
        return self._lock_fd is not None

    def release(self) -> None:
        """Give the lock up (the OS does it too when the process ends); safe to call twice."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the only descriptor releases the flock
            self._lock_fd = None


def config_sha256(config: dict) -> str:
    """SHA-256 of a resolved config's canonical JSON (key order does not matter)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class RunIdentity:
    """What a run directory checks a starting run against: its resolved ``config`` (plain
    values, written to the manifest), ``differences(saved, current)`` -> ``{dotted key: (saved
    value, current value)}`` between a saved configuration and this one, the keys that
    ``may_differ`` when a run is resumed (any other difference is refused), and ``user_files``:
    path -> SHA-256 of each user code file the run executes (kept with each start)."""

    config: dict
    differences: Callable[[dict, dict], dict[str, tuple[Any, Any]]]
    may_differ: frozenset[str]
    user_files: dict[str, str] = field(default_factory=dict)


def claim_run_dir(
    path: str | Path,
    identity: RunIdentity,
    *,
    resume: str = "auto",
    overwrite: bool = False,
    rank: int | None = None,
    stream: TextIO | None = None,
) -> RunDir:
    """Claim the run directory ``path`` (``trainer.output_dir``) for the run of ``identity``
    (see the module docstring); ``resume``: ``"auto"``, ``"never"`` or a checkpoint path
    (``trainer.resume``); ``overwrite``: with ``resume="never"``, move a run found there aside.
    Raises ``ConfigError`` naming the key for every problem the user must fix. ``rank``
    defaults to torchrun's ``RANK``; notes (damaged checkpoints, changed keys) go to
    ``stream`` (stderr)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    path = Path(path)
    if rank != 0:
        return RunDir(path)
    stream = stream or sys.stderr
    _prepare(path)
    run = RunDir(path, _lock_fd=_lock(path))
    try:
        current = identity.config
        saved = _saved_config(path)
        entry: dict[str, Any] = {
            "started_at": _now(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "otbrl_version": otbrl.__version__,
            "user_files": dict(identity.user_files),
        }
        if resume == "never":
            if saved is not None:
                if not overwrite:
                    raise ConfigError(
                        f"'trainer.resume' is never but trainer.output_dir '{path}' holds a run "
                        f"({_describe(path)}): use a new trainer.output_dir, "
                        "trainer.resume=auto to continue it, or trainer.overwrite=true to move "
                        "it aside (nothing is deleted)",
                        "trainer.resume",
                    )
                moved = _move_aside(path)
                print(f"otbrl: moved the previous run in {path} to {moved}", file=stream)
                entry["previous_run_moved_to"] = str(moved)
                saved = None
        elif saved is not None:
            changed = _check_same_run(path, saved, current, identity)
            if changed:
                entry["changed"] = {k: list(v) for k, v in changed.items()}
                text = ", ".join(f"{k} {x!r} -> {y!r}" for k, (x, y) in changed.items())
                print(f"otbrl: resuming {path} with {text}", file=stream)
            for file in _edited_user_files(path, entry["user_files"]):
                print(
                    f"otbrl: resuming {path} with {file} edited since the last start (its "
                    "SHA-256 differs; run.json keeps both)",
                    file=stream,
                )
        run.resume_from = _resume_from(resume, path, entry, stream)
        if run.resume_from is not None:
            entry["resumed_from"] = str(run.resume_from)
            step = checkpoint.checkpoint_step(run.resume_from)
            print(f"otbrl: resuming {path} from {run.resume_from.name} (step {step})", file=stream)
        elif saved is None:
            print(f"otbrl: new run in {path}", file=stream)
        elif "damaged_checkpoints" not in entry:
            print(
                f"otbrl: {path} holds this run but no checkpoint (trainer.save_every=0?): "
                "starting it over from step 0",
                file=stream,
            )
        run.manifest = _write_manifest(path, current, entry, fresh=saved is None)
    except BaseException:
        run.release()
        raise
    return run


def _prepare(path: Path) -> None:
    key = "trainer.output_dir"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"'{key}' must be a directory, got '{path}', which is a file", key)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"'{key}' cannot be created: '{path}': {err.strerror}", key) from None


def _lock(path: Path) -> int:
    """An exclusive, non-blocking ``flock`` on ``run.lock`` holding this process's id."""
    key = "trainer.output_dir"
    lock = path / LOCK
    try:
        fd = lock_file(lock, wait=False)
    except BlockingIOError:
        holder = _holder(lock)
        raise ConfigError(
            f"'{key}' '{path}' is in use by {holder} (lock file '{lock}'): wait for that run "
            "to end, or use another trainer.output_dir",
            key,
        ) from None
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise ConfigError(
                f"'{key}': its file system does not support locks ({err.strerror}; e.g. NFS "
                f"without a lock daemon), which keep two runs out of '{path}': use a directory "
                "on a local file system",
                key,
            ) from None
        raise ConfigError(
            f"'{key}' is not writable: cannot create '{lock}': {err.strerror}", key
        ) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    os.fsync(fd)
    return fd


def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text())
        return f"process {info['pid']} on host {info['host']} (since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _holds_run(path: Path) -> bool:
    """Something of a run is there: a logged step, a summary or a checkpoint. A manifest or a
    config alone (a start that failed before its first step) and files otbrl does not write
    are not a run."""
    metrics, ckpts = path / METRICS_FILE, path / CHECKPOINTS
    return (
        (metrics.is_file() and metrics.stat().st_size > 0)
        or (path / SUMMARY_FILE).exists()
        or (ckpts.is_dir() and any(ckpts.iterdir()))
    )


def _saved_config(path: Path) -> dict | None:
    """The configuration the run in ``path`` was started with; None when the directory holds
    no run (``_holds_run``)."""
    if not _holds_run(path):
        return None
    key = "trainer.output_dir"
    if (path / MANIFEST).is_file():
        try:
            return json.loads((path / MANIFEST).read_text())["config"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ConfigError(
                f"'{key}': '{path / MANIFEST}' is not a valid run manifest: move the directory "
                "away or use trainer.resume=never trainer.overwrite=true",
                key,
            ) from None
    if (path / "config.yaml").is_file():  # a run from before run.json existed
        import yaml  # a dependency of omegaconf

        try:
            loaded = yaml.safe_load((path / "config.yaml").read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            loaded = None
        if isinstance(loaded, dict):
            return loaded
    raise ConfigError(
        f"'{key}' '{path}' holds otbrl outputs but no readable {MANIFEST} or config.yaml, so "
        "whose run it is cannot be told: use a new trainer.output_dir, or trainer.resume=never "
        "trainer.overwrite=true to move them aside",
        key,
    )


def _describe(path: Path) -> str:
    names = [name for name in _RUN_ENTRIES if (path / name).exists()]
    steps = checkpoint.list_checkpoints(path / CHECKPOINTS)
    text = ", ".join(names)
    return text + (f"; checkpoints up to {steps[-1].name}" if steps else "")


def _check_same_run(
    path: Path, saved: dict, current: dict, identity: RunIdentity
) -> dict[str, tuple]:
    """The allowed differences; a ``ConfigError`` naming every other one."""
    diff = identity.differences(saved, current)
    refused = {k: v for k, v in diff.items() if k not in identity.may_differ}
    if refused:
        shown = [f"{k} ({x!r} in the run, {y!r} now)" for k, (x, y) in list(refused.items())[:8]]
        more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
        raise ConfigError(
            f"'trainer.output_dir' '{path}' holds a run with another configuration: "
            f"{', '.join(shown)}{more}; resuming would mix two runs: use a new "
            "trainer.output_dir, or trainer.resume=never trainer.overwrite=true to move the "
            "old run aside",
            sorted(refused)[0],
        )
    return {k: v for k, v in diff.items() if k not in ("trainer.resume", "trainer.overwrite")}


def _fresh_dir(base: Path) -> Path:
    """A new, empty directory ``<base>-<time>`` (``-<n>`` added while that name is taken),
    created here: two processes never get the same one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        target = base.with_name(f"{base.name}-{stamp}" + (f"-{n}" if n else ""))
        try:
            target.mkdir(mode=0o777)
            return target
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name for {base.name}-{stamp}-<n> in {base.parent}")


def _move_aside(path: Path) -> Path:
    """Move everything in ``path`` but the lock into a new ``<path>.old-<time>`` sibling."""
    target = _fresh_dir(path.with_name(f"{path.name}.old"))
    for entry in sorted(path.iterdir()):
        if entry.name != LOCK:
            os.rename(entry, target / entry.name)
    return target


def _keep_later_branch(path: Path, start: Path, entry: dict, stream: TextIO) -> None:
    """Resuming this run from one of its older checkpoints (``start``) starts a new branch: the
    checkpoints of later steps, and the logs that run on past ``start``, move to
    ``<path>/branch-<time>/`` (named, never deleted) — left in place, the new branch would
    overwrite them step by step, retention would delete its own newer checkpoints first (it
    goes by step number), and ``resume=auto`` would go back to the abandoned branch."""
    root = path / CHECKPOINTS
    if start.resolve().parent != root.resolve():
        return  # another run's checkpoint: this run's own are not abandoned
    step = checkpoint.checkpoint_step(start)
    later = [c for c in checkpoint.list_checkpoints(root) if checkpoint.checkpoint_step(c) > step]
    if not later:
        return
    branch = _fresh_dir(path / "branch")
    (branch / CHECKPOINTS).mkdir()
    for ckpt in later:
        os.rename(ckpt, branch / CHECKPOINTS / ckpt.name)
    for name in ("metrics.jsonl", "generations.jsonl", "summary.json"):
        if (path / name).is_file():  # the resumed run cuts these back to its start: copy
            shutil.copy2(path / name, branch / name)
    names = ", ".join(c.name for c in later)
    entry["branch_kept"] = {"path": str(branch), "checkpoints": [c.name for c in later]}
    print(
        f"otbrl: resuming from {start.name}, older than this run's newest checkpoint: the later "
        f"branch ({names}, its logs) moved to {branch.name}/ (nothing deleted)",
        file=stream,
    )


def _resume_from(resume: str, path: Path, entry: dict, stream: TextIO) -> Path | None:
    if resume == "never":
        return None
    if resume != "auto":
        try:
            checkpoint.verify_checkpoint(resume)
        except ValueError as err:
            raise ConfigError(f"'trainer.resume': {err}", "trainer.resume") from None
        _keep_later_branch(path, Path(resume), entry, stream)
        return Path(resume)
    root = path / CHECKPOINTS
    found, skipped = checkpoint.latest_verified_checkpoint(root)
    for bad, why in skipped:
        moved = bad.with_name(f"corrupt-{bad.name}")
        n = 1
        while moved.exists():
            moved, n = bad.with_name(f"corrupt-{bad.name}-{n}"), n + 1
        os.rename(bad, moved)
        print(
            f"otbrl: warning: damaged checkpoint: {why}; moved it to {moved.name}",
            file=stream,
        )
    if skipped:
        entry["damaged_checkpoints"] = [{"path": str(p), "error": why} for p, why in skipped]
        into = f"from {found}" if found else "from step 0 (no intact checkpoint left)"
        print(f"otbrl: warning: resuming {into}", file=stream)
    return found


def _edited_user_files(path: Path, hashes: dict[str, str]) -> list[str]:
    """The user code files whose hash differs from the run's last start (none without one)."""
    try:
        starts = json.loads((path / MANIFEST).read_text()).get("starts") or [{}]
    except (OSError, ValueError):
        return []
    before = starts[-1].get("user_files") or {}
    return [f for f, digest in hashes.items() if f in before and before[f] != digest]


def _write_manifest(path: Path, config: dict, entry: dict, *, fresh: bool) -> dict:
    manifest: dict[str, Any] = {}
    if not fresh and (path / MANIFEST).is_file():
        manifest = json.loads((path / MANIFEST).read_text())
    manifest.setdefault("format", 1)
    manifest.setdefault("created_at", entry["started_at"])
    manifest.update(
        otbrl_version=otbrl.__version__, config=config, config_sha256=config_sha256(config)
    )
    manifest["starts"] = [*manifest.get("starts", []), entry]
    atomic_write_text(path / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest
