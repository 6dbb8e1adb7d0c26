"""build_loss / build_value_loss: plain-loop references per term, exact additivity over
micro-batches for every loss_agg_mode, composed gradients, bad options."""

import math

import pytest
import torch

from otbrl.algos.loss_math import KL_KINDS, LOSS_AGG_MODES, Normalizers, loss_normalizers
from otbrl.algos.loss_terms import LOSSES, Loss, build_loss, build_value_loss, register_loss

B, L = 9, 7
MICRO = ((0, 2), (2, 7), (7, 9))  # three uneven micro-batches


def make_batch(seed=0, is_weights=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    lengths[3] = 0  # an empty row
    m = (torch.arange(L)[None] < lengths[:, None]).float()
    m[1, 2] = 0.0  # a hole
    old = -torch.rand(B, L, generator=g) * 2
    batch = {
        "response_mask": m,
        "old_log_probs": old,
        "advantages": torch.randn(B, L, generator=g),
        "ref_log_probs": old + 0.3 * torch.randn(B, L, generator=g),
        "values": torch.randn(B, L, generator=g),
        "returns": torch.randn(B, L, generator=g),
    }
    if is_weights:
        batch["rollout_is_weights"] = torch.rand(B, L, generator=g) + 0.5
    out = {
        "log_probs": old + 0.4 * torch.randn(B, L, generator=g),
        "entropy": torch.rand(B, L, generator=g) * 3,
        "values": batch["values"] + 0.5 * torch.randn(B, L, generator=g),
    }
    return out, batch


# ---- plain-loop float64 references ----------------------------------------------------------


def loop_agg(per_token, m, mode, num_tokens, num_seqs, horizon):
    total = 0.0
    for i in range(m.shape[0]):
        row = [per_token[i][t] for t in range(m.shape[1]) if m[i, t] > 0]
        if mode == "seq-mean-token-mean":
            total += sum(row) / len(row) if row else 0.0
        else:
            total += sum(row)
    if mode == "token-mean":
        return total / max(num_tokens, 1)
    if mode == "seq-mean-token-sum-norm":
        return total / (horizon * max(num_seqs, 1))
    return total / max(num_seqs, 1)


def loop_kl(d, kind):
    base = KL_KINDS[kind].rstrip("+")
    if base == "k1":
        return d
    if base == "abs":
        return abs(d)
    if base == "k2":
        return 0.5 * d * d
    neg = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(neg) - neg - 1.0, -10.0), 10.0)


def loop_reference(out, batch, mode, *, low, high, c, ent, kl_coef, kind, horizon):
    m = batch["response_mask"].double()
    n_tok, n_seq = float(m.sum()), float((m.sum(-1) > 0).sum())
    pg, clip, dual, akl, ent_tok, kl_tok = [], 0, 0, 0.0, [], []
    for i in range(B):
        pg.append([]), ent_tok.append([]), kl_tok.append([])
        for t in range(L):
            lp, old = float(out["log_probs"][i, t]), float(batch["old_log_probs"][i, t])
            a = float(batch["advantages"][i, t])
            lr = min(max(lp - old, -20.0), 20.0)
            r = math.exp(lr)
            un, cl = -a * r, -a * min(max(r, 1 - low), 1 + high)
            loss = max(un, cl)
            if m[i, t] > 0:
                clip += cl > un
                dual += a < 0 and loss > -a * c
                akl -= lr
            if a < 0:
                loss = min(loss, -a * c)
            pg[i].append(loss * float(batch["rollout_is_weights"][i, t]))
            ent_tok[i].append(float(out["entropy"][i, t]))
            kl_tok[i].append(loop_kl(lp - float(batch["ref_log_probs"][i, t]), kind))
    agg = {"mode": mode, "num_tokens": n_tok, "num_seqs": n_seq, "horizon": horizon}
    pg_loss, h = loop_agg(pg, m, **agg), loop_agg(ent_tok, m, **agg)
    kl = loop_agg(kl_tok, m, **agg)
    metrics = {
        "policy/pg_loss": pg_loss,
        "policy/clip_frac": clip / n_tok,
        "policy/clip_frac_lower": dual / n_tok,
        "policy/approx_kl": akl / n_tok,
        "policy/entropy_loss": h,
        "policy/kl_loss": kl,
        "policy/loss": pg_loss - ent * h + kl_coef * kl,
    }
    return metrics


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kind", ["low_var_kl", "k1", "abs+"])
def test_actor_loss_matches_plain_loop(mode, kind):
    out, batch = make_batch(1)
    options = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    loss_fn = build_loss(
        loss_agg_mode=mode, horizon=L, entropy_coeff=0.01, kl_loss_coef=0.1,
        kl_loss_type=kind, **options,
    )  # fmt: skip
    assert isinstance(loss_fn, Loss)
    assert loss_fn.needs == {"log_probs", "entropy"}
    assert loss_fn.batch_keys == {"response_mask", "old_log_probs", "advantages", "ref_log_probs"}
    loss, metrics = loss_fn(out, batch, loss_normalizers(batch["response_mask"]))
    ref = loop_reference(
        out, batch, mode, low=0.2, high=0.28, c=3.0, ent=0.01, kl_coef=0.1, kind=kind, horizon=L
    )
    assert loss.item() == pytest.approx(ref["policy/loss"], rel=1e-5, abs=1e-6)
    assert set(metrics) == set(ref)
    for key, value in ref.items():
        assert metrics[key].item() == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert metrics[key].dim() == 0 and not metrics[key].requires_grad


