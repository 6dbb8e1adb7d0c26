"""Optimal Token Baseline (OTB) and its multi-turn form (TIR-OTB), vectorized.

Notation (all ``[B, L]``): m = response_mask, r = token_level_rewards,
G_{i,t} = Σ_{j≥t} r_{i,j} m_{i,j} (undiscounted reward-to-go),
w_{i,t} = 1 − 2·exp(old_log_probs) + sum_pi_squared = ‖∇_z log π(y_t)‖² (the squared
logit-gradient norm of the sampled token), times rollout_is_weights² when given,
W_{i,t} = Σ_{j≤t} w_{i,j} m_{i,j}. A group is the set of rows sharing an ``index`` value.

The baseline at position t of a group is the W-weighted mean of G over the rows active there:
B_t = Σ_i G_{i,t} W_{i,t} m_{i,t} / (Σ_i W_{i,t} m_{i,t} + 1e-8).

Group sums are one ``index_add_`` (no Python loop over groups or rows, no host sync per
group). Fresh ``[B, L]`` allocations cost as much as arithmetic on this hardware (page faults),
so the code reuses the buffers it allocated; that is why some lines write into ``out=``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from otbrl.algos._common import check_batch, check_tensor, group_ids

OTB_EPS = 1e-8
ENERGIES = ("logit_gradient", "uniform")


def _check_energy(energy: str) -> None:
    if energy not in ENERGIES:
        raise ValueError(f"energy must be one of {ENERGIES}, got {energy!r}")


def reward_to_go_and_energy(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    *,
    rollout_is_weights: Tensor | None = None,
    energy: str = "logit_gradient",
) -> tuple[Tensor, Tensor]:
    """G (reward-to-go) and W (cumulative token energy), the work every OTB variant must do.

    Shapes: all inputs ``[B, L]`` -> ``(G, W)`` both ``[B, L]`` float32.
    ``energy="logit_gradient"``: w = 1 − 2·exp(old_log_probs) + sum_pi_squared;
    ``energy="uniform"``: w = 1 (old_log_probs and sum_pi_squared are not used).
    Either way w is multiplied by rollout_is_weights² when given. W = cumsum(w·m); G is not
    masked (it is the reward-to-go of the trained tokens seen from every position).
    """
    _check_energy(energy)
    r, m = check_batch(token_level_rewards, response_mask)
    shape = r.shape
    # Reverse along L with index_select(out=) rather than flip(): flip always allocates.
    reverse = torch.arange(shape[1] - 1, -1, -1, device=r.device)
    rm = torch.mul(r, m)
    G = torch.index_select(rm, 1, reverse)
    G.cumsum_(-1)
    torch.index_select(G, 1, reverse, out=rm)
    G, W = rm, G  # W reuses the reversed scratch buffer
    if energy == "logit_gradient":
        old_log_probs = check_tensor("old_log_probs", old_log_probs, shape)
        sum_pi_squared = check_tensor("sum_pi_squared", sum_pi_squared, shape)
        torch.exp(old_log_probs, out=W).mul_(-2.0).add_(sum_pi_squared).add_(1.0).mul_(m)
    else:
        W.copy_(m)
    if rollout_is_weights is not None:
        isw = check_tensor("rollout_is_weights", rollout_is_weights, shape)
        W.mul_(isw).mul_(isw)
    W.cumsum_(-1)
    return G, W


def zero_tail_start(
    lengths: Tensor, gid: Tensor, num_groups: int, seq_len: int, member: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Where OTB's zero tail starts, per row and per group.

    If exactly one member of a group has the strictly largest length ℓ_max, that row's
    baseline is 0 from position ℓ_2 on (ℓ_2 = the group's second-largest member length).

    Args:
        lengths: ``[B]`` response lengths Σ_t m.
        gid: ``[B]`` int64 dense group ids; num_groups: their count.
        seq_len: L, the "no tail" sentinel.
        member: ``[B]`` bool, rows that count as group members (all when None).

    Returns:
        ``(row_start [B] int64, has_tail [B] bool, group_start [num_groups] int64)``:
        ``row_start`` is ℓ_2 for the unique longest member of a group of ≥ 2 members, else L;
        ``group_start`` is ℓ_2 for groups that have such a row, else L.
    """
    lengths = lengths.to(torch.int64)
    if member is not None:
        lengths = torch.where(member, lengths, -1)
    neg = torch.full((num_groups,), -1, dtype=torch.int64, device=lengths.device)
    gmax = neg.scatter_reduce(0, gid, lengths, "amax")
    at_max = (lengths == gmax[gid]) & (lengths >= 0)
    n_at_max = torch.zeros_like(neg).index_add_(0, gid, at_max.long())
    second = neg.scatter_reduce(0, gid, torch.where(at_max, -1, lengths), "amax")
    # second ≥ 0 means the group has another member, so it has ≥ 2 members.
    group_has = (n_at_max == 1) & (second >= 0)
    group_start = torch.where(group_has, second, seq_len)
    has_tail = at_max & group_has[gid]
    row_start = torch.where(has_tail, group_start[gid], seq_len)
    return row_start, has_tail, group_start


