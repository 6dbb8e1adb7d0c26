"""Advantage estimators and their registry.

Every estimator is a function of keyword tensors returning ``(advantages, returns)``, both
``[B, L]`` float32. Notation: m = response_mask, r = token_level_rewards,
score_i = Σ_t r_{i,t}·m_{i,t}; a group is the set of rows sharing an ``index`` value (n = its
size). Inputs are read only where m ≠ 0 (selected, never just multiplied by m): a NaN or inf at
a masked position cannot reach an output, and outputs are exactly 0 there. A product with m is
used only on values computed from selected inputs (a per-row score, a running sum), which are
finite wherever the trained inputs are: there it is exact and cheaper than a selection.

The registry records which statistics each estimator needs from the engine (``needs``), so the
trainer asks for exactly those in the forward pass that computes log-probs. When the answer
depends on an option (OTB with ``energy="uniform"`` needs neither Σπ² nor old log-probs),
``Estimator.needs_for(**options)`` gives it; ``needs`` is the answer for default options.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from otbrl.algos.otb import (
    optimal_token_baseline,
    reward_to_go_and_energy,
    tir_optimal_token_baseline,
)
from otbrl.algos.reductions import (
    check_batch,
    check_tensor,
    group_ids,
    group_sum,
    masked_sum,
    whiten,
)

GRPO_EPS = 1e-6


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator.

    ``fn(**kwargs) -> (advantages [B, L], returns [B, L])``; ``needs``: the statistics (batch
    keys such as ``"old_log_probs"``, ``"sum_pi_squared"``, ``"values"``) it needs with default
    options; ``options_needs``: optional ``(**options) -> frozenset`` for option-dependent needs.
    ``group_relative``: a group whose rewards are all equal gets zero advantages, whatever the
    rest of the batch holds (what dynamic sampling relies on to drop it) — but for OTB's zero
    tail (``handle_zero_tail``): the tokens of its unique longest row past the second-longest
    have baseline 0 and keep their return. Dynamic sampling drops such a group all the same,
    as DAPO does: the rule is the rewards', not the estimator's. ``response_space``: its
    baseline counts positions in response space (the k-th model token of each row, tool
    observations skipped: TIR-OTB), so the metrics that describe it (OTB's zero tail) must too.
    ``group_local``: a group's advantages depend on that group's rows alone (no batch-wide
    normalisation): computed over any set of whole groups they are the same, which is what lets
    the trainer compute them micro-batch by micro-batch inside the update's forwards.
    """

    name: str
    fn: Callable[..., tuple[Tensor, Tensor]]
    needs: frozenset[str]
    options_needs: Callable[..., frozenset[str]] | None = None
    group_relative: bool = False
    response_space: bool = False
    group_local: bool = False
    params: frozenset[str] = field(init=False)  # keyword arguments fn takes
    takes_any: bool = field(init=False)  # fn has **kwargs: it is handed everything

    def __post_init__(self) -> None:
        params = inspect.signature(self.fn).parameters
        object.__setattr__(self, "params", frozenset(params))
        any_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        object.__setattr__(self, "takes_any", any_kw)

    def select(self, kwargs: dict) -> dict:
        """The subset of ``kwargs`` that ``fn`` takes."""
        if self.takes_any:
            return dict(kwargs)
        return {k: v for k, v in kwargs.items() if k in self.params}

    def needs_for(self, **options) -> frozenset[str]:
        """The statistics needed under these estimator options (unknown keys are ignored)."""
        if self.options_needs is None:
            return self.needs
        return frozenset(self.options_needs(**self.select(options)))


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(
    name: str,
    *,
    needs=(),
    options_needs: Callable[..., frozenset[str]] | None = None,
    group_relative: bool = False,
    response_space: bool = False,
    group_local: bool = False,
):
    """Decorator: register ``fn`` under ``name`` with the statistics it needs and the facts the
    trainer acts on (``Estimator.group_relative``, ``Estimator.response_space``,
    ``Estimator.group_local``)."""

    def wrap(fn):
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is already registered")
        ESTIMATORS[name] = Estimator(
            name, fn, frozenset(needs), options_needs, group_relative, response_space, group_local
        )
        return fn

    return wrap


# Short names for the variants the comparison tools measure: alias -> (registry name, options).
# `otbrl variance` also takes "name:key=value:..." for any other option set.
ESTIMATOR_ALIASES: dict[str, tuple[str, dict]] = {
    "otb": ("optimal_token_baseline", {}),
    "otb_notail": ("optimal_token_baseline", {"handle_zero_tail": False}),
    "otb_uniform": ("optimal_token_baseline", {"energy": "uniform"}),
    "otb_loo": ("optimal_token_baseline", {"leave_one_out": True}),
    "drgrpo": ("grpo", {"norm_adv_by_std_in_grpo": False}),
}


