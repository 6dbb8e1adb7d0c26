"""OTB and TIR-OTB against a plain-loop float64 reference, and their invariants."""

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otbrl.algos import compute_advantage
from otbrl.algos.otb import (
    optimal_token_baseline,
    reward_to_go_and_energy,
    tir_optimal_token_baseline,
    zero_tail_mask,
)
from otbrl.ops import token_stats

FNS = {"otb": optimal_token_baseline, "tir": tir_optimal_token_baseline}
ESTIMATOR_NAMES = [
    "optimal_token_baseline", "tir_optimal_token_baseline", "grpo", "rloo",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae",
]  # fmt: skip
GROUP_LOCAL = ["optimal_token_baseline", "tir_optimal_token_baseline", "grpo", "rloo"]
HYP = settings(max_examples=25, deadline=None)


def reference(b, *, tir, zero_tail=True, loo=False, uniform=False):
    """The semantics written out with plain loops over rows, groups and positions (float64)."""
    r, m = b["token_level_rewards"].double(), b["response_mask"].double()
    B, L = r.shape
    if uniform:
        w = torch.ones_like(r)
    else:
        w = 1 - 2 * b["old_log_probs"].double().exp() + b["sum_pi_squared"].double()
    if b.get("rollout_is_weights") is not None:
        w = w * b["rollout_is_weights"].double() ** 2
    G, W = torch.zeros_like(r), torch.zeros_like(r)
    for i in range(B):
        acc = 0.0
        for t in reversed(range(L)):
            acc += float(r[i, t] * m[i, t])
            G[i, t] = acc
        acc = 0.0
        for t in range(L):
            acc += float(w[i, t] * m[i, t])
            W[i, t] = acc
    groups = {}
    for i, key in enumerate(b["index"]):
        groups.setdefault(key, []).append(i)
    adv = torch.zeros_like(r)
    for rows in groups.values():
        # TIR: the k-th response token of a row is its k-th position with m = 1.
        pos = {i: [t for t in range(L) if m[i, t] > 0] if tir else list(range(L)) for i in rows}
        members = [i for i in rows if m[i].sum() > 0] if tir else rows
        length = {i: int(m[i].sum()) for i in rows}
        tail_from = dict.fromkeys(rows, L + 1)
        ranked = sorted((length[i] for i in members), reverse=True)
        if zero_tail and len(ranked) >= 2 and ranked[0] > ranked[1]:
            (top,) = [i for i in members if length[i] == ranked[0]]
            tail_from[top] = ranked[1]
        for i in rows:
            for k, t in enumerate(pos[i]):
                if m[i, t] == 0:
                    continue
                num = den = 0.0
                for j in members:
                    if (loo and j == i) or k >= len(pos[j]):
                        continue
                    tj = pos[j][k]
                    num += float(G[j, tj] * W[j, tj] * m[j, tj])
                    den += float(W[j, tj] * m[j, tj])
                base = num / (den + 1e-8)
                if len(members) == 1 or k >= tail_from[i]:
                    base = 0.0
                adv[i, t] = G[i, t] - base
    return adv, G


def random_batch(seed, B=None, L=None, holes=True, is_weights=None, n_ids=4):
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    B = B or rnd.randint(1, 10)
    L = L or rnd.randint(1, 8)
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    m = (torch.arange(L)[None] < lengths[:, None]).float()
    if holes:  # tool-output holes inside some responses
        m = m * (torch.rand(B, L, generator=g) > 0.25)
    r = torch.randn(B, L, generator=g) * (torch.rand(B, L, generator=g) < 0.5)
    probs = torch.rand(B, L, generator=g) * 0.9 + 0.05
    spi = probs**2 + torch.rand(B, L, generator=g) * (1 - probs) ** 2  # within [π², 1]
    isw = rnd.random() < 0.5 if is_weights is None else is_weights
    return {
        "token_level_rewards": r,
        "response_mask": m,
        "index": [f"u{rnd.randrange(n_ids)}" for _ in range(B)],
        "old_log_probs": probs.log(),
        "sum_pi_squared": spi,
        "rollout_is_weights": torch.rand(B, L, generator=g) + 0.5 if isw else None,
    }


def assert_adv_close(a, b):
    # LOO subtracts a row from its group sum: allow float32 cancellation relative to |B|.
    torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


