"""Row-chunked kernels shared by every op in ``otbrl.ops``.

For raw logits x [n, V], a per-row shift m (the row max) and scale = 1/temperature, the kernels
work with the base-2 shifted logits s = (x − m)·scale·log2(e) and e = 2**s, so that

    log π(y) = (s_y − lse2)·ln 2,  lse2 = log2 Σe
    H        = (lse2 − mu2)·ln 2,  mu2 = Σe·s / Σe
    Σπ²      = Σe² / (Σe)²

Base 2 because ``torch.exp2`` runs ~2.5× faster than ``torch.exp`` on this CPU (AVX2; exp is
the bottleneck); x − m is exact, so the change of base costs one rounding. A chunk of rows is
processed in a scratch buffer reused across chunks: allocating per chunk (and faulting its
pages in) measured slower than the arithmetic. Nothing of size [n, V] is allocated.

The chunks run one after the other in the calling thread; each op over a chunk is parallel
over the chunk's rows through torch's own intra-op threads. A private pool of single-threaded
workers (one per thread, rows split between them) measured slower on a quiet machine: two
Python threads issuing small ops contend for the GIL, and the workers' own OpenMP teams kept
spinning against torch's (2 threads, T=2048, V=32768: 1.1–1.3 × ``torch.log_softmax`` with
the pool against 0.75 × inline, same kernels). The price: on a heavily loaded machine each op's
fork/join barrier waits for descheduled threads (with 14 busy processes on 2 cores a 2-thread
call took over 12 s where the pool took 0.8 s); there, as for any torch code, use one thread.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

# ~256K elements per chunk (1 MiB in float32): the chunk's scratch stays in L2/L3, which is what
# lets the single pass beat torch.log_softmax's full-size write.
_CHUNK_ELEMENTS = 1 << 18


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so that one chunk holds about 2**18 elements (at least 1 row)."""
    return max(1, _CHUNK_ELEMENTS // max(1, vocab_size))


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation/output dtype for logits of ``dtype``: float64 stays, the rest use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_sums(
    x: Tensor,
    labels: Tensor,
    scale: float,
    *,
    want_entropy: bool,
    want_spp: bool,
    chunk: int,
    shift: Tensor | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-row sums of e = 2**s, one pass over x [n, V], ``chunk`` rows at a time.

    Args:
        x: [n, V] raw logits, any float dtype; not modified. V may be 0.
        labels: [n] int64 column of x whose s to report (in [0, V) when V > 0).
        shift: [n, 1] shift m in the accumulation dtype; default: the row max of x.
        out: optional [4, n] accumulation-dtype buffer for the result.
    Returns:
        (sums [4, n] = Σe, Σe·s, Σe², s_label (rows 1/2 left 0 when not asked for),
         shift [n, 1]).
    """
    n, vocab = x.shape
    acc = stats_dtype(x.dtype)
    sums = torch.zeros(4, n, dtype=acc, device=x.device) if out is None else out.zero_()
    own_shift = shift is None
    if own_shift:
        shift = torch.full((n, 1), float("-inf"), dtype=acc, device=x.device)
    if n == 0 or vocab == 0:
        return sums, shift

    work = torch.empty(3, min(n, chunk), vocab, dtype=acc, device=x.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        s, e, prod = work[0, : b - a], work[1, : b - a], work[2, : b - a]
        if own_shift:
            # In the accumulation dtype, so that x − max is not rounded to bf16/fp16.
            shift[a:b] = x[a:b].amax(dim=-1, keepdim=True)
        torch.sub(x[a:b], shift[a:b], out=s)
        s.mul_(scale * LOG2E)
        torch.exp2(s, out=e)
        torch.sum(e, dim=-1, out=sums[0, a:b])
        if want_entropy:
            torch.sum(torch.mul(e, s, out=prod), dim=-1, out=sums[1, a:b])
        if want_spp:
            # ‖e‖² through the norm kernel: a pure reduction, no product written (~3×
            # faster than mul + sum here); sqrt-then-square costs two roundings.
            torch.linalg.vector_norm(e, dim=-1, out=sums[2, a:b]).square_()
        sums[3, a:b] = s.gather(-1, labels[a:b].unsqueeze(-1)).squeeze(-1)

    if want_entropy:
        _fix_masked_dots(x, shift, scale, sums[1])
    return sums, shift


def _fix_masked_dots(x: Tensor, shift: Tensor, scale: float, dot: Tensor) -> None:
    # A −inf logit makes e·s = 0·(−inf) = NaN. Rows with a finite shift but a NaN dot are
    # exactly those (a NaN or +inf logit makes the shift non-finite): sum them again with the
    # zeros kept. Rare, so done row by row after the main pass, with one host sync per call.
    broken = dot.isnan() & shift.squeeze(-1).isfinite()
    if not bool(broken.any()):
        return
    rows = broken.nonzero().squeeze(-1)
    s = (x[rows].to(dot.dtype) - shift[rows]) * (scale * LOG2E)
    e = torch.exp2(s)
    dot[rows] = torch.where(e > 0, e * s, 0.0).sum(dim=-1)


def finish_stats(
    sums: Tensor, want_entropy: bool, want_spp: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log π(y), H, Σπ², lse2, mu2), each [n], from ``row_sums``'s [4, n] sums.

    Entropy, Σπ² and mu2 are empty tensors when not asked for.
    """
    total, dot, sq, s_label = sums
    lse2 = total.log2()
    log_probs = (s_label - lse2) * LN2
    entropy = mu2 = spp = total.new_empty(0)
    if want_entropy:
        mu2 = dot / total
        entropy = (lse2 - mu2) * LN2
    if want_spp:
        spp = sq / (total * total)
    return log_probs, entropy, spp, lse2, mu2


def grad_rows(
    x: Tensor,
    labels: Tensor,
    shift: Tensor,
    lse2: Tensor,
    mu2: Tensor,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    scale: float,
    chunk: int,
    out: Tensor,
    g_label: Tensor | None = None,
) -> Tensor:
    """Gradient w.r.t. x [n, V] of Σ g_lp·log π(y) + Σ g_ent·H, written into ``out`` [n, V].

    With z = x·scale and π = 2**(s − lse2): ∂log π(y)/∂z = onehot(y) − π and
    ∂H/∂z = −π (s − mu2)·ln 2; ∂z/∂x = scale. ``g_lp``/``g_ent`` [n] are the upstream
    gradients (``None``: not used; ``g_lp`` must be 0 on ignored labels); ``g_label`` [n] is
    what the onehot term adds at ``labels`` (default ``g_lp``; the vocab-parallel op zeroes it
    for labels held by another rank). ``out`` may have any float dtype.
    """
    n, vocab = x.shape
    if n == 0 or vocab == 0:
        return out
    if g_label is None:
        g_label = g_lp

    work = torch.empty(2, min(n, chunk), vocab, dtype=lse2.dtype, device=x.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        s, p = work[0, : b - a], work[1, : b - a]
        torch.sub(x[a:b], shift[a:b], out=s)
        s.mul_(scale * LOG2E)
        torch.sub(s, lse2[a:b].unsqueeze(-1), out=p).exp2_()
        if g_ent is not None:
            # factor = −g_lp − g_ent·ln2·(s − mu2). π is exactly 0 below s = −1e4 even in
            # float64, so clamping there changes nothing but keeps 0·(−inf) = NaN out.
            s.clamp_(min=-1e4).sub_(mu2[a:b].unsqueeze(-1))
            s.mul_(g_ent[a:b].unsqueeze(-1) * -LN2)
            if g_lp is not None:
                s.sub_(g_lp[a:b].unsqueeze(-1))
            p.mul_(s)
        else:
            p.mul_(-g_lp[a:b].unsqueeze(-1))
        if g_lp is not None:
            p.scatter_add_(-1, labels[a:b].unsqueeze(-1), g_label[a:b].unsqueeze(-1))
        torch.mul(p, scale, out=out[a:b])

    return out