def micro_width(mask, lo, hi):
    """The padded width of rows lo:hi trimmed to their own last trained token, as a packer
    would make it (≥ 1)."""
    return max(int((mask[lo:hi] * torch.arange(1, L + 1)).max()), 1)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_mini_batch_loss_metrics_and_gradient(mode):
    out, batch = make_batch(2)
    out = {k: v.requires_grad_(True) for k, v in out.items()}
    norms = loss_normalizers(batch["response_mask"])
    for loss_fn in (
        build_loss(loss_agg_mode=mode, horizon=L, entropy_coeff=0.02, kl_loss_coef=0.05),
        build_value_loss(cliprange_value=0.3, loss_agg_mode=mode, horizon=L),
    ):
        full, full_metrics = loss_fn(out, batch, norms)
        full_grads = torch.autograd.grad(full, list(out.values()), allow_unused=True)
        total, sums = 0.0, dict.fromkeys(full_metrics, 0.0)
        grads = [torch.zeros(B, L) for _ in out]
        for lo, hi in MICRO:
            width = micro_width(batch["response_mask"], lo, hi)
            part_out, part_batch = (
                {k: v[lo:hi, :width] for k, v in d.items()} for d in (out, batch)
            )
            part, metrics = loss_fn(part_out, part_batch, norms)
            total += part.item()
            for key, value in metrics.items():
                sums[key] += value.item()
            part_grads = torch.autograd.grad(part, list(out.values()), allow_unused=True)
            for acc, g in zip(grads, part_grads):
                if g is not None:
                    acc += g
        assert total == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
        for key, value in full_metrics.items():
            assert sums[key] == pytest.approx(value.item(), rel=1e-5, abs=1e-7), key
        for acc, g in zip(grads, full_grads):
            if g is not None:
                torch.testing.assert_close(acc, g, rtol=1e-5, atol=1e-7)


def test_composed_gradient_is_the_sum_of_the_terms_gradients():
    out, batch = make_batch(3)
    out = {k: v.requires_grad_(True) for k, v in out.items()}
    norms = loss_normalizers(batch["response_mask"])
    agg = {"loss_agg_mode": "seq-mean-token-mean", "horizon": None}
    composed, _ = build_loss(entropy_coeff=0.05, kl_loss_coef=0.2, **agg)(out, batch, norms)
    policy = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    terms = [
        LOSSES["ppo"].fn(out, batch, norms, **policy, **agg)[0],
        LOSSES["entropy"].fn(out, batch, norms, coef=0.05, **agg)[0],
        LOSSES["kl"].fn(out, batch, norms, coef=0.2, kind="low_var_kl", **agg)[0],
    ]
    inputs = [out["log_probs"], out["entropy"]]
    got = torch.autograd.grad(composed, inputs)
    parts = [torch.autograd.grad(t, inputs, allow_unused=True) for t in terms]
    for i, g in enumerate(got):
        expected = sum(p[i] for p in parts if p[i] is not None)
        torch.testing.assert_close(g, expected)


def test_value_loss_matches_a_float64_loop_and_counts_only_clipped_tokens():
    g = torch.Generator().manual_seed(4)
    n, c = 4000, 0.2
    v, old, ret = (torch.randn(1, n, generator=g) for _ in range(3))
    m = torch.ones(1, n)
    # tokens within rounding of the clip boundary could flip between float32 and float64
    m[(((v - old).double().abs() - c).abs() < 1e-5)] = 0.0
    loss_fn = build_value_loss(cliprange_value=c)
    assert loss_fn.needs == {"values"}
    assert loss_fn.batch_keys == {"response_mask", "values", "returns"}
    batch = {"response_mask": m, "values": old, "returns": ret}
    loss, metrics = loss_fn({"values": v}, batch, loss_normalizers(m))
    total, clipped, tokens = 0.0, 0, 0
    for t in range(n):
        if m[0, t] == 0:
            continue
        vt, ot, rt = float(v[0, t]), float(old[0, t]), float(ret[0, t])
        v_clip = ot + min(max(vt - ot, -c), c) if abs(vt - ot) > c else vt
        err, err_clip = (vt - rt) ** 2, (v_clip - rt) ** 2
        clipped += err_clip > err
        total += 0.5 * max(err, err_clip)
        tokens += 1
    assert loss.item() == pytest.approx(total / tokens, rel=1e-5)
    assert metrics["critic/vf_clip_frac"].item() == pytest.approx(clipped / tokens, abs=1e-7)
    assert 0.05 < clipped / tokens < 0.5  # the case exercises clipping
    assert metrics["critic/value_loss"].item() == pytest.approx(loss.item())
    mean_v = float((v * m).sum() / m.sum())
    assert metrics["critic/values_mean"].item() == pytest.approx(mean_v, abs=1e-6)
    # unclipped: plain ½(V − R)²
    unclipped, _ = build_value_loss(cliprange_value=None)({"values": v}, batch, loss_normalizers(m))
    expected = 0.5 * float(((v - ret).double() ** 2 * m).sum() / m.sum())
    assert unclipped.item() == pytest.approx(expected, rel=1e-5)


