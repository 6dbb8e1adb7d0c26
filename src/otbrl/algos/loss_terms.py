"""The loss registry and the losses the engine is handed (:func:`build_loss`,
:func:`build_value_loss`).

A loss term is registered, like an advantage estimator, with what it reads: the forward
outputs the engine must compute with gradient (``needs`` ⊆ {"log_probs", "entropy",
"values"}) and the batch keys (``batch_keys``). A built loss is called once per micro-batch::

    loss, metrics = loss_fn(out, batch, norms)   # out: forward outputs [B, L], 0 where m = 0

with ``norms`` the :class:`Normalizers` of the whole mini-batch summed over data-parallel
ranks. Every micro-batch loss is its share of the mini-batch loss, and every metric is
additive the same way (token fractions are divided by ``norms.num_tokens``, loss terms are
shares): summing the values of all micro-batches on all ranks gives the mini-batch's, for
every ``loss_agg_mode``. Metrics are detached 0-dim tensors.

The per-token math the terms call lives in :mod:`otbrl.algos.loss_math` (pure functions).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from otbrl.algos.config import POLICY_LOSS_AGG, POLICY_LOSSES
from otbrl.algos.loss_math import (
    KL_KINDS,
    LOSS_AGG_MODES,
    Normalizers,
    agg_loss,
    at_least_one,
    check_clip,
    cispo_token_loss,
    gspo_token_loss,
    kl_penalty,
    ppo_token_loss,
    value_token_loss,
)
from otbrl.algos.reductions import masked_sum
from otbrl.ops.token_stats import HEAD_OUTPUTS, NO_GRADIENT

__all__ = [
    "LOSSES", "POLICY_LOSSES", "Loss", "LossTerm", "SumOfTerms", "build_loss", "build_sft_loss",
    "build_value_loss", "register_loss",
]  # fmt: skip

# what a loss term may differentiate: every forward output but the gradient-free statistics
FORWARD_OUTPUTS = frozenset().union(*HEAD_OUTPUTS.values()) - NO_GRADIENT
ROLES = ("policy", "entropy", "kl", "value")


@runtime_checkable
class Loss(Protocol):
    """What the engine calls: ``(out, batch, norms) -> (loss [], metrics)`` (module docstring)."""

    needs: frozenset[str]
    batch_keys: frozenset[str]

    def __call__(
        self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor], norms: Normalizers
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


@dataclass(frozen=True)
class LossTerm:
    """A registered loss term: ``fn(out, batch, norms, **options) -> (share [], metrics)``.

    ``role``: one of :data:`ROLES` (``build_loss(policy_loss=...)`` takes a ``"policy"`` term);
    ``options``: the keyword options ``fn`` takes (from its signature).
    """

    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    role: str
    needs: frozenset[str]
    batch_keys: frozenset[str]
    options: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        params = inspect.signature(self.fn).parameters.values()
        keyword = frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        object.__setattr__(self, "options", keyword)


LOSSES: dict[str, LossTerm] = {}


def register_loss(name: str, *, role: str, needs=(), batch_keys=()):
    """Decorator: register ``fn(out, batch, norms, *, **options)`` as loss term ``name``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not set(needs) <= FORWARD_OUTPUTS:
        raise ValueError(f"needs must be a subset of {sorted(FORWARD_OUTPUTS)}, got {needs}")

    def wrap(fn):
        if name in LOSSES:
            raise ValueError(f"loss term {name!r} is already registered")
        LOSSES[name] = LossTerm(name, fn, role, frozenset(needs), frozenset(batch_keys))
        return fn

    return wrap


def _norm_kwargs(norms: Normalizers, loss_agg_mode: str, horizon: int | None) -> dict:
    return dict(
        loss_agg_mode=loss_agg_mode,
        num_tokens=norms.num_tokens,
        num_seqs=norms.num_seqs,
        horizon=horizon,
    )


def _token_share(x: Tensor, mask: Tensor, norms: Normalizers) -> Tensor:
    """Σ x·m / num_tokens of the mini-batch: additive over micro-batches and ranks."""
    return (masked_sum(x.float(), mask) / at_least_one(norms.num_tokens)).detach()


