"""Gradient-variance statistics against a linear softmax policy with exactly known moments.

The synthetic policy: prompts p with features x_p, logits θ x_p over A actions, fixed rewards
R[p, a]. One repeat draws N actions per prompt; estimator e's gradient is
(1/(PN)) Σ_{p,i} (R_pi − b_pi) (onehot(a_pi) − π_p) ⊗ x_p with baseline b = 0 ("none"), the
group mean including the sample ("group_mean"), the mean of the others ("rloo") or a constant
1.5 ("constant"). Enumerating all A^N outcomes of a group gives the exact mean and covariance
of every estimator's gradient, so the truth is known without sampling.
"""

import itertools

import pytest
import torch

from otbrl.research.gradient_variance import (
    GradientVarianceAccumulator,
    repeat_moments,
    variance_summary,
)

NAMES = ["none", "group_mean", "rloo", "constant"]
A, FEAT, N, PROMPTS = 3, 3, 4, 3


class LinearPolicy:
    def __init__(self, seed=0):
        gen = torch.Generator().manual_seed(seed)
        theta = torch.randn(A, FEAT, generator=gen, dtype=torch.float64)
        self.x = torch.randn(PROMPTS, FEAT, generator=gen, dtype=torch.float64)
        self.pi = torch.softmax(self.x @ theta.T, -1)  # [P, A]
        self.rewards = 1.0 + torch.rand(PROMPTS, A, generator=gen, dtype=torch.float64)
        outcomes = list(itertools.product(range(A), repeat=N))
        self.probs = torch.zeros(PROMPTS, len(outcomes), dtype=torch.float64)
        self.table = torch.zeros(PROMPTS, len(outcomes), len(NAMES), A * FEAT, dtype=torch.float64)
        for p in range(PROMPTS):
            for o, actions in enumerate(outcomes):
                self.probs[p, o] = torch.prod(self.pi[p, list(actions)])
                r = self.rewards[p, list(actions)]
                baselines = [torch.zeros(N), r.mean().expand(N), None, torch.full((N,), 1.5)]
                for e, baseline in enumerate(baselines):
                    if baseline is None:  # leave-one-out mean of the other rows
                        baseline = (r.sum() - r) / (N - 1)
                    grad = torch.zeros(A, FEAT, dtype=torch.float64)
                    for i, a in enumerate(actions):
                        score = -self.pi[p].clone()
                        score[a] += 1
                        grad += (r[i] - baseline[i]) * torch.outer(score, self.x[p])
                    self.table[p, o, e] = grad.flatten() / (PROMPTS * N)
        mean_p = torch.einsum("po,poed->ped", self.probs, self.table)
        centred = self.table - mean_p[:, None]
        self.mean = mean_p.sum(0)  # [E, D]
        self.trace_cov = torch.einsum("po,poed->e", self.probs, centred.pow(2))
        # the true policy gradient ∇J, written directly from its definition
        true = torch.zeros(A, FEAT, dtype=torch.float64)
        for p in range(PROMPTS):
            for a in range(A):
                score = -self.pi[p].clone()
                score[a] += 1
                true += self.pi[p, a] * self.rewards[p, a] * torch.outer(score, self.x[p])
        self.true_gradient = true.flatten() / PROMPTS

    def truth(self):
        r = self.true_gradient / self.true_gradient.norm()
        scale = self.mean @ r
        return {
            "variance": self.trace_cov,
            "signal_norm_sq": self.mean.pow(2).sum(-1),
            "signal_scale": scale,
            "variance_per_signal": self.trace_cov / scale**2,
        }

    def sample(self, k, gen):
        """[E, K, D] gradients of K independent repeats."""
        total = torch.zeros(k, len(NAMES), A * FEAT, dtype=torch.float64)
        for p in range(PROMPTS):
            idx = torch.multinomial(self.probs[p], k, replacement=True, generator=gen)
            total += self.table[p, idx]
        return total.transpose(0, 1)


@pytest.fixture(scope="module")
def policy():
    return LinearPolicy()


def test_synthetic_policy_means_match_closed_form(policy):
    g = policy.true_gradient
    torch.testing.assert_close(policy.mean[0], g)  # no baseline: unbiased
    torch.testing.assert_close(policy.mean[2], g)  # leave-one-out: unbiased
    torch.testing.assert_close(policy.mean[1], g * (N - 1) / N)  # self-inclusive mean shrinks
    torch.testing.assert_close(policy.mean[3], g)  # a constant baseline: unbiased


