"""Masked summaries, W-score, zero-tail share and the Σπ² variance proxy."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otbrl.algos.metrics import (
    masked_summary,
    otb_metrics,
    step_metrics,
    variance_proxy,
    zero_tail_fraction,
)
from otbrl.algos.otb import token_energy, zero_tail_mask

T = torch.tensor


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_masked_summary_matches_numpy(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=g)
    m = (torch.rand(5, 7, generator=g) < 0.6).float()
    m[0, 0] = m[1, 1] = 1.0  # at least two entries, so the unbiased std exists
    sel = x.numpy()[m.numpy() > 0].astype(np.float64)
    out = masked_summary(x, m, "adv")
    assert out["adv/mean"].item() == pytest.approx(sel.mean(), abs=1e-5)
    assert out["adv/std"].item() == pytest.approx(sel.std(ddof=1), abs=1e-5)
    assert out["adv/min"].item() == pytest.approx(sel.min())
    assert out["adv/max"].item() == pytest.approx(sel.max())


def test_masked_summary_empty_mask_is_zero_not_nan():
    out = masked_summary(torch.randn(2, 3), torch.zeros(2, 3), "x")
    assert all(v.item() == 0.0 for v in out.values())


def test_trajectory_energy_hand_worked_and_is_weights():
    # π_y = 0.5, Σπ² = 0.5 -> w = 0.5 per token; row 0 has 3 tokens, row 1 has 1.
    m = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    lp, spi = torch.full((2, 3), 0.5).log(), torch.full((2, 3), 0.5)
    torch.testing.assert_close(token_energy(m, lp, spi).sum(-1), T([1.5, 0.5]))
    isw = T([[2.0, 1.0, 1.0], [3.0, 1.0, 1.0]])  # w·isw² -> [0.5·4 + 0.5 + 0.5, 0.5·9]
    torch.testing.assert_close(
        token_energy(m, lp, spi, rollout_is_weights=isw).sum(-1), T([3.0, 4.5])
    )
    torch.testing.assert_close(token_energy(m, energy="uniform").sum(-1), T([3.0, 1.0]))
    with pytest.raises(ValueError, match="sum_pi_squared"):
        token_energy(m, lp, None).sum(-1)
    with pytest.raises(ValueError, match="energy"):
        token_energy(m, energy="flat").sum(-1)


def test_variance_proxy_hand_worked():
    # Ā = [masked mean of (1, 3), (−2), (nothing)] = [2, −2, 0]; W = [−0.5, 2, 7] ->
    # max(W, 0) = [0, 2, 7].
    # P = (4·0 + 4·2 + 0·7)/3 = 8/3; g = 1 -> S = 1; noise = (8/3 − 1)/(3 − 1) = 5/6.
    adv = T([[1.0, 3.0], [-2.0, 9.0], [5.0, 5.0]])
    m = T([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    out = variance_proxy(adv, m, T([-0.5, 2.0, 7.0]), grad_norm=1.0)
    assert out["variance_proxy/total_power"].item() == pytest.approx(8 / 3)
    assert out["variance_proxy/signal_strength"].item() == pytest.approx(1.0)
    assert out["variance_proxy/pure_noise"].item() == pytest.approx(5 / 6)
    # A strong signal cannot make the noise negative.
    out = variance_proxy(adv, m, T([-0.5, 2.0, 7.0]), grad_norm=torch.tensor(3.0))
    assert out["variance_proxy/pure_noise"].item() == 0.0
    assert set(variance_proxy(adv, m, T([1.0, 1.0, 1.0]))) == {"variance_proxy/total_power"}
    with pytest.raises(ValueError, match="w_score"):
        variance_proxy(adv, m, T([1.0, 2.0]))


def loop_zero_tail_count(m, index, response_space):
    """Tokens in the zero tail, counted with plain loops from the OTB/TIR-OTB definition."""
    count = 0
    for key in set(index):
        rows = [i for i, k in enumerate(index) if k == key]
        lengths = {i: int(m[i].sum()) for i in rows}
        members = [i for i in rows if lengths[i] > 0] if response_space else rows
        ranked = sorted((lengths[i] for i in members), reverse=True)
        if len(ranked) < 2 or ranked[0] == ranked[1]:
            continue
        (top,) = [i for i in members if lengths[i] == ranked[0]]
        positions = [t for t in range(m.shape[1]) if m[top, t] > 0]
        if response_space:
            count += len(positions) - ranked[1]  # response tokens k ≥ ℓ_2
        else:
            count += sum(t >= ranked[1] for t in positions)
    return count


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_zero_tail_fraction_matches_loop_count(seed, response_space):
    g = torch.Generator().manual_seed(seed)
    B, L = 9, 6
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    m = (torch.arange(L)[None] < lengths[:, None]).float() * (torch.rand(B, L, generator=g) > 0.2)
    index = torch.randint(0, 3, (B,), generator=g).tolist()
    expected = loop_zero_tail_count(m, index, response_space) / max(int(m.sum()), 1)
    got = zero_tail_fraction(m, index, response_space=response_space)
    assert got.item() == pytest.approx(expected)
    assert not (zero_tail_mask(m, index, response_space=response_space) & (m == 0)).any()


def test_otb_metrics_keys():
    g = torch.Generator().manual_seed(0)
    m = torch.ones(4, 5)
    m[0, 3:] = 0
    lp = -torch.rand(4, 5, generator=g)
    out = otb_metrics(
        torch.randn(4, 5, generator=g), m, [0, 0, 1, 1], lp, torch.rand(4, 5), grad_norm=0.5
    )
    assert {"otb/zero_tail_fraction", "otb/w_score/mean", "otb/w_score/max"} <= set(out)
    assert {"variance_proxy/total_power", "variance_proxy/pure_noise"} <= set(out)
    # Rows 2, 3 (length 5) tie; rows 0 (3) and 1 (5): row 1's tokens at t ≥ 3 -> 2 of 18.
    assert out["otb/zero_tail_fraction"].item() == pytest.approx(2 / 18)
    assert set(otb_metrics(torch.zeros(4, 5), m, [0, 0, 1, 1])) == {"otb/zero_tail_fraction"}


def test_step_metrics_weigh_w_as_the_estimator_did():
    """The trainer's metrics take the batch's rollout IS weights into W (as OTB's estimator
    does) and TIR-OTB's zero tail in response space: hand-worked, as the tests above."""
    m = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    lp, spi = torch.full((4, 3), 0.5).log(), torch.full((4, 3), 0.5)  # w = 0.5 per token
    batch = {
        "response_mask": m, "entropy": torch.zeros(4, 3), "advantages": torch.zeros(4, 3),
        "uid": T([0, 0, 1, 1]), "old_log_probs": lp, "sum_pi_squared": spi,
    }  # fmt: skip
    plain = step_metrics(batch, grad_norm=1.0)
    assert plain["otb/w_score/max"] == pytest.approx(1.5)  # row 0: 3 tokens × 0.5
    weighted = step_metrics({**batch, "rollout_is_weights": torch.full((4, 3), 2.0)}, grad_norm=1.0)
    assert weighted["otb/w_score/max"] == pytest.approx(6.0)  # × 2²
    # group 1: an empty row beside a 2-token one. Sequence space: the empty row is a member
    # (length 0), so row 3 is the unique longest and its 2 tokens are tail; response space:
    # not a member, row 3 alone has no second-longest, no tail. Group 0: row 0's tokens 1, 2.
    assert plain["otb/zero_tail_fraction"] == pytest.approx(4 / 6)
    tir = step_metrics(batch, grad_norm=1.0, response_space=True)
    assert tir["otb/zero_tail_fraction"] == pytest.approx(2 / 6)
    for response_space, metrics in ((False, plain), (True, tir)):
        want = zero_tail_mask(m, batch["uid"], response_space=response_space).sum() / 6
        assert metrics["otb/zero_tail_fraction"] == pytest.approx(float(want))
