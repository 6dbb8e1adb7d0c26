"""Token statistics of an lm_head projection without ever holding the [T, V] logits.

logits = hidden @ weight.T (+ bias) is formed ``chunk_size`` tokens at a time, reduced to the
per-token statistics of ``token_stats`` and dropped. The backward recomputes the logits in
blocks of vocabulary columns [T, block] (as many elements as a forward chunk) from the saved
inputs and the per-row scalars (shift, lse, Σπs), turns each block into its logit gradient
and folds that into the gradients of hidden, weight and bias at once, so memory stays at one
chunk in both directions. The price is one extra matmul (the recompute) compared with keeping
the logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from otbrl.ops.chunked import default_chunk_size, finish_stats, grad_rows, row_sums, stats_dtype
from otbrl.ops.token_stats import (
    IGNORE_INDEX,
    TokenStats,
    check_label_range,
    check_temperature,
    upstream_grads,
)

# ~4M logits per token chunk (16 MiB in float32): big enough for efficient matmuls, small
# enough that the handful of chunk buffers stays a few percent of the full [T, V] logits.
_FUSED_CHUNK_ELEMENTS = 1 << 22


def default_fused_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk of ``fused_linear_token_stats`` (about 2**22 logits, at least 1)."""
    return max(1, _FUSED_CHUNK_ELEMENTS // max(1, vocab_size))


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)


class _FusedLinearTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, scale, want_entropy, want_spp, chunk):
        n, vocab = hidden.shape[0], weight.shape[0]
        ignored = labels == IGNORE_INDEX
        safe_labels = labels.masked_fill(ignored, 0)
        sums = torch.empty(4, n, dtype=stats_dtype(hidden.dtype), device=hidden.device)
        shift = torch.empty(n, 1, dtype=sums.dtype, device=hidden.device)
        inner = default_chunk_size(vocab)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            logits = _chunk_logits(hidden[a:b], weight, bias)
            _, shift[a:b] = row_sums(
                logits,
                safe_labels[a:b],
                scale,
                want_entropy=want_entropy,
                want_spp=want_spp,
                chunk=inner,
                out=sums[:, a:b],
            )
        lp, ent, spp, lse, mu = finish_stats(sums, want_entropy, want_spp)
        lp.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe_labels, ignored, shift, lse, mu)
        ctx.scale, ctx.chunk, ctx.inner = scale, chunk, inner
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(spp)
        return lp, ent, spp

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_spp):
        hidden, weight, bias, safe_labels, ignored, shift, lse, mu = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_lp, g_ent = upstream_grads(g_lp, g_ent, ignored, lse.dtype)
        (n, hidden_size), vocab = hidden.shape, weight.shape[0]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        if (g_lp is None and g_ent is None) or n == 0:
            return grad_h, grad_w, grad_b, None, None, None, None, None
        # Backward walks the vocabulary, not the tokens: with the per-row shift, lse and Σπs
        # known, any [T, V] block's gradient stands alone, so each weight-gradient block is
        # one full-K matmul written once (walking tokens re-reads and re-writes all of [V, H]
        # per chunk). The block holds as many logits as a forward chunk.
        block = max(1, min(vocab, ctx.chunk * vocab // n))
        # The hidden gradient sums over vocabulary blocks: in float32 for low-precision inputs.
        acc_h = grad_h
        if need_h and hidden.dtype != lse.dtype:
            acc_h = torch.zeros(n, hidden_size, dtype=lse.dtype, device=hidden.device)
        for v0 in range(0, vocab, block):
            v1 = min(v0 + block, vocab)
            logits = _chunk_logits(hidden, weight[v0:v1], None if bias is None else bias[v0:v1])
            local = safe_labels - v0
            here = (local >= 0) & (local < v1 - v0)
            # The logit gradient overwrites the recomputed logits' own buffer.
            dz = grad_rows(
                logits,
                local.masked_fill(~here, 0),
                shift,
                lse,
                mu,
                g_lp,
                g_ent,
                ctx.scale,
                default_chunk_size(v1 - v0),
                out=logits,
                g_label=None if g_lp is None else g_lp.masked_fill(~here, 0.0),
            )
            if need_w:
                torch.mm(dz.T, hidden, out=grad_w[v0:v1])
            if need_h and acc_h is grad_h:
                acc_h.addmm_(dz, weight[v0:v1])
            elif need_h:
                # the block's product in the inputs' dtype (bf16 matmuls run ~4x faster than
                # fp32 ones on a CPU with bf16 units, and on tensor cores), summed in float32
                acc_h += torch.mm(dz, weight[v0:v1])
            if need_b:
                grad_b[v0:v1] = dz.sum(dim=0, dtype=lse.dtype)
        if need_h and acc_h is not grad_h:
            grad_h.copy_(acc_h)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def fused_linear_token_stats(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = True,
    sum_pi_squared: bool = True,
    chunk_size: int | None = None,
) -> TokenStats:
    """``token_stats(hidden @ weight.T + bias, labels)`` without materializing the logits.

    Args:
        hidden: [T, H] float32/float64/bfloat16/float16 final hidden states.
        weight: [V, H] same dtype, the ``nn.Linear`` / HF ``lm_head.weight`` layout.
        labels: [T] int64 ids in [0, V), or −100 for "no label".
        bias: optional [V].
        temperature, entropy, sum_pi_squared: as in ``token_stats``.
        chunk_size: tokens per chunk (default about 2**22 / V); results do not depend on it.
    Returns:
        ``TokenStats`` of [T] fields (float32; float64 for float64 inputs). ``log_probs`` and
        ``entropy`` are differentiable w.r.t. hidden, weight and bias.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if hidden.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise TypeError(f"hidden: expected float32/float64/bfloat16/float16, got {hidden.dtype}")
    if hidden.dim() != 2:
        raise ValueError(
            f"hidden: expected shape [T, H], got {tuple(hidden.shape)} (flatten a batch's tokens: "
            "hidden.flatten(0, -2), labels.flatten())"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(
            f"weight: expected shape [V, H={hidden.shape[1]}] with V >= 1, "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} (hidden's), got {weight.dtype}")
    if bias is not None and (
        not isinstance(bias, Tensor)
        or tuple(bias.shape) != (weight.shape[0],)
        or bias.dtype != hidden.dtype
    ):
        got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"bias: expected a [{weight.shape[0]}] {hidden.dtype} tensor, got {got}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected an int64 tensor, got {labels.dtype}")
    if tuple(labels.shape) != (hidden.shape[0],):
        raise ValueError(f"labels: expected shape ({hidden.shape[0]},), got {tuple(labels.shape)}")
    scale = 1.0 / check_temperature(temperature)
    vocab = weight.shape[0]
    if chunk_size is None:
        chunk_size = default_fused_chunk_size(vocab)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
    check_label_range(labels, vocab)
    lp, ent, spp = _FusedLinearTokenStats.apply(
        hidden,
        weight,
        bias,
        labels.long(),
        scale,
        bool(entropy),
        bool(sum_pi_squared),
        chunk_size,
    )
    return TokenStats(lp, ent if entropy else None, spp if sum_pi_squared else None)