def test_group_mean_is_a_scaled_leave_one_out(policy):
    # r_i − mean_{j≠i} r_j = N/(N−1) (r_i − mean_j r_j): the two gradients are proportional in
    # every sample, so the variance ratio is exactly ((N−1)/N)² and the per-signal ratio is 1
    grads = policy.sample(30, torch.Generator().manual_seed(6))
    out = variance_summary(repeat_moments(grads, policy.true_gradient), NAMES, base="rloo")
    assert out["ratios"]["group_mean/rloo"]["value"] == pytest.approx(((N - 1) / N) ** 2)
    assert out["ratios"]["group_mean/rloo"]["ci95"] == pytest.approx([((N - 1) / N) ** 2] * 2)
    assert out["ratios_per_signal"]["group_mean/rloo"]["value"] == pytest.approx(1.0)


def test_point_estimates_match_plain_formulas(policy):
    grads = policy.sample(50, torch.Generator().manual_seed(1))
    ref = policy.true_gradient
    out = variance_summary(repeat_moments(grads, ref), NAMES, num_bootstrap=0)
    for e, name in enumerate(NAMES):
        g = grads[e]
        cov_trace = torch.cov(g.T).trace()  # torch.cov is the unbiased (K−1) covariance
        mean = g.mean(0)
        scale = mean @ ref / ref.norm()
        got = out["estimators"][name]
        assert got["variance"] == pytest.approx(cov_trace.item(), rel=1e-10)
        assert got["signal_norm_sq"] == pytest.approx(
            (mean @ mean - cov_trace / 50).item(), rel=1e-10
        )
        assert got["signal_scale"] == pytest.approx(scale.item(), rel=1e-10)
        assert got["variance_per_signal"] == pytest.approx((cov_trace / scale**2).item(), rel=1e-10)
        assert "variance_ci" not in got


def test_estimates_converge_to_truth(policy):
    truth = policy.truth()
    gen = torch.Generator().manual_seed(2)
    errors = {}
    for k in (200, 20000):
        grads = policy.sample(k, gen)
        out = variance_summary(
            repeat_moments(grads, policy.true_gradient, gram=False), NAMES, num_bootstrap=0
        )
        for stat, true in truth.items():
            for e, name in enumerate(NAMES):
                est = out["estimators"][name][stat]
                errors[k, stat, name] = abs(est / true[e].item() - 1)
    for stat in truth:
        for name in NAMES:
            # sd of the relative error at K=20000 is below 1 % for every statistic here
            assert errors[20000, stat, name] < 0.03, (stat, name, errors[20000, stat, name])
    mean_small = sum(v for (k, *_), v in errors.items() if k == 200) / 16
    mean_large = sum(v for (k, *_), v in errors.items() if k == 20000) / 16
    assert mean_large < mean_small / 3


def test_truth_orders_the_estimators(policy):
    # an independent sanity check of the synthetic case: baselines cut the variance
    t = policy.truth()["variance"]
    assert t[1] < t[0] and t[2] < t[0] and t[3] < t[0]


def test_paired_bootstrap_ci_covers_truth_at_nominal_rate(policy):
    truth = policy.truth()
    targets = {
        ("ratios", "group_mean/none"): truth["variance"][1] / truth["variance"][0],
        ("ratios", "constant/none"): truth["variance"][3] / truth["variance"][0],
        ("ratios_per_signal", "group_mean/none"): truth["variance_per_signal"][1]
        / truth["variance_per_signal"][0],
        ("ratios_per_signal", "constant/none"): truth["variance_per_signal"][3]
        / truth["variance_per_signal"][0],
    }
    gen = torch.Generator().manual_seed(3)
    experiments = 400
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 400 tiny problems: thread hand-offs would cost more than the math
    hits = dict.fromkeys(targets, 0)
    widths = dict.fromkeys(targets, 0.0)
    for i in range(experiments):
        grads = policy.sample(100, gen)
        out = variance_summary(
            repeat_moments(grads, policy.true_gradient),
            NAMES,
            base="none",
            num_bootstrap=400,
            seed=i,
        )
        for key, true in targets.items():
            lo, hi = out[key[0]][key[1]]["ci95"]
            hits[key] += lo <= true.item() <= hi
            widths[key] += (hi - lo) / experiments
    torch.set_num_threads(threads)
    for key in targets:
        coverage = hits[key] / experiments
        # binomial sd at 95 % over 400 runs is 1.1 %: a CI that is 30 % too narrow (≈ 85 %)
        # or always much too wide (≈ 100 %, e.g. an unpaired bootstrap that ignores the positive
        # correlation of estimators evaluated on the same samples) falls outside this band
        assert 0.90 <= coverage <= 0.985, (key, coverage)
        assert widths[key] > 0


