"""``algorithm.off_policy``: tis and decoupled (AReaL) losses and OTB's W with behaviour
weights, each against a per-token float64 reference written here, plus the config mapping."""

import math

import pytest
import torch

from otbrl.algos import compute_advantage
from otbrl.algos.loss_math import Normalizers, loss_normalizers
from otbrl.algos.loss_terms import build_loss
from otbrl.algos.otb import token_energy
from otbrl.algos.rollout_correction import rollout_is_weights
from otbrl.config import ConfigError, load_config
from otbrl.run.needs import correction_mode


def _batch(seed=0, b=8, length=6, stale=0.5):
    """π_θ (log_probs), π_prox (old), π_behave (rollout) several versions apart, A, m."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (b,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    prox = -torch.rand(b, length, generator=g) * 2 - 0.05
    behave = prox + torch.randn(b, length, generator=g) * stale
    theta = prox + torch.randn(b, length, generator=g) * 0.3
    adv = torch.randn(b, length, generator=g)
    return theta, prox, behave, adv, mask


def _behaviour_weight(prox, behave, cap, mode):
    """One token's weight, from the formulas in docs/rollout.md."""
    w = math.exp(prox - behave)
    if mode == "tis":
        return min(w, cap)
    return w if w <= cap else 0.0  # decoupled: over the cap is weighted 0, not truncated


def _reference_loss(theta, prox, behave, adv, mask, *, mode, cap, low, high, c):
    """token-mean of w·max(−A·r, −A·clip(r, 1−low, 1+high)) with r = π_θ/π_prox (dual clip
    min(·, −A·c) for A < 0), a float64 loop over tokens."""
    total, n = 0.0, 0
    for i, t in mask.nonzero().tolist():
        a = float(adv[i, t])
        r = math.exp(float(theta[i, t]) - float(prox[i, t]))
        token = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
        if c is not None and a < 0:
            token = min(token, -a * c)
        w = (
            1.0
            if mode == "none"
            else _behaviour_weight(float(prox[i, t]), float(behave[i, t]), cap, mode)
        )
        total += w * token
        n += 1
    return total / n


@pytest.mark.parametrize("cap", [1.2, 2.0])
def test_decoupled_weights_match_a_plain_loop(cap):
    _, prox, behave, _, mask = _batch(1, stale=0.6)
    weights, keep, metrics = rollout_is_weights(prox, behave, mask, mode="decoupled", cap=cap)
    assert torch.equal(keep, mask)
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    masked = 0
    for i, t in mask.nonzero().tolist():
        w = math.exp(float(prox[i, t]) - float(behave[i, t]))
        expected[i, t] = w if w <= cap else 0.0
        masked += w > cap
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=0)
    assert 0 < masked < mask.sum()  # both outcomes are seen
    assert metrics["rollout/is_masked_frac"] == pytest.approx(masked / mask.sum().item())


@pytest.mark.parametrize("mode", ["none", "tis", "decoupled"])
@pytest.mark.parametrize("c", [None, 3.0])
def test_off_policy_losses_equal_their_per_token_reference(mode, c):
    theta, prox, behave, adv, mask = _batch(2)
    theta = theta.clone().requires_grad_()
    batch = {"response_mask": mask, "old_log_probs": prox, "advantages": adv}
    if mode != "none":
        weight_mode = {"tis": "token_tis", "decoupled": "decoupled"}[mode]
        batch["rollout_is_weights"] = rollout_is_weights(
            prox, behave, mask, mode=weight_mode, cap=1.5
        )[0]
    loss_fn = build_loss(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c)
    norms = loss_normalizers(mask)
    assert isinstance(norms, Normalizers)
    loss, _ = loss_fn({"log_probs": theta}, batch, norms)
    expected = _reference_loss(
        theta.detach(), prox, behave, adv, mask, mode=mode, cap=1.5, low=0.2, high=0.28, c=c
    )
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-7)
    loss.backward()  # the weights are constants: the gradient is w · ∂PPO/∂log π_θ
    assert torch.isfinite(theta.grad).all()


def test_decoupled_differs_from_tis_only_above_the_cap():
    _, prox, behave, _, mask = _batch(3, stale=0.8)
    tis = rollout_is_weights(prox, behave, mask, mode="token_tis", cap=1.5)[0]
    dec = rollout_is_weights(prox, behave, mask, mode="decoupled", cap=1.5)[0]
    below = (prox - behave).exp() <= 1.5
    valid = mask.bool()
    assert torch.equal(tis[valid & below], dec[valid & below])
    assert (dec[valid & ~below] == 0).all() and (tis[valid & ~below] == 1.5).all()


@pytest.mark.parametrize("mode", ["token_tis", "decoupled"])
def test_otb_energy_carries_the_squared_behaviour_weights(mode):
    _, prox, behave, _, mask = _batch(4)
    g = torch.Generator().manual_seed(9)
    sum_pi_sq = prox.exp() ** 2 + torch.rand(prox.shape, generator=g) * 0.1
    w = rollout_is_weights(prox, behave, mask, mode=mode, cap=1.5)[0]
    got = token_energy(mask, prox, sum_pi_sq, rollout_is_weights=w)
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    for i, t in mask.nonzero().tolist():
        pi = math.exp(float(prox[i, t]))
        energy = 1 - 2 * pi + float(sum_pi_sq[i, t])
        rho = _behaviour_weight(
            float(prox[i, t]), float(behave[i, t]), 1.5, "tis" if mode == "token_tis" else mode
        )
        expected[i, t] = rho * rho * energy
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    # and the estimator reads them from the batch as the trainer passes it (**batch)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(mask.shape[0]), mask.sum(1).long() - 1] = torch.rand(
        mask.shape[0], generator=g
    )
    index = torch.arange(mask.shape[0]) // 4
    common = dict(token_level_rewards=rewards, response_mask=mask, index=index,
                  old_log_probs=prox, sum_pi_squared=sum_pi_sq)  # fmt: skip
    with_w, _ = compute_advantage("optimal_token_baseline", **common, rollout_is_weights=w)
    without, _ = compute_advantage("optimal_token_baseline", **common)
    assert not torch.allclose(with_w, without)


def test_config_maps_off_policy_to_one_correction():
    assert correction_mode(load_config(overrides=[])) == "none"
    cfg = load_config(overrides=["algorithm.off_policy=tis"])
    assert correction_mode(cfg) == "token_tis"
    cfg = load_config(overrides=["algorithm.off_policy=decoupled"])
    assert correction_mode(cfg) == "decoupled"
    cfg = load_config(overrides=["algorithm.rollout_correction=seq_mis"])
    assert correction_mode(cfg) == "seq_mis"
    with pytest.raises(ConfigError, match=r"algorithm\.off_policy"):
        load_config(overrides=["algorithm.off_policy=tis", "algorithm.rollout_correction=seq_mis"])
    with pytest.raises(ConfigError, match=r"algorithm\.off_policy"):
        load_config(overrides=["algorithm.off_policy=decouple"])