def test_rollout_is_weights_scale_the_policy_term_only_when_present():
    out, batch = make_batch(5, is_weights=False)
    norms = loss_normalizers(batch["response_mask"])
    loss_fn = build_loss()
    plain, _ = loss_fn(out, batch, norms)
    doubled, _ = loss_fn(out, {**batch, "rollout_is_weights": torch.full((B, L), 2.0)}, norms)
    assert doubled.item() == pytest.approx(2 * plain.item(), rel=1e-6)


def test_bad_options_name_the_argument():
    for kwargs, name in [
        ({"policy_loss": "ppo_clip"}, "policy_loss"),  # its name before "ppo"
        ({"policy_loss": "entropy"}, "policy_loss"),  # registered, but not a policy term
        ({"loss_agg_mode": "mean"}, "loss_agg_mode"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "horizon"),
        ({"horizon": 0}, "horizon"),
        ({"horizon": 2.5}, "horizon"),
        ({"kl_loss_type": "k4"}, "kl_loss_type"),
        ({"kl_loss_type": "k2+"}, "kl_loss_type"),
        ({"entropy_coeff": -0.1}, "entropy_coeff"),
        ({"kl_loss_coef": -1.0}, "kl_loss_coef"),
        ({"kl_loss_coef": math.inf}, "kl_loss_coef"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"clip_ratio_low": math.nan}, "clip_ratio_low"),
        ({"clip_ratio_high": -0.2}, "clip_ratio_high"),
    ]:
        with pytest.raises(ValueError, match=name):
            build_loss(**kwargs)
    with pytest.raises(TypeError, match="entropy_coeff"):
        build_loss(entropy_coeff="0.1")
    with pytest.raises(TypeError, match="clip_ratio_c"):
        build_loss(clip_ratio_c=True)
    with pytest.raises(ValueError, match="cliprange_value"):
        build_value_loss(cliprange_value=-0.5)
    with pytest.raises(ValueError, match="horizon"):
        build_value_loss(loss_agg_mode="seq-mean-token-sum-norm")
    out, batch = make_batch(6)
    del batch["advantages"]
    with pytest.raises(ValueError, match="advantages"):
        build_loss()(out, batch, loss_normalizers(batch["response_mask"]))
    with pytest.raises(ValueError, match="entropy"):
        build_loss(entropy_coeff=0.1)({"log_probs": out["log_probs"]}, batch, None)


def test_disabled_terms_are_left_out_and_dual_clip_can_be_off():
    loss_fn = build_loss(clip_ratio_c=None)
    assert loss_fn.needs == {"log_probs"} and "ref_log_probs" not in loss_fn.batch_keys
    out, batch = make_batch(7)
    _, metrics = loss_fn(out, batch, loss_normalizers(batch["response_mask"]))
    assert set(metrics) == {"policy/loss", "policy/pg_loss", "policy/clip_frac", "policy/approx_kl"}


def test_a_registered_policy_term_can_be_built():
    @register_loss("test_vanilla_pg", role="policy", needs={"log_probs"},
                   batch_keys={"response_mask", "advantages"})  # fmt: skip
    def vanilla(out, batch, norms, *, loss_agg_mode, horizon):
        from otbrl.algos.loss_math import agg_loss

        per_token = -batch["advantages"] * out["log_probs"]
        kw = dict(num_tokens=norms.num_tokens, num_seqs=norms.num_seqs, horizon=horizon)
        return agg_loss(per_token, batch["response_mask"], loss_agg_mode, **kw), {}

    try:
        out, batch = make_batch(8)
        m = batch["response_mask"]
        loss, metrics = build_loss(policy_loss="test_vanilla_pg")(out, batch, loss_normalizers(m))
        expected = -(batch["advantages"] * out["log_probs"] * m).sum() / m.sum()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
        assert set(metrics) == {"policy/loss"}
        with pytest.raises(ValueError, match="already registered"):
            register_loss("test_vanilla_pg", role="policy")(vanilla)
        with pytest.raises(ValueError, match="needs"):
            register_loss("test_bad", role="policy", needs={"logits"})
    finally:
        del LOSSES["test_vanilla_pg"]


def test_normalizers_also_read_like_the_earlier_dict():
    norms = loss_normalizers(torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert isinstance(norms, Normalizers)
    assert norms.num_tokens.item() == 3 and norms.num_seqs.item() == 2
    assert norms["num_tokens"] is norms.num_tokens and norms[1] is norms.num_seqs
    assert {**norms} == {"num_tokens": norms.num_tokens, "num_seqs": norms.num_seqs}
    assert norms.num_tokens.dtype == norms.num_seqs.dtype == torch.float32
