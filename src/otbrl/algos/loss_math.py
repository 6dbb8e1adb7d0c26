"""The loss math: policy (PPO), entropy, KL and value losses over ``[B, L]`` token tensors.

Pure functions; :mod:`otbrl.algos.loss_terms` registers them as loss terms and re-exports them.

Gradient accumulation: a mini-batch is often split into micro-batches (and data-parallel
ranks) whose losses are backpropagated one by one. For the sum of those losses to equal the
mini-batch loss exactly, every aggregation divides by a normalizer of the *whole mini-batch*
(:class:`Normalizers`, from :func:`loss_normalizers`, summed over ranks by the engine) and, for
``seq-mean-token-sum-norm``, by a fixed ``horizon``. The functions take them as
``num_tokens`` / ``num_seqs`` / ``horizon``; without them a batch's own counts are used (right
when there is one micro-batch).

Masked positions (m = 0: padding, tool output) are selected away before any arithmetic, so
a NaN or inf there reaches neither a loss, a metric nor a gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from otbrl.algos.config import KL_KINDS, LOSS_AGG_MODES
from otbrl.algos.reductions import check_tensor, masked_mean, masked_sum

LOG_RATIO_CLAMP = 20.0  # exp(±20) is finite in float32; larger log-ratios are outliers anyway
K3_CLAMP = 10.0


class Normalizers(NamedTuple):
    """Loss normalizers of the whole mini-batch (summed over data-parallel ranks).

    ``num_tokens``: 0-dim float32, Σ response_mask. ``num_seqs``: 0-dim float32, the rows with
    at least one trained token. Indexing by name (``norms["num_tokens"]``) and ``**norms``
    work too, for callers written against the earlier dict form.
    """

    num_tokens: Tensor
    num_seqs: Tensor

    def keys(self) -> tuple[str, ...]:
        return self._fields

    def __getitem__(self, key):
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)


def loss_normalizers(response_mask: Tensor) -> Normalizers:
    """This batch's normalizers, ``response_mask`` ``[B, L]`` -> :class:`Normalizers`.

    Local counts: a data-parallel engine all-reduces (sums) both fields. Rows with no trained
    token carry no gradient and are not counted as sequences.
    """
    m = check_tensor("response_mask", response_mask)
    if m.dim() != 2:
        raise ValueError(f"response_mask must be 2-D [B, L], got shape {tuple(m.shape)}")
    return Normalizers(m.sum(), (m.sum(-1) > 0).sum().to(torch.float32))


def at_least_one(n: Tensor | float) -> Tensor | float:
    # An all-padding batch has loss 0 (not NaN); the numerator is 0 then too.
    return n.clamp(min=1.0) if isinstance(n, Tensor) else max(float(n), 1.0)


def agg_loss(
    values: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    horizon: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss ``values`` ``[B, L]`` to a scalar (sums select with the mask).

    - ``token-mean``: Σ x·m / num_tokens.
    - ``seq-mean-token-sum``: Σ_i Σ_t x·m / num_seqs.
    - ``seq-mean-token-mean``: Σ_i (Σ_t x·m / Σ_t m) / num_seqs (empty rows add 0).
    - ``seq-mean-token-sum-norm``: Σ x·m / (horizon · num_seqs) (Dr. GRPO); ``horizon``
      defaults to L: pass the fixed one (the max response length) when micro-batches differ
      in padded length.

    ``num_tokens`` / ``num_seqs`` default to this batch's counts (:func:`loss_normalizers`);
    pass the mini-batch's to make micro-batch losses sum to the mini-batch loss.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [B, L], got shape {tuple(values.shape)}")
    m = check_tensor("response_mask", response_mask, values.shape).to(values.dtype)
    if num_tokens is None or num_seqs is None:
        local = loss_normalizers(m)
        num_tokens = local.num_tokens if num_tokens is None else num_tokens
        num_seqs = local.num_seqs if num_seqs is None else num_seqs
    if loss_agg_mode == "token-mean":
        return masked_sum(values, m) / at_least_one(num_tokens)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(values, m) / at_least_one(num_seqs)
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked_sum(values, m, dim=-1) / m.sum(-1).clamp(min=1.0)
        return per_seq.sum() / at_least_one(num_seqs)
    horizon = values.shape[-1] if horizon is None else horizon
    if horizon <= 0:
        raise ValueError(f"horizon must be a positive int, got {horizon}")
    return masked_sum(values, m) / (horizon * at_least_one(num_seqs))


def _kl_estimate(log_ratio: Tensor, kind: str) -> Tensor:
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    neg = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (neg.exp() - neg - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL(π‖π_ref) estimators from sampled-token log-probs, ``[B, L]`` -> ``[B, L]``.

    With log r = log_probs − ref_log_probs:

    - ``k1`` (alias ``kl``): log r. Unbiased, high variance, can be negative.
    - ``abs``: ``|log r|``.
    - ``k2`` (alias ``mse``): ½(log r)².
    - ``k3`` (alias ``low_var_kl``): exp(−log r) + log r − 1 ≥ 0, unbiased and low-variance;
      clamped to [−10, 10] (log r clamped to ±20 first) against outliers.
    - ``k1+``, ``kl+``, ``abs+``, ``k3+``, ``low_var_kl+`` (straight-through): the value of the
      estimator without "+", exactly, with the gradient of k2 (log r per unit of log r).

    Gradients flow through both inputs as written. Valid names: :data:`KL_KINDS`.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {sorted(KL_KINDS)}, got {kind!r}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"ref_log_probs must have shape {tuple(log_probs.shape)}, "
            f"got {tuple(ref_log_probs.shape)}"
        )
    log_ratio = log_probs - ref_log_probs
    canonical = KL_KINDS[kind]
    value = _kl_estimate(log_ratio, canonical.rstrip("+"))
    if not canonical.endswith("+"):
        return value
    k2 = _kl_estimate(log_ratio, "k2")
    return value.detach() + (k2 - k2.detach())  # value exactly, gradient of k2


def kl_in_reward(
    token_level_scores: Tensor,
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    *,
    coef: float,
    kind: str = "k1",
) -> tuple[Tensor, Tensor]:
    """Fold a KL penalty into the rewards: r = scores − coef·KL·m.

    Shapes: ``[B, L]`` -> ``(token_level_rewards [B, L], mean KL over masked tokens [])``.
    No gradient flows (rewards are data).
    """
    with torch.no_grad():
        m = check_tensor("response_mask", response_mask, token_level_scores.shape)
        keep = m != 0
        lp, ref = (torch.where(keep, x, 0.0) for x in (log_probs, ref_log_probs))
        kl = torch.where(keep, kl_penalty(lp, ref, kind) * m, 0.0)
        return token_level_scores - coef * kl, masked_mean(kl, m)


def _selected(keep: Tensor, log_probs, old_log_probs, advantages):
    """``(log π, A, log-ratio)`` with every input selected by ``keep`` before any arithmetic: a
    NaN where m = 0 cannot reach a loss or, through ``where``'s backward, the gradient. The
    log-ratio is clamped to ±``LOG_RATIO_CLAMP``."""
    lp, old, advantages = (
        torch.where(keep, x, 0.0) for x in (log_probs, old_log_probs, advantages)
    )
    return lp, advantages, (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_surrogate(advantages, ratio, keep, low, high) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic bound max(−A·r, −A·clip(r, 1 − low, 1 + high)) ``[B, L]`` and the
    tokens where the clipped branch is the larger (bool ``[B, L]``)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), keep & (clipped > unclipped)


def _weighted(loss: Tensor, keep: Tensor, rollout_is_weights) -> Tensor:
    """``loss`` times the rollout importance weights ``[B, L]`` when given."""
    if rollout_is_weights is None:
        return loss
    isw = check_tensor("rollout_is_weights", rollout_is_weights, keep.shape)
    return loss * torch.where(keep, isw, 0.0)


def ppo_token_loss(
    log_probs, old_log_probs, advantages, keep, low, high, c, rollout_is_weights
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token PPO loss ``[B, L]`` and the tokens where the clip / the dual clip is active
    (bool ``[B, L]``) and the log-ratio; inputs selected by ``keep`` (:func:`_selected`)."""
    _, advantages, log_ratio = _selected(keep, log_probs, old_log_probs, advantages)
    loss, is_clipped = _clipped_surrogate(advantages, log_ratio.exp(), keep, low, high)
    dual = torch.zeros_like(keep)
    if c is not None:
        bound = -advantages * c
        dual = keep & (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return _weighted(loss, keep, rollout_is_weights), is_clipped, dual, log_ratio


def gspo_token_loss(
    log_probs, old_log_probs, advantages, keep, low, high, rollout_is_weights
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GSPO-token's per-token loss ``[B, L]`` (Zheng et al. 2025, eq. 10-11), the tokens where
    its clip is active (bool ``[B, L]``), each row's sequence ratio s_i ``[B]`` and the
    log-ratio ``[B, L]``.

    s_i = exp(mean over the row's tokens of log π − log π_old) (the geometric mean of the token
    ratios); the token ratio s_{i,t} = sg(s_i) · π(y_t) / sg(π(y_t)) has the value s_i and the
    gradient s_i · ∇log π(y_t); ℓ_t = max(−A_t · s_{i,t}, −A_t · clip(s_{i,t}, 1 − low, 1 + high))
    (times ``rollout_is_weights`` when given). With an advantage constant along the row this is
    sequence-level GSPO (its gradient s_i · A_i · mean_t ∇log π); with per-token advantages
    (OTB, GAE) each token keeps its own A_t, and the clip — one decision per row and sign of
    A_t — is the sequence's. Inputs selected by ``keep`` (:func:`_selected`)."""
    lp, advantages, log_ratio = _selected(keep, log_probs, old_log_probs, advantages)
    seq_ratio = ((log_ratio * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)).detach().exp()
    ratio = seq_ratio.unsqueeze(1) * (lp - lp.detach()).exp()
    loss, is_clipped = _clipped_surrogate(advantages, ratio, keep, low, high)
    return _weighted(loss, keep, rollout_is_weights), is_clipped, seq_ratio, log_ratio


def cispo_token_loss(
    log_probs, old_log_probs, advantages, keep, low, high, rollout_is_weights
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO's per-token loss ``[B, L]`` (MiniMax-M1, 2025, eq. 4-5), the tokens whose weight
    was clipped (bool ``[B, L]``) and the log-ratio ``[B, L]``.

    ℓ_t = −sg(clip(r_t, 1 − low, 1 + high)) · A_t · log π(y_t), r_t = π(y_t) / π_old(y_t): the
    importance weight is clipped and carries no gradient, and every token keeps its gradient
    (PPO's clip drops the clipped tokens'); times ``rollout_is_weights`` when given. The paper
    sets no lower bound (ε_low large): ``low`` close to 1."""
    lp, advantages, log_ratio = _selected(keep, log_probs, old_log_probs, advantages)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - low, 1.0 + high)
    loss = -weight * advantages * lp
    return _weighted(loss, keep, rollout_is_weights), keep & (weight != ratio), log_ratio


def check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c) -> None:
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (or None), got {clip_ratio_c}")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip ratios must be >= 0, got clip_ratio_low={clip_ratio_low}, "
            f"clip_ratio_high={clip_ratio_high}"
        )


def ppo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    rollout_is_weights: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    horizon: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clipping and dual-clip, aggregated to a scalar.

    ratio = exp(log_probs − old_log_probs) (log-ratio clamped to ±20);
    per token: ℓ = max(−A·ratio, −A·clip(ratio, 1 − low, 1 + high)); for A < 0 and
    ``clip_ratio_c`` set (> 1), ℓ = min(ℓ, −A·c) (dual-clip); times ``rollout_is_weights``
    when given. Aggregated by :func:`agg_loss` (normalizers as there).

    Shapes: ``[B, L]`` inputs -> ``(loss [], metrics)``; metrics (0-dim, detached, masked means
    over this batch): ``clip_frac`` (tokens where the clipped term is active), ``clip_frac_lower``
    (tokens where the dual-clip bound is active), ``approx_kl`` (mean of old − new log-prob).
    """
    shape = log_probs.shape
    old_log_probs = check_tensor("old_log_probs", old_log_probs, shape)
    advantages = check_tensor("advantages", advantages, shape)
    m = check_tensor("response_mask", response_mask, shape)
    check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    loss, clipped, dual, log_ratio = ppo_token_loss(
        log_probs, old_log_probs, advantages, m != 0, clip_ratio_low, clip_ratio_high,
        clip_ratio_c, rollout_is_weights,
    )  # fmt: skip
    metrics = {"clip_frac": masked_mean(clipped.float(), m).detach()}
    if clip_ratio_c is not None:
        metrics["clip_frac_lower"] = masked_mean(dual.float(), m).detach()
    metrics["approx_kl"] = masked_mean(-log_ratio, m).detach()
    total = agg_loss(
        loss, m, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon
    )
    return total, metrics


def entropy_bonus(
    entropy: Tensor,
    response_mask: Tensor,
    coef: float,
    loss_agg_mode: str = "token-mean",
    **normalizers,
) -> Tensor:
    """The loss term −coef · agg(entropy): add it to the policy loss to reward exploration.

    ``entropy``, ``response_mask`` ``[B, L]`` -> scalar; ``normalizers`` as in :func:`agg_loss`.
    """
    return -coef * agg_loss(entropy, response_mask, loss_agg_mode, **normalizers)


def value_token_loss(values, old_values, returns, keep, clip_range) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss ``[B, L]`` and the tokens whose clipped error is the one
    used (bool ``[B, L]``). V_clip is V itself wherever ``|V − V_old| ≤ c``, so the clipped error
    can only be the larger one where the value really was clipped."""
    v = torch.where(keep, values, 0.0)
    err = (v - torch.where(keep, returns, 0.0)).square()
    if clip_range is None:
        return 0.5 * err, torch.zeros_like(keep)
    old = torch.where(keep, old_values, 0.0)
    delta = v - old
    was_clipped = delta.abs() > clip_range
    v_clip = torch.where(was_clipped, old + delta.clamp(-clip_range, clip_range), v)
    err_clip = (v_clip - torch.where(keep, returns, 0.0)).square()
    use_clip = keep & was_clipped & (err_clip > err)
    return 0.5 * torch.where(use_clip, err_clip, err), use_clip


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    **normalizers,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss ½·max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, ±c)
    where ``|V − V_old| > c`` and V elsewhere.

    Shapes: ``[B, L]`` -> ``(loss [], {"vf_clip_frac": []})``: the masked share of tokens whose
    value was clipped and whose clipped error is the larger; ``clip_range=None`` disables
    clipping. Normalizers as in :func:`agg_loss`.
    """
    shape = values.shape
    old_values = check_tensor("old_values", old_values, shape)
    returns = check_tensor("returns", returns, shape)
    m = check_tensor("response_mask", response_mask, shape)
    loss, clipped = value_token_loss(values, old_values, returns, m != 0, clip_range)
    total = agg_loss(loss, m, loss_agg_mode, **normalizers)
    return total, {"vf_clip_frac": masked_mean(clipped.float(), m).detach()}
