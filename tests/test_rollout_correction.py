"""Mismatch metrics and importance-sampling corrections vs float64 plain-loop references."""

import math

import pytest
import torch

from otbrl.algos.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    rollout_is_weights,
    rollout_mismatch_metrics,
)


def _batch(seed=0, b=9, length=7, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (b,), generator=g)
    lengths[0] = length  # one full row, and (seed-dependent) empty rows
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    old = -torch.rand(b, length, generator=g) * 3
    rollout = old + torch.randn(b, length, generator=g) * scale
    # Garbage where nothing is trained: it must not leak into anything.
    old = torch.where(mask.bool(), old, torch.full_like(old, float("nan")))
    rollout = torch.where(mask.bool(), rollout, torch.full_like(rollout, float("-inf")))
    return old, rollout, mask


def _valid(old, rollout, mask):
    """(row, old, rollout) in float64 for every valid token, by a plain loop."""
    out = []
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] > 0:
                out.append((i, float(old[i, t]), float(rollout[i, t])))
    return out


def test_mismatch_metrics_match_a_plain_loop():
    old, rollout, mask = _batch()
    got = rollout_mismatch_metrics(old, rollout, mask)
    tokens = _valid(old, rollout, mask)
    n = len(tokens)
    diffs = [abs(a - b) for _, a, b in tokens]
    assert got["rollout/logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / n, rel=1e-6)
    assert got["rollout/logprob_abs_diff_max"] == pytest.approx(max(diffs), rel=1e-6)
    # ppl_ratio = PPL_trainer / PPL_rollout, each exp(-mean token log-prob) of the batch.
    ppl_trainer = math.exp(-sum(a for _, a, _ in tokens) / n)
    ppl_rollout = math.exp(-sum(b for _, _, b in tokens) / n)
    assert got["rollout/ppl_ratio"] == pytest.approx(ppl_trainer / ppl_rollout, rel=1e-6)
    assert all(math.isfinite(v) for v in got.values())


def test_identical_log_probs_mean_no_mismatch():
    old, _, mask = _batch(1)
    got = rollout_mismatch_metrics(old, old.clone(), mask)
    assert got == {
        "rollout/logprob_abs_diff_mean": 0.0,
        "rollout/logprob_abs_diff_max": 0.0,
        "rollout/ppl_ratio": 1.0,
    }
    empty = rollout_mismatch_metrics(old, old, torch.zeros_like(mask))
    assert empty["rollout/ppl_ratio"] == 1.0 and empty["rollout/logprob_abs_diff_max"] == 0.0


@pytest.mark.parametrize("cap", [1.0, 1.5, 2.0, 10.0])
def test_token_tis_matches_a_plain_loop(cap):
    old, rollout, mask = _batch(2, scale=0.6)
    weights, keep, metrics = rollout_is_weights(old, rollout, mask, mode="token_tis", cap=cap)
    assert weights.dtype == keep.dtype == torch.float32
    assert torch.equal(keep, mask)
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    clipped = 0
    for i, t in mask.nonzero().tolist():
        ratio = math.exp(float(old[i, t]) - float(rollout[i, t]))
        expected[i, t] = min(ratio, cap)
        clipped += ratio > cap
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=0)
    assert metrics["rollout/is_truncated_frac"] == pytest.approx(clipped / mask.sum().item())
    kept_mean = expected.sum().item() / mask.sum().item()
    assert metrics["rollout/is_weight_mean"] == pytest.approx(kept_mean, rel=1e-6)
    assert torch.isfinite(weights).all() and (weights <= cap).all()


@pytest.mark.parametrize("cap", [1.0, 1.3, 3.0])
def test_seq_mis_matches_a_plain_loop(cap):
    old, rollout, mask = _batch(3, scale=0.4)
    weights, keep, metrics = rollout_is_weights(old, rollout, mask, mode="seq_mis", cap=cap)
    expected = torch.zeros(mask.shape)
    rows_with_tokens, dropped = 0, 0
    for i in range(mask.shape[0]):
        log_ratio = sum(
            float(old[i, t]) - float(rollout[i, t]) for t in range(mask.shape[1]) if mask[i, t]
        )
        ratio = math.exp(log_ratio)
        inside = 1 / cap <= ratio <= cap
        rows_with_tokens += bool(mask[i].any())
        dropped += bool(mask[i].any()) and not inside
        expected[i] = mask[i] * float(inside)
    assert torch.equal(keep, expected)
    assert torch.equal(weights, expected)  # weight 1 on kept tokens, 0 elsewhere
    assert metrics["rollout/seq_masked_frac"] == pytest.approx(dropped / rows_with_tokens)
    if cap == 3.0:
        assert 0 < dropped < rows_with_tokens  # the test sees both outcomes


