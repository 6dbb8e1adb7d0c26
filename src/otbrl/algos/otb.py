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


def row_lengths(response_mask: Tensor) -> Tensor:
    """Σ_t m per row, ``[B, L]`` -> ``[B]`` float32 (a mat-vec: exact integer counts < 2^24)."""
    ones = torch.ones(response_mask.shape[1], device=response_mask.device)
    return torch.mv(response_mask, ones)


def rows_with_holes(response_mask: Tensor, lengths: Tensor | None = None) -> Tensor:
    """``[B]`` bool: rows whose trained tokens are not the prefix 0..ℓ−1 (tool-output holes,
    or leading padding). Assumes a 0/1 mask.

    A row's positions sum to ℓ(ℓ−1)/2 exactly when they are 0..ℓ−1 (any other set of ℓ distinct
    positions sums higher); a float32 mat-vec is exact while L(L−1)/2 < 2^24.
    """
    L = response_mask.shape[1]
    if L * (L - 1) // 2 >= 2**24:  # long rows: look for a 0 -> 1 step instead
        return (response_mask[:, 1:] > response_mask[:, :-1]).any(-1)
    if lengths is None:
        lengths = row_lengths(response_mask)
    positions = torch.arange(L, device=response_mask.device, dtype=response_mask.dtype)
    return torch.mv(response_mask, positions) != lengths * (lengths - 1) / 2


def _flat_positions(mask_rows: Tensor, gid_rows: Tensor, num_groups: int) -> Tensor:
    """Flat group-space index gid·L + k of every position of the given rows, ``[R, L]`` ->
    ``[R·L]`` (``mask_rows`` is a scratch copy and is overwritten).

    k = (number of trained tokens up to t) − 1: the response-token index. Unmasked positions
    carry num = den = 0, so where they land (their clamped k) adds nothing, and what they read
    back is multiplied by m = 0.
    """
    L = mask_rows.shape[1]
    kpos = mask_rows.cumsum_(-1).sub_(1).clamp_(min=0)
    if num_groups * L < 2**24:  # float32 holds the index exactly: convert in place
        kpos.add_((gid_rows.to(kpos.dtype) * L)[:, None])
        flat = kpos.view(torch.int32)  # same 4-byte slots, elementwise conversion
        flat.copy_(kpos)
        return flat.view(-1)
    return (kpos.to(torch.int64) + (gid_rows * L)[:, None]).view(-1)


class _GroupLayout:
    """Where each row's values sit in group space ``[num_groups, L]``.

    A row without holes puts position t at group column t: one row-wise ``index_add_`` and
    ``index_select`` (OTB uses only this). TIR-OTB puts a row's k-th response token at column k:
    rows with holes go through a flat ``index_add_`` / ``index_select`` with index gid·L + k;
    when most rows (≥ 3/4) have holes, every row does (cheaper than splitting).
    """

    def __init__(
        self, gid: Tensor, num_groups: int, seq_len: int, response_mask: Tensor | None = None
    ):
        self.gid, self.ng, self.L = gid, num_groups, seq_len
        self.mode, self.row_gid = "rows", gid
        if response_mask is None:
            return
        # Rows without holes already have k = t; only the others need their k computed.
        holes = rows_with_holes(response_mask).nonzero()[:, 0]  # one host sync per batch
        if 4 * holes.numel() >= 3 * gid.numel():
            self.mode = "flat"
            self.flat = _flat_positions(response_mask.clone(), gid, num_groups)
        elif holes.numel():
            self.mode, self.holes = "mixed", holes
            self.row_gid = gid.index_fill(0, holes, num_groups)  # a dump row for hole rows
            rows = response_mask.index_select(0, holes)
            self.flat = _flat_positions(rows, gid.index_select(0, holes), num_groups)

    def sums(self, x: Tensor) -> Tensor:
        """Per-group column sums of ``x`` ``[B, L]`` -> ``[num_groups, L]``."""
        if self.mode == "flat":
            out = torch.zeros(self.ng * self.L, device=x.device)
            return out.index_add_(0, self.flat, x.view(-1)).view(self.ng, self.L)
        rows = self.ng + (self.mode == "mixed")
        out = torch.zeros((rows, self.L), device=x.device).index_add_(0, self.row_gid, x)
        out = out[: self.ng]
        if self.mode == "mixed":
            out.view(-1).index_add_(0, self.flat, x.index_select(0, self.holes).view(-1))
        return out

    def gather(self, table: Tensor, out: Tensor) -> Tensor:
        """Each row's entries of a group table ``[num_groups, L]`` -> ``out`` ``[B, L]``."""
        if self.mode == "flat":
            torch.index_select(table.reshape(-1), 0, self.flat, out=out.view(-1))
            return out
        torch.index_select(table, 0, self.gid, out=out)
        if self.mode == "mixed":
            picked = table.reshape(-1).index_select(0, self.flat).view(-1, self.L)
            out.index_copy_(0, self.holes, picked)
        return out


