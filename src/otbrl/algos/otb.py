"""Optimal Token Baseline (OTB) and its multi-turn form (TIR-OTB), vectorized.

Notation (all ``[B, L]``): m = response_mask (0/1), r = token_level_rewards,
G_{i,t} = Σ_{j≥t} r_{i,j} m_{i,j} (undiscounted reward-to-go),
w_{i,t} = 1 − 2·exp(old_log_probs) + sum_pi_squared = ‖∇_z log π(y_t)‖² (the squared
logit-gradient norm of the sampled token), times rollout_is_weights² when given,
W_{i,t} = Σ_{j≤t} w_{i,j} m_{i,j}. A group is the set of rows sharing an ``index`` value.

The baseline at position t of a group is the W-weighted mean of G over the rows active there,
and the advantage is the reward-to-go minus it::

    B_t = Σ_i G_{i,t} W_{i,t} m_{i,t} / (Σ_i W_{i,t} m_{i,t} + 1e-8)
    A_{i,t} = (G_{i,t} − B_t)·m_{i,t}

The inputs are selected with m (``torch.where``) before any arithmetic, so a NaN or inf where
m = 0 (padding, tool output) never reaches an output, which is 0 there. The later products with
m act on sums of selected terms only (finite wherever the trained inputs are): exact there.
Group sums are one row-wise ``index_add_`` into a ``[num_groups, L]`` table (no Python loop
over groups or rows). Fresh ``[B, L]`` buffers cost as much as arithmetic on the CPUs measured
(page faults), so the code writes into buffers it allocated; that is what the ``out=`` are for.
"""

from __future__ import annotations

import torch
from torch import Tensor

from otbrl.algos.config import ENERGIES
from otbrl.algos.reductions import check_batch, check_tensor, group_ids, group_sum

OTB_EPS = 1e-8


def _check_energy(energy: str) -> None:
    if energy not in ENERGIES:
        raise ValueError(f"energy must be one of {ENERGIES}, got {energy!r}")


def _trained(m: Tensor) -> Tensor:
    # m.bool() is m ≠ 0, several times faster on CPU than the float comparison
    return m.bool()


def _energy(m, keep, old_log_probs, sum_pi_squared, rollout_is_weights, energy, out=None):
    """w·m into ``out`` (see :func:`token_energy`); ``keep`` = (m ≠ 0), computed once."""
    _check_energy(energy)
    if energy == "logit_gradient":
        old_log_probs = check_tensor("old_log_probs", old_log_probs, m.shape)
        sum_pi_squared = check_tensor("sum_pi_squared", sum_pi_squared, m.shape)
        w = torch.exp(old_log_probs, out=out)
        w = torch.add(sum_pi_squared, w, alpha=-2.0, out=w).add_(1.0)
    else:
        w = torch.ones_like(m) if out is None else out.fill_(1.0)
    if rollout_is_weights is not None:
        isw = check_tensor("rollout_is_weights", rollout_is_weights, m.shape)
        w.mul_(isw).mul_(isw)
    return torch.where(keep, w, w.new_zeros(()), out=w)


def token_energy(
    response_mask: Tensor,
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    *,
    rollout_is_weights: Tensor | None = None,
    energy: str = "logit_gradient",
) -> Tensor:
    """Per-token energy w·m, ``[B, L]`` -> ``[B, L]`` float32, exactly 0 where m = 0.

    ``energy="logit_gradient"``: w = 1 − 2·exp(old_log_probs) + sum_pi_squared;
    ``energy="uniform"``: w = 1 (old_log_probs and sum_pi_squared are not used).
    Either way w is multiplied by rollout_is_weights² when given.
    """
    m = check_tensor("response_mask", response_mask)
    if m.dim() != 2:
        raise ValueError(f"response_mask must be 2-D [B, L], got shape {tuple(m.shape)}")
    return _energy(m, _trained(m), old_log_probs, sum_pi_squared, rollout_is_weights, energy)


