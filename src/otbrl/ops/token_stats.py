"""Per-token statistics of a softmax policy in one chunked pass: log π(y), entropy and Σπ².

For logits z (already divided by the temperature) of one token and its label y:

    lse      = log Σ_v exp(z_v)
    log π(y) = z_y − lse
    H        = lse − Σ_v π_v z_v
    Σπ²      = Σ_v exp(2 (z_v − lse))

All three come from the same max-shifted exponentials e = exp(z − max z) (computed in base 2,
see ``shifted``), so one pass over a cache-sized chunk of rows yields them, accumulated in
float32 (float64 for float64 logits). Nothing of size [T, V] is ever written: the backward
recomputes each chunk from the logits and the per-row scalars (lse and Σπ(z − max)) kept
from the forward.

Policies (documented here once, shared by every op in ``otbrl.ops``):

- Labels equal to ``IGNORE_INDEX`` (−100, the Hugging Face convention) mean "no label": their
  log-prob is 0 and carries no gradient; entropy and Σπ² are still computed for that row.
  Any other label outside [0, V) raises ``ValueError``.
- A row with a NaN or +inf logit, or with every logit −inf (no distribution), gives NaN in all
  three statistics of that row only; other rows are unaffected. −inf entries in a row that also
  has finite logits are a masked vocabulary and are handled exactly (probability 0).
- Outputs are float32 for float32/bfloat16/float16 logits and float64 for float64 logits (so
  float64 references and ``gradcheck`` are exact); gradients have the logits' dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

IGNORE_INDEX = -100
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

# ~1M elements per chunk (4 MiB in float32): the e/s work buffers of one chunk stay in L2/L3,
# which is what lets the single pass beat torch.log_softmax's full-size write.
_CHUNK_ELEMENTS = 1 << 20


class TokenStats(NamedTuple):
    """Per-token statistics; each field has shape ``logits.shape[:-1]``.

    ``log_probs`` and ``entropy`` are differentiable w.r.t. the logits; ``sum_pi_squared`` is a
    statistic without gradient. A field that was not asked for is ``None``.
    """

    log_probs: Tensor
    entropy: Tensor | None
    sum_pi_squared: Tensor | None


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so that one chunk holds about 2**20 elements (at least 1 row)."""
    return max(1, _CHUNK_ELEMENTS // max(1, vocab_size))


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation/output dtype for logits of ``dtype``: float64 stays, the rest use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_temperature(temperature: float) -> float:
    """Validate ``temperature`` (a positive finite number) and return it as a float."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature}")
    return float(temperature)


def check_logits_labels(
    logits: Tensor, labels: Tensor, name: str = "logits", min_vocab: int = 1
) -> None:
    """Type and shape checks shared by the ops: ``logits`` [..., V] float, ``labels`` [...] int."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels: expected a torch.Tensor, got {type(labels).__name__}")
    if logits.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: expected float32/float64/bfloat16/float16, got {logits.dtype}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected an int64 tensor, got {labels.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < min_vocab:
        raise ValueError(
            f"{name}: expected shape [..., V] with V >= {min_vocab}, got {tuple(logits.shape)}"
        )
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels: expected shape {tuple(logits.shape[:-1])} ({name}.shape[:-1]), "
            f"got {tuple(labels.shape)}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels: expected device {logits.device}, got {labels.device}")