def _baseline(
    G: Tensor,
    den: Tensor,
    layout: _GroupLayout,
    n_members: Tensor,
    leave_one_out: bool,
    group_start: Tensor | None = None,
    uncut_rows: Tensor | None = None,
) -> Tensor:
    """Per-row baselines ``[B, L]`` from den = W·m ``[B, L]`` (its buffer is reused).

    Group baseline: Σ G·den / (Σ den + ε), 0 for groups of one member; with ``group_start``,
    cut to 0 from ``group_start[g]`` on, except for ``uncut_rows`` (row ids), which read the
    uncut values. Leave-one-out: (Σ_g G·den − G_i·den_i) / (Σ_g den − den_i + ε).
    """
    sum_den = layout.sums(den)
    if leave_one_out:
        num = den * G
        sum_num = layout.sums(num)
        loo_den = layout.gather(sum_den, torch.empty_like(den)).sub_(den).add_(OTB_EPS)
        baseline = layout.gather(sum_num, den).sub_(num).div_(loo_den)
        return baseline.mul_((n_members[layout.gid] > 1).to(den.dtype)[:, None])
    num = den.mul_(G)
    sum_num = layout.sums(num)
    base = sum_num.div_(sum_den.add_(OTB_EPS))
    base.mul_((n_members > 1).to(base.dtype)[:, None])  # groups of one get B = 0
    if group_start is None:
        return layout.gather(base, num)
    saved = None
    if uncut_rows is not None and uncut_rows.numel():
        saved = base.index_select(0, layout.gid.index_select(0, uncut_rows))
    positions = torch.arange(base.shape[1], device=base.device)
    base.masked_fill_(positions[None] >= group_start[:, None], 0.0)
    baseline = layout.gather(base, num)
    if saved is not None:
        baseline.index_copy_(0, uncut_rows, saved)
    return baseline


def _row_ends(response_mask: Tensor, lengths: Tensor) -> Tensor:
    """``[B]`` one past each row's last trained position (ℓ for a row without holes)."""
    holes = rows_with_holes(response_mask, lengths).nonzero()[:, 0]
    ends = lengths.clone()
    if holes.numel():
        positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
        last = response_mask.index_select(0, holes).mul_(positions).amax(-1)
        ends.index_copy_(0, holes, last.to(ends.dtype))
    return ends


def _returns_energy_groups(
    token_level_rewards,
    response_mask,
    index,
    old_log_probs,
    sum_pi_squared,
    rollout_is_weights,
    energy,
) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Shared by both OTB forms: ``(G, W, m, gid, num_groups)``; G, W, m ``[B, L]``, gid ``[B]``."""
    G, W = reward_to_go_and_energy(
        token_level_rewards,
        response_mask,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
        energy=energy,
    )
    gid, ng = group_ids(index, G.shape[0], G.device)
    return G, W, response_mask.float(), gid, ng


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
    G, W, m, gid, ng = _returns_energy_groups(
        token_level_rewards,
        response_mask,
        index,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
        energy,
    )
    L = G.shape[1]
    n_members = torch.bincount(gid, minlength=ng)
    layout = _GroupLayout(gid, ng, L)
    den = W.mul_(m)
    if not handle_zero_tail:
        baseline = _baseline(G, den, layout, n_members, leave_one_out)
    else:
        lengths = row_lengths(m)
        row_start, has_tail, group_start = zero_tail_start(lengths, gid, ng, L)
        if leave_one_out:  # per-row baselines: cut the (at most one per group) tail rows
            baseline = _baseline(G, den, layout, n_members, leave_one_out)
            rows = has_tail.nonzero()[:, 0]  # one host sync per batch
            cut = baseline.index_select(0, rows)
            positions = torch.arange(L, device=G.device)
            cut.masked_fill_(positions[None] >= row_start.index_select(0, rows)[:, None], 0.0)
            baseline.index_copy_(0, rows, cut)
        else:
            # Cut the group's baseline from ℓ_2 on: that reaches only the tail row, except for
            # rows whose holes carry them past ℓ_2; those read the uncut values.
            ends = _row_ends(m, lengths)
            uncut = ((~has_tail) & (ends > group_start[gid])).nonzero()[:, 0]
            baseline = _baseline(G, den, layout, n_members, False, group_start, uncut)
    advantages = torch.sub(G, baseline, out=baseline).mul_(m)
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
    as in :func:`optimal_token_baseline`. The mask must be 0/1.

    Shapes: ``[B, L]`` tensors, ``index`` ``[B]`` -> ``(advantages, returns)`` ``[B, L]``;
    advantages are (G − B)·m at the masked positions, 0 elsewhere; returns = G (not masked).
    """
    G, W, m, gid, ng = _returns_energy_groups(
        token_level_rewards,
        response_mask,
        index,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
        energy,
    )
    L = G.shape[1]
    lengths = row_lengths(m)
    member = lengths > 0
    n_members = torch.zeros(ng, dtype=torch.int64, device=G.device).index_add_(
        0, gid, member.long()
    )
    layout = _GroupLayout(gid, ng, L, m)
    group_start = None
    if handle_zero_tail and not leave_one_out:
        # In k space no other member has a token at k ≥ ℓ_2, so cutting the group's baseline
        # there touches only the unique longest row. Leave-one-out needs no cut at all: that
        # row's "others" have nothing at k ≥ ℓ_2, so its baseline is already exactly 0.
        _, _, group_start = zero_tail_start(lengths, gid, ng, L, member)
    baseline = _baseline(G, W.mul_(m), layout, n_members, leave_one_out, group_start)
    advantages = torch.sub(G, baseline, out=baseline).mul_(m)
    return advantages, G
