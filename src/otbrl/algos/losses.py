"""Policy losses, KL estimators and loss aggregation over ``[B, L]`` token tensors.

Gradient accumulation: a mini-batch is often split into micro-batches whose losses are
backpropagated one by one. For the sum of the micro-batch losses to equal the mini-batch loss
exactly, every aggregation divides by a normalizer of the *whole mini-batch*, not of the
micro-batch. Compute it once with :func:`loss_normalizers` on the mini-batch's response mask
and pass ``num_tokens`` / ``num_seqs`` (and, for ``seq-mean-token-sum-norm``, a fixed
``horizon``) to :func:`agg_loss` / :func:`ppo_policy_loss` for every micro-batch. Without them
the micro-batch's own counts are used (right when there is one micro-batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from otbrl.algos._common import check_tensor, masked_mean

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_KINDS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3"}
KL_KINDS["low_var_kl"] = "k3"
LOG_RATIO_CLAMP = 20.0  # exp(±20) is finite in float32; larger log-ratios are outliers anyway
K3_CLAMP = 10.0


def loss_normalizers(response_mask: Tensor) -> dict[str, Tensor]:
    """Mini-batch normalizers for exact gradient accumulation.

    Shapes: ``response_mask`` ``[B, L]`` -> ``{"num_tokens": Σ m, "num_seqs": #rows with Σ m > 0}``
    (0-dim float32 tensors). Rows with no trained token carry no gradient and are not counted.
    """
    m = check_tensor("response_mask", response_mask)
    return {"num_tokens": m.sum(), "num_seqs": (m.sum(-1) > 0).sum().to(torch.float32)}


def agg_loss(
    values: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    horizon: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss ``values`` ``[B, L]`` to a scalar.

    - ``token-mean``: Σ x·m / num_tokens.
    - ``seq-mean-token-sum``: Σ_i Σ_t x·m / num_seqs.
    - ``seq-mean-token-mean``: Σ_i (Σ_t x·m / Σ_t m) / num_seqs (empty rows add 0).
    - ``seq-mean-token-sum-norm``: Σ x·m / (horizon · num_seqs) (Dr. GRPO); ``horizon``
      defaults to L, pass a fixed one (e.g. the max response length) when micro-batches differ
      in padded length.
    ``num_tokens`` / ``num_seqs`` default to this batch's counts (:func:`loss_normalizers`);
    pass the mini-batch's to make micro-batch losses sum to the mini-batch loss.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [B, L], got shape {tuple(values.shape)}")
    m = check_tensor("response_mask", response_mask, values.shape).to(values.dtype)
    local = loss_normalizers(m)
    n_tok = local["num_tokens"] if num_tokens is None else num_tokens
    n_seq = local["num_seqs"] if num_seqs is None else num_seqs
    masked = values * m
    if loss_agg_mode == "token-mean":
        return masked.sum() / _at_least_one(n_tok)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked.sum() / _at_least_one(n_seq)
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / m.sum(-1).clamp(min=1.0)
        return per_seq.sum() / _at_least_one(n_seq)
    horizon = values.shape[-1] if horizon is None else horizon
    if horizon <= 0:
        raise ValueError(f"horizon must be a positive int, got {horizon}")
    return masked.sum() / (horizon * _at_least_one(n_seq))


def _at_least_one(n: Tensor | float) -> Tensor | float:
    # An all-padding batch has loss 0 (not NaN); the numerator is 0 then too.
    return n.clamp(min=1.0) if isinstance(n, Tensor) else max(float(n), 1.0)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL(π‖π_ref) estimators from sampled-token log-probs, ``[B, L]`` -> ``[B, L]``.

    With log r = log_probs − ref_log_probs:
    - ``k1`` (alias ``kl``): log r. Unbiased, high variance, can be negative.
    - ``abs``: |log r|.
    - ``k2`` (alias ``mse``): ½(log r)².
    - ``k3`` (alias ``low_var_kl``): exp(−log r) + log r − 1 ≥ 0, unbiased and low-variance;
      clamped to [−10, 10] (log r clamped to ±20 first) against outliers.
    Gradients flow through both inputs as written.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {sorted(KL_KINDS)}, got {kind!r}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"ref_log_probs must have shape {tuple(log_probs.shape)}, "
            f"got {tuple(ref_log_probs.shape)}"
        )
    log_ratio = log_probs - ref_log_probs
    kind = KL_KINDS[kind]
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    neg = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (neg.exp() - neg - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


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
        kl = kl_penalty(log_probs, ref_log_probs, kind) * m
        return token_level_scores - coef * kl, masked_mean(kl, m)


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
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (or None), got {clip_ratio_c}")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip ratios must be >= 0, got clip_ratio_low={clip_ratio_low}, "
            f"clip_ratio_high={clip_ratio_high}"
        )
    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": masked_mean((clipped > unclipped).float(), m).detach()}
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        lower = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
        metrics["clip_frac_lower"] = masked_mean(lower.float(), m).detach()
    if rollout_is_weights is not None:
        loss = loss * check_tensor("rollout_is_weights", rollout_is_weights, shape)
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
    """Clipped critic loss ½·max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, ±c).

    Shapes: ``[B, L]`` -> ``(loss [], {"vf_clip_frac": []})``; ``clip_range=None`` disables
    clipping. Normalizers as in :func:`agg_loss`.
    """
    shape = values.shape
    old_values = check_tensor("old_values", old_values, shape)
    returns = check_tensor("returns", returns, shape)
    m = check_tensor("response_mask", response_mask, shape)
    err = (values - returns).square()
    if clip_range is None:
        loss, frac = 0.5 * err, torch.zeros((), device=values.device)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err_clip = (v_clip - returns).square()
        loss = 0.5 * torch.maximum(err, err_clip)
        frac = masked_mean((err_clip > err).float(), m)
    total = agg_loss(loss, m, loss_agg_mode, **normalizers)
    return total, {"vf_clip_frac": frac.detach()}


# -- TEMPORARY: the lead's stand-in for the loss registry (replaced by the algos branch) ------
from typing import NamedTuple  # noqa: E402


class Normalizers(NamedTuple):
    num_tokens: Tensor
    num_seqs: Tensor

    def __getitem__(self, key):
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)

    def keys(self):
        return self._fields


class _Loss:
    def __init__(self, fn, needs, batch_keys):
        self.fn, self.needs, self.batch_keys = fn, frozenset(needs), frozenset(batch_keys)

    def __call__(self, out, batch, norms):
        return self.fn(out, batch, norms)


Loss = _Loss


def build_loss(
    *,
    policy_loss="ppo_clip",
    loss_agg_mode="token-mean",
    horizon=None,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    entropy_coeff=0.0,
    kl_loss_coef=0.0,
    kl_loss_type="low_var_kl",
):
    needs = {"log_probs"} | ({"entropy"} if entropy_coeff != 0 else set())
    keys = {"response_mask", "old_log_probs", "advantages"}
    if kl_loss_coef > 0:
        keys.add("ref_log_probs")

    def fn(out, batch, norms):
        m = batch["response_mask"]
        agg = {
            "loss_agg_mode": loss_agg_mode,
            "num_tokens": norms.num_tokens,
            "num_seqs": norms.num_seqs,
            "horizon": horizon,
        }
        loss, pg = ppo_policy_loss(
            out["log_probs"],
            batch["old_log_probs"],
            batch["advantages"],
            m,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
            rollout_is_weights=batch.get("rollout_is_weights"),
            **agg,
        )
        frac = m.sum() / norms.num_tokens.clamp(min=1.0)
        metrics = {
            "policy/pg_loss": loss.detach(),
            "policy/clip_frac": pg["clip_frac"] * frac,
            "policy/approx_kl": pg["approx_kl"] * frac,
        }
        if entropy_coeff != 0:
            ent = entropy_bonus(out["entropy"], m, entropy_coeff, **agg)
            loss = loss + ent
            metrics["policy/entropy_loss"] = ent.detach()
        if kl_loss_coef > 0:
            kl = agg_loss(
                kl_penalty(out["log_probs"], batch["ref_log_probs"], kl_loss_type), m, **agg
            )
            loss = loss + kl_loss_coef * kl
            metrics["policy/kl_loss"] = kl.detach()
        metrics["policy/loss"] = loss.detach()
        return loss, metrics

    return _Loss(fn, needs, keys)


def build_value_loss(*, cliprange_value=0.5, loss_agg_mode="token-mean"):
    def fn(out, batch, norms):
        m = batch["response_mask"]
        loss, info = value_loss(
            out["values"],
            batch["values"],
            batch["returns"],
            m,
            clip_range=cliprange_value,
            loss_agg_mode=loss_agg_mode,
            num_tokens=norms.num_tokens,
            num_seqs=norms.num_seqs,
        )
        frac = m.sum() / norms.num_tokens.clamp(min=1.0)
        return loss, {
            "critic/value_loss": loss.detach(),
            "critic/vf_clip_frac": info["vf_clip_frac"] * frac,
        }

    return _Loss(fn, {"values"}, {"response_mask", "values", "returns"})


_old_loss_normalizers = loss_normalizers


def loss_normalizers(response_mask):
    d = _old_loss_normalizers(response_mask)
    return Normalizers(d["num_tokens"], d["num_seqs"])
