"""Ulysses sequence parallel for packed sequences.

A packed batch [1, nnz] (sequences concatenated, `cu_seqlens` marking their starts) is padded
to a multiple of the SP size and cut into equal slices, one per rank of the SP group. Every
per-token layer (embedding, norms, MLP, lm_head, the statistics) runs on the local slice.
Around attention, one all-to-all trades "all heads, my tokens" for "my heads, all tokens"
(q, k and v in one message), attention runs over the full packed sequence with a
block-diagonal causal mask, and a second all-to-all trades back. The per-token statistics
are all-gathered and unpadded, so every rank of the group holds the single-process result.

    apply_ulysses(model, sp_group)                        # once, after building the model
    ids, pos, pad = slice_for_rank(input_ids, position_ids, sp_group)
    out = model(input_ids=ids, position_ids=pos, **packed_forward_kwargs(cu_seqlens, sp))
    log_probs = gather_and_unpad(local_log_probs, sp_group, pad)

Padding tokens form their own sequence at the end, so no real token attends to them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "otbrl_ulysses"


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; it is its own inverse, so backward is the same op."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: Tensor, group) -> Tensor:
    x = x.contiguous()
    # empty_like would copy a permuted stride order; the collective writes row-major memory.
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, group=group)
    return out


class _GatherSlices(torch.autograd.Function):
    """All-gather equal slices along dim 0; backward keeps this rank's slice of the gradient.

    The gathered tensor is treated as replicated over the group: every rank must compute the
    same function of it (they do: identical inputs, identical code), so the gradient of the
    group's common loss with respect to this rank's slice is just that slice of the gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.rank = dist.get_rank(group)
        ctx.n = x.shape[0]
        ctx.size = dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(ctx.size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n].contiguous(), None


def _seq_to_heads(x: Tensor, sp: int, group) -> Tensor:
    """[B, H, n, D] (all heads, local tokens) -> [B, H/sp, sp*n, D] (local heads, all tokens)."""
    b, h, n, d = x.shape
    x = x.reshape(b, sp, h // sp, n, d).permute(1, 0, 2, 3, 4)  # [sp (dest), B, H/sp, n, D]
    x = _AllToAll.apply(x.contiguous(), group)  # dim 0 is now the source rank = sequence slice
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * n, d)


def _heads_to_seq(x: Tensor, sp: int, group) -> Tensor:
    """[B, H/sp, sp*n, D] (local heads, all tokens) -> [B, H, n, D] (all heads, local tokens)."""
    b, hl, s, d = x.shape
    n = s // sp
    x = x.reshape(b, hl, sp, n, d).permute(2, 0, 1, 3, 4)  # [sp (dest = slice), B, H/sp, n, D]
    x = _AllToAll.apply(x.contiguous(), group)  # dim 0 is now the source rank = head block
    return x.permute(1, 0, 2, 3, 4).reshape(b, sp * hl, n, d)


def block_causal_mask(cu_seqlens: Tensor, total: int) -> Tensor:
    """Boolean [total, total] mask: token i may attend to j iff same sequence and j <= i."""
    seq_id = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    seq_id[cu_seqlens[1:-1].long()] = 1
    seq_id = seq_id.cumsum(0)
    pos = torch.arange(total, device=cu_seqlens.device)
    return (seq_id[:, None] == seq_id[None, :]) & (pos[None, :] <= pos[:, None])


