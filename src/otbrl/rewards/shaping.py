"""Reward shaping on top of the scored rewards (tensor math, no I/O)."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(
    lengths: Tensor, *, max_length: int, buffer_len: int, penalty: float
) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per response: 0 up to
    ``max_length - buffer_len`` tokens, then falling linearly to ``-penalty`` at
    ``max_length``::

        p(L) = min(0, ((max_length - buffer_len) - L) / buffer_len * penalty)

    ``lengths``: [B] response lengths in tokens (a truncated response has ``max_length``).
    Returns [B] float32 penalties (<= 0) to add to the rewards.
    """
    if not 0 < buffer_len <= max_length:
        raise ValueError(
            f"buffer_len: expected 0 < buffer_len <= max_length ({max_length}), got {buffer_len}"
        )
    if lengths.ndim != 1:
        raise ValueError(f"lengths: expected [B], got shape {tuple(lengths.shape)}")
    expected = max_length - buffer_len
    shaped = (expected - lengths.to(torch.float32)) / buffer_len * penalty
    return torch.clamp(shaped, max=0.0)