@register_loss(
    "ppo",
    role="policy",
    needs={"log_probs"},
    batch_keys={"response_mask", "old_log_probs", "advantages"},
)
def ppo_term(
    out, batch, norms, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, horizon
):
    """PPO's clipped surrogate (:func:`ppo_policy_loss`), times ``batch["rollout_is_weights"]``
    when the batch holds them. Metrics: ``policy/pg_loss``, ``policy/clip_frac``,
    ``policy/clip_frac_lower`` (with dual clip), ``policy/approx_kl``."""
    m = batch["response_mask"]
    loss, clipped, dual, log_ratio = ppo_token_loss(
        out["log_probs"], batch["old_log_probs"], batch["advantages"], m != 0, clip_ratio_low,
        clip_ratio_high, clip_ratio_c, batch.get("rollout_is_weights", None),
    )  # fmt: skip
    pg = agg_loss(loss, m, **_norm_kwargs(norms, loss_agg_mode, horizon))
    metrics = {"policy/pg_loss": pg.detach(), "policy/clip_frac": _token_share(clipped, m, norms)}
    if clip_ratio_c is not None:
        metrics["policy/clip_frac_lower"] = _token_share(dual, m, norms)
    metrics["policy/approx_kl"] = _token_share(-log_ratio, m, norms)
    return pg, metrics


_RATIO_KEYS = {"response_mask", "old_log_probs", "advantages"}


@register_loss("gspo", role="policy", needs={"log_probs"}, batch_keys=_RATIO_KEYS)
def gspo_term(out, batch, norms, *, clip_ratio_low, clip_ratio_high, loss_agg_mode, horizon):
    """GSPO's clipped sequence ratio in its token form (:func:`gspo_token_loss`), times
    ``batch["rollout_is_weights"]`` when the batch holds them. Metrics: ``policy/pg_loss``,
    ``policy/clip_frac`` (tokens whose clip is active), ``policy/seq_clip_frac`` (sequences
    with a clipped token: with a row-constant advantage, the sequences GSPO clipped),
    ``policy/seq_ratio_mean`` (mean s_i) and ``policy/approx_kl``."""
    m = batch["response_mask"]
    keep = m != 0
    loss, clipped, seq_ratio, log_ratio = gspo_token_loss(
        out["log_probs"], batch["old_log_probs"], batch["advantages"], keep, clip_ratio_low,
        clip_ratio_high, batch.get("rollout_is_weights", None),
    )  # fmt: skip
    pg = agg_loss(loss, m, **_norm_kwargs(norms, loss_agg_mode, horizon))
    rows = keep.any(dim=1)
    per_seq = at_least_one(norms.num_seqs)
    return pg, {
        "policy/pg_loss": pg.detach(),
        "policy/clip_frac": _token_share(clipped, m, norms),
        "policy/seq_clip_frac": (clipped.any(dim=1) & rows).float().sum().detach() / per_seq,
        "policy/seq_ratio_mean": (seq_ratio * rows).sum().detach() / per_seq,
        "policy/approx_kl": _token_share(-log_ratio, m, norms),
    }


@register_loss("cispo", role="policy", needs={"log_probs"}, batch_keys=_RATIO_KEYS)
def cispo_term(out, batch, norms, *, clip_ratio_low, clip_ratio_high, loss_agg_mode, horizon):
    """CISPO's clipped, stop-gradient importance weight on every token's log-likelihood
    (:func:`cispo_token_loss`), times ``batch["rollout_is_weights"]`` when the batch holds
    them. Metrics: ``policy/pg_loss``, ``policy/clip_frac`` (tokens whose weight was clipped)
    and ``policy/approx_kl``."""
    m = batch["response_mask"]
    loss, clipped, log_ratio = cispo_token_loss(
        out["log_probs"], batch["old_log_probs"], batch["advantages"], m != 0, clip_ratio_low,
        clip_ratio_high, batch.get("rollout_is_weights", None),
    )  # fmt: skip
    pg = agg_loss(loss, m, **_norm_kwargs(norms, loss_agg_mode, horizon))
    return pg, {
        "policy/pg_loss": pg.detach(),
        "policy/clip_frac": _token_share(clipped, m, norms),
        "policy/approx_kl": _token_share(-log_ratio, m, norms),
    }


@register_loss("entropy", role="entropy", needs={"entropy"}, batch_keys={"response_mask"})
def entropy_term(out, batch, norms, *, coef, loss_agg_mode, horizon):
    """−coef·agg(entropy) (:func:`entropy_bonus`); ``policy/entropy_loss`` = agg(entropy)."""
    m = batch["response_mask"]
    entropy = agg_loss(out["entropy"], m, **_norm_kwargs(norms, loss_agg_mode, horizon))
    return -coef * entropy, {"policy/entropy_loss": entropy.detach()}


