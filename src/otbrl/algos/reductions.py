"""Shared helpers for ``otbrl.algos``: input checks, group ids, masked statistics, whitening.

Everything here is pure tensor math over ``[B, L]`` tensors (B rows, L response positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

WHITEN_EPS = 1e-8
REDUCE_CHUNK = 1 << 18  # elements per chunk of a full masked reduction (1 MiB of float32)


def check_tensor(name: str, x: Any, shape: torch.Size | tuple[int, ...] | None = None) -> Tensor:
    """Return ``x`` as a float32 tensor after checking it is a tensor of the expected shape.

    Raises ``ValueError`` when ``x`` is None (a required input is missing) or has the wrong
    shape, ``TypeError`` when it is not a tensor. Bool/int masks are converted to float32.
    """
    if x is None:
        raise ValueError(f"{name} is required but was not given (None)")
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.dtype != torch.float32:
        x = x.float()
    return x


def check_batch(token_level_rewards: Any, response_mask: Any) -> tuple[Tensor, Tensor]:
    """Check the two arguments every estimator takes; returns them as float32 ``[B, L]``."""
    r = check_tensor("token_level_rewards", token_level_rewards)
    if r.dim() != 2:
        raise ValueError(f"token_level_rewards must be 2-D [B, L], got shape {tuple(r.shape)}")
    m = check_tensor("response_mask", response_mask, r.shape)
    return r, m


def group_ids(
    index: Any, batch_size: int, device: torch.device | None = None
) -> tuple[Tensor, int]:
    """Dense group ids for a per-row group key.

    Args:
        index: ``[B]`` int tensor, numpy array, or a sequence of hashables (e.g. uid strings).
            Rows that share a value form a group; the values' order does not matter.
        batch_size: B, checked against ``len(index)``.
        device: where to put the result (defaults to the tensor's own device, else CPU).

    Returns:
        ``(gid, num_groups)``: ``gid`` is ``[B]`` int64 in ``[0, num_groups)``.
    """
    if index is None:
        raise ValueError("index is required but was not given (None)")
    if isinstance(index, Tensor):
        if index.dim() != 1 or index.numel() != batch_size:
            raise ValueError(f"index must have shape ({batch_size},), got {tuple(index.shape)}")
        if index.is_floating_point() or index.is_complex():
            raise TypeError(f"index must be an integer tensor, got dtype {index.dtype}")
        uniq, gid = torch.unique(index, return_inverse=True)
        return gid.to(device or index.device, torch.int64), int(uniq.numel())
    if isinstance(index, str) or not isinstance(index, Sequence | np.ndarray):
        raise TypeError(
            "index must be a tensor, numpy array or sequence of hashables, "
            f"got {type(index).__name__}"
        )
    if len(index) != batch_size:
        raise ValueError(f"index must have {batch_size} entries (one per row), got {len(index)}")
    if isinstance(index, np.ndarray) and index.dtype != object and index.ndim == 1:
        uniq, inv = np.unique(index, return_inverse=True)
        return torch.from_numpy(inv.astype(np.int64).reshape(-1)).to(device or "cpu"), len(uniq)
    # Hashable keys (uid strings, tuples...): one dict pass per batch, not per group.
    ids: dict[Any, int] = {}
    try:
        gid_list = [ids.setdefault(key, len(ids)) for key in index]
    except TypeError as err:
        raise TypeError(f"index entries must be hashable group keys: {err}") from None
    return torch.tensor(gid_list, dtype=torch.int64, device=device or "cpu"), len(ids)


def group_sum(x: Tensor, gid: Tensor, num_groups: int) -> Tensor:
    """Per-group sums of ``x`` ``[B, ...]`` over rows -> ``[num_groups, ...]`` (one scatter)."""
    out = x.new_zeros((num_groups, *x.shape[1:]))
    return out.index_add_(0, gid, x)


def _check_same_shape(x: Tensor, mask: Tensor) -> None:
    if x.shape != mask.shape:
        shape, got = tuple(x.shape), tuple(mask.shape)
        raise ValueError(f"mask must have the shape of the values, {shape}, got {got}")


def _chunks(x: Tensor, mask: Tensor):
    """``x`` and ``mask`` flattened and cut into matching chunks: a reduction over them keeps
    its temporaries small (a fresh ``[B, L]`` buffer costs page faults on this hardware) and
    adds with torch's cascaded sums (a float32 dot over millions of tokens drifts by ~1e-4)."""
    return zip(x.reshape(-1).split(REDUCE_CHUNK), mask.reshape(-1).split(REDUCE_CHUNK))


def _select(x: Tensor, mask: Tensor) -> Tensor:
    # mask.bool() is m ≠ 0, several times faster on CPU than the float comparison
    return torch.where(mask.bool(), x * mask, 0.0)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·m over the positions where m ≠ 0, over everything (``dim=None``) or along ``dim``.

    Shapes: ``x``, ``mask`` of equal shape (e.g. ``[B, L]``) -> 0-dim, or ``x``'s shape
    without ``dim``. The mask selects (``torch.where``), it does not only multiply: a NaN or
    inf where m = 0 (padding, an observation token) stays out of the sum and of its gradient.
    Mask entries may be non-negative weights (an entry c stands for c tokens of value x).
    """
    _check_same_shape(x, mask)
    if dim is None:
        return sum(_select(c, m).sum() for c, m in _chunks(x, mask))
    if x.dim() == 2 and dim in (1, -1) and x.shape[0]:  # row sums, a chunk of rows at a time
        rows = max(REDUCE_CHUNK // max(x.shape[1], 1), 1)
        parts = zip(x.split(rows), mask.split(rows))
        return torch.cat([_select(c, m).sum(-1) for c, m in parts])
    return _select(x, mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·m / (Σ m + 1e-8) over the selected positions (:func:`masked_sum`); 0 for an empty
    mask. Shapes as in :func:`masked_sum`."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / (count + WHITEN_EPS)


def _mean_and_var(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    mean = masked_mean(x, mask)
    n = mask.sum()
    squares = sum(_select((c - mean).square(), m).sum() for c, m in _chunks(x, mask))
    # No host sync: fewer than two tokens have no spread to measure, so the variance is 0.
    var = squares / (n - 1).clamp(min=1.0)
    return mean, torch.where(n > 1, var, torch.zeros_like(var))


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased masked variance over all elements, Σ (x − μ)²·m / (Σ m − 1); 0 when Σ m < 2.

    μ = :func:`masked_mean`. Shapes: ``x``, ``mask`` of equal shape -> 0-dim.
    """
    return _mean_and_var(x, mask)[1]


def whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x − μ)/sqrt(σ² + 1e-8) at the selected positions (m ≠ 0), exactly 0 elsewhere.

    μ = :func:`masked_mean`, σ² = :func:`masked_var` (unbiased); ``mask`` may hold non-negative
    counts (an entry c stands for c tokens of value x). With fewer than two masked tokens the
    result is 0 (nothing to whiten against). No gradient (advantages are data).

    Shapes: ``x``, ``mask`` of equal shape (e.g. ``[B, L]``) -> that shape.
    """
    mean, var = _mean_and_var(x, mask)
    scale = torch.where(mask.sum() > 1, torch.rsqrt(var + WHITEN_EPS), torch.zeros_like(var))
    out = torch.sub(x, mean).mul_(scale)
    return out.masked_fill_(mask.bool().logical_not_(), 0.0)
