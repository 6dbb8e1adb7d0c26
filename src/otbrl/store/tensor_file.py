"""A safetensors file written tensor by tensor: memory stays flat whatever the file's size.

``safetensors.torch.save`` (what ``torch.distributed.checkpoint``'s HF writer calls) builds the
whole file in one in-memory buffer, and a full state dict gathered for ``save_file`` is a second
copy of the model: a checkpoint save then needs as much memory again as the state it writes.
Here the header is written from the tensors' names, dtypes and shapes alone, then each tensor's
bytes go to the file as they come (from an iterator that may gather one tensor at a time), read
straight from the tensor's own storage: the only copy is of one tensor that is not already
contiguous and on the CPU. The file is the format ``safetensors`` reads (``load_file``,
``safe_open``, ``HuggingFaceStorageReader``): 8-byte little-endian header length, JSON header
padded with spaces to 8 bytes, then the tensors' bytes back to back in header order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["TensorSpec", "safetensors_order", "write_safetensors"]

# safetensors' dtype names
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# (name, dtype, shape): what the header needs before any tensor's bytes are known
TensorSpec = tuple[str, torch.dtype, Sequence[int]]


def safetensors_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """``specs`` in the order their bytes go to the file: widest dtype first (stable), so every
    tensor starts at a multiple of its element size, as ``safetensors`` itself lays them out."""
    return sorted(specs, key=lambda spec: -torch.empty((), dtype=spec[1]).element_size())


def write_safetensors(
    path: str | Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``path`` as a safetensors file holding ``tensors``, one tensor in memory at a time.

    ``specs``: the (name, dtype, shape) of every tensor in the order ``tensors`` yields them
    (take it through ``safetensors_order`` for aligned offsets). ``tensors`` is consumed to the
    end; each value must match its spec (a ``ValueError`` naming the tensor otherwise: a missing
    or extra tensor too). ``metadata``: the header's ``__metadata__`` (strings only). The file
    is written in place: write it inside a temp directory that is renamed when complete.
    """
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata: expected a dict of strings")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: safetensors cannot hold dtype {dtype}")
        if name in header:
            raise ValueError(f"{name}: listed twice")
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": [int(n) for n in shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    expected = iter(specs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, value in tensors:
            spec = next(expected, None)
            if spec is None or spec[0] != name:
                want = "no more tensors" if spec is None else repr(spec[0])
                raise ValueError(f"{name}: expected {want} next (the order of specs)")
            if value.dtype != spec[1] or tuple(value.shape) != tuple(spec[2]):
                raise ValueError(
                    f"{name}: got {value.dtype} {list(value.shape)}, the header says "
                    f"{spec[1]} {list(spec[2])}"
                )
            _write_bytes(f, value)
        missing = next(expected, None)
        if missing is not None:
            raise ValueError(f"{missing[0]}: listed in specs but never given")


def _write_bytes(f, value: torch.Tensor) -> None:
    """A tensor's bytes in C order, read from its own storage when it is contiguous on the CPU."""
    if value.numel() == 0:
        return
    value = value.detach()
    if value.device.type != "cpu":
        value = value.cpu()
    f.write(memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy()))