@register_loss("kl", role="kl", needs={"log_probs"}, batch_keys={"response_mask", "ref_log_probs"})
def kl_term(out, batch, norms, *, coef, kind, loss_agg_mode, horizon):
    """coef·agg(KL(π‖π_ref)) (:func:`kl_penalty` of ``kind``); ``policy/kl_loss`` = agg(KL)."""
    m = batch["response_mask"]
    keep = m != 0
    lp, ref = (torch.where(keep, x, 0.0) for x in (out["log_probs"], batch["ref_log_probs"]))
    kl = agg_loss(kl_penalty(lp, ref, kind), m, **_norm_kwargs(norms, loss_agg_mode, horizon))
    return coef * kl, {"policy/kl_loss": kl.detach()}


@register_loss(
    "value", role="value", needs={"values"}, batch_keys={"response_mask", "values", "returns"}
)
def value_term(out, batch, norms, *, cliprange_value, loss_agg_mode, horizon):
    """The clipped critic loss (:func:`value_loss`; ``batch["values"]`` are the old values).
    Metrics: ``critic/value_loss``, ``critic/vf_clip_frac``, ``critic/values_mean``."""
    m = batch["response_mask"]
    loss, clipped = value_token_loss(
        out["values"], batch["values"], batch["returns"], m != 0, cliprange_value
    )
    total = agg_loss(loss, m, **_norm_kwargs(norms, loss_agg_mode, horizon))
    return total, {
        "critic/value_loss": total.detach(),
        "critic/vf_clip_frac": _token_share(clipped, m, norms),
        "critic/values_mean": _token_share(out["values"], m, norms),
    }


@register_loss("nll", role="policy", needs={"log_probs"}, batch_keys={"response_mask"})
def nll_term(out, batch, norms, *, loss_agg_mode, horizon):
    """Supervised fine-tuning: agg(−log π) of the demonstrated tokens (``response_mask`` 1).
    Metrics: ``sft/loss`` and ``sft/sure_frac``, the share of rows whose every trained token
    has probability > 1/2 — a row that greedy decoding answers exactly (the argmax)."""
    m = batch["response_mask"]
    nll = agg_loss(-out["log_probs"], m, **_norm_kwargs(norms, loss_agg_mode, horizon))
    keep = m != 0
    unsure = keep & (out["log_probs"].detach() <= -math.log(2.0))
    sure = (keep.any(dim=1) & ~unsure.any(dim=1)).float().sum()
    return nll, {"sft/loss": nll.detach(), "sft/sure_frac": sure / at_least_one(norms.num_seqs)}


@dataclass(frozen=True)
class SumOfTerms:
    """A loss made of registered terms, each with its options; implements :class:`Loss`.

    ``total``: the metric name of the summed loss (``None``: no extra metric).
    """

    terms: tuple[tuple[LossTerm, dict], ...]
    total: str | None = None
    needs: frozenset[str] = field(init=False)
    batch_keys: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "needs", frozenset().union(*(t.needs for t, _ in self.terms)))
        keys = frozenset().union(*(t.batch_keys for t, _ in self.terms))
        object.__setattr__(self, "batch_keys", keys)

    def __call__(self, out, batch, norms: Normalizers) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch: ``out`` / ``batch`` ``[B, L]`` tensors -> ``(share [], metrics)``."""
        for what, given, wanted in (("out", out, self.needs), ("batch", batch, self.batch_keys)):
            missing = sorted(wanted - set(given))
            if missing:
                raise ValueError(f"{what} is missing keys {missing} this loss reads")
        if not isinstance(norms, Normalizers):
            raise TypeError(f"norms must be Normalizers, got {type(norms).__name__}")
        total, metrics = None, {}
        for term, options in self.terms:
            share, term_metrics = term.fn(out, batch, norms, **options)
            total = share if total is None else total + share
            metrics.update(term_metrics)
        if self.total is not None:
            metrics[self.total] = total.detach()
        return total, metrics


def _number(name: str, value, *, minimum: float = 0.0, strict: bool = False) -> float:
    """A finite real ≥ ``minimum`` (> with ``strict``), else ValueError/TypeError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value}")
    return float(value)