def zero_tail_mask(response_mask: Tensor, index, *, response_space: bool = False) -> Tensor:
    """Bool ``[B, L]``: the trained tokens whose OTB baseline the zero tail sets to 0.

    ``response_space=False``: OTB (positions are absolute t; every row is a member).
    ``response_space=True``: TIR-OTB (positions are response-token indices k; rows with an
    empty response are not members).
    """
    m = check_tensor("response_mask", response_mask)
    if m.dim() != 2:
        raise ValueError(f"response_mask must be 2-D [B, L], got shape {tuple(m.shape)}")
    B, L = m.shape
    gid, ng = group_ids(index, B, m.device)
    lengths = m.sum(-1)
    member = lengths > 0 if response_space else None
    row_start, _, _ = zero_tail_start(lengths, gid, ng, L, member)
    pos = m.cumsum(-1) - 1 if response_space else torch.arange(L, device=m.device)[None]
    return (m > 0) & (pos >= row_start[:, None])


def _group_table(
    sum_num: Tensor, sum_den: Tensor, n_members: Tensor, group_start: Tensor | None
) -> Tensor:
    """Per-group baselines ``[ng, K]``; with a zero tail, ``[2·ng, K]`` where row ng+g is row g
    cut to 0 from ``group_start[g]`` on (the slot the group's unique longest row reads)."""
    ng, K = sum_num.shape
    base = sum_num.div_(sum_den.add_(OTB_EPS))
    base.mul_((n_members > 1).to(base.dtype)[:, None])  # groups of one get B = 0
    if group_start is None:
        return base
    table = torch.empty((2 * ng, K), dtype=base.dtype, device=base.device)
    table[:ng] = base
    keep = torch.arange(K, device=base.device)[None] < group_start[:, None]
    torch.mul(base, keep, out=table[ng:])
    return table


def _loo_baseline(gather, sum_num, sum_den, num, den, n_members_row) -> Tensor:
    """Leave-one-out: (Σ_g num − num_i) / (Σ_g den − den_i + ε); groups of one get 0.

    ``gather(table, dst)`` reads each row's group entries of ``table`` into ``dst``. The result
    is written into ``den``'s buffer (``num`` is left intact for the caller).
    """
    loo_den = gather(sum_den, torch.empty_like(den)).sub_(den)
    loo_num = gather(sum_num, den).sub_(num)
    loo_num.div_(loo_den.add_(OTB_EPS))
    return loo_num.mul_((n_members_row > 1).to(loo_num.dtype)[:, None])


def optimal_token_baseline(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index,
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    leave_one_out: bool = False,
    energy: str = "logit_gradient",
) -> tuple[Tensor, Tensor]:
    """OTB advantages: (G − B)·m with the per-position group baseline B (module docstring).

    Shapes: ``[B, L]`` tensors, ``index`` ``[B]`` -> ``(advantages, returns)`` ``[B, L]`` float32.
    - Every row is a group member (an empty response too); groups of n = 1 get B = 0.
    - ``handle_zero_tail``: if exactly one row has the strictly largest length ℓ_max, its
      baseline is 0 from absolute position ℓ_2 (second-largest length) on.
    - ``leave_one_out``: row i's baseline uses the other rows of its group only (unbiased);
      n = 1 -> 0. ``energy``: ``"logit_gradient"`` (needs old_log_probs, sum_pi_squared) or
      ``"uniform"`` (w ≡ 1, the ablation).
    - returns = G.
    """
    G, W = reward_to_go_and_energy(
        token_level_rewards,
        response_mask,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
        energy=energy,
    )
    m = response_mask.float()
    B, L = G.shape
    gid, ng = group_ids(index, B, G.device)
    n_members = torch.bincount(gid, minlength=ng)
    den = W.mul_(m)
    num = torch.mul(G, den)  # becomes the advantages buffer at the end
    sum_den = torch.zeros((ng, L), device=G.device).index_add_(0, gid, den)
    sum_num = torch.zeros((ng, L), device=G.device).index_add_(0, gid, num)
    row_start = has_tail = group_start = None
    if handle_zero_tail:
        row_start, has_tail, group_start = zero_tail_start(m.sum(-1), gid, ng, L)
    if leave_one_out:

        def gather(table, out):
            return torch.index_select(table, 0, gid, out=out)

        baseline = _loo_baseline(gather, sum_num, sum_den, num, den, n_members[gid])
        if row_start is not None:
            tail = torch.arange(L, device=G.device)[None] >= row_start[:, None]
            baseline.masked_fill_(tail, 0.0)
    else:
        table = _group_table(sum_num, sum_den, n_members, group_start)
        slot = gid if has_tail is None else gid + ng * has_tail.long()
        baseline = torch.index_select(table, 0, slot, out=den)
    advantages = torch.sub(G, baseline, out=num).mul_(m)
    return advantages, G


