"""Row-chunked kernels shared by every op in ``otbrl.ops``.

For raw logits x [n, V], a per-row shift m (the row max) and scale = 1/temperature, the kernels
work with the shifted logits s = (x − m)·scale and e = exp(s), so that

    log π(y) = s_y − lse,  lse = log Σe
    H        = lse − mu,   mu  = Σe·s / Σe
    Σπ²      = Σe² / (Σe)²

The shift is subtracted before scaling, so no rounding of m·scale enters s. A chunk of rows is
processed in a scratch buffer reused across chunks: allocating per chunk (and faulting its
pages in) measured slower than the arithmetic. Nothing of size [n, V] is allocated.

The chunks run one after the other in the calling thread; each op over a chunk is parallel
over the chunk's rows through torch's own intra-op threads. A private pool of single-threaded
workers (one per thread, rows split between them) measured slower on a quiet machine: two
Python threads issuing small ops contend for the GIL, and the workers' own OpenMP teams kept
spinning against torch's (2 threads, T=2048, V=32768: 1.1–1.9 × ``torch.log_softmax`` with
the pool against 0.75 × inline, same kernels). The price: on a heavily loaded machine each op's
fork/join barrier waits for descheduled threads (with 14 busy processes on 2 cores a 2-thread
call took over 12 s where the pool took 0.8 s); there, as for any torch code, use one thread.
With at least as many rows per chunk as threads, results are bit-identical for any thread
count (torch gives each row's reductions to one thread, and exp's scalar tail at a split point
rounds like its vector body — exp2's did not).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The Triton kernel works in base 2 (exp2 is the native GPU instruction); the
# eager kernels here use exp, which measured 1.5 × (AVX-512) to 2.5 × (AVX2) faster than exp2
# with torch 2.13 on the development CPU.
LOG2E = 1.0 / math.log(2.0)

# ~128K elements (512 KiB in float32) per intra-op thread and chunk: the logits and the two
# scratch slices a thread touches then stay in its 2 MiB L2; twice that measured 10–17 % slower.
_CHUNK_ELEMENTS_PER_THREAD = 1 << 17


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk: about 2**17 elements per intra-op thread (at least 1 row)."""
    elements = _CHUNK_ELEMENTS_PER_THREAD * max(1, torch.get_num_threads())
    return max(1, elements // max(1, vocab_size))


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
    """Per-row sums of e = exp(s), one pass over x [n, V], ``chunk`` rows at a time.

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
    work = torch.empty(2, min(n, chunk), vocab, dtype=acc, device=x.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        xa, ma, s, e = x[a:b], shift[a:b], work[0, : b - a], work[1, : b - a]
        if own_shift:
            # In the accumulation dtype, so that x − max is not rounded to bf16/fp16.
            ma.copy_(xa.amax(dim=-1, keepdim=True))
        torch.sub(xa, ma, out=s)
        if scale != 1.0:
            s.mul_(scale)
        torch.exp(s, out=e)
        torch.sum(e, dim=-1, out=sums[0, a:b])
        if want_spp:
            # ‖e‖² through the norm kernel: a pure reduction, no product written (~3×
            # faster than mul + sum here); sqrt-then-square costs two roundings.
            torch.linalg.vector_norm(e, dim=-1, out=sums[2, a:b]).square_()
        if want_entropy:
            # s is not needed any more: e·s overwrites it (a third buffer costs L2 room).
            torch.sum(s.mul_(e), dim=-1, out=sums[1, a:b])
    # s at the label, with the same two roundings as in the chunk, for all rows at once.
    torch.sub(x.gather(-1, labels.unsqueeze(-1)), shift, out=sums[3].unsqueeze(-1))
    if scale != 1.0:
        sums[3].mul_(scale)
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
    s = (x[rows].to(dot.dtype) - shift[rows]) * scale
    e = torch.exp(s)
    dot[rows] = torch.where(e > 0, e * s, 0.0).sum(dim=-1)


def finish_stats(
    sums: Tensor, want_entropy: bool, want_spp: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log π(y), H, Σπ², lse, mu), each [n], from ``row_sums``'s [4, n] sums.

    Entropy, Σπ² and mu are empty tensors when not asked for.
    """
    total, dot, sq, s_label = sums
    lse = total.log()
    log_probs = s_label - lse
    entropy = mu = spp = total.new_empty(0)
    if want_entropy:
        mu = dot / total
        entropy = lse - mu
    if want_spp:
        spp = sq / (total * total)
    return log_probs, entropy, spp, lse, mu


def grad_rows(
    x: Tensor,
    labels: Tensor,
    shift: Tensor,
    lse: Tensor,
    mu: Tensor,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    scale: float,
    chunk: int,
    out: Tensor,
    g_label: Tensor | None = None,
) -> Tensor:
    """Gradient w.r.t. x [n, V] of Σ g_lp·log π(y) + Σ g_ent·H, written into ``out`` [n, V].

    With z = x·scale and π = exp(s − lse): ∂log π(y)/∂z = onehot(y) − π and
    ∂H/∂z = −π (s − mu); ∂z/∂x = scale. ``g_lp``/``g_ent`` [n] are the upstream gradients
    (``None``: not used; ``g_lp`` must be 0 on ignored labels); ``g_label`` [n] is what the
    onehot term adds at ``labels`` (default ``g_lp``; the vocab-parallel op zeroes it for
    labels held by another rank). ``out`` may have any float dtype and may be ``x`` itself.
    """
    n, vocab = x.shape
    if n == 0 or vocab == 0:
        return out
    if g_label is None:
        g_label = g_lp
    if g_ent is not None:
        # factor = −g_lp − g_ent·(s − mu) = slope·s + offset, two ops per chunk instead of three.
        slope = -g_ent.unsqueeze(-1)
        offset = (g_ent * mu if g_lp is None else g_ent * mu - g_lp).unsqueeze(-1)
    # π·factor is built in place in ``out`` when it has the accumulation dtype (no copy).
    direct = out.dtype == lse.dtype
    work = torch.empty(1 if direct else 2, min(n, chunk), vocab, dtype=lse.dtype, device=x.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        s = work[0, : b - a]
        p = out[a:b] if direct else work[1, : b - a]
        # s is taken from x before p is written: ``out`` may alias ``x``.
        torch.sub(x[a:b], shift[a:b], out=s)
        if scale != 1.0:
            s.mul_(scale)
        torch.sub(s, lse[a:b].unsqueeze(-1), out=p).exp_()
        if g_ent is not None:
            # π is exactly 0 below s = −1e4 even in float64, so clamping there changes
            # nothing but keeps 0·(−inf) = NaN out.
            p.mul_(s.clamp_(min=-1e4).mul_(slope[a:b]).add_(offset[a:b]))
        else:
            p.mul_(-g_lp[a:b].unsqueeze(-1))
        if g_lp is not None:
            p.scatter_add_(-1, labels[a:b].unsqueeze(-1), g_label[a:b].unsqueeze(-1))
        if scale != 1.0:
            p.mul_(scale)
        if not direct:
            out[a:b].copy_(p)
    return out
