"""token_stats / sum_pi_squared against an independent float64 softmax reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otbrl.ops import IGNORE_INDEX, sum_pi_squared, token_stats

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [(8, 17), (3, 5, 32), (1, 1024), (64, 32768)]


def reference(logits, labels, temperature=1.0):
    """float64 log-softmax reference: (log π(y), entropy, Σπ²) with −100 labels → log-prob 0."""
    z = logits.double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    # p·logp with p = 0 (−inf logits) is 0 by continuity.
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1)
    spp = (p * p).sum(-1)
    ignored = labels == IGNORE_INDEX
    lp = logp.gather(-1, labels.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    return lp.masked_fill(ignored, 0.0), entropy, spp


def tolerance(dtype, vocab):
    # Inputs in bf16/fp16 are exact numbers the float64 reference sees too; the op works in
    # float32 from there, so every non-float64 dtype gets a float32 tolerance: a few ulps of
    # lse ≈ log V + max|z| plus pairwise-sum rounding that grows like log V.
    if dtype == torch.float64:
        return {"atol": 1e-10, "rtol": 1e-10}
    return {"atol": 2e-5 if vocab > 4096 else 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    before = logits.clone()
    stats = token_stats(logits, labels)
    ref = reference(logits, labels)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for got, want in zip(stats, ref):
        assert got.shape == shape[:-1] and got.dtype == out_dtype
        torch.testing.assert_close(got.double(), want, **tolerance(dtype, shape[-1]))
    # π_y² ≤ Σπ² ≤ 1 (with rounding slack) — the bounds OTB's weights rely on.
    slack = 1e-6
    py = stats.log_probs.double().exp()
    assert bool((py * py <= stats.sum_pi_squared + slack).all())
    assert bool((stats.sum_pi_squared <= 1 + slack).all())
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_divides_logits(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (6,), generator=g)
    before = logits.clone()
    stats = token_stats(logits, labels, temperature=temperature)
    for got, want in zip(stats, reference(logits, labels, temperature)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.equal(logits, before)


def test_fields_not_asked_for_are_none():
    logits, labels = torch.randn(4, 9), torch.randint(0, 9, (4,))
    stats = token_stats(logits, labels, entropy=False, sum_pi_squared=False)
    assert stats.entropy is None and stats.sum_pi_squared is None
    torch.testing.assert_close(stats.log_probs.double(), reference(logits, labels)[0])


@pytest.mark.parametrize("offset", [1000.0, -1000.0])
def test_extreme_logits(offset):
    g = torch.Generator().manual_seed(2)
    logits = offset + torch.randn(16, 300, generator=g)
    labels = torch.randint(0, 300, (16,), generator=g)
    for got, want in zip(token_stats(logits, labels), reference(logits, labels)):
        assert bool(got.isfinite().all())
        # fp32 spacing at |z| = 1000 is 6e-5: the inputs themselves carry that much.
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_all_mass_on_one_token():
    logits = torch.zeros(3, 40)
    logits[:, 7] = 1e4
    labels = torch.tensor([7, 0, 7])
    stats = token_stats(logits, labels)
    torch.testing.assert_close(stats.log_probs, torch.tensor([0.0, -1e4, 0.0]))
    torch.testing.assert_close(stats.entropy, torch.zeros(3))
    torch.testing.assert_close(stats.sum_pi_squared, torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_vocabulary_minus_inf(dtype):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 64, generator=g, dtype=dtype)
    mask = torch.rand(10, 64, generator=g) < 0.5
    mask[:, 0] = False  # every row keeps a finite logit, and the label lives there
    logits = logits.masked_fill(mask, float("-inf"))
    labels = torch.zeros(10, dtype=torch.int64)
    stats = token_stats(logits.requires_grad_(), labels, chunk_size=3)
    for got, want in zip(stats, reference(logits.detach(), labels)):
        assert bool(got.isfinite().all())
        torch.testing.assert_close(got.double(), want, **tolerance(dtype, 64))
    # A large upstream weight must not turn 0·(−inf) into NaN in the masked entries.
    (stats.log_probs.sum() + 1e6 * stats.entropy.sum()).backward()
    assert bool(logits.grad.isfinite().all())
    assert bool((logits.grad[mask] == 0).all())


def test_vocabulary_of_one():
    logits = torch.randn(5, 1, requires_grad=True)
    stats = token_stats(logits, torch.zeros(5, dtype=torch.int64))
    torch.testing.assert_close(stats.log_probs, torch.zeros(5))
    torch.testing.assert_close(stats.entropy, torch.zeros(5))
    torch.testing.assert_close(stats.sum_pi_squared, torch.ones(5))
    (stats.log_probs + stats.entropy).sum().backward()
    torch.testing.assert_close(logits.grad, torch.zeros(5, 1))


def test_nan_row_gives_nan_in_that_row_only():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 33, generator=g)
    logits[2, 5] = float("nan")
    logits[4] = float("-inf")  # no distribution at all
    logits.requires_grad_()
    labels = torch.randint(0, 33, (6,), generator=g)
    stats = token_stats(logits, labels, chunk_size=4)
    good = torch.tensor([True, True, False, True, False, True])
    ref = reference(logits.detach()[good], labels[good])
    for got, want in zip(stats, ref):
        assert bool(got[~good].isnan().all())
        torch.testing.assert_close(got[good].double(), want, **tolerance(torch.float32, 33))
    (stats.log_probs + stats.entropy).sum().backward()
    assert bool(logits.grad[good].isfinite().all())


@pytest.mark.parametrize("shape", [(0, 11), (2, 0, 11)], ids=str)
def test_empty_input(shape):
    logits = torch.randn(shape, requires_grad=True)
    stats = token_stats(logits, torch.zeros(shape[:-1], dtype=torch.int64))
    assert all(f.shape == shape[:-1] for f in stats)
    (stats.log_probs.sum() + stats.entropy.sum()).backward()
    assert logits.grad.shape == shape


def test_ignore_index_means_no_label():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 12, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([3, IGNORE_INDEX, 0, IGNORE_INDEX])
    stats = token_stats(logits, labels)
    for got, want in zip(stats, reference(logits.detach(), labels)):
        torch.testing.assert_close(got, want)
    stats.log_probs.sum().backward()
    assert bool((logits.grad[[1, 3]] == 0).all()) and bool((logits.grad[[0, 2]] != 0).any())


def test_logit_gradient_identity():
    """‖∇_z log π(y)‖² = 1 − 2π_y + Σπ²: the fact the Optimal Token Baseline rests on."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(32, 200, generator=g, dtype=torch.float64) * 3).requires_grad_()
    labels = torch.randint(0, 200, (32,), generator=g)
    stats = token_stats(logits, labels)
    # Rows are independent, so the gradient of the sum holds each row's own gradient.
    (grad,) = torch.autograd.grad(stats.log_probs.sum(), logits)
    # The same gradient through torch's own log_softmax: an independent autograd path.
    ref_lp = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).sum()
    (ref_grad,) = torch.autograd.grad(ref_lp, logits)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=1e-12)
    pi_y = stats.log_probs.detach().exp()
    rhs = 1 - 2 * pi_y + stats.sum_pi_squared
    torch.testing.assert_close(grad.pow(2).sum(-1), rhs, atol=1e-6, rtol=0)
    torch.testing.assert_close(ref_grad.pow(2).sum(-1), rhs, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("temperature", "chunk", "ent"), [(1.0, None, True), (0.7, 2, True), (1.3, 3, False)]
)
def test_gradcheck(temperature, chunk, ent):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 2, 9, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (5, 2), generator=g)
    labels[1, 0] = IGNORE_INDEX

    def fn(x):
        s = token_stats(x, labels, temperature=temperature, entropy=ent, chunk_size=chunk)
        return (s.log_probs, s.entropy) if ent else s.log_probs

    assert torch.autograd.gradcheck(fn, (logits,))
    # The entropy gradient alone (log-prob output unused) takes its own backward branch.
    assert torch.autograd.gradcheck(lambda x: token_stats(x, labels).entropy, (logits,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gradient_matches_autograd_reference(dtype):
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(24, 500, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 500, (24,), generator=g)
    w_lp, w_ent = torch.randn(24, generator=g), torch.randn(24, generator=g)
    before = logits.detach().clone()
    stats = token_stats(logits, labels, temperature=0.8, chunk_size=5)
    (stats.log_probs * w_lp + stats.entropy * w_ent).sum().backward()
    assert logits.grad.dtype == dtype
    assert torch.equal(logits.detach(), before)
    x = logits.detach().double().requires_grad_()
    lp, ent, _ = reference(x, labels, 0.8)
    (lp * w_lp.double() + ent * w_ent.double()).sum().backward()
    # One rounding of the float32 gradient to `dtype`: the dtype's default tolerance (≈ 1 ulp).
    torch.testing.assert_close(logits.grad, x.grad.to(dtype))


def test_sum_pi_squared_wrapper():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 3, 40, generator=g, requires_grad=True)
    spp = sum_pi_squared(logits, temperature=0.5)
    assert not spp.requires_grad and spp.shape == (2, 3)
    want = reference(logits.detach(), torch.zeros(2, 3, dtype=torch.int64), 0.5)[2]
    torch.testing.assert_close(spp.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"labels": torch.tensor([0, 9])}, ValueError, "labels: expected ids in"),
        ({"labels": torch.tensor([0, -2])}, ValueError, "labels: expected ids in"),
        ({"labels": torch.tensor([0.0, 1.0])}, TypeError, "labels: expected an int64"),
        ({"labels": torch.tensor([0, 1, 2])}, ValueError, r"labels: expected shape \(2,\)"),
        ({"logits": torch.zeros(2, 9, dtype=torch.int64)}, TypeError, "logits: expected float"),
        ({"logits": [[0.0]]}, TypeError, "logits: expected a torch.Tensor"),
        ({"temperature": 0.0}, ValueError, "temperature: expected a finite number > 0"),
        ({"temperature": "1"}, TypeError, "temperature: expected a float"),
        ({"chunk_size": 0}, ValueError, "chunk_size: expected a positive int"),
    ],
)
def test_bad_input_errors(kwargs, error, match):
    args = {"logits": torch.zeros(2, 9), "labels": torch.tensor([0, 8])} | kwargs
    with pytest.raises(error, match=match):
        token_stats(args.pop("logits"), args.pop("labels"), **args)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 40),
    vocab=st.integers(1, 70),
    chunk=st.integers(1, 50),
    temperature=st.floats(0.25, 4.0),
    seed=st.integers(0, 2**16),
)
def test_chunk_size_never_changes_results(rows, vocab, chunk, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 5).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    w = torch.randn(2, rows, generator=g)
    results = []
    for c in (None, chunk):
        s = token_stats(logits, labels, temperature=temperature, chunk_size=c)
        (grad,) = torch.autograd.grad((s.log_probs * w[0] + s.entropy * w[1]).sum(), logits)
        results.append((*s, grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def stats_and_grad_per_thread_count(rows, vocab, chunk, thread_counts, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    w = torch.randn(2, rows, generator=g)
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            s = token_stats(logits, labels, temperature=0.7, chunk_size=chunk)
            (grad,) = torch.autograd.grad((s.log_probs * w[0] + s.entropy * w[1]).sum(), logits)
            assert torch.get_num_threads() == threads  # the op leaves the caller's count alone
            results.append((*s, grad))
    finally:
        torch.set_num_threads(saved)
    return results


# V > 32768 elements per row: torch splits every op of a chunk over its intra-op threads.
@pytest.mark.parametrize(
    ("rows", "vocab", "chunk"), [(45, 33333, 3), (48, 40001, 6), (40, 70001, 8), (50, 300, 4)]
)
def test_thread_count_never_changes_results(rows, vocab, chunk):
    """With at least as many rows per chunk as threads, torch gives each row's reductions to
    one thread and elementwise ops round alike everywhere: bit-identical to one thread."""
    results = stats_and_grad_per_thread_count(rows, vocab, chunk, (1, 2, 3), seed=10)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_one_long_row_per_chunk_splits_its_sums_over_threads():
    """A chunk of one row of more than 32768 logits has its row sums split over threads by
    torch (two-pass reduction): the results then differ from one thread by rounding only."""
    one, two = stats_and_grad_per_thread_count(9, 100003, 1, (1, 2), seed=11)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
