"""The where-rule: NaN/inf at masked positions of any input reach no output, reduction,
metric or gradient, and outputs at masked positions are exactly 0."""

import pytest
import torch

from otbrl.algos import ESTIMATORS, compute_advantage
from otbrl.algos.loss_math import (
    agg_loss,
    entropy_bonus,
    kl_in_reward,
    loss_normalizers,
    ppo_policy_loss,
    value_loss,
)
from otbrl.algos.loss_terms import build_loss, build_value_loss
from otbrl.algos.metrics import masked_summary, otb_metrics, variance_proxy
from otbrl.algos.otb import reward_to_go_and_energy, token_energy
from otbrl.algos.reductions import masked_mean, masked_sum, masked_var, whiten

T = torch.tensor
BAD = (float("nan"), float("inf"), float("-inf"))


def poison(x, mask, seed):
    """x with NaN, +inf and −inf at its masked positions (cycled)."""
    out = x.clone()
    holes = (mask == 0).nonzero()
    for j, (i, t) in enumerate(holes.tolist()):
        out[i, t] = BAD[(j + seed) % 3]
    return out


def test_the_issue_example_mean_is_2_5():
    x, m = T([[1.0, 2.0, float("nan"), 4.0]]), T([[1.0, 0.0, 0.0, 1.0]])
    assert masked_mean(x, m).item() == 2.5
    assert masked_sum(x, m).item() == 5.0
    assert masked_var(x, m).item() == pytest.approx(4.5)
    w = whiten(x, m)
    assert torch.isfinite(w).all() and w[0, 1] == 0 and w[0, 2] == 0
    torch.testing.assert_close(w[0, [0, 3]], T([-1.5, 1.5]) / 4.5**0.5)


def test_masked_reductions_and_their_gradients_ignore_masked_values():
    g = torch.Generator().manual_seed(0)
    m = (torch.rand(6, 9, generator=g) > 0.4).float()
    clean = torch.randn(6, 9, generator=g)
    for dim in (None, -1):
        got = []
        for x in (poison(clean, m, 1), clean.clone()):
            x.requires_grad_(True)
            value = masked_mean(x, m, dim)
            (grad,) = torch.autograd.grad(value.sum(), x)
            got.append((value, grad))
        (v_bad, g_bad), (v_ok, g_ok) = got
        torch.testing.assert_close(v_bad, v_ok, rtol=0, atol=0)
        torch.testing.assert_close(g_bad, g_ok, rtol=0, atol=0)
        assert (g_bad[m == 0] == 0).all()
    torch.testing.assert_close(masked_var(poison(clean, m, 2), m), masked_var(clean, m))
    w_bad, w_ok = whiten(poison(clean, m, 0), m), whiten(clean, m)
    torch.testing.assert_close(w_bad, w_ok, rtol=0, atol=0)
    assert (w_bad[m == 0] == 0).all()


def estimator_batch(seed):
    g = torch.Generator().manual_seed(seed)
    Bn, Ln = 12, 10
    lengths = torch.randint(1, Ln + 1, (Bn,), generator=g)
    m = (torch.arange(Ln)[None] < lengths[:, None]).float()
    m = m * (torch.rand(Bn, Ln, generator=g) > 0.2)  # tool-output holes
    m[0] = 0.0  # an empty response
    r = torch.randn(Bn, Ln, generator=g)
    probs = torch.rand(Bn, Ln, generator=g) * 0.9 + 0.05
    return {
        "token_level_rewards": r,
        "response_mask": m,
        "index": torch.arange(Bn) % 4,
        "old_log_probs": probs.log(),
        "sum_pi_squared": probs**2 + torch.rand(Bn, Ln, generator=g) * (1 - probs) ** 2,
        "rollout_is_weights": torch.rand(Bn, Ln, generator=g) + 0.5,
        "values": torch.randn(Bn, Ln, generator=g),
        "gamma": 0.9,
        "lam": 0.8,
    }


