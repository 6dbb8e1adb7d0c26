"""Padded [B, L] ↔ packed ("remove padding") layout.

A packed batch keeps only the valid entries of a padded one, row after row, as [nnz, ...];
``cu_seqlens`` [B+1] (int32) marks where each row starts, the layout varlen attention kernels
take. ``indices`` are the flat positions b·L + t of the kept entries, so ``unpack`` can put
values (for instance per-token statistics computed packed) back in their padded place.

A row's valid entries need not be contiguous in the padded row (a left-padded prompt followed
by a right-padded response is fine): they are kept in order and packed next to each other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Packed(NamedTuple):
    """Valid entries of a padded batch.

    values: [nnz, ...] the kept entries of x, row-major order.
    indices: [nnz] int64 flat indices into B·L.
    cu_seqlens: [B+1] int32 cumulative row lengths, starting at 0.
    max_seqlen: the longest row's number of valid entries.
    """

    values: Tensor
    indices: Tensor
    cu_seqlens: Tensor
    max_seqlen: int


def _check_mask(attention_mask: Tensor) -> Tensor:
    if not isinstance(attention_mask, Tensor):
        raise TypeError(
            f"attention_mask: expected a torch.Tensor, got {type(attention_mask).__name__}"
        )
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask: expected shape [B, L], got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    if attention_mask.dtype != torch.bool and bool(
        ((attention_mask != 0) & (attention_mask != 1)).any()
    ):
        raise ValueError("attention_mask: expected only 0/1 (or bool) values, got other values")
    return mask


def pack(x: Tensor, attention_mask: Tensor) -> Packed:
    """Keep the entries of ``x`` where ``attention_mask`` is set.

    Args:
        x: [B, L, ...] any dtype; differentiable (gradients flow back to the kept entries).
        attention_mask: [B, L] bool or 0/1 integer/float.
    Returns:
        ``Packed`` with values [nnz, ...], indices [nnz], cu_seqlens [B+1], max_seqlen.
    """
    mask = _check_mask(attention_mask)
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2 or tuple(x.shape[:2]) != tuple(mask.shape):
        raise ValueError(
            f"x: expected shape [B, L, ...] with [B, L] = {tuple(mask.shape)} "
            f"(attention_mask.shape), got {tuple(x.shape)}"
        )
    batch, seq_len = mask.shape
    indices = mask.reshape(-1).nonzero().squeeze(-1)
    values = x.reshape(batch * seq_len, *x.shape[2:]).index_select(0, indices)
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(lengths, dim=0, out=cu_seqlens[1:])
    max_seqlen = int(lengths.max()) if batch > 0 else 0
    return Packed(values, indices, cu_seqlens, max_seqlen)


def unpack(
    values: Tensor, indices: Tensor, batch_size: int, seq_len: int, fill: float = 0.0
) -> Tensor:
    """Scatter packed ``values`` [nnz, ...] back to a padded [batch_size, seq_len, ...] tensor.

    Positions not listed in ``indices`` [nnz] (int64 flat indices into batch_size·seq_len) hold
    ``fill``. Differentiable w.r.t. ``values``.
    """
    if not isinstance(values, Tensor) or not isinstance(indices, Tensor):
        raise TypeError("values, indices: expected torch.Tensors")
    if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"indices: expected a 1-D int64 tensor, got shape {tuple(indices.shape)} "
            f"dtype {indices.dtype}"
        )
    if values.dim() < 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(
            f"values: expected shape [nnz={indices.shape[0]}, ...], got {tuple(values.shape)}"
        )
    for name, n in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {n!r}")
    total = batch_size * seq_len
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= total):
        raise ValueError(
            f"indices: expected values in [0, {total}) (batch_size·seq_len), got "
            f"[{int(indices.min())}, {int(indices.max())}]"
        )
    out = values.new_full((total, *values.shape[1:]), fill)
    out = out.index_copy(0, indices.long(), values)
    return out.reshape(batch_size, seq_len, *values.shape[1:])


def packed_position_ids(cu_seqlens: Tensor) -> Tensor:
    """Position of each packed entry inside its own row: [B+1] cu_seqlens → [nnz] int64."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens: expected a 1-D tensor [B+1] starting at 0")
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens: expected non-decreasing from 0, got {cu.tolist()}")
    nnz = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=nnz)
    return torch.arange(nnz, device=cu.device) - starts