def test_seq_mis_band_is_inclusive_and_symmetric():
    # Sequence log-ratios of exactly ±log C stay; a hair beyond is dropped.
    # C = e: log C = 1 is exact in float32, so the edge is tested, not a rounding.
    mask = torch.ones(4, 1)
    c = math.e
    old = torch.tensor([[1.0], [-1.0], [1.001], [-1.001]])
    rollout = torch.zeros(4, 1)
    _, keep, _ = rollout_is_weights(old, rollout, mask, mode="seq_mis", cap=c)
    assert keep[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_none_mode_keeps_everything():
    old, rollout, mask = _batch(4)
    weights, keep, metrics = rollout_is_weights(old, rollout, mask, mode="none", cap=2.0)
    assert torch.equal(weights, mask) and torch.equal(keep, mask)
    assert metrics["rollout/is_weight_mean"] == 1.0
    assert set(ROLLOUT_CORRECTIONS) == {"none", "token_tis", "seq_mis", "decoupled"}


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_masked_garbage_cannot_leak(mode):
    old, rollout, mask = _batch(5)
    valid = mask.bool()
    clean_old = torch.where(valid, old, torch.zeros_like(old))
    clean_rollout = torch.where(valid, rollout, torch.zeros_like(rollout))
    a = rollout_is_weights(old, rollout, mask, mode=mode, cap=2.0)
    b = rollout_is_weights(clean_old, clean_rollout, mask, mode=mode, cap=2.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    assert torch.isfinite(a[0]).all()
    assert (a[0][~valid] == 0).all()
    assert rollout_mismatch_metrics(old, rollout, mask) == rollout_mismatch_metrics(
        clean_old, clean_rollout, mask
    )


def test_weights_carry_no_gradient_and_inputs_are_untouched():
    old, rollout, mask = _batch(6)
    old = torch.where(mask.bool(), old, 0.0).requires_grad_()
    before = rollout.clone()
    weights, keep, _ = rollout_is_weights(old, rollout, mask, mode="token_tis", cap=2.0)
    assert not weights.requires_grad and not keep.requires_grad
    assert torch.equal(rollout, before)


def test_large_log_ratios_do_not_overflow():
    mask = torch.ones(1, 3)
    old = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[-200.0, -1.0, 300.0]])  # ratios e^200 and e^-302
    weights, _, metrics = rollout_is_weights(old, rollout, mask, mode="token_tis", cap=5.0)
    assert weights.tolist() == [[5.0, 1.0, 0.0]]
    assert metrics["rollout/is_truncated_frac"] == pytest.approx(1 / 3)
    _, keep, _ = rollout_is_weights(old, rollout, mask, mode="seq_mis", cap=5.0)
    assert keep.sum() == 0


def test_bad_input_names_the_argument():
    old, rollout, mask = _batch(7)
    with pytest.raises(ValueError, match="mode"):
        rollout_is_weights(old, rollout, mask, mode="tis", cap=2.0)
    with pytest.raises(ValueError, match="cap"):
        rollout_is_weights(old, rollout, mask, mode="token_tis", cap=0.5)
    with pytest.raises(TypeError, match="cap"):
        rollout_is_weights(old, rollout, mask, mode="token_tis", cap=float("inf"))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        rollout_mismatch_metrics(old, rollout[:, :-1], mask)
    with pytest.raises(ValueError, match="response_mask"):
        rollout_mismatch_metrics(old, rollout, mask[:-1])
    with pytest.raises(ValueError, match="old_log_probs"):
        rollout_mismatch_metrics(old[0], rollout[0], mask[0])
    with pytest.raises(TypeError, match="old_log_probs"):
        rollout_mismatch_metrics(old.tolist(), rollout, mask)
    with pytest.raises(TypeError, match="rollout_log_probs"):
        rollout_mismatch_metrics(old, rollout.long(), mask)
