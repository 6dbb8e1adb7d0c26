"""Helpers for tests that tamper with checkpoints the way a disk, a copy or an attacker would."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from otbrl.store.integrity import file_manifest


class Payload:
    """Unpickling this runs ``touch <marker>``: proof that a file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_pickle(target: Path, marker: Path) -> None:
    """Write a pickle to ``target`` that creates ``marker`` if anything ever unpickles it."""
    with open(target, "wb") as f:
        pickle.dump(Payload(marker), f, protocol=2)


def reseal(ckpt: Path) -> None:
    """Rewrite ``checkpoint.json``'s file list to match the directory as it is now: what an
    attacker who can write the checkpoint would do so that verification passes."""
    marker = ckpt / "checkpoint.json"
    meta = json.loads(marker.read_text())
    meta["files"] = file_manifest(ckpt, exclude={"checkpoint.json"})
    marker.write_text(json.dumps(meta))


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte of a file in place (the middle one by default): same size, other bytes."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut a file to a fraction of its size, as a full disk or a killed copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