def check_label_range(labels: Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` if a label is outside [0, vocab_size) and is not ``IGNORE_INDEX``."""
    bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)
    if bool(bad.any()):
        value = int(labels[bad].flatten()[0])
        raise ValueError(
            f"labels: expected ids in [0, {vocab_size}) or {IGNORE_INDEX} (ignored), got {value}"
        )


def row_max(x: Tensor) -> Tensor:
    """Max over the last dim of x [n, V] as [n, 1] in the accumulation dtype (−inf if V = 0).

    Kept in float32 so that x − max is not rounded back to bf16/fp16.
    """
    acc = stats_dtype(x.dtype)
    if x.shape[-1] == 0:
        return torch.full((x.shape[0], 1), float("-inf"), dtype=acc, device=x.device)
    return x.amax(dim=-1, keepdim=True).to(acc)


def shifted(x: Tensor, m: Tensor, scale: float) -> Tensor:
    """s = (x − m)·scale·log2(e) in a fresh accumulation-dtype buffer: x [n, V], m [n, 1].

    Base 2 because ``torch.exp2`` runs ~2.5× faster than ``torch.exp`` on CPU (measured,
    AVX2), and exp is the bottleneck; x − m is exact, so the extra product costs one rounding.
    """
    s = torch.empty(x.shape, dtype=stats_dtype(x.dtype), device=x.device)
    torch.sub(x, m, out=s)
    s.mul_(scale * LOG2E)
    return s


def shifted_sums(
    s: Tensor, m: Tensor, want_entropy: bool, want_spp: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Row sums of e = 2**s: (Σe, Σe·s or None, Σe² or None), each [n].

    ``m`` [n, 1] is the shift s was made with; rows where it is finite but Σe·s is NaN hold
    −inf logits (0·(−inf)), and only those rows are summed again with the zeros kept exact.
    """
    e = torch.exp2(s)
    total = e.sum(dim=-1)
    dot = sq = None
    if want_entropy:
        dot = torch.linalg.vecdot(e, s)
        broken = dot.isnan() & m.squeeze(-1).isfinite()
        if bool(broken.any()):
            rows = broken.nonzero().squeeze(-1)
            er, sr = e[rows], s[rows]
            dot[rows] = torch.where(er > 0, er * sr, 0.0).sum(dim=-1)
    if want_spp:
        sq = torch.linalg.vecdot(e, e)
    return total, dot, sq


def chunk_forward(
    x: Tensor, labels: Tensor, scale: float, want_entropy: bool, want_spp: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Statistics of one chunk of rows.

    Args:
        x: [n, V] raw logits (any float dtype), not modified.
        labels: [n] int64 in [0, V) (ignored labels already replaced by 0).
        scale: 1 / temperature.
    Returns:
        (log_probs, entropy, sum_pi_squared, lse2, mu2), each [n] in ``stats_dtype(x.dtype)``;
        for the base-2 shifted s = (x − max x)·scale·log2(e), ``lse2`` = log2 Σ 2**s and
        ``mu2`` = Σ π s. Entropy/Σπ² are empty when not asked for; ``mu2`` without entropy.
    """
    m = row_max(x)
    s = shifted(x, m, scale)
    total, dot, sq = shifted_sums(s, m, want_entropy, want_spp)
    return finish_stats(total, dot, sq, s.gather(-1, labels.unsqueeze(-1)).squeeze(-1))


def finish_stats(
    total: Tensor, dot: Tensor | None, sq: Tensor | None, s_y: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log π(y), H, Σπ², lse2, mu2) from the base-2 row sums Σe, Σe·s, Σe² and s_y, all [n]."""
    lse2 = total.log2()
    log_probs = (s_y - lse2) * LN2
    entropy = mu2 = spp = total.new_empty(0)
    if dot is not None:
        mu2 = dot / total
        entropy = (lse2 - mu2) * LN2
    if sq is not None:
        spp = sq / (total * total)
    return log_probs, entropy, spp, lse2, mu2


def chunk_grad_logits(
    x: Tensor,
    labels: Tensor,
    lse2: Tensor,
    mu2: Tensor | None,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    scale: float,
    m: Tensor | None = None,
    g_label: Tensor | None = None,
) -> Tensor:
    """Gradient w.r.t. the raw logits x [n, V] of Σ g_lp·log π(y) + Σ g_ent·H for one chunk.

    With z = x·scale, s its base-2 shift and π = 2**(s − lse2):
    ∂log π(y)/∂z = onehot(y) − π and ∂H/∂z = −π (s − Σπ s)·ln 2; ∂z/∂x = scale.
    ``m`` [n, 1] is the shift (default: the row max of x); ``g_label`` [n] is what the onehot
    term adds at ``labels`` (default ``g_lp``; the vocab-parallel op zeroes it for labels held
    by another rank). Returns [n, V] in ``stats_dtype(x.dtype)``.
    """
    s = shifted(x, row_max(x) if m is None else m, scale)
    p = torch.exp2(s - lse2.unsqueeze(-1))
    if g_ent is not None:
        # factor = −g_lp − g_ent·ln2·(s − mu2). π underflows to exactly 0 below s = −1e4 even
        # in float64, so clamping there changes nothing but keeps 0·(−inf) = NaN out.
        s.clamp_(min=-1e4)
        s.sub_(mu2.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1) * -LN2)
        if g_lp is not None:
            s.sub_(g_lp.unsqueeze(-1))
        grad = p.mul_(s)
    else:
        grad = p.mul_(-g_lp.unsqueeze(-1))
    if g_lp is not None and x.shape[-1] > 0:
        g_label = g_lp if g_label is None else g_label
        grad.scatter_add_(-1, labels.unsqueeze(-1), g_label.unsqueeze(-1))
    if scale != 1.0:
        grad.mul_(scale)
    return grad


def rows_forward(
    x: Tensor, safe_labels: Tensor, scale: float, want_entropy: bool, want_spp: bool, chunk: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``chunk_forward`` over all rows of x [n, V], ``chunk`` rows at a time; outputs [n] each."""
    n = x.shape[0]
    acc = stats_dtype(x.dtype)
    outs = [
        torch.empty(n if want else 0, dtype=acc, device=x.device)
        for want in (True, want_entropy, want_spp, True, want_entropy)
    ]
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        for out, part in zip(
            outs, chunk_forward(x[a:b], safe_labels[a:b], scale, want_entropy, want_spp)
        ):
            if out.numel():
                out[a:b] = part
    return tuple(outs)


def rows_grad(
    x: Tensor,
    safe_labels: Tensor,
    lse: Tensor,
    mu: Tensor,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    scale: float,
    chunk: int,
    out: Tensor,
) -> Tensor:
    """``chunk_grad_logits`` over all rows of x [n, V], written into ``out`` [n, V] (any dtype).

    ``g_lp`` must already be 0 on ignored labels; a ``None`` gradient is skipped.
    """
    for a in range(0, x.shape[0], chunk):
        b = min(a + chunk, x.shape[0])
        out[a:b] = chunk_grad_logits(
            x[a:b],
            safe_labels[a:b],
            lse[a:b],
            None if g_ent is None else mu[a:b],
            None if g_lp is None else g_lp[a:b],
            None if g_ent is None else g_ent[a:b],
            scale,
        )
    return out


def upstream_grads(
    g_lp: Tensor | None, g_ent: Tensor | None, ignored: Tensor, acc: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """Output gradients in the accumulation dtype; ignored labels get no log-prob gradient."""
    if g_lp is not None:
        g_lp = g_lp.to(acc).masked_fill(ignored, 0.0)
    if g_ent is not None:
        g_ent = g_ent.to(acc) if g_ent.numel() else None
    return g_lp, g_ent


class _TokenStatsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, scale, want_entropy, want_spp, chunk):
        ignored = labels == IGNORE_INDEX
        safe_labels = labels.masked_fill(ignored, 0)
        lp, ent, spp, lse, mu = rows_forward(
            logits, safe_labels, scale, want_entropy, want_spp, chunk
        )
        lp.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(logits, safe_labels, ignored, lse, mu)
        ctx.scale, ctx.chunk = scale, chunk
        # Unused outputs then arrive as None in backward instead of zero tensors to multiply.
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(spp)
        return lp, ent, spp

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_spp):
        logits, safe_labels, ignored, lse, mu = ctx.saved_tensors
        g_lp, g_ent = upstream_grads(g_lp, g_ent, ignored, lse.dtype)
        if g_lp is None and g_ent is None:
            return torch.zeros_like(logits), None, None, None, None, None
        grad = torch.empty_like(logits)
        rows_grad(logits, safe_labels, lse, mu, g_lp, g_ent, ctx.scale, ctx.chunk, grad)
        return grad, None, None, None, None, None


def token_stats(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = True,
    sum_pi_squared: bool = True,
    chunk_size: int | None = None,
) -> TokenStats:
    """log π(y), entropy and Σπ² of softmax(logits / temperature), in one chunked pass.

    Args:
        logits: [..., V] float32/float64/bfloat16/float16; never modified.
        labels: [...] int64 token ids in [0, V), or −100 for "no label" (log-prob 0).
        temperature: positive; statistics are those of softmax(logits / temperature).
        entropy, sum_pi_squared: compute these fields (else they are ``None``).
        chunk_size: rows per chunk (default: about 2**20 elements per chunk); results do not
            depend on it.
    Returns:
        ``TokenStats`` with fields of shape ``logits.shape[:-1]``, float32 (float64 for float64
        logits). ``log_probs`` and ``entropy`` are differentiable w.r.t. ``logits``.
    """
    check_logits_labels(logits, labels)
    scale = 1.0 / check_temperature(temperature)
    vocab = logits.shape[-1]
    if chunk_size is None:
        chunk_size = default_chunk_size(vocab)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
    check_label_range(labels, vocab)
    batch_shape = logits.shape[:-1]
    flat = logits.reshape(-1, vocab)
    lp, ent, spp = _TokenStatsFunction.apply(
        flat, labels.reshape(-1).long(), scale, bool(entropy), bool(sum_pi_squared), chunk_size
    )
    return TokenStats(
        lp.reshape(batch_shape),
        ent.reshape(batch_shape) if entropy else None,
        spp.reshape(batch_shape) if sum_pi_squared else None,
    )


def sum_pi_squared(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Σ_v π_v² of softmax(logits / temperature): [..., V] → [...] float32, no gradient.

    Lies in [1/V, 1]. With y ~ π, E‖∇_z log π(y)‖² = 1 − Σπ², the per-token weight the
    Optimal Token Baseline is built on.
    """
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    labels = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    with torch.no_grad():
        stats = token_stats(logits, labels, temperature=temperature, entropy=False)
    return stats.sum_pi_squared
