"""Triton kernels of ``token_stats`` for GPUs: one program per row, one pass over V.

The forward keeps a running max m and the sums Σe, Σe·s, Σe² relative to it (s = (x − m)·
scale·log2 e, e = 2**s), rescaling them when a block raises the max:
δ = (m_old − m_new)·scale·log2 e, Σe ← 2**δ Σe, Σe·s ← 2**δ (Σe·s + δ Σe), Σe² ← 4**δ Σe².
So the logits are read once and three numbers (plus the shift, lse and Σπs for the backward)
are written per row. The backward reads each row once more and writes its gradient.

Used by ``token_stats`` only for CUDA tensors when triton is importable; the same kernels run
on CPU tensors under ``TRITON_INTERPRET=1`` (NumPy semantics), which is how the tests check
them. Same contract and policies as ``token_stats``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from otbrl.ops.chunked import LOG2E

_BLOCK = 1024


@triton.jit
def _forward_kernel(
    x_ptr, x_stride, label_ptr, out_ptr, n_rows, n_cols, scale2, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * x_stride
    m = -float("inf")
    total = 0.0
    dot = 0.0
    sq = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        # Rescale the running sums to the new max; an empty sum stays 0 (δ may be −inf).
        delta = (m - new_m) * scale2
        factor = tl.exp2(delta)
        dot = tl.where(total > 0, (dot + delta * total) * factor, 0.0)
        sq = sq * factor * factor
        total = total * factor
        s = (x - new_m) * scale2
        e = tl.exp2(s)
        total += tl.sum(e, axis=0)
        dot += tl.sum(tl.where(e > 0, e * s, 0.0), axis=0)
        sq += tl.sum(e * e, axis=0)
        m = new_m
    label = tl.load(label_ptr + row)
    s_y = (tl.load(base + label).to(tl.float32) - m) * scale2
    lse2 = tl.log2(total)
    mu2 = dot / total
    tl.store(out_ptr + row, (s_y - lse2) * 0.6931471805599453)
    tl.store(out_ptr + n_rows + row, (lse2 - mu2) * 0.6931471805599453)
    tl.store(out_ptr + 2 * n_rows + row, sq / (total * total))
    tl.store(out_ptr + 3 * n_rows + row, m)
    tl.store(out_ptr + 4 * n_rows + row, lse2)
    tl.store(out_ptr + 5 * n_rows + row, mu2)


@triton.jit
def _backward_kernel(
    x_ptr,
    x_stride,
    grad_ptr,
    label_ptr,
    saved_ptr,
    g_lp_ptr,
    g_ent_ptr,
    n_rows,
    n_cols,
    scale,
    scale2,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * x_stride
    out = grad_ptr + row.to(tl.int64) * n_cols
    m = tl.load(saved_ptr + row)
    lse2 = tl.load(saved_ptr + n_rows + row)
    mu2 = tl.load(saved_ptr + 2 * n_rows + row)
    g_lp = tl.load(g_lp_ptr + row)
    g_ent = tl.load(g_ent_ptr + row)
    label = tl.load(label_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x - m) * scale2
        p = tl.exp2(s - lse2)
        # −1e4 clamp: π is exactly 0 there, and it keeps 0·(−inf) = NaN out of masked logits.
        factor = -g_lp - g_ent * 0.6931471805599453 * (tl.maximum(s, -1e4) - mu2)
        grad = p * factor + tl.where(cols == label, g_lp, 0.0)
        tl.store(out + cols, (grad * scale).to(grad_ptr.dtype.element_ty), mask=mask)


class _TritonTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignored, scale):
        n, vocab = logits.shape
        out = torch.empty(6, n, dtype=torch.float32, device=logits.device)
        if n > 0:
            _forward_kernel[(n,)](
                logits, logits.stride(0), labels, out, n, vocab, scale * LOG2E, BLOCK=_BLOCK
            )
        lp, ent, spp = out[0].masked_fill(ignored, 0.0), out[1], out[2]
        ctx.save_for_backward(logits, labels, ignored, out[3:].contiguous())
        ctx.scale = scale
        ctx.mark_non_differentiable(spp)
        return lp, ent, spp

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_spp):
        logits, labels, ignored, saved = ctx.saved_tensors
        n, vocab = logits.shape
        g_lp = g_lp.float().masked_fill(ignored, 0.0).contiguous()
        g_ent = g_ent.float().contiguous()
        grad = torch.empty(n, vocab, dtype=logits.dtype, device=logits.device)
        if n > 0:
            _backward_kernel[(n,)](
                logits,
                logits.stride(0),
                grad,
                labels,
                saved,
                g_lp,
                g_ent,
                n,
                vocab,
                ctx.scale,
                ctx.scale * LOG2E,
                BLOCK=_BLOCK,
            )
        return grad, None, None, None


def triton_token_stats(
    logits: Tensor, labels: Tensor, ignored: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Kernel entry behind ``token_stats``: logits [n, V] (fp32/bf16/fp16, unit stride in V),
    labels [n] int64 in [0, V) (ignored ones replaced by 0), ignored [n] bool, scale = 1/T.

    Returns (log_probs, entropy, sum_pi_squared), each [n] float32; inputs are validated by
    the caller. Float64 is not supported (the kernels accumulate in float32).
    """
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits: expected float32/bfloat16/float16, got {logits.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _TritonTokenStats.apply(logits, labels.contiguous(), ignored, scale)