FLOAT_INPUTS = ("token_level_rewards", "old_log_probs", "sum_pi_squared", "rollout_is_weights")
OPTIONS = [{}, {"leave_one_out": True}, {"energy": "uniform"}, {"handle_zero_tail": False}]


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_estimators_never_read_masked_positions(name, options, gamma):
    clean = {**estimator_batch(3), "gamma": gamma}
    m = clean["response_mask"]
    bad = dict(clean)
    for j, key in enumerate((*FLOAT_INPUTS, "values")):
        bad[key] = poison(clean[key], m, j)
    adv, ret = compute_advantage(name, **clean, **options)
    bad_adv, bad_ret = compute_advantage(name, **bad, **options)
    torch.testing.assert_close(bad_adv, adv, rtol=0, atol=0)
    torch.testing.assert_close(bad_ret, ret, rtol=0, atol=0)
    assert torch.isfinite(bad_adv).all() and torch.isfinite(bad_ret).all()
    assert (bad_adv[m == 0] == 0).all()


def test_reward_to_go_and_energy_never_read_masked_positions():
    clean = estimator_batch(4)
    m = clean["response_mask"]
    args = [clean[k] for k in ("token_level_rewards", "old_log_probs", "sum_pi_squared")]
    isw = clean["rollout_is_weights"]
    G, W = reward_to_go_and_energy(args[0], m, args[1], args[2], rollout_is_weights=isw)
    bad = [poison(a, m, j) for j, a in enumerate(args)]
    bG, bW = reward_to_go_and_energy(
        bad[0], m, bad[1], bad[2], rollout_is_weights=poison(isw, m, 2)
    )
    torch.testing.assert_close((bG, bW), (G, W), rtol=0, atol=0)
    w = token_energy(m, bad[1], bad[2], rollout_is_weights=poison(isw, m, 1))
    assert torch.isfinite(w).all() and (w[m == 0] == 0).all()


def loss_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    Bn, Ln = 7, 6
    m = (torch.rand(Bn, Ln, generator=g) > 0.35).float()
    old = -torch.rand(Bn, Ln, generator=g)
    out = {
        "log_probs": old + 0.3 * torch.randn(Bn, Ln, generator=g),
        "entropy": torch.rand(Bn, Ln, generator=g),
        "values": torch.randn(Bn, Ln, generator=g),
    }
    batch = {
        "response_mask": m,
        "old_log_probs": old,
        "advantages": torch.randn(Bn, Ln, generator=g),
        "ref_log_probs": old + 0.2 * torch.randn(Bn, Ln, generator=g),
        "rollout_is_weights": torch.rand(Bn, Ln, generator=g) + 0.5,
        "values": torch.randn(Bn, Ln, generator=g),
        "returns": torch.randn(Bn, Ln, generator=g),
    }
    return out, batch


LOSS_FNS = {
    "actor": build_loss(entropy_coeff=0.1, kl_loss_coef=0.2),
    "actor k3+": build_loss(entropy_coeff=0.1, kl_loss_coef=0.2, kl_loss_type="k3+"),
    "actor seq-mean-token-mean": build_loss(
        loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.1, kl_loss_coef=0.2
    ),
    "critic": build_value_loss(cliprange_value=0.2),
}


