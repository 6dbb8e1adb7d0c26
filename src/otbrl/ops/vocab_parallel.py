"""Token statistics of logits sharded over the vocabulary across a process group.

Each rank holds the columns [vocab_start, vocab_start + V_local) of the logits (the output of
a column-parallel lm_head left sharded). One chunked pass over the shard computes the partial
sums with the shard's own row max, then the forward makes exactly two collectives:

1. all-reduce MAX of the local row max → the global shift m;
2. all-reduce SUM of the local partials rescaled to m (s = (z − m)/T):
   [Σ e, Σ e·s, Σ e², s_y (0 off-shard), 1{y on this shard}] per row, stacked with this
   rank's V_local (so every rank learns the global V and can check the labels).

From the global sums every rank derives the same log π(y) = s_y − log Σe, entropy
log Σe − Σe·s/Σe and Σπ² = Σe²/(Σe)² (``finish_stats``). Shards may be uneven (or empty).

The backward needs no collective: for the local columns, ∂log π(y)/∂z = onehot_local − π_local
and ∂H/∂z = −π_local (s − Σπ s), where Σπ s and log Σe are the global values already kept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from otbrl.ops.chunked import default_chunk_size, finish_stats, grad_rows, row_sums, stats_dtype
from otbrl.ops.token_stats import (
    IGNORE_INDEX,
    TokenStats,
    check_logits_labels,
    check_temperature,
    upstream_grads,
)


class _VocabParallelTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, labels, vocab_start, group, scale, want_entropy, want_spp):
        n, local_vocab = x.shape
        acc = stats_dtype(x.dtype)
        ignored = labels == IGNORE_INDEX
        local = labels - vocab_start
        on_shard = (local >= 0) & (local < local_vocab) & ~ignored
        local = local.masked_fill(~on_shard, 0)

        # One pass over the shard with its own row max; rescaled below to the global one.
        parts = torch.empty(5 * n + 1, dtype=acc, device=x.device)
        rows = parts[: 5 * n].view(5, n)
        chunk = default_chunk_size(local_vocab)
        _, local_shift = row_sums(
            x,
            local,
            scale,
            want_entropy=want_entropy,
            want_spp=want_spp,
            chunk=chunk,
            out=rows[:4],
        )
        shift = local_shift.clone()
        # Collective 1 of 2. Called through the module so that tests can count it.
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)

        # With δ = (m_local − m)·scale ≤ 0, s_global = s_local + δ, so
        # Σe ← e**δ Σe, Σe·s ← e**δ (Σe·s + δ Σe), Σe² ← e**2δ Σe², s_y ← s_y + δ.
        delta = ((local_shift - shift) * scale).squeeze(-1)
        factor = torch.exp(delta)
        total, dot, sq, s_y = rows[:4]
        has_mass = total > 0  # else δ may be −inf and δ·Σe = NaN for an empty sum
        if want_entropy:
            dot.copy_(torch.where(has_mass, (dot + delta * total) * factor, 0.0))
        sq.mul_(factor * factor)
        total.mul_(factor)
        s_y.add_(delta).masked_fill_(~on_shard, 0.0)
        rows[4] = on_shard.to(acc)
        parts[-1] = local_vocab
        # Collective 2 of 2: [Σe, Σe·s, Σe², s_y, 1{y here}] per row and V_local, stacked.
        dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=group)

        vocab = int(parts[-1])
        hits = rows[4]
        bad = (hits != 1) & ~ignored
        if bool(bad.any()):
            # Every rank sees the same sums, so every rank raises: no rank is left waiting.
            value = int(labels[bad][0])
            raise ValueError(
                f"labels: expected global ids in [0, {vocab}) or {IGNORE_INDEX} (ignored), got "
                f"{value} (held by {int(hits[bad][0])} ranks; shards must tile the vocabulary)"
            )
        log_probs, entropy, spp, lse, mu = finish_stats(rows[:4], want_entropy, want_spp)
        log_probs.masked_fill_(ignored, 0.0)

        ctx.save_for_backward(x, local, on_shard, ignored, shift, lse, mu)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(spp)
        return log_probs, entropy, spp

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_spp):
        x, local, on_shard, ignored, shift, lse, mu = ctx.saved_tensors
        g_lp, g_ent = upstream_grads(g_lp, g_ent, ignored, lse.dtype)
        none = (None,) * 6
        if g_lp is None and g_ent is None:
            return torch.zeros_like(x), *none
        g_label = None if g_lp is None else g_lp.masked_fill(~on_shard, 0.0)
        grad = torch.empty_like(x)
        grad_rows(
            x, local, shift, lse, mu, g_lp, g_ent, ctx.scale, ctx.chunk, grad, g_label=g_label
        )
        return grad, *none


def vocab_parallel_token_stats(
    local_logits: Tensor,
    labels: Tensor,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    entropy: bool = True,
    sum_pi_squared: bool = True,
) -> TokenStats:
    """``token_stats`` of logits whose vocabulary is sharded over ``group``.

    Args:
        local_logits: [..., V_local] this rank's columns [vocab_start, vocab_start + V_local)
            of the full [..., V] logits; V_local may differ between ranks (even be 0).
        labels: [...] global token ids (the same on every rank), or −100 for "no label".
            A label on another rank's shard is normal; one outside [0, V) raises ValueError
            on every rank.
        vocab_start: first global vocabulary id of this shard.
        group: process group over which the vocabulary is sharded (default: the world).
        temperature, entropy, sum_pi_squared: as in ``token_stats``.
    Returns:
        ``TokenStats`` with fields [...] (float32; float64 for float64 logits), identical on
        every rank. ``log_probs`` and ``entropy`` are differentiable w.r.t. ``local_logits``.

    Makes exactly two all-reduce calls in the forward and none in the backward.
    """
    if not isinstance(local_logits, Tensor):
        raise TypeError(f"local_logits: expected a torch.Tensor, got {type(local_logits).__name__}")
    # An empty shard is legal (more ranks than a tiny vocabulary needs).
    check_logits_labels(local_logits, labels, name="local_logits", min_vocab=0)
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start: expected a non-negative int, got {vocab_start!r}")
    scale = 1.0 / check_temperature(temperature)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_token_stats needs an initialized torch.distributed")
    batch_shape = local_logits.shape[:-1]
    flat = local_logits.reshape(labels.numel(), local_logits.shape[-1])
    lp, ent, spp = _VocabParallelTokenStats.apply(
        flat,
        labels.reshape(-1).long(),
        vocab_start,
        group,
        scale,
        bool(entropy),
        bool(sum_pi_squared),
    )
    return TokenStats(
        lp.reshape(batch_shape),
        ent.reshape(batch_shape) if entropy else None,
        spp.reshape(batch_shape) if sum_pi_squared else None,
    )
