"""Memory as numbers: what a model's weights and its optimizer state take in this process, and
the peak memory since the last reset (the trainer's ``memory/*`` metrics).

GB here is 10⁹ bytes. Under FSDP2 / TP a parameter and its optimizer state are sharded: the
figures are this process's shards, what its device holds. The peak is the device's:

- CUDA: ``torch.cuda.max_memory_allocated`` (tensors PyTorch allocated; its caching allocator
  reserves somewhat more), reset with ``torch.cuda.reset_peak_memory_stats``.
- CPU: the process's peak resident set size. On Linux that is ``VmHWM`` of
  ``/proc/self/status``, reset by writing ``5`` to ``/proc/self/clear_refs``; where that file
  cannot be written (another OS, a locked-down container) the reset does nothing and the peak
  is the high-water mark since the process started (``VmHWM``, or ``ru_maxrss`` off Linux).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["optimizer_gb", "params_gb", "peak_memory_gb", "reset_peak_memory", "tensors_gb"]

GB = 1e9
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def tensors_gb(tensors: Iterable[torch.Tensor]) -> float:
    """GB the distinct storages of ``tensors`` take in this process (a DTensor counts its local
    shard; tensors sharing storage, such as tied weights, count once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total / GB


def params_gb(model: torch.nn.Module) -> float:
    """GB of ``model``'s parameters (trainable or frozen) in this process."""
    return tensors_gb(model.parameters())


def optimizer_gb(optimizer: torch.optim.Optimizer | None) -> float:
    """GB of ``optimizer``'s state tensors in this process (AdamW: its moments and step
    counters; 0 before the first step has created them, or without an optimizer)."""
    if optimizer is None:
        return 0.0
    return tensors_gb(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def state_memory(engines: Iterable) -> dict[str, float]:
    """``memory/params_gb`` (every model of ``engines``, a model two engines share counted
    once) and ``memory/optimizer_gb`` (the trainable ones' optimizer state), this process's
    shards under FSDP2 / TP."""
    engines = list(engines)
    return {
        "memory/params_gb": tensors_gb(p for e in engines for p in e.model.parameters()),
        "memory/optimizer_gb": sum(optimizer_gb(getattr(e, "optimizer", None)) for e in engines),
    }


def _status_kb(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``), or None off Linux."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_memory(device: torch.device | str = "cpu") -> None:
    """Start a new peak: ``peak_memory_gb(device)`` then reports the peak since this call
    (CPU: where ``/proc/self/clear_refs`` cannot be written, this does nothing)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def peak_memory_gb(device: torch.device | str = "cpu") -> float:
    """GB at the peak since the last ``reset_peak_memory(device)``: CUDA the most memory
    tensors held (``max_memory_allocated``), CPU the process's peak resident set size."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB
    kb = _status_kb("VmHWM")
    if kb is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kb = peak // 1024 if sys.platform == "darwin" else peak  # macOS reports bytes
    return kb * 1024 / GB