def tir_optimal_token_baseline(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index,
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    leave_one_out: bool = False,
    energy: str = "logit_gradient",
) -> tuple[Tensor, Tensor]:
    """TIR-OTB: OTB aligned by response-token index k instead of absolute position.

    For multi-turn rollouts whose mask has holes (tool output is not trained on). Row i's k-th
    response token is its k-th position with m = 1 (k = 0..ℓ_i−1). G, W are as in OTB; the group
    baseline B_k = Σ_i G_{i,k} W_{i,k} / (Σ_i W_{i,k} + 1e-8) sums over the members that have a
    k-th token. Rows with an empty response are not members; groups of n = 1 member get B = 0;
    the zero tail (``handle_zero_tail``) applies in k space; ``leave_one_out`` and ``energy``
    as in :func:`optimal_token_baseline`.

    Shapes: ``[B, L]`` tensors, ``index`` ``[B]`` -> ``(advantages, returns)`` ``[B, L]``;
    advantages are (G − B)·m at the masked positions, 0 elsewhere; returns = G (not masked).
    """
    G, W = reward_to_go_and_energy(
        token_level_rewards,
        response_mask,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
        energy=energy,
    )
    m = response_mask.float()
    B, L = G.shape
    gid, ng = group_ids(index, B, G.device)
    lengths = m.sum(-1)
    member = lengths > 0
    n_members = torch.zeros(ng, dtype=torch.int64, device=G.device).index_add_(
        0, gid, member.long()
    )
    # Flat index of (group, k) for every position: k = (# masked tokens up to t) − 1. Unmasked
    # positions carry num = den = 0, so where they land (clamped k) adds nothing, and what
    # they read back is multiplied by m = 0. float32 counts are exact up to 2^24 > L.
    out = torch.cumsum(m, -1)
    itype = torch.int32 if 2 * ng * L < 2**31 else torch.int64
    flat = out.to(itype).sub_(1).clamp_(min=0)
    flat.add_((gid * L).to(itype)[:, None])
    flat = flat.view(-1)
    den = W.mul_(m)
    num = torch.mul(G, den, out=out)
    sum_den = torch.zeros(ng * L, device=G.device).index_add_(0, flat, den.view(-1))
    sum_num = torch.zeros(ng * L, device=G.device).index_add_(0, flat, num.view(-1))
    sum_den, sum_num = sum_den.view(ng, L), sum_num.view(ng, L)
    has_tail = group_start = None
    if handle_zero_tail:
        _, has_tail, group_start = zero_tail_start(lengths, gid, ng, L, member)

    if leave_one_out:

        def gather(table, dst):
            torch.index_select(table.view(-1), 0, flat, out=dst.view(-1))
            return dst

        # In k space no other member has a token at k ≥ ℓ_2, so the leave-one-out baseline of
        # the unique longest row is already exactly 0 there: the zero tail needs no extra step.
        baseline = _loo_baseline(gather, sum_num, sum_den, num, den, n_members[gid])
    else:
        table = _group_table(sum_num, sum_den, n_members, group_start)
        if has_tail is not None:  # the unique longest row reads its group's cut copy
            flat.view(B, L).add_((has_tail.to(itype) * (ng * L))[:, None])
        baseline = torch.index_select(table.view(-1), 0, flat, out=den.view(-1)).view(B, L)
    advantages = torch.sub(G, baseline, out=num).mul_(m)
    return advantages, G
