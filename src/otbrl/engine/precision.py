"""Numeric precision of a model: what its weights are stored in, what its forward computes in.

Three settings, named as PyTorch Lightning names them (``model.precision``):

| name         | weights + AdamW state | forward / backward | gradient reduction |
|--------------|-----------------------|--------------------|--------------------|
| ``32-true``    | float32               | float32            | float32            |
| ``bf16-mixed`` | float32 (master)      | bfloat16           | float32            |
| ``bf16-true``  | bfloat16              | bfloat16           | bfloat16           |

``bf16-mixed`` on one process (and under tensor parallelism without FSDP) runs the forward
under ``torch.autocast`` (matmuls in bf16 from the fp32 weights, norms and softmax in fp32);
under FSDP2 the ``MixedPrecisionPolicy`` all-gathers the shards as bf16 and reduce-scatters the
gradients in fp32, so the communication is bf16 too. Either way the optimizer steps fp32
weights with fp32 moments, and the token statistics (log-prob, entropy, Σπ²) are accumulated in
fp32 from the bf16 logits by ``otbrl.ops`` in every layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from otbrl.errors import ConfigError
from otbrl.settings import PRECISIONS


@dataclass(frozen=True)
class Precision:
    """One ``model.precision`` setting.

    Attributes:
        name: ``"32-true"`` | ``"bf16-mixed"`` | ``"bf16-true"``.
        storage: dtype of the trained weights and of the optimizer state.
        compute: dtype the forward and backward compute in.
    """

    name: str
    storage: torch.dtype
    compute: torch.dtype

    @property
    def mixed(self) -> bool:
        """Weights kept in a wider dtype than the compute (master weights)."""
        return self.storage != self.compute

    @property
    def storage_name(self) -> str:
        """``storage`` as the string ``otbrl.models`` loaders take (``"float32"``...)."""
        return str(self.storage).removeprefix("torch.")

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's policy: bf16 all-gather and compute, fp32 gradient reduce-scatter (mixed);
        the parameters' own dtype otherwise."""
        if self.mixed:
            return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def autocast(self, device: torch.device | str, *, enabled: bool = True):
        """The context a forward of an unsharded (or TP-only) mixed model runs in; a null
        context for ``32-true``, ``bf16-true`` or ``enabled=False`` (FSDP2 casts instead)."""
        if not (self.mixed and enabled):
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute)


_TABLE = {
    "32-true": Precision("32-true", torch.float32, torch.float32),
    "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.bfloat16),
    "bf16-true": Precision("bf16-true", torch.bfloat16, torch.bfloat16),
}


def get_precision(name: str) -> Precision:
    """The ``Precision`` of ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in _TABLE:
        raise ValueError(f"precision: expected one of {list(PRECISIONS)}, got {name!r}")
    return _TABLE[name]


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bf16 matmuls in hardware (CUDA compute capability ≥ 8.0,
    or a CPU with AVX512-BF16 / AMX). Elsewhere torch emulates them: measured on an AVX2-only
    EPYC, a 1024×2048 @ 2048×2048 bf16 matmul ran ~200× slower than in fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True


def check_precision_device(
    precision: str, device: torch.device | str, key: str = "model.precision"
) -> str | None:
    """Refuse a bf16 precision on a device that cannot compute bf16; return a note to print at
    start when it can but only by emulation (a CPU without bf16 instructions), else None.

    Raises ``ConfigError`` naming ``key``, the setting ``precision`` came from (a CUDA device
    before Ampere).
    """
    p = get_precision(precision)
    if p.compute != torch.bfloat16:
        return None
    device = torch.device(device)
    if device.type == "cuda" and not (
        torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "CUDA"
        raise ConfigError(
            f"'{key}' {precision}: {name} cannot compute in bfloat16 (compute "
            f"capability 8.0 or newer needed); use {key}=32-true",
            key,
        )
    if not native_bf16(device):
        return (
            f"{key}={precision}: this {device.type.upper()} has no bf16 instructions "
            "(torch emulates them, far slower than float32); 32-true is faster here"
        )
    return None
