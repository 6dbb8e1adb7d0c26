"""Per-token statistics of a softmax policy in one chunked pass: log π(y), entropy and Σπ².

For logits z (already divided by the temperature) of one token and its label y::

    lse      = log Σ_v exp(z_v)
    log π(y) = z_y − lse
    H        = lse − Σ_v π_v z_v
    Σπ²      = Σ_v exp(2 (z_v − lse))

All three come from the same max-shifted exponentials e = exp(z − max z) (see
``otbrl.ops.chunked``), so one pass over a cache-sized chunk of rows yields them, accumulated in
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

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from otbrl.ops.chunked import default_chunk_size, finish_stats, grad_rows, row_sums

IGNORE_INDEX = -100


class TokenStats(NamedTuple):
    """Per-token statistics; each field has shape ``logits.shape[:-1]``.

    ``log_probs`` and ``entropy`` are differentiable w.r.t. the logits; ``sum_pi_squared`` is a
    statistic without gradient. A field that was not asked for is ``None``.
    """

    log_probs: Tensor
    entropy: Tensor | None
    sum_pi_squared: Tensor | None


# The forward outputs an engine can be asked for, by head: a policy's token statistics (the
# fields above) and a value head's values. The one table the engine's layout, the loss registry
# and the run's statistic sources read.
HEAD_OUTPUTS = {"policy": frozenset(TokenStats._fields), "value": frozenset({"values"})}
NO_GRADIENT = frozenset({"sum_pi_squared"})  # outputs a loss cannot differentiate through


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
        sums, shift = row_sums(
            logits, safe_labels, scale, want_entropy=want_entropy, want_spp=want_spp, chunk=chunk
        )
        lp, ent, spp, lse, mu = finish_stats(sums, want_entropy, want_spp)
        lp.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(logits, safe_labels, ignored, shift, lse, mu)
        ctx.scale, ctx.chunk = scale, chunk
        # Unused outputs then arrive as None in backward instead of zero tensors to multiply.
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(spp)
        return lp, ent, spp

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_spp):
        logits, safe_labels, ignored, shift, lse, mu = ctx.saved_tensors
        g_lp, g_ent = upstream_grads(g_lp, g_ent, ignored, lse.dtype)
        if g_lp is None and g_ent is None:
            return torch.zeros_like(logits), None, None, None, None, None
        grad = torch.empty_like(logits)
        grad_rows(logits, safe_labels, shift, lse, mu, g_lp, g_ent, ctx.scale, ctx.chunk, grad)
        return grad, None, None, None, None, None


@functools.cache
def _triton_kernel():
    # GPU path: one-pass Triton kernels, when triton is importable (CUDA tensors only).
    try:
        from otbrl.ops.triton_token_stats import triton_token_stats
    except ImportError:
        return None
    return triton_token_stats


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
        chunk_size: rows per chunk (default: about 2**17 elements per intra-op thread);
            results do not depend on it. CUDA tensors go through one-pass Triton kernels when
            triton is installed (``otbrl.ops.triton_token_stats``), which ignore it.
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
    flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1).long()
    kernel = _triton_kernel() if flat.is_cuda and flat.dtype != torch.float64 else None
    if kernel is not None:
        ignored = flat_labels == IGNORE_INDEX
        lp, ent, spp = kernel(flat, flat_labels.masked_fill(ignored, 0), ignored, scale)
    else:
        lp, ent, spp = _TokenStatsFunction.apply(
            flat, flat_labels, scale, bool(entropy), bool(sum_pi_squared), chunk_size
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
