"""Where a response's scalar reward lands in the ``[B, Lr]`` token rewards."""

from __future__ import annotations

import torch
from torch import Tensor


def place_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Token-level scores ``[B, Lr]`` float32: each row's scalar score on its last trained token
    (the last position with ``response_mask`` 1, whatever holes come before it), 0 elsewhere;
    a row with no trained token gets no reward.

    ``scores``: ``[B]``; ``response_mask``: ``[B, Lr]``.
    """
    if scores.ndim != 1 or response_mask.ndim != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores, response_mask: expected [B] and [B, Lr], got {tuple(scores.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    trained = response_mask > 0
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = torch.where(trained, positions, 0).amax(dim=1) - 1  # -1: nothing trained
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    rows = (last >= 0).nonzero(as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows].to(torch.float32)
    return out