@pytest.mark.parametrize("which", sorted(LOSS_FNS))
def test_loss_terms_metrics_and_gradients_ignore_masked_positions(which):
    loss_fn = LOSS_FNS[which]
    results = []
    for bad in (False, True):
        out, batch = loss_inputs(5)
        m = batch["response_mask"]
        if bad:
            out = {k: poison(v, m, j) for j, (k, v) in enumerate(out.items())}
            batch = {
                k: v if k == "response_mask" else poison(v, m, j)
                for j, (k, v) in enumerate(batch.items())
            }
        out = {k: v.requires_grad_(True) for k, v in out.items()}
        loss, metrics = loss_fn(out, batch, loss_normalizers(m))
        grads = torch.autograd.grad(loss, list(out.values()), allow_unused=True)
        results.append((loss, metrics, grads))
    (loss, metrics, grads), (bad_loss, bad_metrics, bad_grads) = results
    assert torch.isfinite(bad_loss) and bad_loss == loss
    assert bad_metrics.keys() == metrics.keys()
    for key in metrics:
        assert torch.isfinite(bad_metrics[key]) and bad_metrics[key] == metrics[key], key
    for g, bg in zip(grads, bad_grads):
        if g is not None:
            assert torch.isfinite(bg).all()
            torch.testing.assert_close(bg, g, rtol=0, atol=0)
            assert (bg[m == 0] == 0).all()


def test_pure_loss_functions_ignore_masked_positions():
    out, batch = loss_inputs(6)
    m = batch["response_mask"]
    b = {k: poison(v, m, j) for j, (k, v) in enumerate(batch.items()) if k != "response_mask"}
    lp = poison(out["log_probs"], m, 0).requires_grad_(True)
    loss, met = ppo_policy_loss(
        lp, b["old_log_probs"], b["advantages"], m, rollout_is_weights=b["rollout_is_weights"]
    )
    clean, clean_met = ppo_policy_loss(
        out["log_probs"], batch["old_log_probs"], batch["advantages"], m,
        rollout_is_weights=batch["rollout_is_weights"],
    )  # fmt: skip
    assert loss == clean and all(met[k] == clean_met[k] for k in met)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(grad).all() and (grad[m == 0] == 0).all()
    ent = poison(out["entropy"], m, 1)
    assert entropy_bonus(ent, m, 0.1) == entropy_bonus(out["entropy"], m, 0.1)
    mode = "seq-mean-token-mean"
    assert agg_loss(ent, m, mode) == agg_loss(out["entropy"], m, mode)
    v_loss, v_met = value_loss(poison(out["values"], m, 2), b["values"], b["returns"], m)
    c_loss, c_met = value_loss(out["values"], batch["values"], batch["returns"], m)
    assert v_loss == c_loss and v_met == c_met
    scores = torch.randn(m.shape)
    rewards, mean_kl = kl_in_reward(scores, lp.detach(), b["ref_log_probs"], m, coef=0.1)
    clean_r, clean_kl = kl_in_reward(scores, out["log_probs"], batch["ref_log_probs"], m, coef=0.1)
    torch.testing.assert_close((rewards, mean_kl), (clean_r, clean_kl), rtol=0, atol=0)
    assert torch.equal(rewards[m == 0], scores[m == 0])


def test_metrics_ignore_masked_positions():
    b = estimator_batch(7)
    m = b["response_mask"]
    adv = compute_advantage("optimal_token_baseline", **b)[0]
    lp, spi, isw = (b[k] for k in ("old_log_probs", "sum_pi_squared", "rollout_is_weights"))
    blp, bspi, bisw, badv = (poison(x, m, j) for j, x in enumerate((lp, spi, isw, adv)))
    torch.testing.assert_close(masked_summary(badv, m, "a"), masked_summary(adv, m, "a"))
    w = token_energy(m, lp, spi, rollout_is_weights=isw).sum(-1)
    bw = token_energy(m, blp, bspi, rollout_is_weights=bisw).sum(-1)
    torch.testing.assert_close(bw, w, rtol=0, atol=0)
    vp = variance_proxy(badv, m, bw, grad_norm=0.3)
    torch.testing.assert_close(vp, variance_proxy(adv, m, w, grad_norm=0.3), rtol=0, atol=0)
    got = otb_metrics(badv, m, b["index"], blp, bspi, rollout_is_weights=bisw)
    ref = otb_metrics(adv, m, b["index"], lp, spi, rollout_is_weights=isw)
    assert all(torch.isfinite(v) for v in got.values())
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
