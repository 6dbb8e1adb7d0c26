"""PPO loss, KL estimators, loss aggregation (incl. exact gradient accumulation), value loss."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otbrl.algos.loss_math import (
    KL_KINDS,
    LOSS_AGG_MODES,
    agg_loss,
    entropy_bonus,
    kl_in_reward,
    kl_penalty,
    loss_normalizers,
    ppo_policy_loss,
    value_loss,
)

T = torch.tensor


def test_ppo_hand_worked_with_dual_clip():
    # low = high = 0.2, c = 3, one row of four tokens:
    #  A=+1, ratio 1.5: max(−1.5, −1.2) = −1.2 (clipped)
    #  A=−1, ratio 0.5: max(0.5, 0.8) = 0.8 (clipped); dual bound 3 not active
    #  A=−1, ratio 5.0: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual-clip active)
    #  A=+1, ratio 0.9: max(−0.9, −0.9) = −0.9 (not clipped)
    # token-mean = (−1.2 + 0.8 + 3 − 0.9)/4 = 0.425.
    ratio = T([[1.5, 0.5, 5.0, 0.9]])
    old = T([[-1.0, -2.0, -3.0, -0.5]])
    lp = (old + ratio.log()).requires_grad_(True)
    adv, mask = T([[1.0, -1.0, -1.0, 1.0]]), torch.ones(1, 4)
    loss, met = ppo_policy_loss(lp, old, adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(0.425, abs=1e-6)
    assert met["clip_frac"].item() == pytest.approx(0.5)
    assert met["clip_frac_lower"].item() == pytest.approx(0.25)
    kl = -sum(math.log(x) for x in (1.5, 0.5, 5.0, 0.9)) / 4
    assert met["approx_kl"].item() == pytest.approx(kl, abs=1e-6)
    # Only the unclipped token has a gradient: d/dlp (−A·ratio)/4 = −0.9/4.
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, T([[0.0, 0.0, 0.0, -0.9 / 4]]))
    # Without dual-clip the third token keeps its 5.
    loss, met = ppo_policy_loss(lp, old, adv, mask, clip_ratio_c=None)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 5 - 0.9) / 4, abs=1e-6)
    assert "clip_frac_lower" not in met


def test_ppo_asymmetric_clip_and_mask():
    # clip_ratio_high = 0.28 lets ratio 1.25 through for A > 0; the masked token is ignored.
    lp, old = T([[math.log(1.25), 0.0]]), T([[0.0, 5.0]])
    adv, mask = T([[2.0, 100.0]]), T([[1.0, 0.0]])
    loss, met = ppo_policy_loss(lp, old, adv, mask, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-2.5, abs=1e-6) and met["clip_frac"].item() == 0.0
    loss, met = ppo_policy_loss(lp, old, adv, mask, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-2.4, abs=1e-6) and met["clip_frac"].item() == 1.0


def test_ppo_bad_inputs():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(x, x, x, x, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(x, x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        ppo_policy_loss(x, x, x, x, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="clip ratios"):
        ppo_policy_loss(x, x, x, x, clip_ratio_low=-0.1)


def test_kl_estimators_and_aliases():
    lp, ref = T([[-1.0, -2.0, -0.5]]), T([[-1.5, -1.0, -0.5]])
    d = lp - ref  # log r = [0.5, −1, 0]
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, "kl"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, "abs"), d.abs())
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(lp, ref, "mse"), 0.5 * d**2)
    k3 = T([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1, 0.0]])
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), k3)
    assert kl_penalty(T([[0.0]]), T([[-50.0]]), "k3").item() == 10.0  # clamped outlier
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(lp, ref, "k4")
    with pytest.raises(ValueError, match="ref_log_probs"):
        kl_penalty(lp, ref[:, :2], "k1")


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000))
def test_k1_k3_expectations_are_the_exact_kl(seed):
    # E_{y~π}[k1] = E_{y~π}[k3] = KL(π‖ref), computed exactly over a small vocabulary. Logits
    # stay within ±1.2, so |log r| ≤ 2.4 < log 13 and k3's clamp at 10 never binds.
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.rand(6, generator=g, dtype=torch.float64) * 1.2, -1)
    logq = torch.log_softmax(torch.rand(6, generator=g, dtype=torch.float64) * 1.2, -1)
    p = logp.exp()
    exact = (p * (logp - logq)).sum()
    for kind in ("k1", "k3"):
        est = (p * kl_penalty(logp[None], logq[None], kind)[0]).sum()
        assert est.item() == pytest.approx(exact.item(), rel=1e-9, abs=1e-12)
    assert (kl_penalty(logp[None], logq[None], "k3") >= 0).all()


def test_kl_in_reward():
    scores = T([[0.0, 1.0], [2.0, 0.0]])
    lp, ref, mask = (
        T([[-1.0, -1.0], [-2.0, -1.0]]),
        T([[-1.5, -0.5], [-1.0, -3.0]]),
        T([[1.0, 1.0], [1.0, 0.0]]),
    )
    rewards, mean_kl = kl_in_reward(scores, lp, ref, mask, coef=0.1, kind="k1")
    # k1 = [[0.5, −0.5], [−1, (masked)]] -> r = scores − 0.1·k1·m; masked mean = −1/3.
    torch.testing.assert_close(rewards, T([[-0.05, 1.05], [2.1, 0.0]]))
    assert mean_kl.item() == pytest.approx(-1 / 3, abs=1e-6)


def test_agg_modes_hand_worked():
    x = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    m = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the third row is empty
    # masked: row 0 -> 1 + 2 = 3 (2 tokens), row 1 -> 4 (1 token); 3 tokens, 2 sequences.
    assert agg_loss(x, m, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(x, m, "seq-mean-token-sum").item() == pytest.approx(7 / 2)
    assert agg_loss(x, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert agg_loss(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(7 / (3 * 2))
    assert agg_loss(x, m, "seq-mean-token-sum-norm", horizon=7).item() == pytest.approx(7 / 14)
    assert agg_loss(x, torch.zeros(3, 3), "token-mean").item() == 0.0  # no NaN
    norms = loss_normalizers(m)
    assert norms["num_tokens"].item() == 3 and norms["num_seqs"].item() == 2


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(LOSS_AGG_MODES), st.integers(1, 4))
def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient(seed, mode, n_micro):
    g = torch.Generator().manual_seed(seed)
    B, L = 8, 6
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    m = (torch.arange(L)[None] < lengths[:, None]).float()
    lp = torch.randn(B, L, generator=g).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, L, generator=g)
    norms = {**loss_normalizers(m), "horizon": L}
    full, _ = ppo_policy_loss(lp, old, adv, m, loss_agg_mode=mode, **norms)
    (g_full,) = torch.autograd.grad(full, lp)
    total, g_acc = 0.0, torch.zeros_like(lp)
    for rows in torch.arange(B).chunk(n_micro):
        # Each micro-batch is trimmed to its own longest response, as a packer would do.
        Lm = max(int(lengths[rows].max()), 1)
        part, _ = ppo_policy_loss(
            lp[rows, :Lm], old[rows, :Lm], adv[rows, :Lm], m[rows, :Lm], loss_agg_mode=mode, **norms
        )
        total = total + part.detach()
        (gp,) = torch.autograd.grad(part, lp)
        g_acc += gp
    torch.testing.assert_close(total, full.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_acc, g_full, atol=1e-6, rtol=1e-5)


def test_entropy_bonus_and_value_loss():
    ent, m = T([[1.0, 3.0], [2.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    assert entropy_bonus(ent, m, 0.01).item() == pytest.approx(-0.01 * 2.0)
    # V = [1, 3], V_old = [0, 3.5], R = [2, 2], c = 0.5: V_clip = [0.5, 3];
    # token 0: max((1−2)², (0.5−2)²) = 2.25 (clipped); token 1: max(1, 1) = 1 -> ½·(2.25+1)/2.
    v, old, ret = T([[1.0, 3.0]]), T([[0.0, 3.5]]), T([[2.0, 2.0]])
    loss, met = value_loss(v, old, ret, torch.ones(1, 2), clip_range=0.5)
    assert loss.item() == pytest.approx(0.5 * 3.25 / 2)
    assert met["vf_clip_frac"].item() == pytest.approx(0.5)
    loss, _ = value_loss(v, old, ret, torch.ones(1, 2), clip_range=None)
    assert loss.item() == pytest.approx(0.5 * 2 / 2)
    with pytest.raises(ValueError, match="returns"):
        value_loss(v, old, ret[:, :1], torch.ones(1, 2))


@pytest.mark.parametrize("kind", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+"])
def test_straight_through_kl_has_the_base_value_and_the_k2_gradient(kind):
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 5, generator=g) * 3).requires_grad_(True)  # |log r| up to ~20: k3 clamps
    ref = torch.randn(3, 5, generator=g).requires_grad_(True)
    value = kl_penalty(lp, ref, kind)
    assert torch.equal(value, kl_penalty(lp, ref, kind[:-1]))  # exactly the base estimator
    weights = torch.rand(3, 5, generator=g)  # a generic cotangent
    got = torch.autograd.grad((value * weights).sum(), (lp, ref))
    k2 = torch.autograd.grad((kl_penalty(lp, ref, "k2") * weights).sum(), (lp, ref))
    torch.testing.assert_close(got, k2, rtol=0, atol=0)
    log_ratio = (lp - ref).detach()
    torch.testing.assert_close(got[0], weights * log_ratio)  # ∂½(log r)²/∂log π = log r
    assert kind in KL_KINDS and kind[:-1] in KL_KINDS