def _ulysses_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """HF attention interface: q/k/v [B, H*, n_local, D] -> output [B, n_local, H, D]."""
    group = module._otbrl_sp_group
    sp = dist.get_world_size(group)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        raise ValueError(
            "cu_seq_lens_q: Ulysses attention needs the packed layout; pass packed_forward_kwargs()"
        )
    h, hkv = query.shape[1], key.shape[1]
    if hkv % sp:
        # Too few KV heads to split: replicate them up to the query heads first.
        key = key.repeat_interleave(h // hkv, dim=1)
        value = value.repeat_interleave(h // hkv, dim=1)
        hkv = h
    # One message for q, k and v: concatenate per destination rank along the head dim.
    b, _, n, d = query.shape
    qkv = torch.cat(
        [t.reshape(b, sp, t.shape[1] // sp, n, d) for t in (query, key, value)], dim=2
    ).reshape(b, -1, n, d)
    qkv = _seq_to_heads(qkv, sp, group)
    hq, hk = h // sp, hkv // sp
    q, k, v = qkv.split([hq, hk, hk], dim=1)
    mask = block_causal_mask(cu_seqlens, q.shape[2])
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=hq != hk
    )
    out = _heads_to_seq(out, sp, group)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _ulysses_attention)


def apply_ulysses(model: nn.Module, sp_group) -> nn.Module:
    """Switch `model`'s attention to Ulysses over `sp_group` (in place); returns the model.

    Needs num_attention_heads divisible by the SP size (KV heads are replicated up when they
    do not divide). From then on the model must be called on packed slices with
    `packed_forward_kwargs`. An SP group of size 1 is valid (plain packed attention).
    """
    sp = dist.get_world_size(sp_group)
    heads = model.config.num_attention_heads
    if heads % sp:
        raise ValueError(
            "model.config.num_attention_heads: expected a multiple of the SP size "
            f"{sp}, got {heads}"
        )
    for module in model.modules():
        if hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            module._otbrl_sp_group = sp_group
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def padded_length(nnz: int, sp: int) -> int:
    """nnz rounded up to a multiple of the SP size."""
    return -(-nnz // sp) * sp


def packed_forward_kwargs(cu_seqlens: Tensor, sp: int) -> dict:
    """Extra model kwargs carrying the padded packed layout to the attention function.

    `cu_seqlens` [B+1] int32 of the unpadded packed batch; the pad (if any) is appended as
    one more sequence so it attends only to itself.
    """
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: expected a 1-D tensor [B+1], got shape {tuple(cu_seqlens.shape)}"
        )
    nnz = int(cu_seqlens[-1])
    total = padded_length(nnz, sp)
    cu = cu_seqlens.to(torch.int32)
    if total > nnz:
        cu = torch.cat([cu, cu.new_tensor([total])])
    max_len = int((cu[1:] - cu[:-1]).max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


def slice_for_rank(input_ids: Tensor, position_ids: Tensor, sp_group) -> tuple[Tensor, Tensor, int]:
    """Pad packed [1, nnz] ids/positions to a multiple of the SP size and keep this rank's slice.

    Returns (ids [1, n_local], positions [1, n_local], pad). Pad positions restart at 0, so
    they look like one more short sequence to anything reading positions.
    """
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids: expected a packed [1, nnz] tensor, got shape {tuple(input_ids.shape)}"
        )
    if position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids: expected shape {tuple(input_ids.shape)} like input_ids, "
            f"got {tuple(position_ids.shape)}"
        )
    sp = dist.get_world_size(sp_group)
    rank = dist.get_rank(sp_group)
    nnz = input_ids.shape[1]
    pad = padded_length(nnz, sp) - nnz
    if pad:
        input_ids = F.pad(input_ids, (0, pad), value=0)
        position_ids = torch.cat(
            [position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1
        )
    n = input_ids.shape[1] // sp
    return input_ids[:, rank * n : (rank + 1) * n], position_ids[:, rank * n : (rank + 1) * n], pad


def gather_and_unpad(local: Tensor, sp_group, pad: int) -> Tensor:
    """All-gather per-token values [n_local, ...] over the SP group and drop the pad: [nnz, ...].

    Differentiable: every rank of the group must then compute the same loss from the result.
    """
    if pad < 0 or pad >= max(local.shape[0] * dist.get_world_size(sp_group), 1):
        raise ValueError(f"pad: expected 0 <= pad < padded length, got {pad}")
    full = _GatherSlices.apply(local, sp_group)
    return full[: full.shape[0] - pad]