def test_matches_loop_reference_on_random_batches():
    for seed in range(24):
        b = random_batch(seed)
        snapshot = {k: v.clone() for k, v in b.items() if torch.is_tensor(v)}
        for kind, fn in FNS.items():
            for zero_tail in (True, False):
                for loo in (False, True):
                    for uniform in (False, True):
                        adv, ret = fn(
                            **b,
                            handle_zero_tail=zero_tail,
                            leave_one_out=loo,
                            energy="uniform" if uniform else "logit_gradient",
                        )
                        ra, rg = reference(
                            b, tir=kind == "tir", zero_tail=zero_tail, loo=loo, uniform=uniform
                        )
                        assert_adv_close(adv, ra)
                        torch.testing.assert_close(ret.double(), rg, atol=1e-5, rtol=1e-5)
        for k, v in snapshot.items():  # inputs are never written to
            assert torch.equal(b[k], v), k


def test_large_group_ids_and_many_groups_match_reference():
    # Interleaved ids, sizes 1..N: 40 rows over 13 groups, with holes and IS weights.
    b = random_batch(99, B=40, L=9, is_weights=True, n_ids=13)
    for kind, fn in FNS.items():
        assert_adv_close(fn(**b)[0], reference(b, tir=kind == "tir")[0])


def permuted(b, perm):
    out = {k: (v[perm] if torch.is_tensor(v) else v) for k, v in b.items()}
    out["index"] = [b["index"][i] for i in perm.tolist()]
    return out


def with_values(b):
    return {**b, "values": b["old_log_probs"].exp(), "gamma": 0.9, "lam": 0.8}


