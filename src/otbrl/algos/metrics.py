"""Batch metrics: masked summaries, OTB's W-score and zero-tail share, Σπ² variance proxies,
and the per-step sets the trainer logs (``sample_metrics``, ``step_metrics``).

The building blocks return 0-dim tensors (no host sync; the logger converts) keyed by metric
name; the per-step sets return Python floats, what the trainer logs. Inputs
are read only where the mask selects them: a NaN or inf at a masked position never shows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from otbrl.algos.otb import token_energy, zero_tail_mask
from otbrl.algos.reductions import check_tensor, masked_mean, masked_var


def masked_summary(x: Tensor, response_mask: Tensor, prefix: str) -> dict[str, Tensor]:
    """``{prefix}/mean``, ``/std`` (unbiased), ``/min``, ``/max`` of ``x`` over masked entries.

    Shapes: ``x`` ``[B, L]`` (or any shape matching the mask) -> 0-dim tensors. An empty mask
    gives zeros rather than NaN/inf.
    """
    m = check_tensor("response_mask", response_mask, x.shape)
    x = x.detach().float()
    selected = m != 0
    zero = torch.zeros((), device=x.device)
    any_ = selected.any()
    return {
        f"{prefix}/mean": masked_mean(x, m),
        f"{prefix}/std": masked_var(x, m).sqrt(),
        f"{prefix}/min": torch.where(any_, torch.where(selected, x, torch.inf).min(), zero),
        f"{prefix}/max": torch.where(any_, torch.where(selected, x, -torch.inf).max(), zero),
    }


def variance_proxy(
    advantages: Tensor,
    response_mask: Tensor,
    w_score: Tensor,
    grad_norm: Tensor | float | None = None,
) -> dict[str, Tensor]:
    """Σπ²-based gradient-variance proxies for one batch of N trajectories.

    Total power P = mean_τ(Ā_τ² · max(W(τ), 0)), Ā_τ = the masked-mean advantage of τ (0 for an
    empty response), W(τ) = Σ_t w_t m_t: the row sums of
    :func:`otbrl.algos.otb.token_energy`, as in OTB. Given the norm g of the batch-mean
    gradient: signal S = g², noise = max(0, (P − S)/(N − 1)) (0 when N = 1).

    Shapes: ``advantages``, ``response_mask`` ``[N, L]``, ``w_score`` ``[N]`` -> keys
    ``variance_proxy/total_power`` and, with ``grad_norm``, ``variance_proxy/signal_strength``
    and ``variance_proxy/pure_noise`` (0-dim tensors).
    """
    m = check_tensor("response_mask", response_mask, advantages.shape)
    n_tok = m.sum(-1)
    w_score = check_tensor("w_score", w_score, n_tok.shape)
    a_bar = masked_mean(advantages.detach().float(), m, dim=-1)
    power = (a_bar.square() * w_score.clamp(min=0.0)).mean()
    out = {"variance_proxy/total_power": power}
    if grad_norm is not None:
        g = torch.as_tensor(grad_norm, dtype=torch.float32, device=power.device)
        signal = g.square()
        n = advantages.shape[0]
        noise = (power - signal).clamp(min=0.0) / (n - 1) if n > 1 else torch.zeros_like(power)
        out["variance_proxy/signal_strength"] = signal
        out["variance_proxy/pure_noise"] = noise
    return out


def zero_tail_fraction(response_mask: Tensor, index, *, response_space: bool = False) -> Tensor:
    """Share of trained tokens whose OTB baseline the zero tail sets to 0, ``[B, L]`` -> [].

    ``response_space=True`` for TIR-OTB (k space, empty rows not members); see
    :func:`otbrl.algos.otb.zero_tail_mask`.
    """
    tail = zero_tail_mask(response_mask, index, response_space=response_space)
    return tail.sum().float() / (response_mask != 0).sum().clamp(min=1).float()


def otb_metrics(
    advantages: Tensor,
    response_mask: Tensor,
    index,
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    *,
    rollout_is_weights: Tensor | None = None,
    grad_norm: Tensor | float | None = None,
    response_space: bool = False,
) -> dict[str, Tensor]:
    """The OTB metric set: ``otb/w_score/*`` summaries, ``otb/zero_tail_fraction`` and, when the
    Σπ² inputs are given, the ``variance_proxy/*`` keys. Shapes as in the functions above."""
    out = {
        "otb/zero_tail_fraction": zero_tail_fraction(
            response_mask, index, response_space=response_space
        )
    }
    if old_log_probs is None or sum_pi_squared is None:
        return out
    w = token_energy(
        response_mask, old_log_probs, sum_pi_squared, rollout_is_weights=rollout_is_weights
    ).sum(-1)  # W(τ), the trajectory's energy
    rows = torch.ones_like(w)
    out.update(masked_summary(w, rows, "otb/w_score"))
    out.update(variance_proxy(advantages, response_mask, w, grad_norm))
    return out


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> Tensor:
    """How much of the returns' variance the value estimates explain, over masked tokens:
    1 − Var(R − V) / Var(R) (1 = perfect, 0 = no better than the mean, < 0 = worse).

    Shapes: ``[B, L]`` -> 0-dim tensor; 0 when the returns do not vary.
    """
    m = check_tensor("response_mask", response_mask, values.shape)
    r = check_tensor("returns", returns, values.shape)
    v = check_tensor("values", values, values.shape)
    # The unbiased factors cancel in the ratio: this is the population form as well.
    total = masked_var(r, m)
    return torch.where(total > 0, 1.0 - masked_var(r - v, m) / total.clamp(min=1e-12), 0.0)


def sample_metrics(scores: Tensor, response_mask: Tensor, truncated: Tensor) -> dict[str, float]:
    """What a sampled batch holds: ``train/reward_mean`` / ``reward_max`` of the scalar scores
    ``[B]``, ``train/response_length_mean`` (trained tokens per row, ``response_mask`` [B, Lr]) and
    ``train/response_clip_ratio`` (share of rows that hit the length cap without a stop token,
    ``truncated`` [B] bool). Python floats: the sampling step reports them as they are."""
    return {
        "train/reward_mean": float(scores.mean()),
        "train/reward_max": float(scores.max()),
        "train/response_length_mean": float(response_mask.sum(dim=1).mean()),
        "train/response_clip_ratio": float(truncated.float().mean()),
    }


def step_metrics(
    batch: dict[str, Tensor],
    *,
    grad_norm: Tensor | float | None,
    response_space: bool = False,
) -> dict[str, float]:
    """The statistics of a trained batch, after its update: ``policy/entropy_mean``; with Σπ²
    in the batch ``policy/sum_pi_squared_mean`` and :func:`otb_metrics` (``grad_norm``, the
    update's mean pre-clip norm, stands in for the batch-gradient norm; W weighted by the
    batch's ``rollout_is_weights`` when it has them, as the estimator's was;
    ``response_space=True`` for TIR-OTB's zero tail); with ``values`` the critic's
    ``critic/values_mean``, ``critic/returns_mean`` and ``critic/explained_variance``.

    ``batch``: the step's batch (``response_mask``, ``entropy``, ``advantages``, ``uid`` and the
    optional ``sum_pi_squared`` / ``old_log_probs`` / ``rollout_is_weights`` / ``values`` /
    ``returns``, all [B, Lr]).
    """
    mask = batch["response_mask"]
    out = {"policy/entropy_mean": float(masked_mean(batch["entropy"], mask))}
    if "sum_pi_squared" in batch:
        out["policy/sum_pi_squared_mean"] = float(masked_mean(batch["sum_pi_squared"], mask))
        extra = otb_metrics(
            batch["advantages"],
            mask,
            batch["uid"],
            batch["old_log_probs"],
            batch["sum_pi_squared"],
            rollout_is_weights=batch.get("rollout_is_weights"),
            grad_norm=grad_norm,
            response_space=response_space,
        )
        out.update({k: float(v) for k, v in extra.items()})
    if "values" in batch:
        out["critic/values_mean"] = float(masked_mean(batch["values"], mask))
        out["critic/returns_mean"] = float(masked_mean(batch["returns"], mask))
        out["critic/explained_variance"] = float(
            explained_variance(batch["values"], batch["returns"], mask)
        )
    return out
