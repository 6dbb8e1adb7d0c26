"""Micro-batches by token budget (``otbrl.engine.micro``): a partition of the rows, each bin
under the budget, exactly the count the ranks agreed on, balanced on a skewed distribution;
and the config check that a budget holds the longest sequence, before any model loads."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from otbrl.engine.micro import balance_ranks, first_fit_bins, padded_bins, token_bins
from run_utils import refused, tiny_run_factory


@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    slack=st.integers(0, 100),
    data=st.data(),
)
def test_bins_partition_the_rows_under_the_budget(lengths, slack, data):
    budget = max(lengths) + slack
    first = first_fit_bins(lengths, budget)
    count = data.draw(st.integers(len(first), len(lengths)))
    for bins in (first, token_bins(lengths, budget, count)):
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(b and sum(lengths[i] for i in b) <= budget for b in bins)
    assert len(token_bins(lengths, budget, count)) == count
    # first-fit decreasing never needs more than twice the bins the tokens fill
    assert len(first) <= max(1, 2 * -(-sum(lengths) // budget))


def _padded_cost(prompt, response, rows) -> int:
    return len(rows) * (max(prompt[i] for i in rows) + max(response[i] for i in rows))


@given(
    sizes=st.lists(st.tuples(st.integers(1, 32), st.integers(0, 64)), min_size=1, max_size=40),
    slack=st.integers(0, 200),
    data=st.data(),
)
def test_padded_bins_partition_the_rows_under_the_budget(sizes, slack, data):
    """Padded micro-batches cost rows x (longest prompt + longest response): each under the
    budget, a partition of the rows, exactly the agreed count; for rows of one width the
    fewest micro-batches (budget // width rows each)."""
    prompt, response = [p for p, _ in sizes], [r for _, r in sizes]
    budget = max(p + r for p, r in sizes) + slack
    first = padded_bins(prompt, response, budget, None)
    count = data.draw(st.integers(len(first), len(sizes)))
    for bins in (first, padded_bins(prompt, response, budget, count)):
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
        assert all(b and _padded_cost(prompt, response, b) <= budget for b in bins)
    assert len(padded_bins(prompt, response, budget, count)) == count
    width = prompt[0] + response[0]
    same = padded_bins([prompt[0]] * len(sizes), [response[0]] * len(sizes), budget, None)
    assert len(same) == -(-len(sizes) // (budget // width))


def test_padded_bins_keep_like_lengths_together():
    """On a skewed batch (16-512 tokens) the padded micro-batches hold little padding: their
    cost is within 25 % of the real tokens (1.21 x at a budget of 1024), where consecutive runs
    of rows in as many micro-batches pay for their longest rows (3.1 x)."""
    rng = random.Random(0)
    response = [min(512, int(16 * 2 ** rng.expovariate(0.7))) for _ in range(64)]
    prompt = [rng.randint(16, 32) for _ in range(64)]
    real = sum(prompt) + sum(response)
    bins = padded_bins(prompt, response, 1024, None)
    cost = sum(_padded_cost(prompt, response, b) for b in bins)
    assert cost <= 1.25 * real
    size = -(-64 // len(bins))
    runs = [list(range(k, min(k + size, 64))) for k in range(0, 64, size)]
    assert sum(_padded_cost(prompt, response, b) for b in runs) > 2.5 * real


def test_a_skewed_batch_is_balanced_within_one_row():
    """Lengths spanning 16-512 tokens (most short, a few long), as reasoning batches have: the
    bins' loads differ by at most the longest row (LPT's bound), where consecutive runs of rows
    differ by far more."""
    rng = random.Random(0)
    lengths = [min(512, int(16 * 2 ** rng.expovariate(0.7))) for _ in range(64)]
    assert max(lengths) >= 256 and min(lengths) < 32
    budget = 2048
    count = len(first_fit_bins(lengths, budget)) + 1  # another rank needed one more
    loads = [sum(lengths[i] for i in b) for b in token_bins(lengths, budget, count)]
    assert max(loads) - min(loads) <= max(lengths)
    consecutive = [sum(lengths[k * 64 // count : (k + 1) * 64 // count]) for k in range(count)]
    assert max(consecutive) - min(consecutive) > max(loads) - min(loads)


@given(lengths=st.lists(st.integers(1, 512), min_size=4, max_size=64), ranks=st.integers(1, 4))
def test_ranks_get_every_row_once_and_near_equal_loads(lengths, ranks):
    dealt = balance_ranks(lengths, ranks)
    assert sorted(i for d in dealt for i in d) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in d) for d in dealt]
    assert all(dealt) and max(loads) - min(loads) <= max(lengths)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="a row of 9 tokens is longer than the budget of 8"):
        first_fit_bins([3, 9], 8)
    with pytest.raises(ValueError, match=r"count: expected between 2 .* and 3"):
        token_bins([5, 5, 5], 10, 4)
    with pytest.raises(ValueError, match="budget"):
        first_fit_bins([3], 0)
    with pytest.raises(ValueError, match="at least 3 rows"):
        balance_ranks([1, 2], 3)


def test_a_budget_below_the_longest_sequence_is_refused_before_loading(
    tmp_path, capsys, no_model_loading
):
    overrides = tiny_run_factory(tmp_path)
    for key in ("actor.max_tokens_per_micro_batch", "critic.max_tokens_per_micro_batch"):
        extra = ["critic.enable=true"] if key.startswith("critic") else []
        refused(["train", *overrides(tmp_path / "run", f"{key}=8", *extra)], capsys, key,
                "longest prompt plus the response budget")  # fmt: skip


@given(
    groups=st.lists(
        st.tuples(st.integers(1, 6), st.integers(1, 32), st.integers(0, 64)),
        min_size=1,
        max_size=20,
    ),
    slack=st.integers(0, 300),
    data=st.data(),
)
def test_padded_bins_of_groups_cost_every_row(groups, slack, data):
    """Items standing for several rows (``rows=``: a group kept whole) cost all of them:
    each micro-batch's rows x its widths stays under the budget, items are a partition."""
    rows = [g for g, _, _ in groups]
    prompt, response = [p for _, p, _ in groups], [r for _, _, r in groups]
    budget = max(g * (p + r) for g, p, r in groups) + slack
    first = padded_bins(prompt, response, budget, None, rows=rows)
    count = data.draw(st.integers(len(first), len(groups)))
    for bins in (first, padded_bins(prompt, response, budget, count, rows=rows)):
        assert sorted(i for b in bins for i in b) == list(range(len(groups)))
        for b in bins:
            width = max(prompt[i] for i in b) + max(response[i] for i in b)
            assert sum(rows[i] for i in b) * width <= budget
    with pytest.raises(ValueError, match="rows"):
        padded_bins(prompt, response, budget, None, rows=[0] * len(groups))


def test_micro_batches_of_whole_groups(tiny_dir):
    """``FrozenEngine.group_micro_batches``: every group inside one micro-batch, the rows a
    permutation, under the row cap and under a token budget (padded and packed); None when a
    group is over the cap."""
    import torch
    from transformers import AutoModelForCausalLM

    from otbrl.engine.frozen import FrozenEngine
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    uid = torch.tensor([3, 3, 3, 0, 0, 0, 7, 7, 7, 1, 1, 1])
    lengths = torch.tensor([5, 2, 9, 4, 4, 4, 1, 8, 3, 6, 2, 2])
    width = 12
    mask = (torch.arange(width)[None] < 3 + lengths[:, None]).long()
    batch = {"attention_mask": mask, "input_ids": torch.ones_like(mask),
             "responses": torch.ones(12, width - 3, dtype=torch.long),
             "response_mask": mask[:, 3:].float(), "prompts": torch.ones(12, 3)}  # fmt: skip
    cases = [(MicroBatchConfig(6, None), False), (MicroBatchConfig(8, 30), True),
             (MicroBatchConfig(8, 40), False)]  # fmt: skip
    for micro, packed in cases:
        engine = FrozenEngine(model, EngineSpec(micro=micro, packed=packed))
        bins = engine.group_micro_batches(batch, uid)
        assert bins is not None and len(bins) > 1
        assert sorted(torch.cat(bins).tolist()) == list(range(12))
        for b in bins:
            for g in set(uid[b].tolist()):
                assert set(torch.nonzero(uid == g).flatten().tolist()) <= set(b.tolist())
    small = FrozenEngine(model, EngineSpec(micro=MicroBatchConfig(2, None)))
    assert small.group_micro_batches(batch, uid) is None  # a group of 3 rows, 2 a micro-batch