def test_streaming_accumulator_matches_batch(policy):
    grads = policy.sample(40, torch.Generator().manual_seed(4))
    batch = variance_summary(repeat_moments(grads, policy.true_gradient), NAMES, base="none")
    exact = GradientVarianceAccumulator(4, policy.true_gradient)
    sketched = GradientVarianceAccumulator(4, policy.true_gradient, sketch_dim=64, seed=1)
    light = GradientVarianceAccumulator(4, policy.true_gradient, bootstrap=False)
    for k in range(40):
        for acc in (exact, sketched, light):
            acc.add(grads[:, k])
    assert light.moments().gram is None
    for acc, ci_tol in ((exact, 1e-4), (sketched, 0.25)):
        out = variance_summary(acc.moments(), NAMES, base="none")
        for name in NAMES:
            for stat in ("variance", "signal_norm_sq", "signal_scale", "variance_per_signal"):
                # point estimates come from the exact sums in every mode
                assert out["estimators"][name][stat] == pytest.approx(
                    batch["estimators"][name][stat], rel=1e-6
                )
        for pair, ratio in batch["ratios"].items():
            lo, hi = out["ratios"][pair]["ci95"]
            width = ratio["ci95"][1] - ratio["ci95"][0]
            assert abs(lo - ratio["ci95"][0]) <= ci_tol * width + 1e-12
            assert abs(hi - ratio["ci95"][1]) <= ci_tol * width + 1e-12


def test_sketch_is_unbiased_for_dot_products():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5000, generator=gen, dtype=torch.float64)
    ref = torch.ones(5000, dtype=torch.float64)
    grams = []
    for seed in range(200):
        acc = GradientVarianceAccumulator(1, ref, sketch_dim=32, seed=seed)
        acc.add(x[:1])
        acc.add(x[1:])
        grams.append(acc.moments().gram[0, 0, 1])
    est = torch.stack(grams)
    exact = x[0] @ x[1]
    # sd of one sketched dot ≈ ‖x0‖‖x1‖/√32 ≈ 884; mean of 200 has sd ≈ 63
    assert abs(est.mean() - exact) < 4 * est.std() / 200**0.5


def test_bad_inputs():
    ref = torch.ones(4)
    with pytest.raises(ValueError, match="grads"):
        repeat_moments(torch.zeros(2, 3), ref)
    with pytest.raises(ValueError, match="reference"):
        repeat_moments(torch.zeros(1, 3, 5), ref)
    with pytest.raises(ValueError, match="reference"):
        repeat_moments(torch.zeros(1, 3, 4), torch.zeros(4))
    with pytest.raises(TypeError, match="reference"):
        GradientVarianceAccumulator(1, [1.0, 2.0])
    acc = GradientVarianceAccumulator(2, ref)
    with pytest.raises(ValueError, match="grads"):
        acc.add(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="grads"):
        acc.add(torch.full((2, 4), float("nan")))
    acc.add(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="num_repeats"):
        acc.moments()
    m = repeat_moments(torch.randn(2, 5, 4), ref)
    with pytest.raises(ValueError, match="repeats"):
        variance_summary(repeat_moments(torch.randn(2, 1, 4), ref), ["a", "b"])
    with pytest.raises(ValueError, match="names"):
        variance_summary(m, ["a"])
    with pytest.raises(ValueError, match="base"):
        variance_summary(m, ["a", "b"], base="c")
    with pytest.raises(ValueError, match="num_bootstrap"):
        variance_summary(m._replace(gram=None), ["a", "b"], num_bootstrap=10)
