"""Weights as safetensors buckets in a directory the trainer and the vLLM servers both see
(``/dev/shm`` on one machine, a shared file system across hosts): the trainer writes them
(``ServerRollout.sync_weights``), the servers' worker extension (``otbrl.rollout.server_worker``)
streams them back in the order they were written. The bucket format lives here alone.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

BUCKET_GLOB = "bucket-*.safetensors"


def scratch_dir() -> Path:
    """A fresh directory for buckets: in ``/dev/shm`` (memory, no disk write) when it is
    writable, else in the system temp dir."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="otbrl-weights-", dir=root))


def write_buckets(directory: Path, named_tensors: Iterable, bucket_bytes: int) -> None:
    """Replace the buckets of ``directory`` with ``named_tensors`` ((HF name, tensor) pairs),
    ~``bucket_bytes`` a bucket. One bucket is in memory at a time (never a second full copy
    of the model); each file appears whole (written, then renamed)."""
    from safetensors.torch import save_file
    from torch import Tensor

    for old in bucket_files(directory):
        old.unlink()
    bucket: dict[str, Tensor] = {}
    size, index = 0, 0

    def flush():
        nonlocal bucket, size, index
        if bucket:
            path = directory / f"bucket-{index:05d}.safetensors"
            tmp = path.with_suffix(".tmp")
            save_file(bucket, str(tmp))
            tmp.rename(path)
            index += 1
        bucket, size = {}, 0

    for name, tensor in named_tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"named_tensors: {name!r} is a {type(tensor).__name__}")
        bucket[name] = tensor.detach().contiguous().cpu()
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            flush()
    flush()


def bucket_files(directory: str | Path) -> list[Path]:
    """The weight buckets of ``directory`` in the order they were written (by name)."""
    return sorted(Path(directory).glob(BUCKET_GLOB))


def iter_buckets(directory: str | Path):
    """(HF name, tensor) of every bucket of ``directory``, one bucket open at a time."""
    from safetensors import safe_open

    for path in bucket_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)
