"""Micro-batches by token budget: which rows of a batch run in one forward.

A batch whose response lengths vary 10× either wastes its micro-batches on padding or runs out
of memory on the longest one when micro-batches are counted in rows. Under a token budget T a
rank's rows are packed into as few micro-batches as first-fit decreasing finds (each ≤ T
tokens); every rank of a collective forward must then run the same number k of them (the
largest of the ranks' counts), so each rank re-partitions its rows into exactly k bins —
longest-processing-time first (each row, longest first, to the lightest bin: a makespan within
4/3 of the optimum) when that keeps every bin under T, else the first-fit bins split until
there are k. Pure Python over row lengths: the engine asks for the bins, the ranks agree on k.

In the padded layout a micro-batch is cut to its own widths (its longest prompt and response),
so it costs its rows × that width: ``padded_bins`` keeps rows of like length together under
the budget, so little of what a forward computes is padding.

Before that, in the packed layout, the rows of each global mini-batch are dealt out again over
the data-parallel ranks (``balance_ranks``, LPT again) so that each rank's token load is near
the mean: the rank with the most tokens sets the step's time, and the loss is normalised by the
global mini-batch's counts, so which rank trains a row does not change the gradient.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def _check(lengths: Sequence[int], budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget: expected an int >= 1, got {budget!r}")
    if not lengths:
        raise ValueError("lengths: expected at least one row")
    longest = max(lengths)
    if longest > budget:
        raise ValueError(
            f"lengths: a row of {longest} tokens is longer than the budget of {budget} tokens"
        )


def first_fit_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Rows (indices into ``lengths`` [N], tokens per row) packed first-fit decreasing into
    bins of at most ``budget`` tokens each; every bin non-empty, rows in index order within it.
    ``ValueError`` for a row longer than the budget."""
    _check(lengths, budget)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def token_bins(lengths: Sequence[int], budget: int, count: int | None) -> list[list[int]]:
    """Exactly ``count`` non-empty bins of the rows of ``lengths`` [N], each of at most
    ``budget`` tokens, as balanced as the methods of the module docstring give; ``count`` must
    lie between the first-fit count and N. ``count`` None: the first-fit bins."""
    bins = first_fit_bins(lengths, budget)
    if count is None:
        return bins
    if not len(bins) <= count <= len(lengths):
        raise ValueError(
            f"count: expected between {len(bins)} (bins the budget needs) and {len(lengths)} "
            f"(rows), got {count}"
        )
    heap = [(0, b) for b in range(count)]  # (load, bin): the lightest first
    balanced: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        balanced[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    if max(load for load, _ in heap) <= budget:
        return [sorted(b) for b in balanced]
    while len(bins) < count:  # split the bin of most rows: both halves stay under the budget
        big = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        rows = sorted(bins.pop(big), key=lambda i: (-lengths[i], i))
        bins += [sorted(rows[0::2]), sorted(rows[1::2])]
    return bins


def padded_bins(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    budget: int,
    count: int | None,
    rows: Sequence[int] | None = None,
) -> list[list[int]]:
    """Micro-batches of the padded layout, where a micro-batch of n rows costs n × (its longest
    prompt + its longest response) tokens (it is trimmed to its own widths): the rows sorted by
    length, longest first, each micro-batch the next rows while its cost stays within
    ``budget`` — rows of like length together, so little of a micro-batch is padding (the
    fewest micro-batches for rows of one width each). ``count`` None: that many; else exactly
    ``count`` (between that and N): the costliest micro-batch is halved until there are as
    many (halves of like rows cost no more). Arguments ``[N]`` each; rows in index order
    within a micro-batch. ``ValueError`` for a row over the budget. ``rows`` [N]: item i stands
    for ``rows[i]`` rows whose longest prompt and response are its lengths (a group that must
    stay whole); None: one row each."""
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError(
            f"response_lengths: expected {len(prompt_lengths)} rows like prompt_lengths, "
            f"got {len(response_lengths)}"
        )
    weight = [1] * len(prompt_lengths) if rows is None else list(rows)
    if len(weight) != len(prompt_lengths) or min(weight, default=1) < 1:
        raise ValueError(f"rows: expected {len(prompt_lengths)} counts >= 1, got {rows}")
    totals = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    _check([w * t for w, t in zip(weight, totals)], budget)

    def cost(items: list[int]) -> int:
        return sum(weight[i] for i in items) * (
            max(prompt_lengths[i] for i in items) + max(response_lengths[i] for i in items)
        )

    runs: list[list[int]] = []
    widest = (0, 0)  # the current run's longest prompt and response
    for i in sorted(range(len(totals)), key=lambda i: (-totals[i], i)):
        grown = (max(widest[0], prompt_lengths[i]), max(widest[1], response_lengths[i]))
        if runs and (sum(weight[j] for j in runs[-1]) + weight[i]) * sum(grown) <= budget:
            runs[-1].append(i)
            widest = grown
        else:
            runs.append([i])
            widest = (prompt_lengths[i], response_lengths[i])
    if count is not None:
        if not len(runs) <= count <= len(totals):
            raise ValueError(
                f"count: expected between {len(runs)} (micro-batches the budget needs) and "
                f"{len(totals)} (rows), got {count}"
            )
        while len(runs) < count:
            big = max(range(len(runs)), key=lambda b: (len(runs[b]) > 1, cost(runs[b]), -b))
            items = runs.pop(big)
            half = (len(items) + 1) // 2
            runs[big:big] = [items[:half], items[half:]]
    return [sorted(b) for b in runs]


def balance_ranks(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """The rows of ``lengths`` [N] (tokens per row, N ≥ ``ranks``) dealt to ``ranks`` data-
    parallel ranks, longest first to the least-loaded rank (LPT): every rank gets a row and the
    loads differ by at most the longest row. Rows in index order on each rank."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks: expected an int >= 1, got {ranks!r}")
    if len(lengths) < ranks:
        raise ValueError(
            f"lengths: expected at least {ranks} rows (one per rank), got {len(lengths)}"
        )
    heap = [(0, 0, r) for r in range(ranks)]  # (load, rows, rank): the lightest first
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, count, r = heapq.heappop(heap)
        dealt[r].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, r))
    return [sorted(d) for d in dealt]