@HYP
@given(st.integers(0, 10_000), st.sampled_from(ESTIMATOR_NAMES))
def test_row_permutation_permutes_outputs(seed, name):
    b = with_values(random_batch(seed))
    perm = torch.randperm(
        b["response_mask"].shape[0], generator=torch.Generator().manual_seed(seed)
    )
    adv, ret = compute_advantage(name, **b)
    padv, pret = compute_advantage(name, **permuted(b, perm))
    torch.testing.assert_close(padv, adv[perm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pret, ret[perm], atol=1e-5, rtol=1e-5)


@HYP
@given(st.integers(0, 10_000), st.sampled_from(ESTIMATOR_NAMES), st.integers(1, 5))
def test_masked_padding_columns_leave_outputs_unchanged(seed, name, extra):
    b = with_values(random_batch(seed))
    B, L = b["response_mask"].shape
    padded = {}
    for k, v in b.items():
        if torch.is_tensor(v):
            fill = torch.zeros(B, extra) if k in ("token_level_rewards", "response_mask") else None
            padded[k] = torch.cat([v, fill if fill is not None else torch.rand(B, extra)], 1)
        else:
            padded[k] = v
    adv, ret = compute_advantage(name, **b)
    padv, pret = compute_advantage(name, **padded)
    torch.testing.assert_close(padv[:, :L], adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pret[:, :L], ret, atol=1e-5, rtol=1e-5)
    assert padv[:, L:].abs().max() == 0


@HYP
@given(st.integers(0, 10_000), st.sampled_from(GROUP_LOCAL), st.booleans())
def test_groups_are_independent(seed, name, loo):
    a, c = random_batch(seed), random_batch(seed + 1)
    L = min(a["response_mask"].shape[1], c["response_mask"].shape[1])
    a, c = ({k: v[:, :L] if torch.is_tensor(v) else v for k, v in x.items()} for x in (a, c))
    a["rollout_is_weights"] = c["rollout_is_weights"] = None
    c["index"] = [k + "_other" for k in c["index"]]
    both = {k: torch.cat([a[k], c[k]]) if torch.is_tensor(a[k]) else None for k in a}
    both["index"] = a["index"] + c["index"]
    adv = compute_advantage(name, **both, leave_one_out=loo)[0]
    Ba = a["response_mask"].shape[0]
    torch.testing.assert_close(adv[:Ba], compute_advantage(name, **a, leave_one_out=loo)[0])
    torch.testing.assert_close(adv[Ba:], compute_advantage(name, **c, leave_one_out=loo)[0])


@HYP
@given(st.integers(0, 10_000), st.sampled_from(["otb", "tir"]))
def test_equal_weights_give_minus_group_mean(seed, kind):
    # Full masks and w depending on the position only: every row of a group has the same W_t,
    # so B_t is the plain group mean of G_t (up to the 1e-8 in the denominator).
    b = random_batch(seed, holes=False, is_weights=False)
    B, L = b["response_mask"].shape
    b["response_mask"] = torch.ones(B, L)
    b["old_log_probs"] = b["old_log_probs"][:1].expand(B, L)
    b["sum_pi_squared"] = b["sum_pi_squared"][:1].expand(B, L)
    adv, G = FNS[kind](**b, handle_zero_tail=False)
    expected = G.clone()
    for key in set(b["index"]):
        rows = [i for i, k in enumerate(b["index"]) if k == key]
        if len(rows) > 1:
            expected[rows] -= G[rows].mean(0)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


@HYP
@given(st.integers(0, 10_000), st.sampled_from(["otb", "tir"]))
def test_unit_is_weights_equal_no_is(seed, kind):
    b = random_batch(seed, is_weights=False)
    plain = FNS[kind](**b)
    ones = FNS[kind](**{**b, "rollout_is_weights": torch.ones_like(b["response_mask"])})
    torch.testing.assert_close(ones, plain, atol=0, rtol=0)


@HYP
@given(st.integers(0, 10_000), st.booleans())
def test_tir_equals_otb_without_holes(seed, zero_tail):
    # Right-padded masks (no holes) and no empty response: k = t for every token, and both
    # variants see the same members, so they agree exactly, zero tail included. They differ when
    # a group holds empty responses (OTB counts them in n and ℓ_2, TIR-OTB leaves them out;
    # see test_empty_response_membership_otb_vs_tir) and, of course, when masks have holes.
    b = random_batch(seed, holes=False)
    m = b["response_mask"]
    m[:, 0] = 1.0  # no empty responses
    otb = optimal_token_baseline(**b, handle_zero_tail=zero_tail)
    tir = tir_optimal_token_baseline(**b, handle_zero_tail=zero_tail)
    torch.testing.assert_close(tir, otb, atol=1e-6, rtol=1e-6)


@HYP
@given(st.integers(0, 10_000), st.sampled_from(["otb", "tir"]))
def test_leave_one_out_equals_otb_on_the_group_without_that_row(seed, kind):
    # Give row i an IS weight of 0: its w, W are 0, so OTB's baseline for its group becomes
    # the weighted mean over the other rows only, which is LOO's baseline for row i.
    b = random_batch(seed, is_weights=False)
    b["response_mask"][:, 0] = 1.0  # keep every row a member in both variants
    loo = FNS[kind](**b, leave_one_out=True, handle_zero_tail=False)[0]
    B = b["response_mask"].shape[0]
    for i in range(B):
        isw = torch.ones_like(b["response_mask"])
        isw[i] = 0.0
        ghost = FNS[kind](**{**b, "rollout_is_weights": isw}, handle_zero_tail=False)[0]
        # (A row alone in its group gets B = 0 both ways.)
        expected = ghost[i]
        torch.testing.assert_close(loo[i], expected, atol=2e-5, rtol=2e-5)


@HYP
@given(st.integers(0, 10_000))
def test_uniform_energy_is_the_mean_return_of_active_rows(seed):
    # Right-padded masks: all rows active at t have W_t = t + 1, so B_t is the plain mean of G
    # over the active rows. (With holes, W counts each row's own tokens so far and differs.)
    b = random_batch(seed, holes=False, is_weights=False)
    adv, G = optimal_token_baseline(**b, energy="uniform", handle_zero_tail=False)
    m = b["response_mask"]
    expected = torch.zeros_like(G)
    for key in set(b["index"]):
        rows = [i for i, k in enumerate(b["index"]) if k == key]
        if len(rows) == 1:
            expected[rows] = G[rows] * m[rows]
            continue
        active = m[rows]
        mean = (G[rows] * active).sum(0) / active.sum(0).clamp(min=1)
        expected[rows] = (G[rows] - mean) * active
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


@HYP
@given(st.integers(0, 10_000), st.sampled_from(["otb", "tir"]))
def test_zero_tail_mask_marks_where_zero_tail_changes_the_baseline(seed, kind):
    b = random_batch(seed)
    with_tail, G = FNS[kind](**b)
    without = FNS[kind](**b, handle_zero_tail=False)[0]
    tail = zero_tail_mask(b["response_mask"], b["index"], response_space=kind == "tir")
    m = b["response_mask"]
    torch.testing.assert_close(with_tail[tail], (G * m)[tail])
    torch.testing.assert_close(with_tail[~tail], without[~tail])


def test_w_matches_autograd_logit_gradient_norm():
    # w_t = 1 − 2π_y + Σπ² is ‖∂ log π(y_t)/∂z_t‖²; W is its masked running sum. A tiny causal
    # model (embedding -> causal running mean -> linear head) gives the logits; the statistics
    # come from otbrl.ops.token_stats (at a temperature, as the engine computes them), the
    # reference from autograd through a float64 log-softmax.
    torch.manual_seed(0)
    B, T, V, H, temp = 3, 7, 11, 8, 0.7
    emb, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V)
    tokens = torch.randint(0, V, (B, T + 1))
    x = emb(tokens[:, :-1])
    x = x.cumsum(1) / torch.arange(1, T + 1)[None, :, None]
    logits = head(torch.tanh(x)).detach()
    labels = tokens[:, 1:]
    z = (logits.double() / temp).requires_grad_(True)
    log_probs = torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0]
    (grad,) = torch.autograd.grad(log_probs.sum(), z)
    mask = (torch.rand(B, T) > 0.3).float()
    W_autograd = ((grad**2).sum(-1) * mask.double()).cumsum(-1)
    stats = token_stats(logits, labels, temperature=temp, entropy=False)
    _, W = reward_to_go_and_energy(
        torch.zeros(B, T), mask, stats.log_probs.detach(), stats.sum_pi_squared
    )
    torch.testing.assert_close(W.double(), W_autograd, atol=1e-5, rtol=1e-5)