def _returns_and_energy(r, m, keep, old_log_probs, sum_pi_squared, rollout_is_weights, energy):
    # G reversed, cumsum, reversed back into r·m's buffer (index_select(out=): flip allocates)
    reverse = torch.arange(r.shape[1] - 1, -1, -1, device=r.device)
    rm = torch.where(keep, r, 0.0)
    G = rm.flip(1).cumsum_(1)
    G, W = torch.index_select(G, 1, reverse, out=rm), G  # W reuses the reversed scratch
    _energy(m, keep, old_log_probs, sum_pi_squared, rollout_is_weights, energy, out=W)
    return G, W.cumsum_(1)


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

    Shapes: all inputs ``[B, L]`` -> ``(G, W)`` both ``[B, L]`` float32. W = cumsum of
    :func:`token_energy`; G is not masked (it is the reward-to-go of the trained tokens seen
    from every position). Neither reads an input where m = 0.
    """
    r, m = check_batch(token_level_rewards, response_mask)
    return _returns_and_energy(
        r, m, _trained(m), old_log_probs, sum_pi_squared, rollout_is_weights, energy
    )


def zero_tail_start(
    lengths: Tensor, gid: Tensor, num_groups: int, seq_len: int, member: Tensor | None = None
) -> Tensor:
    """Where OTB's zero tail starts, per row: ``[B]`` int64.

    If exactly one member of a group has the strictly largest length ℓ_max, that row's
    baseline is 0 from position ℓ_2 on (ℓ_2 = the group's second-largest member length); every
    other row gets L (``seq_len``, no tail). ``lengths`` ``[B]`` = Σ_t m; ``gid`` ``[B]`` dense
    group ids; ``member`` ``[B]`` bool, the rows that count as group members (all when None).
    """
    lengths = lengths.to(torch.int64)
    if member is not None:
        lengths = torch.where(member, lengths, -1)
    none = torch.full((num_groups,), -1, dtype=torch.int64, device=lengths.device)
    longest = none.scatter_reduce(0, gid, lengths, "amax")
    at_max = (lengths == longest[gid]) & (lengths >= 0)
    n_at_max = torch.zeros_like(none).index_add_(0, gid, at_max.long())
    second = none.scatter_reduce(0, gid, torch.where(at_max, -1, lengths), "amax")
    # second ≥ 0: the group has another member, so it has ≥ 2 members
    has_tail = at_max & ((n_at_max == 1) & (second >= 0))[gid]
    return torch.where(has_tail, second[gid], seq_len)


def baseline_cut_from(
    lengths: Tensor,
    gid: Tensor,
    num_groups: int,
    seq_len: int,
    *,
    member: Tensor | None = None,
    zero_tail: bool = True,
) -> Tensor:
    """Per row, the first position from which its baseline is 0: ``[B]`` int64.

    0 for a row whose group has fewer than two members (a lone row has no baseline), the zero
    tail's start (:func:`zero_tail_start`) with ``zero_tail``, else L. Arguments as there.
    """
    if member is None:
        member = torch.ones_like(gid, dtype=torch.bool)
    n_members = torch.zeros(num_groups, dtype=torch.int64, device=gid.device)
    n_members.index_add_(0, gid, member.long())
    if zero_tail:
        start = zero_tail_start(lengths, gid, num_groups, seq_len, member)
    else:
        start = torch.full_like(gid, seq_len)
    return torch.where(n_members[gid] > 1, start, 0)


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
    start = zero_tail_start(lengths, gid, ng, L, member)
    pos = m.cumsum(-1) - 1 if response_space else torch.arange(L, device=m.device)[None]
    return (m > 0) & (pos >= start[:, None])


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


class _GroupTable:
    """Where each row's tokens sit in a group table ``[num_groups, L]``.

    A row without holes puts position t at column t: all such rows go through one row-wise
    ``index_add_`` / ``index_select``. A row with holes (``holes``, TIR-OTB only) puts its k-th
    trained token at column k: those rows go element by element through the flat index
    g·L + k (their row-wise sums land in a spare row, ``num_groups``, and are dropped). An
    untrained position gets its predecessor's k; it adds 0 there (its values are 0). Measured
    (``benchmarks/advantages.py``): the element-wise path costs ~2× the row-wise one, which is
    why rows without holes keep the row-wise one.
    """

    def __init__(self, gid: Tensor, ng: int, keep: Tensor, holes: Tensor | None = None):
        self.gid, self.ng, self.L = gid, ng, keep.shape[1]
        self.holes = holes if holes is not None and holes.numel() else None
        self.every_row = self.holes is not None and self.holes.numel() == gid.numel()
        if self.holes is None:
            return
        self.row_gid = gid.index_fill(0, self.holes, ng)
        index_dtype = torch.int32 if (ng + 1) * self.L < 2**31 else torch.int64
        self.offsets = self._hole_rows(gid).to(index_dtype)[:, None] * self.L  # g·L, [R, 1]
        k = self._hole_rows(keep).cumsum(1, dtype=index_dtype).sub_(1).clamp_(0)
        self.flat = k.add_(self.offsets)  # [R, L], non-decreasing along a row

    def _hole_rows(self, x: Tensor) -> Tensor:
        return x if self.every_row else x.index_select(0, self.holes)

    def sums(self, x: Tensor) -> Tensor:
        """Per group and column, the sum over its rows: ``[B, L]`` -> ``[num_groups, L]``."""
        if self.holes is None:
            return group_sum(x, self.gid, self.ng)
        if self.every_row:
            table = x.new_zeros(self.ng, self.L)
        else:
            table = group_sum(x, self.row_gid, self.ng + 1)[: self.ng]
        flat, values = self.flat.view(-1), self._hole_rows(x).view(-1)
        return table.view(-1).index_add_(0, flat, values).view_as(table)

    def read(self, table: Tensor, out: Tensor) -> Tensor:
        """Each row's entries of a group table, at its own columns -> ``out`` ``[B, L]``."""
        flat = None if self.holes is None else self.flat.view(-1)
        if self.every_row:
            return torch.index_select(table.view(-1), 0, flat, out=out.view(-1)).view_as(out)
        torch.index_select(table, 0, self.gid, out=out)
        if self.holes is not None:
            out.index_copy_(0, self.holes, table.view(-1).index_select(0, flat).view(-1, self.L))
        return out

    def cut_positions(self, cut_from: Tensor) -> Tensor:
        """``[B]`` cut positions in k -> in t: a row with holes is cut from its (cut_from)-th
        trained token on, the first position whose k reaches cut_from (L when none does)."""
        if self.holes is None:
            return cut_from
        in_flat = self._hole_rows(cut_from).to(self.flat.dtype)[:, None] + self.offsets
        in_t = torch.searchsorted(self.flat, in_flat)[:, 0]
        return in_t if self.every_row else cut_from.index_copy(0, self.holes, in_t)


def _advantages(G, W, m, keep, groups: _GroupTable, cut_from, leave_one_out):
    """(G − B)·m, B = Σ_group G·W·m / (Σ_group W·m + ε) per column of ``groups``, 0 from
    ``cut_from`` on; with ``leave_one_out`` row i's sums leave row i out. Reuses the buffers
    of W (for B, then the advantages) and of ``keep`` (m ≠ 0, no longer needed: the cut).

    Products with m are exact here: G and W are sums of selected terms only, so they are finite
    wherever the trained inputs are, and the table sums hold nothing else.
    """
    den = W.mul_(m)  # W·m
    sum_den = groups.sums(den)
    num = den * G if leave_one_out else den.mul_(G)  # G·W·m
    sum_num = groups.sums(num)
    if leave_one_out:
        others_num = groups.read(sum_num, torch.empty_like(num)).sub_(num)
        others_den = groups.read(sum_den, num).sub_(den).add_(OTB_EPS)
        base = others_num.div_(others_den)
    else:
        base = groups.read(sum_num.div_(sum_den.add_(OTB_EPS)), num)
    # One pass over the batch: cutting only the rows that have a cut is faster with large
    # groups but costs as much with groups of 2, so the cost would grow with the group count.
    positions = torch.arange(base.shape[1], device=base.device)
    cut = torch.ge(positions, groups.cut_positions(cut_from)[:, None], out=keep)
    base.masked_fill_(cut, 0.0)
    return torch.sub(G, base, out=base).mul_(m)


def _returns_energy_groups(
    token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, isw, energy
):
    """Shared by both OTB forms: ``(G, W, m, keep = (m ≠ 0), lengths, gid, num_groups)``."""
    r, m = check_batch(token_level_rewards, response_mask)
    keep = _trained(m)
    G, W = _returns_and_energy(r, m, keep, old_log_probs, sum_pi_squared, isw, energy)
    gid, ng = group_ids(index, G.shape[0], G.device)
    return G, W, m, keep, row_lengths(m), gid, ng


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
    G, W, m, keep, lengths, gid, ng = _returns_energy_groups(
        token_level_rewards,
        response_mask,
        index,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
        energy,
    )
    cut_from = baseline_cut_from(lengths, gid, ng, G.shape[1], zero_tail=handle_zero_tail)
    return _advantages(G, W, m, keep, _GroupTable(gid, ng, keep), cut_from, leave_one_out), G


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
    G, W, m, keep, lengths, gid, ng = _returns_energy_groups(
        token_level_rewards,
        response_mask,
        index,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
        energy,
    )
    member = lengths > 0
    cut_from = baseline_cut_from(
        lengths, gid, ng, G.shape[1], member=member, zero_tail=handle_zero_tail
    )
    holes = rows_with_holes(m, lengths).nonzero()[:, 0]  # one host sync per batch
    groups = _GroupTable(gid, ng, keep, holes)
    return _advantages(G, W, m, keep, groups, cut_from, leave_one_out), G
