"""File manifests: the size and SHA-256 of every file under a folder, and their verification.

A checkpoint's ``checkpoint.json`` carries the manifest of every other file of the checkpoint
and is written last, so a directory whose files all match it is complete and unmodified. A
bit flipped by a disk, a file truncated by a full disk or a killed copy, a file replaced or
added by hand: each is found before anything is loaded, and the error names the file.
No torch here: reading a manifest is cheap for tools.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

_CHUNK = 1 << 20


class IntegrityError(ValueError):
    """A folder's files do not match its manifest; ``str(err)`` names the folder and file."""


def sha256_file(path: str | Path) -> str:
    """The hex SHA-256 of a file's bytes (read in 1 MiB chunks: memory stays flat)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path, exclude: Iterable[str]) -> dict[str, Path]:
    """Relative POSIX path -> path of every entry under ``root`` except ``exclude``;
    folders are walked, anything that is not a folder is listed (so a symlink is caught)."""
    skip = set(exclude)
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for name in list(dirnames):
            if (base / name).is_symlink():  # os.walk would not descend; list it as a file
                dirnames.remove(name)
                filenames.append(name)
        for name in filenames:
            rel = (base / name).relative_to(root).as_posix()
            if rel not in skip:
                found[rel] = base / name
    return dict(sorted(found.items()))


def file_manifest(root: str | Path, *, exclude: Iterable[str] = ()) -> dict[str, dict]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file under ``root``
    (sorted by path), leaving out the relative paths in ``exclude``."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"root: expected a directory, got {root}")
    manifest = {}
    for rel, path in _files(root, exclude).items():
        if path.is_symlink() or not path.is_file():
            raise ValueError(f"root: {path} is not a regular file; a manifest lists files only")
        manifest[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return manifest


def verify_manifest(
    root: str | Path, manifest: Mapping[str, Mapping], *, exclude: Iterable[str] = ()
) -> None:
    """Check that the files under ``root`` are exactly ``manifest``'s, with its sizes and
    SHA-256 digests; raises ``IntegrityError`` naming the first file that differs (missing,
    another size, other bytes, or not listed). Sizes are checked before any hashing, so a
    truncated file is reported without reading the rest."""
    root = Path(root)
    if not isinstance(manifest, Mapping) or not manifest:
        raise IntegrityError(f"{root}: the manifest lists no files")
    present = _files(root, exclude)
    for rel in manifest:
        if rel not in present:
            raise IntegrityError(f"{root}: file '{rel}' is missing (the manifest lists it)")
    for rel, path in present.items():
        if rel not in manifest:
            raise IntegrityError(f"{root}: file '{rel}' is not in the manifest (added later?)")
        if path.is_symlink() or not path.is_file():
            raise IntegrityError(f"{root}: '{rel}' is not a regular file")
    for rel, entry in manifest.items():
        size = present[rel].stat().st_size
        if size != entry.get("size"):
            raise IntegrityError(
                f"{root}: file '{rel}' has {size} bytes, the manifest says {entry.get('size')} "
                "(truncated or replaced)"
            )
    for rel, entry in manifest.items():
        if sha256_file(present[rel]) != entry.get("sha256"):
            raise IntegrityError(
                f"{root}: file '{rel}' does not match its SHA-256 in the manifest (corrupted)"
            )