def get_estimator(name: str) -> Estimator:
    """The registered estimator called ``name``; ``ValueError`` listing valid names otherwise."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def compute_advantage(name: str, **kwargs) -> tuple[Tensor, Tensor]:
    """Run estimator ``name`` on a superset of keyword arguments.

    Each estimator receives only the arguments its function takes, so a trainer can pass one
    common dict (batch tensors plus options) to any estimator. Advantages are constants of the
    update: tensors that require grad (log-probs straight from a forward) are read detached.
    Returns ``(advantages, returns)``, both ``[B, L]`` float32.
    """
    est = get_estimator(name)
    selected = est.select(kwargs)
    detached = {
        k: v.detach() if isinstance(v, Tensor) and v.requires_grad else v
        for k, v in selected.items()
    }
    return est.fn(**detached)


def _otb_needs(energy: str = "logit_gradient", **_) -> frozenset[str]:
    if energy == "uniform":
        return frozenset()
    return frozenset({"old_log_probs", "sum_pi_squared"})


register_estimator(
    "optimal_token_baseline",
    needs=_otb_needs(),
    options_needs=_otb_needs,
    group_relative=True,
    group_local=True,
)(optimal_token_baseline)
register_estimator(
    "tir_optimal_token_baseline",
    needs=_otb_needs(),
    options_needs=_otb_needs,
    group_relative=True,
    response_space=True,
    group_local=True,
)(tir_optimal_token_baseline)


def _scores_and_groups(token_level_rewards, response_mask, index):
    r, m = check_batch(token_level_rewards, response_mask)
    gid, ng = group_ids(index, r.shape[0], r.device)
    n = torch.bincount(gid, minlength=ng).to(r.dtype)
    return masked_sum(r, m, dim=-1), m, gid, n


@register_estimator("grpo", group_relative=True, group_local=True)
def grpo(
    *, token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo: bool = True
) -> tuple[Tensor, Tensor]:
    """GRPO: a_i = (score_i − mean_g)/(std_g + 1e-6), std unbiased; broadcast ·m.

    ``norm_adv_by_std_in_grpo=False`` gives a_i = score_i − mean_g (Dr. GRPO). Groups of n = 1
    use mean 0, std 1. Shapes: ``[B, L]`` -> ``(advantages, returns)`` ``[B, L]`` (equal).
    """
    score, m, gid, n = _scores_and_groups(token_level_rewards, response_mask, index)
    mean = group_sum(score, gid, n.numel()) / n
    var = group_sum((score - mean[gid]) ** 2, gid, n.numel()) / (n - 1).clamp(min=1.0)
    single = n[gid] == 1
    mean_row = torch.where(single, 0.0, mean[gid])
    std_row = torch.where(single, 1.0, var.sqrt()[gid])
    a = score - mean_row
    if norm_adv_by_std_in_grpo:
        a = a / (std_row + GRPO_EPS)
    adv = a[:, None] * m
    return adv, adv.clone()


@register_estimator("rloo", group_relative=True, group_local=True)
def rloo(*, token_level_rewards, response_mask, index) -> tuple[Tensor, Tensor]:
    """RLOO: a_i = (n·score_i − Σ_g score)/(n − 1) (score minus the others' mean); n = 1: score_i.

    Shapes: ``[B, L]`` -> ``(advantages, returns)`` ``[B, L]``, a_i broadcast ·m (equal).
    """
    score, m, gid, n = _scores_and_groups(token_level_rewards, response_mask, index)
    total = group_sum(score, gid, n.numel())[gid]
    nr = n[gid]
    a = torch.where(nr > 1, (nr * score - total) / (nr - 1).clamp(min=1.0), score)
    adv = a[:, None] * m
    return adv, adv.clone()


@register_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    *, token_level_rewards, response_mask, index
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline: a_i = score_i − mean_g (n = 1: score_i), broadcast
    over tokens, whitened over all masked tokens of the batch, times m.

    Shapes: ``[B, L]`` -> ``(advantages, returns)`` ``[B, L]`` (equal).
    """
    score, m, gid, n = _scores_and_groups(token_level_rewards, response_mask, index)
    mean = group_sum(score, gid, n.numel()) / n
    a = torch.where(n[gid] > 1, score - mean[gid], score)
    # a is constant along each row, so whitening's token sums are a_i weighted by ℓ_i.
    lengths = m.sum(-1, keepdim=True)
    adv = whiten(a[:, None], lengths) * m
    return adv, adv.clone()


SCAN_BLOCK = 128  # positions per time-major block: small enough to stay in cache


def _time_major(x: Tensor, start: int, stop: int) -> Tensor:
    """A fresh ``[stop − start, B]`` copy (never a view: callers write into it)."""
    return x[:, start:stop].t().clone(memory_format=torch.contiguous_format)


def _reinforce_scan(r: Tensor, m: Tensor, gamma: float) -> Tensor:
    """R_t = r_t + γ·R_{t+1} at m_t = 1, R carried through m_t = 0; returns R·m ``[B, L]``.

    A loop over L (the recursion is sequential in t), vectorized over rows, one fused
    multiply-add per step on time-major blocks of ``SCAN_BLOCK`` positions.
    """
    B, L = r.shape
    out = torch.empty_like(r)
    carry = r.new_zeros(B)
    for start in range(((L - 1) // SCAN_BLOCK) * SCAN_BLOCK, -1, -SCAN_BLOCK):
        stop = min(start + SCAN_BLOCK, L)
        mT = _time_major(m, start, stop)
        uT = _time_major(r, start, stop).masked_fill_(mT == 0, 0.0)
        dT = mT * (gamma - 1.0) + 1.0  # γ where trained, 1 (carry through) elsewhere
        for t in range(stop - start - 1, -1, -1):
            carry = torch.addcmul(uT[t], dT[t], carry, out=uT[t])
        carry = carry.clone()  # it is a row of uT, which the next line masks
        out[:, start:stop] = uT.mul_(mT).t()
    return out


def _gae_scan(r: Tensor, m: Tensor, v: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE's A ``[B, L]`` (0 where m = 0), same blocked loop as :func:`_reinforce_scan`.

    Per step: δ_t = r_t − V_t + γ·V_next; A_t = m_t·δ_t + (γλ·m_t + 1 − m_t)·A_next;
    V_next ← m_t·V_t + (1 − m_t)·V_next.
    """
    B, L = r.shape
    out = torch.empty_like(r)
    a_next, v_next = r.new_zeros(B), r.new_zeros(B)
    delta, v_new = r.new_empty(B), r.new_empty(B)
    for start in range(((L - 1) // SCAN_BLOCK) * SCAN_BLOCK, -1, -SCAN_BLOCK):
        stop = min(start + SCAN_BLOCK, L)
        mT = _time_major(m, start, stop)
        skip = mT == 0  # r and V are not read there
        vT = _time_major(v, start, stop).masked_fill_(skip, 0.0)
        rvT = _time_major(r, start, stop).masked_fill_(skip, 0.0).sub_(vT)
        keepT = 1.0 - mT
        cT = mT * (gamma * lam) + keepT
        mvT = vT.mul_(mT)
        aT = torch.empty_like(mT)
        for t in range(stop - start - 1, -1, -1):
            torch.add(rvT[t], v_next, alpha=gamma, out=delta)
            a_next = torch.mul(mT[t], delta, out=aT[t]).addcmul_(cT[t], a_next)
            torch.addcmul(mvT[t], keepT[t], v_next, out=v_new)
            v_next, v_new = v_new, v_next
        a_next = a_next.clone()  # it is a row of aT, which the next line masks
        out[:, start:stop] = aT.mul_(mT).t()
    return out


@register_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    *, token_level_rewards, response_mask, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted returns R_t = r_t + γ·R_{t+1} that skip masked positions (at
    m_t = 0, R passes through unchanged and the output is 0); advantages = whiten(R)·m.

    Shapes: ``[B, L]`` -> ``(advantages, returns = R·m)`` ``[B, L]``.
    """
    r, m = check_batch(token_level_rewards, response_mask)
    if gamma == 1.0:  # undiscounted: R is OTB's reward-to-go G
        R = reward_to_go_and_energy(r, m, energy="uniform")[0].mul_(m)  # G is finite: exact
    else:
        R = _reinforce_scan(r, m, float(gamma))
    return whiten(R, m), R


@register_estimator("gae", needs={"values"})
def gae(
    *, token_level_rewards, response_mask, values, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """GAE: δ_t = r_t + γ·V_next − V_t, A_t = δ_t + γλ·A_next, where V_next/A_next skip masked
    positions (carried through unchanged; 0 past the end).

    Shapes: ``[B, L]`` -> ``(advantages = whiten(A)·m, returns = (A + V)·m)`` ``[B, L]``.
    """
    r, m = check_batch(token_level_rewards, response_mask)
    v = check_tensor("values", values, r.shape)
    A = _gae_scan(r, m, v, float(gamma), float(lam))
    returns = torch.add(A, v).masked_fill_(m.bool().logical_not_(), 0.0)
    return whiten(A, m), returns
