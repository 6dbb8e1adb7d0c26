"""Hand-worked cases, registry and input errors for every advantage estimator."""

import math

import numpy as np
import pytest
import torch

from otbrl.algos import ESTIMATORS, compute_advantage, get_estimator
from otbrl.algos.advantages import (
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from otbrl.algos.otb import optimal_token_baseline, tir_optimal_token_baseline

T = torch.tensor


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=tol)


def otb_case():
    # Row 0: m=[1,1,1], r=[0,0,1] -> G=[1,1,1]; π_y = 0.5, Σπ² = 0.5 -> w = 1 - 1 + 0.5 = 0.5,
    #        W = [0.5, 1.0, 1.5].
    # Row 1: m=[1,1,0], r=[0,3,0] -> G=[3,3,0]; π_y = 0.25, Σπ² = 0.25 -> w = 0.75,
    #        W = [0.75, 1.5, 1.5].
    # Row 2: its own group, m=[1,0,0], r=[2,0,0] -> G=[2,0,0].
    r = T([[0.0, 0, 1], [0, 3, 0], [2, 0, 0]])
    m = T([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    olp = torch.log(T([[0.5] * 3, [0.25] * 3, [0.5] * 3]))
    spi = T([[0.5] * 3, [0.25] * 3, [0.5] * 3])
    return dict(
        token_level_rewards=r, response_mask=m, index=["a", "a", "b"], old_log_probs=olp,
        sum_pi_squared=spi,
    )  # fmt: skip


def test_otb_hand_worked():
    # B_0 = (1·0.5 + 3·0.75)/(0.5 + 0.75) = 2.2; B_1 = (1·1 + 3·1.5)/(1 + 1.5) = 2.2;
    # B_2 = 1·1.5/1.5 = 1 (only row 0 active). Row 2 is alone: B = 0.
    adv, ret = optimal_token_baseline(**otb_case(), handle_zero_tail=False)
    close(adv, [[-1.2, -1.2, 0.0], [0.8, 0.8, 0.0], [2.0, 0.0, 0.0]])
    close(ret, [[1.0, 1, 1], [3, 3, 0], [2, 0, 0]])
    # Zero tail: row 0 is the unique longest (3 > 2), ℓ_2 = 2, so its B_2 = 0 -> adv 1 - 0.
    adv, _ = optimal_token_baseline(**otb_case())
    close(adv, [[-1.2, -1.2, 1.0], [0.8, 0.8, 0.0], [2.0, 0.0, 0.0]])


def test_otb_leave_one_out_and_uniform_hand_worked():
    # LOO: row 0's baseline is row 1's G where row 1 is active: [3, 3, none -> 0];
    # row 1's is row 0's G: [1, 1]. Row 2 (n = 1) keeps B = 0.
    adv, _ = optimal_token_baseline(**otb_case(), leave_one_out=True)
    close(adv, [[-2.0, -2.0, 1.0], [2.0, 2.0, 0.0], [2.0, 0.0, 0.0]])
    # Uniform energy: W = cumsum(m) = [1,2,3] and [1,2,2]; B_0 = (1+3)/2 = 2,
    # B_1 = (1·2 + 3·2)/4 = 2; B_2 (row 0 alone) = 1, or 0 with the zero tail.
    case = otb_case()
    del case["old_log_probs"], case["sum_pi_squared"]
    adv, _ = optimal_token_baseline(**case, energy="uniform", handle_zero_tail=False)
    close(adv, [[-1.0, -1.0, 0.0], [1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    adv, _ = optimal_token_baseline(**case, energy="uniform")
    close(adv, [[-1.0, -1.0, 1.0], [1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])


def test_tir_otb_hand_worked_with_a_hole():
    # Row 0: m=[1,0,1,1] (t=1 is tool output), r=[0,0,0,2] -> G=[2,2,2,2]; uniform W=[1,1,2,3].
    #        Its response tokens k=0,1,2 sit at t=0,2,3 with (G, W) = (2,1), (2,2), (2,3).
    # Row 1: m=[1,1,0,0], r=[0,4,0,0] -> G=[4,4,0,0]; k=0,1 at t=0,1 with (4,1), (4,2).
    # B_k0 = (2·1 + 4·1)/2 = 3; B_k1 = (2·2 + 4·2)/4 = 3; B_k2 = 2 (row 0 alone), or 0 with
    # the zero tail (row 0 is the unique longest, ℓ_2 = 2).
    r = T([[0.0, 0, 0, 2], [0, 4, 0, 0]])
    m = T([[1.0, 0, 1, 1], [1, 1, 0, 0]])
    kw = dict(token_level_rewards=r, response_mask=m, index=T([7, 7]), energy="uniform")
    adv, ret = tir_optimal_token_baseline(**kw, handle_zero_tail=False)
    close(adv, [[-1.0, 0.0, -1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    close(ret, [[2.0, 2, 2, 2], [4, 4, 0, 0]])  # returns are not masked
    adv, _ = tir_optimal_token_baseline(**kw)
    close(adv, [[-1.0, 0.0, -1.0, 2.0], [1.0, 1.0, 0.0, 0.0]])
    # OTB aligns by absolute t instead: at t=1 only row 1 is active (B=4), at t=2 only row 0.
    adv, _ = optimal_token_baseline(**kw, handle_zero_tail=False)
    close(adv, [[-1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_empty_response_membership_otb_vs_tir():
    # One real row (G = [5, 5]) and one empty row in a group. TIR-OTB leaves the empty row out,
    # so the group has n = 1 and B = 0. OTB counts it: n = 2, and the zero tail (unique longest,
    # ℓ_2 = 0) zeroes the baseline from t = 0 -> the same advantages. Without the zero tail,
    # OTB's baseline is the row's own G (advantage ≈ 0).
    r = T([[0.0, 5.0], [0.0, 0.0]])
    m = T([[1.0, 1.0], [0.0, 0.0]])
    kw = dict(token_level_rewards=r, response_mask=m, index=[0, 0], energy="uniform")
    close(tir_optimal_token_baseline(**kw)[0], [[5.0, 5.0], [0.0, 0.0]])
    close(optimal_token_baseline(**kw)[0], [[5.0, 5.0], [0.0, 0.0]])
    close(optimal_token_baseline(**kw, handle_zero_tail=False)[0], [[0.0, 0.0], [0.0, 0.0]])


def grpo_case():
    # Group "p": scores 1, 2, 3 (rewards on the last valid token); group "q": a single score 5.
    r = T([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0], [5.0, 0.0]])
    m = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    return dict(token_level_rewards=r, response_mask=m, index=["p", "p", "p", "q"])


def test_grpo_hand_worked():
    # mean 2, unbiased std sqrt(((−1)² + 0 + 1²)/2) = 1 -> a = (−1, 0, 1)/(1 + 1e-6);
    # the singleton uses mean 0, std 1 -> 5/(1 + 1e-6).
    adv, ret = grpo(**grpo_case())
    s = 1 / (1 + 1e-6)
    close(adv, [[-s, -s], [0.0, 0.0], [s, s], [5 * s, 0.0]])
    close(ret, adv)
    adv, _ = grpo(**grpo_case(), norm_adv_by_std_in_grpo=False)  # Dr. GRPO
    close(adv, [[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0], [5.0, 0.0]])


def test_rloo_hand_worked():
    # (3·1 − 6)/2 = −1.5, (3·2 − 6)/2 = 0, (3·3 − 6)/2 = 1.5; the singleton keeps 5.
    adv, ret = rloo(**grpo_case())
    close(adv, [[-1.5, -1.5], [0.0, 0.0], [1.5, 1.5], [5.0, 0.0]])
    close(ret, adv)


def test_reinforce_plus_plus_baseline_hand_worked():
    # a = score − group mean: (−1, 0, 1) and 5 (singleton). Masked tokens: −1, −1, 0, 1, 1, 5:
    # μ = 5/6; Σ(x − μ)² = 2(11/6)² + (5/6)² + 2(1/6)² + (25/6)² = 894/36; σ² = that / 5.
    adv, _ = reinforce_plus_plus_baseline(**grpo_case())
    mu, sd = 5 / 6, math.sqrt(894 / 36 / 5)
    z = [(x - mu) / sd for x in (-1, 0, 1, 5)]
    close(adv, [[z[0], z[0]], [z[1], 0.0], [z[2], z[2]], [z[3], 0.0]], tol=1e-5)


def test_reinforce_plus_plus_hand_worked():
    # γ = 0.5, m = [1,0,1,1], r = [1,9,2,4] (the 9 sits on a tool token and is skipped):
    # R_3 = 4, R_2 = 2 + 0.5·4 = 4, t=1 passes R through (output 0), R_0 = 1 + 0.5·4 = 3.
    # Whitening over (3, 4, 4): μ = 11/3, σ² = (4/9 + 1/9 + 1/9)/2 = 1/3.
    r, m = T([[1.0, 9.0, 2.0, 4.0]]), T([[1.0, 0.0, 1.0, 1.0]])
    adv, ret = reinforce_plus_plus(token_level_rewards=r, response_mask=m, gamma=0.5)
    close(ret, [[3.0, 0.0, 4.0, 4.0]])
    s = math.sqrt(3.0)
    close(adv, [[(3 - 11 / 3) * s, 0.0, (4 - 11 / 3) * s, (4 - 11 / 3) * s]])


def test_gae_hand_worked():
    # γ = 1, λ = 0.5, m = [1,0,1], r = [0,0,1], V = [0.5,0.2,0.4]:
    # t=2: δ = 1 + 0 − 0.4 = 0.6, A = 0.6; t=1 is skipped; t=0: V_next = 0.4 (from t=2),
    # δ = 0 + 0.4 − 0.5 = −0.1, A = −0.1 + 0.5·0.6 = 0.2. returns = (A + V)·m = [0.7, 0, 1].
    # Whitened over (0.2, 0.6): μ = 0.4, σ² = 0.08.
    r, m, v = T([[0.0, 0.0, 1.0]]), T([[1.0, 0.0, 1.0]]), T([[0.5, 0.2, 0.4]])
    adv, ret = gae(token_level_rewards=r, response_mask=m, values=v, gamma=1.0, lam=0.5)
    close(ret, [[0.7, 0.0, 1.0]])
    z = 0.2 / math.sqrt(0.08 + 1e-8)
    close(adv, [[-z, 0.0, z]])


def test_registry_needs_and_dispatch():
    assert set(ESTIMATORS) >= {
        "optimal_token_baseline", "tir_optimal_token_baseline", "grpo", "rloo",
        "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae",
    }  # fmt: skip
    otb = get_estimator("optimal_token_baseline")
    assert otb.needs == {"old_log_probs", "sum_pi_squared"}
    assert otb.needs_for() == otb.needs
    assert otb.needs_for(energy="uniform", unrelated_key=1) == frozenset()
    assert get_estimator("tir_optimal_token_baseline").needs_for(energy="uniform") == frozenset()
    assert get_estimator("gae").needs == {"values"}
    assert get_estimator("grpo").needs == frozenset()
    with pytest.raises(ValueError, match="grpo"):
        get_estimator("gpro")
    # One common dict for every estimator: extra keys are dropped, options reach the function.
    common = dict(
        **otb_case(), values=torch.zeros(3, 3), gamma=1.0, lam=1.0, handle_zero_tail=False
    )
    for name in ESTIMATORS:
        adv, ret = compute_advantage(name, **common)
        assert adv.shape == ret.shape == (3, 3) and adv.dtype == ret.dtype == torch.float32
    close(compute_advantage("optimal_token_baseline", **common)[0][0], [-1.2, -1.2, 0.0])


def test_custom_estimator_registration():
    from otbrl.algos.advantages import ESTIMATORS as registry
    from otbrl.algos.advantages import register_estimator

    @register_estimator("test_zero_baseline", needs={"values"})
    def zero_baseline(*, token_level_rewards, response_mask, **rest):
        return token_level_rewards * response_mask, rest["values"]

    try:
        values = torch.ones(3, 3)
        adv, ret = compute_advantage("test_zero_baseline", **otb_case(), values=values)
        close(adv, otb_case()["token_level_rewards"] * otb_case()["response_mask"])
        assert ret is values  # **kwargs estimators receive every argument
        assert get_estimator("test_zero_baseline").needs_for(energy="uniform") == {"values"}
        with pytest.raises(ValueError, match="already registered"):
            register_estimator("test_zero_baseline")(zero_baseline)
    finally:
        del registry["test_zero_baseline"]


def test_index_forms_agree():
    case = grpo_case()
    ref = rloo(**case)[0]
    for index in (
        ["p", "p", "p", "q"],
        np.array([3, 3, 3, 9]),
        T([3, 3, 3, -1]),
        [(1, "a")] * 3 + [2],
    ):
        case["index"] = index
        close(rloo(**case)[0], ref)


def test_inputs_that_require_grad_are_read_as_constants():
    """Log-probs straight from a forward (``token_stats`` of logits that require grad) made
    OTB fail inside ``torch.exp(out=...)``: "functions with out=... arguments don't support
    automatic differentiation". Advantages are constants of the update."""
    case = otb_case()
    want = compute_advantage("optimal_token_baseline", **case)
    case["old_log_probs"] = case["old_log_probs"].clone().requires_grad_()
    case["sum_pi_squared"] = case["sum_pi_squared"].clone().requires_grad_()
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline", "grpo"):
        adv, ret = compute_advantage(name, **case)
        assert not adv.requires_grad and not ret.requires_grad
    got = compute_advantage("optimal_token_baseline", **case)
    close(got[0], want[0])
    close(got[1], want[1])


def test_bad_inputs_name_the_argument():
    case = otb_case()
    with pytest.raises(ValueError, match="sum_pi_squared"):
        optimal_token_baseline(**{**case, "sum_pi_squared": None})
    with pytest.raises(ValueError, match="old_log_probs"):
        tir_optimal_token_baseline(**{**case, "old_log_probs": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="response_mask"):
        grpo(**{**grpo_case(), "response_mask": torch.ones(4, 3)})
    with pytest.raises(ValueError, match="rollout_is_weights"):
        optimal_token_baseline(**case, rollout_is_weights=torch.ones(2, 3))
    with pytest.raises(ValueError, match="index"):
        rloo(**{**grpo_case(), "index": [0, 0]})
    with pytest.raises(TypeError, match="index"):
        rloo(**{**grpo_case(), "index": torch.zeros(4)})
    with pytest.raises(ValueError, match="energy"):
        optimal_token_baseline(**case, energy="logit")
    with pytest.raises(ValueError, match="values"):
        gae(token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3), values=None)
    with pytest.raises(TypeError, match="token_level_rewards"):
        rloo(**{**grpo_case(), "token_level_rewards": [[1.0, 2.0]]})
    with pytest.raises(ValueError, match="token_level_rewards"):
        rloo(**{**grpo_case(), "token_level_rewards": torch.zeros(4)})


def loop_returns(r, m, v, gamma, lam):
    """REINFORCE++ returns and GAE's A from the recursions, one row and position at a time."""
    B, L = r.shape
    R, A = torch.zeros(B, L, dtype=torch.float64), torch.zeros(B, L, dtype=torch.float64)
    for i in range(B):
        carry_r = carry_a = next_v = 0.0
        for t in reversed(range(L)):
            if m[i, t] == 0:
                continue
            carry_r = float(r[i, t]) + gamma * carry_r
            delta = float(r[i, t]) + gamma * next_v - float(v[i, t])
            carry_a = delta + gamma * lam * carry_a
            next_v = float(v[i, t])
            R[i, t], A[i, t] = carry_r, carry_a
    return R, A


def loop_whiten(x, m):
    sel = x[m > 0]
    return (x - sel.mean()) / torch.sqrt(sel.var() + 1e-8) * m


@pytest.mark.parametrize(
    "gamma, lam, B, L", [(1.0, 1.0, 6, 9), (0.9, 0.95, 6, 9), (0.5, 0.0, 1, 9), (0.99, 0.9, 3, 300)]
)
def test_reinforce_plus_plus_and_gae_match_loops(gamma, lam, B, L):
    # L = 300 spans several of the scans' time blocks; B = 1 makes row slices look contiguous.
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    r = torch.randn(B, L, generator=g)
    m = (torch.rand(B, L, generator=g) < 0.7).float()
    m[:, 127:130] = 0.0  # a hole across a block boundary
    v = torch.randn(B, L, generator=g)
    before = (r.clone(), m.clone(), v.clone())
    R, A = loop_returns(r, m, v, gamma, lam)
    adv, ret = reinforce_plus_plus(token_level_rewards=r, response_mask=m, gamma=gamma)
    close(ret, R.float())
    close(adv, loop_whiten(R, m).float())
    adv, ret = gae(token_level_rewards=r, response_mask=m, values=v, gamma=gamma, lam=lam)
    close(ret, ((A + v) * m).float())
    close(adv, loop_whiten(A, m).float())
    for x, y in zip((r, m, v), before):  # inputs are never written to
        assert torch.equal(x, y)
