"""The tensor work of ``OTBGRPOTrainer`` that does not touch TRL: per-token rewards, group ids,
and the gather of per-rank ``[b, T_rank]`` tensors into one ``[N, T_max]`` batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def token_level_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Each row's scalar reward on its last trained token, 0 elsewhere.

    Shapes: ``rewards`` ``[N]``, ``response_mask`` ``[N, T]`` -> ``[N, T]`` float32. A row with
    no trained token gets no reward (it has no token to credit). NaN rewards must be replaced
    by the caller.
    """
    if rewards.dim() != 1 or response_mask.dim() != 2 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"rewards [N] and response_mask [N, T] expected, got {tuple(rewards.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    N, T = response_mask.shape
    positions = torch.arange(T, device=response_mask.device).expand(N, T)
    last = torch.where(response_mask > 0, positions, -1).amax(-1)
    out = torch.zeros(N, T, dtype=torch.float32, device=response_mask.device)
    rows = (last >= 0).nonzero()[:, 0]
    out[rows, last[rows]] = rewards[rows].to(out.dtype)
    return out


def group_index(num_rows: int, num_generations: int, alone: Tensor | None = None) -> Tensor:
    """Group id of each row of TRL's gathered batch, ``[N]`` int64.

    TRL's sampler puts the ``num_generations`` completions of a prompt on consecutive rows of
    the gathered batch (a group may straddle ranks). ``alone`` (``[N]`` bool) rows get a group
    of their own: TRL's unscorable completions, kept out of every other row's baseline.
    """
    if num_generations < 1 or num_rows % num_generations:
        raise ValueError(
            f"num_generations: expected a divisor of the gathered batch size {num_rows}, "
            f"got {num_generations}"
        )
    index = torch.arange(num_rows) // num_generations
    if alone is not None:
        index = torch.where(alone.cpu(), num_rows + torch.arange(num_rows), index)
    return index


def gather_padded(
    tensors: list[Tensor],
    pad_across: Callable[[Tensor], Tensor],
    gather: Callable[[Tensor], Tensor],
) -> list[Tensor]:
    """Per-rank ``[b, T_rank]`` tensors -> the gathered ``[N, T_max]`` ones, N = b × ranks.

    ``pad_across(x)`` right-pads dim 2 of ``x`` ``[b, k, T_rank]`` with zeros to the longest
    T over ranks (accelerate's ``pad_across_processes``); ``gather`` concatenates dim 0 over
    ranks in rank order. All k tensors travel in one collective. Zero padding is right for
    every field: it sits where the response mask is 0.
    """
    stacked = torch.stack([t.float() for t in tensors], dim=1)  # [b, k, T]
    gathered = gather(pad_across(stacked.contiguous()))
    return list(gathered.unbind(1))