def _check_mode(loss_agg_mode: str, horizon) -> int | None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if horizon is None:
        if loss_agg_mode == "seq-mean-token-sum-norm":
            raise ValueError(
                "horizon is required with loss_agg_mode='seq-mean-token-sum-norm' "
                "(the fixed horizon: the maximum response length), got None"
            )
        return None
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon <= 0:
        raise ValueError(f"horizon must be a positive int, got {horizon!r}")
    return horizon


def build_loss(
    *,
    policy_loss: str = "ppo",
    loss_agg_mode: str = "token-mean",
    horizon: int | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    entropy_coeff: float = 0.0,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
) -> SumOfTerms:
    """The actor's loss: the policy term (+ ``entropy`` when ``entropy_coeff`` ≠ 0, then
    ``"entropy"`` is in ``needs``) (+ ``kl`` when ``kl_loss_coef`` > 0, then
    ``"ref_log_probs"`` is in ``batch_keys``). Metric ``policy/loss`` is the total.

    ``policy_loss``: a registered policy term — ``ppo`` (any aggregation; ``clip_ratio_c`` is
    its dual clip), ``gspo`` or ``cispo`` (only the aggregation their papers define,
    ``algos.config.POLICY_LOSS_AGG``; no dual clip). ``horizon``: the fixed horizon of
    ``seq-mean-token-sum-norm`` (the maximum response length), required for that mode.
    ``clip_ratio_c=None`` disables the dual clip. Bad options
    raise ``ValueError`` (``TypeError`` for a non-number) naming the argument.
    """
    term = LOSSES.get(policy_loss)
    if term is None or term.role != "policy":
        valid = sorted(n for n, t in LOSSES.items() if t.role == "policy")
        raise ValueError(f"policy_loss must be one of {valid}, got {policy_loss!r}")
    horizon = _check_mode(loss_agg_mode, horizon)
    defined = POLICY_LOSS_AGG.get(policy_loss, loss_agg_mode)
    if loss_agg_mode != defined:
        raise ValueError(
            f"loss_agg_mode: {policy_loss} is defined with {defined!r} (its paper's average), "
            f"got {loss_agg_mode!r}"
        )
    low = _number("clip_ratio_low", clip_ratio_low)
    high = _number("clip_ratio_high", clip_ratio_high)
    c = (
        None
        if clip_ratio_c is None
        else _number("clip_ratio_c", clip_ratio_c, minimum=1.0, strict=True)
    )
    check_clip(low, high, c)
    entropy_coeff = _number("entropy_coeff", entropy_coeff)
    kl_loss_coef = _number("kl_loss_coef", kl_loss_coef)
    if kl_loss_type not in KL_KINDS:
        raise ValueError(f"kl_loss_type must be one of {sorted(KL_KINDS)}, got {kl_loss_type!r}")
    agg = {"loss_agg_mode": loss_agg_mode, "horizon": horizon}
    policy = {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c, **agg}
    terms = [(term, {k: v for k, v in policy.items() if k in term.options})]
    if entropy_coeff != 0.0:
        terms.append((LOSSES["entropy"], {"coef": entropy_coeff, **agg}))
    if kl_loss_coef > 0.0:
        terms.append((LOSSES["kl"], {"coef": kl_loss_coef, "kind": kl_loss_type, **agg}))
    return SumOfTerms(tuple(terms), total="policy/loss")


def build_sft_loss(*, loss_agg_mode: str = "token-mean") -> SumOfTerms:
    """The supervised loss (the ``nll`` term): ``needs`` {"log_probs"}, ``batch_keys``
    {"response_mask"} (1 on the demonstrated tokens; 0 on observations and padding)."""
    horizon = _check_mode(loss_agg_mode, None)
    return SumOfTerms(((LOSSES["nll"], {"loss_agg_mode": loss_agg_mode, "horizon": horizon}),))


def build_value_loss(
    *,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    horizon: int | None = None,
) -> SumOfTerms:
    """The critic's loss (the ``value`` term): ``needs`` {"values"}, ``batch_keys``
    {"response_mask", "values" (the old values), "returns"}. ``cliprange_value=None``
    disables clipping; ``horizon`` as in :func:`build_loss`."""
    horizon = _check_mode(loss_agg_mode, horizon)
    if cliprange_value is not None:
        cliprange_value = _number("cliprange_value", cliprange_value, strict=True)
    options = {"cliprange_value": cliprange_value, "loss_agg_mode": loss_agg_mode}
    return SumOfTerms(((LOSSES["value"], {**options, "horizon": horizon}),))
