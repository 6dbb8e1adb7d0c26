"""Train/inference mismatch: metrics and importance-sampling corrections of the rollout.

The rollout engine samples response token y_t from π_rollout and reports
ρ_t = log π_rollout(y_t) (``rollout_log_probs``); the trainer recomputes
ℓ_t = log π_old(y_t) (``old_log_probs``) with its own forward. All inputs ``[B, L]``,
``response_mask`` m ``[B, L]`` (1 = trained token). Every quantity selects valid tokens with
``torch.where`` first, so whatever a masked position holds (NaN, ±inf) cannot leak.

Metrics (over the N = Σ m valid tokens of the batch):
    logprob_abs_diff_mean = Σ m |ℓ − ρ| / N
    logprob_abs_diff_max  = max over valid tokens of |ℓ − ρ|
    ppl_ratio             = PPL_trainer / PPL_rollout = exp(Σ m (ρ − ℓ) / N),
                            PPL_x = exp(−Σ m log π_x / N) (token-level perplexity of the batch);
                            > 1: the trainer finds the samples less likely than the engine did.

Corrections, with cap C ≥ 1 and per-token log-ratio δ_t = ℓ_t − ρ_t:
    token_tis  (truncated importance sampling): w_t = min(exp(δ_t), C); keep = m.
    seq_mis    (sequence masking): r_i = exp(Σ_t m δ_t); a sequence with r_i outside
               [1/C, C] is dropped (keep = 0 on all its tokens); w = keep.
    decoupled  (AReaL's behaviour weight, for off-policy samples): with ℓ = log π_prox (the
               trainer's log-probs at the start of the update) and ρ = log π_behave (the
               policy that sampled the token, possibly several versions old),
               w_t = exp(δ_t) · 1[exp(δ_t) ≤ C]: a token whose weight exceeds the cap is
               not truncated but weighted 0 (it still counts in the token normalizer);
               keep = m. The PPO ratio of the loss is taken against π_prox (``old_log_probs``).
    none       w = m, keep = m.
Weights are 0 wherever keep is 0 (padding, dropped sequences), never NaN. They are constants
(no gradient): they multiply the per-token policy loss, and OTB's energy W takes them as
``rollout_is_weights`` (w² · logit-gradient energy, the ρ̄² correction).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from otbrl.algos.config import CORRECTIONS, OFF_POLICY, OFF_POLICY_MODES

ROLLOUT_CORRECTIONS = (*CORRECTIONS, "decoupled")


def correction_mode(off_policy: str, rollout_correction: str) -> str:
    """The one ``rollout_is_weights`` mode that ``algorithm.off_policy`` and
    ``algorithm.rollout_correction`` set between them: the off-policy mode when it is not
    ``"none"`` (the config checks refuse both at once), else the correction."""
    if off_policy not in OFF_POLICY_MODES:
        raise ValueError(f"off_policy: expected one of {OFF_POLICY}, got {off_policy!r}")
    if rollout_correction not in CORRECTIONS:
        raise ValueError(
            f"rollout_correction: expected one of {CORRECTIONS}, got {rollout_correction!r}"
        )
    return rollout_correction if off_policy == "none" else OFF_POLICY_MODES[off_policy]


def rollout_mismatch_metrics(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """Mismatch between the trainer's and the rollout engine's log-probs of the sampled tokens.

    Shapes: all three ``[B, L]``. Returns ``rollout/logprob_abs_diff_mean``,
    ``rollout/logprob_abs_diff_max`` and ``rollout/ppl_ratio`` (formulas in the module
    docstring); with no valid token they are 0, 0 and 1 (nothing disagrees).
    """
    old, rollout, valid = _check(old_log_probs, rollout_log_probs, response_mask)
    n = valid.sum()
    # float64: a batch-wide sum of fp32 differences of ~1e-7 each keeps its digits.
    delta = torch.where(valid, old.double() - rollout.double(), 0.0)
    if int(n) == 0:
        return {
            "rollout/logprob_abs_diff_mean": 0.0,
            "rollout/logprob_abs_diff_max": 0.0,
            "rollout/ppl_ratio": 1.0,
        }
    return {
        "rollout/logprob_abs_diff_mean": float(delta.abs().sum() / n),
        "rollout/logprob_abs_diff_max": float(delta.abs().max()),
        "rollout/ppl_ratio": float(torch.exp(-delta.sum() / n)),
    }


def rollout_is_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    mode: str,
    cap: float,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Importance weights and keep mask that correct for sampling with the rollout engine.

    Args:
        old_log_probs, rollout_log_probs, response_mask: ``[B, L]``.
        mode: ``"token_tis"``, ``"seq_mis"``, ``"decoupled"`` or ``"none"`` (formulas in the
            module docstring).
        cap: C ≥ 1: the truncation of token weights (token_tis), the largest weight kept
            (decoupled), or the sequence ratio band [1/C, C] (seq_mis).

    Returns:
        ``(weights, keep_mask, metrics)``: weights and keep_mask ``[B, L]`` float32 without
        gradient, weights 0 wherever keep_mask is 0; metrics ``rollout/is_weight_mean`` (mean
        weight over kept tokens), ``rollout/is_truncated_frac`` (token_tis: share of valid
        tokens whose ratio exceeded C), ``rollout/is_masked_frac`` (decoupled: share of valid
        tokens weighted 0 for exceeding C), ``rollout/seq_masked_frac`` (seq_mis: share of
        sequences with valid tokens that were dropped).
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"mode: expected one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap):
        raise TypeError(f"cap: expected a finite number ≥ 1, got {cap!r}")
    if cap < 1:
        raise ValueError(f"cap: expected a number ≥ 1, got {cap!r}")
    old, rollout, valid = _check(old_log_probs, rollout_log_probs, response_mask)
    with torch.no_grad():
        delta = torch.where(valid, old.float() - rollout.float(), 0.0)
        log_cap = math.log(cap)
        metrics: dict[str, float] = {}
        if mode == "token_tis":
            # exp of the clamped log-ratio: never overflows, min(exp(δ), C) exactly.
            weights = torch.where(valid, delta.clamp(max=log_cap).exp(), 0.0)
            keep = valid
            truncated = valid & (delta > log_cap)
            metrics["rollout/is_truncated_frac"] = _frac(truncated.sum(), valid.sum())
        elif mode == "decoupled":
            within = valid & (delta <= log_cap)
            # exp of the clamped log-ratio: finite; the tokens above the cap are zeroed.
            weights = torch.where(within, delta.clamp(max=log_cap).exp(), 0.0)
            keep = valid
            metrics["rollout/is_masked_frac"] = _frac((valid & ~within).sum(), valid.sum())
        else:
            keep = valid
            if mode == "seq_mis":
                seq = delta.double().sum(dim=1)  # log r_i
                inside = seq.abs() <= log_cap
                keep = valid & inside[:, None]
                has_tokens = valid.any(dim=1)
                metrics["rollout/seq_masked_frac"] = _frac(
                    (has_tokens & ~inside).sum(), has_tokens.sum()
                )
            weights = keep.float()
        kept = keep.sum()
        metrics["rollout/is_weight_mean"] = float(weights.double().sum() / kept) if kept else 1.0
    return weights, keep.float(), metrics


def correct_for_rollout(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    mode: str,
    cap: float,
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """How far the rollout engine's log-probs are from the trainer's (``old_log_probs``: π_prox,
    computed once before the update), and the correction for it: ``(weights [B, L] or None when
    ``mode`` is ``"none"``, the response mask [B, L] with the sequences ``seq_mis`` drops
    zeroed, metrics)`` — ``rollout_mismatch_metrics`` plus, with a mode, ``rollout_is_weights``'
    own. The weights reach the policy loss and OTB's energy W as ``rollout_is_weights``."""
    metrics = rollout_mismatch_metrics(old_log_probs, rollout_log_probs, response_mask)
    if mode == "none":
        return None, response_mask, metrics
    weights, keep, extra = rollout_is_weights(
        old_log_probs, rollout_log_probs, response_mask, mode=mode, cap=cap
    )
    metrics.update(extra)
    return weights, response_mask * keep, metrics


def _frac(part: Tensor, whole: Tensor) -> float:
    return float(part) / float(whole) if int(whole) else 0.0


def _check(old: Tensor, rollout: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    for name, x in (("old_log_probs", old), ("rollout_log_probs", rollout)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name}: expected a float tensor, got dtype {x.dtype}")
    if old.dim() != 2:
        raise ValueError(f"old_log_probs: expected shape [B, L], got {tuple(old.shape)}")
    if rollout.shape != old.shape:
        raise ValueError(
            f"rollout_log_probs: expected shape {tuple(old.shape)} like old_log_probs, "
            f"got {tuple(rollout.shape)}"
        )
    if not isinstance(mask, Tensor) or mask.shape != old.shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"response_mask: expected shape {tuple(old.shape)}, got {got}")
    return old.detach(), rollout.detach(), mask.detach() > 0
