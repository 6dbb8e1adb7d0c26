"""Opt-in ``torch.compile`` path of ``token_stats``.

Inductor fuses the row max, the exponentials and the three row sums into one loop nest that
writes three numbers per row, and the backward into one elementwise kernel. The first call per
shape pays the compile (seconds to tens of seconds on CPU), so nothing in otbrl calls this by
default; call ``compiled_token_stats`` where the same shapes repeat (a training loop).
Same contract, results and policies as ``token_stats``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from otbrl.ops.chunked import LN2, LOG2E, stats_dtype
from otbrl.ops.token_stats import (
    IGNORE_INDEX,
    TokenStats,
    check_label_range,
    check_logits_labels,
    check_temperature,
    upstream_grads,
)


def _shifted(x: Tensor, scale: float) -> Tensor:
    # Base-2 shifted logits (the compiled kernel keeps base 2; the eager kernels in
    # otbrl.ops.chunked use exp, which measured faster in eager torch on this CPU).
    acc = stats_dtype(x.dtype)
    return (x.to(acc) - x.amax(-1, keepdim=True).to(acc)) * (scale * LOG2E)


def _dense_forward(x: Tensor, labels: Tensor, scale: float):
    # x [n, V] raw logits; labels [n] in [0, V). Same identities as otbrl.ops.chunked.
    s = _shifted(x, scale)
    e = torch.exp2(s)
    total = e.sum(-1)
    lse2 = torch.log2(total)
    # e > 0 guard: a −inf logit must add 0, not 0·(−inf).
    mu2 = torch.where(e > 0, e * s, 0.0).sum(-1) / total
    spp = (e * e).sum(-1) / (total * total)
    log_probs = (s.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse2) * LN2
    return log_probs, (lse2 - mu2) * LN2, spp, lse2, mu2


def _dense_backward(x, labels, lse2, mu2, g_lp, g_ent, scale: float):
    s = _shifted(x, scale)
    p = torch.exp2(s - lse2.unsqueeze(-1))
    factor = -g_lp.unsqueeze(-1) - (g_ent * LN2).unsqueeze(-1) * (
        s.clamp(min=-1e4) - mu2.unsqueeze(-1)
    )
    onehot = torch.arange(x.shape[-1], device=x.device) == labels.unsqueeze(-1)
    grad = (p * factor + torch.where(onehot, g_lp.unsqueeze(-1), 0.0)) * scale
    return grad.to(x.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=None)


class _CompiledTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, scale):
        ignored = labels == IGNORE_INDEX
        safe = labels.masked_fill(ignored, 0)
        lp, ent, spp, lse, mu = _compiled(_dense_forward)(logits, safe, scale)
        lp = lp.masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, safe, ignored, lse, mu)
        ctx.scale = scale
        ctx.mark_non_differentiable(spp)
        return lp, ent, spp

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_spp):
        logits, safe, ignored, lse, mu = ctx.saved_tensors
        g_lp, g_ent = upstream_grads(g_lp, g_ent, ignored, lse.dtype)
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent
        grad = _compiled(_dense_backward)(logits, safe, lse, mu, g_lp, g_ent, ctx.scale)
        return grad, None, None


def compiled_token_stats(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = True,
    sum_pi_squared: bool = True,
) -> TokenStats:
    """``token_stats`` through ``torch.compile``: [..., V] logits, [...] labels → TokenStats.

    All three statistics are always computed (fusion makes the extra sums nearly free); the
    flags only choose which fields are returned (others are ``None``).
    """
    check_logits_labels(logits, labels)
    scale = 1.0 / check_temperature(temperature)
    vocab = logits.shape[-1]
    check_label_range(labels, vocab)
    shape = logits.shape[:-1]
    lp, ent, spp = _CompiledTokenStats.apply(
        logits.reshape(labels.numel(), vocab), labels.reshape(-1).long(), scale
    )
    return TokenStats(
        lp.reshape(shape),
        ent.reshape(shape) if entropy else None,
        spp.reshape(shape) if sum_pi_squared else None,
    )
