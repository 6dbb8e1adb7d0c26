"""User code named in the config as ``path/to/file.py:function`` (``reward.function``,
``rollout.multi_turn.tools``): each file executed once per process, and again only if it
changed. No torch here.

A reward file may count its calls or hold state, and one file may hold both the reward and the
tools: every caller goes through :func:`load_user_function`, so the file runs once whichever
key names it first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def spec_file(spec) -> Path | None:
    """The resolved ``.py`` file a ``path/to/file.py[:function]`` spec names; None for
    anything else (a built-in name, no spec). The file need not exist."""
    if not isinstance(spec, str) or ".py" not in spec:
        return None
    file = Path(spec.rsplit(":", 1)[0] if ":" in spec else spec).expanduser()
    return file.resolve() if file.suffix == ".py" else None


def file_sha256(path: Path) -> str:
    """SHA-256 of the file's bytes, hex: what a run records of a user file it executes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_user_function(spec: str, what: str) -> Callable:
    """The callable ``function`` of ``spec = "path/to/file.py:function"``.

    ``what`` opens every error message (``"reward function"``, ``"tools"``). A missing file,
    a missing name or a failing import is a ``ValueError`` (the names the file defines are
    listed); a name that is not callable is a ``TypeError``.
    """
    file, _, name = spec.rpartition(":")
    path = Path(file).expanduser()
    if not path.is_file():
        raise ValueError(f"{what}: file {file!r} (from {spec!r}) does not exist")
    module = import_user_file(path, file, what)
    fn = getattr(module, name, None)
    if fn is None:
        available = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
        )
        raise ValueError(f"{what}: {file!r} has no {name!r} (callables there: {available})")
    if not callable(fn):
        raise TypeError(f"{what}: {name!r} in {file!r} is a {type(fn).__name__}, not callable")
    return fn


def import_user_file(path: Path, file: str, what: str) -> ModuleType:
    """The module of the user file at ``path`` (``file``: as the user wrote it, for messages),
    executed once per process and again only when its modification time changed."""
    resolved = path.resolve()
    module_name = f"otbrl_user_{hashlib.sha256(str(resolved).encode()).hexdigest()[:16]}"
    stamp = resolved.stat().st_mtime_ns
    module = sys.modules.get(module_name)
    if module is not None and getattr(module, "__otbrl_mtime__", None) == stamp:
        return module
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{what}: cannot import {file!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # lets dataclasses/pickling inside the file resolve it
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a file that calls exit() must not end the run silently
        del sys.modules[module_name]
        raise ValueError(f"{what}: importing {file!r} failed: {type(e).__name__}: {e}") from e
    module.__otbrl_mtime__ = stamp
    return module