def test_tir_layouts_rows_mixed_flat_agree_with_reference():
    # No row has holes, a few rows have holes (only those are moved to k space), most rows
    # have holes. All match the loop.
    for n_holes in (0, 2, 12):
        b = random_batch(7, B=16, L=9, holes=False, is_weights=True, n_ids=4)
        b["response_mask"][:, 0] = 1.0
        b["response_mask"][:n_holes, 1] = 0.0  # a hole (or a 1-token response)
        b["response_mask"][:n_holes, 2] = 1.0
        for zero_tail in (True, False):
            for loo in (False, True):
                adv = tir_optimal_token_baseline(**b, handle_zero_tail=zero_tail, leave_one_out=loo)
                ref = reference(b, tir=True, zero_tail=zero_tail, loo=loo)
                assert_adv_close(adv[0], ref[0])


def test_tir_with_holes_in_every_row_or_none_matches_reference():
    # Every row through the flat k index, and none: both match the loop, all options.
    for seed in range(6):
        b = random_batch(seed, B=12, L=9, holes=False, is_weights=seed % 2 == 0, n_ids=3)
        b["response_mask"][:, 0] = 1.0
        every = {**b, "response_mask": b["response_mask"].clone()}
        every["response_mask"][:, 1] = 0.0  # a hole in every row (or a 1-token response)
        every["response_mask"][:, 2] = 1.0
        for case in (b, every):
            for zero_tail in (True, False):
                for loo in (False, True):
                    adv, ret = tir_optimal_token_baseline(
                        **case, handle_zero_tail=zero_tail, leave_one_out=loo
                    )
                    ref = reference(case, tir=True, zero_tail=zero_tail, loo=loo)
                    assert_adv_close(adv, ref[0])
                    torch.testing.assert_close(ret.double(), ref[1], atol=1e-5, rtol=1e-5)


def test_hole_check_short_and_long_rows():
    from otbrl.algos.otb import rows_with_holes

    # Short rows use the exact position sum; rows of 6,000 positions exceed float32's exact
    # sums, so the neighbour test is used there. Both must agree with a plain check.
    for L in (10, 6000):
        m = torch.zeros(5, L)
        m[0, :7] = 1  # prefix
        m[1, 1:7] = 1  # leading padding
        m[2, :3] = 1
        m[2, L - 3 :] = 1  # a hole
        m[4, :] = 1  # full row (row 3 is empty)
        plain = [bool(r.sum() > 0 and r.nonzero().max() + 1 != r.sum()) for r in m]
        assert rows_with_holes(m).tolist() == plain == [False, True, True, False, False]
