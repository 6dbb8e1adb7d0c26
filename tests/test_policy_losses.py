"""GSPO and CISPO (``actor.policy_loss``): each against a float64 reference written from its
paper's equations (value and gradient, per-token advantages, a mask with holes, rollout
importance weights), against TRL's own loss code on the same tensors, refused where undefined,
and one short run per estimator family from the command line."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from otbrl.algos.config import POLICY_LOSS_AGG
from otbrl.algos.loss_math import loss_normalizers
from otbrl.algos.loss_terms import build_loss
from otbrl.config import ConfigError, load_config
from run_utils import read_metrics, tiny_run_factory

B, L = 5, 7
LOW, HIGH = 0.1, 0.15


def _batch(seed=0, *, constant_advantage=False):
    """Log-probs near the old ones (ratios inside and outside the clip band), a mask with
    padding and a hole (an observation), per-token or per-row advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.3
    mask = torch.ones(B, L, dtype=torch.float64)
    for i, n in enumerate((7, 5, 3, 6, 1)):
        mask[i, n:] = 0
    mask[3, 2] = 0  # an observation token inside the response
    adv = torch.randn(B, L, generator=g, dtype=torch.float64)
    if constant_advantage:
        adv = adv[:, :1].expand(B, L).clone()
    # float32-exact: the losses take the weights as float32 (otbrl.algos.reductions.check_tensor)
    isw = (0.5 + torch.rand(B, L, generator=g)).double()
    # NaN where nothing is trained: it must reach neither the loss nor the gradient
    lp, old = lp.masked_fill(mask == 0, float("nan")), old.masked_fill(mask == 0, float("nan"))
    return lp, old, adv, mask, isw


def _ours(name, lp, old, adv, mask, isw=None, **options):
    options = {"clip_ratio_low": LOW, **options}
    loss_fn = build_loss(policy_loss=name, loss_agg_mode=POLICY_LOSS_AGG[name], **options)
    lp = lp.clone().requires_grad_(True)
    batch = {"response_mask": mask, "old_log_probs": old, "advantages": adv}
    if isw is not None:
        batch["rollout_is_weights"] = isw
    loss, metrics = loss_fn({"log_probs": lp}, batch, loss_normalizers(mask))
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _gspo_reference(lp, old, adv, mask, isw):
    """Zheng et al. (2025), GSPO-token: J = 1/G Σ_i 1/|y_i| Σ_t min(s_it A_it, clip(s_it) A_it),
    s_it = sg(s_i) π_t / sg(π_t), s_i = exp(1/|y_i| Σ_t log(π_t / π_old,t)); the loss is −J.
    Its gradient in log π_t: −A_it s_i / (G |y_i|) where the unclipped branch is the min, else 0
    (a plain loop; the rollout weight multiplies each token's term)."""
    loss, grad = torch.tensor(0.0, dtype=torch.float64), torch.zeros_like(lp)
    rows = [i for i in range(B) if mask[i].sum() > 0]
    for i in rows:
        tokens = [t for t in range(L) if mask[i, t] != 0]
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in tokens) / len(tokens))
        for t in tokens:
            a, w = adv[i, t], isw[i, t]
            unclipped, clipped = a * s, a * s.clamp(1 - LOW, 1 + HIGH)
            loss -= w * min(unclipped, clipped) / (len(rows) * len(tokens))
            if unclipped <= clipped:
                grad[i, t] = -w * a * s / (len(rows) * len(tokens))
    return loss, grad


def _cispo_reference(lp, old, adv, mask, isw):
    """MiniMax-M1 (2025), CISPO: J = 1/Σ|o_i| Σ_i Σ_t sg(r̂_it) A_it log π_t,
    r̂ = clip(r, 1 − ε_low, 1 + ε_high); the loss is −J, its gradient −r̂ A / N (a plain loop)."""
    n = int(mask.sum())
    loss, grad = torch.tensor(0.0, dtype=torch.float64), torch.zeros_like(lp)
    for i in range(B):
        for t in range(L):
            if mask[i, t] == 0:
                continue
            r = torch.exp(lp[i, t] - old[i, t]).clamp(1 - LOW, 1 + HIGH)
            loss -= isw[i, t] * r * adv[i, t] * lp[i, t] / n
            grad[i, t] = -isw[i, t] * r * adv[i, t] / n
    return loss, grad


@pytest.mark.parametrize("name", ["gspo", "cispo"])
@pytest.mark.parametrize("constant_advantage", [False, True])
def test_the_loss_equals_its_papers_equations(name, constant_advantage):
    lp, old, adv, mask, isw = _batch(1, constant_advantage=constant_advantage)
    reference = {"gspo": _gspo_reference, "cispo": _cispo_reference}[name]
    want, want_grad = reference(lp, old, adv, mask, isw)
    got, grad, metrics = _ours(name, lp, old, adv, mask, isw, clip_ratio_high=HIGH)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    assert 0 < metrics["policy/clip_frac"] < 1  # the band is crossed both ways: not vacuous
    if name == "gspo":
        assert 0 < metrics["policy/seq_clip_frac"] < 1


def test_gspo_with_one_advantage_per_row_is_sequence_level_gspo():
    """A row-constant advantage makes the token form the sequence objective: the loss of
    s_i = exp(mean log-ratio) with the gradient through every token of the row (autograd)."""
    lp, old, adv, mask, _ = _batch(2, constant_advantage=True)
    got, grad, _ = _ours("gspo", lp, old, adv, mask, clip_ratio_high=HIGH)
    x = lp.masked_fill(mask == 0, 0.0).requires_grad_(True)
    keep = mask != 0
    log_s = ((x - old.masked_fill(~keep, 0.0)) * mask).sum(1) / mask.sum(1)
    s, a = log_s.exp(), adv[:, 0]
    want = -torch.minimum(s * a, s.clamp(1 - LOW, 1 + HIGH) * a).mean()
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, x.grad.masked_fill(~keep, 0.0), rtol=1e-12, atol=1e-12)


class _OneProcess:
    """What TRL's loss asks of its accelerator, on one process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(loss_type, level, lp, old, adv, mask, *, epsilon_low, epsilon_high):
    """``GRPOTrainer._compute_loss`` of TRL itself on these tensors (the model's forward
    replaced by the given log-probs; one process, no accumulation, no KL or entropy term)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    x = lp.masked_fill(mask == 0, 0.0).float().requires_grad_(True)
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
        beta=0.0, loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        args=SimpleNamespace(delta=None, steps_per_generation=1), use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, accelerator=_OneProcess(),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (x, torch.zeros_like(x), None),
    )  # fmt: skip
    ids = torch.zeros(B, L, dtype=torch.long)
    inputs = {
        "prompt_ids": ids[:, :1], "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": ids, "completion_mask": mask.long(),
        "advantages": adv.float() if level == "token" else adv[:, 0].float(),
        "old_per_token_logps": old.masked_fill(mask == 0, 0.0).float(),
        "num_items_in_batch": mask.sum().float(),
    }  # fmt: skip
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach().double(), x.grad.double(), trainer._metrics["train"]


def test_gspo_equals_trls_sequence_level_grpo_loss():
    """TRL 1.16 ``importance_sampling_level="sequence"``, ``loss_type="grpo"`` (its GSPO) with
    one advantage per completion: the same loss and gradient (float32 there)."""
    lp, old, adv, mask, _ = _batch(3, constant_advantage=True)
    got, grad, metrics = _ours("gspo", lp, old, adv, mask, clip_ratio_high=HIGH)
    want, want_grad, trl = _trl_loss(
        "grpo", "sequence", lp, old, adv, mask, epsilon_low=LOW, epsilon_high=HIGH
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-6)
    # TRL counts clipped sequences (one value per sequence at that level): ours per sequence too
    assert metrics["policy/seq_clip_frac"].item() == pytest.approx(trl["clip_ratio/region_mean"][0])
    assert metrics["policy/seq_clip_frac"] > 0  # one of the five sequences is clipped


def test_cispo_equals_trls_cispo_loss():
    """TRL 1.16 ``loss_type="cispo"`` clamps the weight at ``epsilon_high`` from above only (the
    paper's ε_low is "large"): ours with the upper bound 1 + clip_ratio_high = epsilon_high and a
    lower bound below every ratio gives the same loss and gradient."""
    lp, old, adv, mask, _ = _batch(4)
    assert torch.exp(lp - old)[mask != 0].min() < 1 - LOW  # a lower bound would bind here
    got, grad, _ = _ours("cispo", lp, old, adv, mask, clip_ratio_low=0.999, clip_ratio_high=HIGH)
    want, want_grad, _ = _trl_loss(
        "cispo", "token", lp, old, adv, mask, epsilon_low=LOW, epsilon_high=1 + HIGH
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.masked_fill(mask == 0, 0.0), want_grad, rtol=1e-4, atol=1e-6)


def test_every_configurable_policy_loss_is_a_registered_policy_term():
    from otbrl.algos.loss_terms import LOSSES, POLICY_LOSSES

    assert all(LOSSES[name].role == "policy" for name in POLICY_LOSSES)


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (
            ["actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean"],
            "actor.loss_agg_mode",
            "seq-mean-token-mean",
        ),
        (
            ["actor.policy_loss=cispo", "actor.loss_agg_mode=seq-mean-token-mean"],
            "actor.loss_agg_mode",
            "token-mean",
        ),
        (["actor.policy_loss=cispo", "actor.clip_ratio_c=2"], "actor.clip_ratio_c", "PPO"),
        (["actor.policy_loss=trpo"], "actor.policy_loss", "cispo"),
    ],
)
def test_undefined_combinations_are_refused_naming_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        load_config(None, overrides)
    assert err.value.key == key


@pytest.mark.parametrize(
    ("loss", "agg"),
    [("ppo", "token-mean"), ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean")],
)
def test_the_aggregation_follows_the_policy_loss_unless_set(loss, agg):
    """``actor.policy_loss=gspo`` alone trains with GSPO's own aggregation (it was refused until
    ``actor.loss_agg_mode`` was given too); a mode set explicitly is kept (PPO takes any)."""
    assert load_config(None, [f"actor.policy_loss={loss}"]).actor.loss_agg_mode == agg
    explicit = load_config(None, ["actor.loss_agg_mode=seq-mean-token-sum"])
    assert explicit.actor.loss_agg_mode == "seq-mean-token-sum"


def test_build_loss_refuses_an_undefined_aggregation():
    with pytest.raises(ValueError, match=r"loss_agg_mode: gspo is defined with"):
        build_loss(policy_loss="gspo", loss_agg_mode="token-mean")


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    return tiny_run_factory(tmp_path_factory.mktemp("policy_losses"))


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("gspo", ["algorithm.adv_estimator=optimal_token_baseline", "algorithm.off_policy=tis"]),
        ("cispo", ["algorithm.adv_estimator=grpo", "algorithm.off_policy=decoupled"]),
    ],
)
def test_a_run_trains_with_the_loss_from_the_command_line(overrides, tmp_path, name, extra):
    from otbrl import cli

    agg = POLICY_LOSS_AGG[name]
    # the entropy term gives every step a gradient whatever the random model's rewards are
    args = overrides(
        str(tmp_path / name), f"actor.policy_loss={name}", f"actor.loss_agg_mode={agg}",
        "actor.entropy_coeff=0.01", *extra,
    )  # fmt: skip
    assert cli.main(["train", *args]) == 0
    steps = [r for r in read_metrics(tmp_path / name) if "policy/loss" in r]
    assert len(steps) == 4 and all(r["policy/grad_norm"] > 0 for r in steps)
    assert all(
        math.isfinite(r["policy/pg_loss"]) and 0 <= r["policy/clip_frac"] <= 1 for r in steps
    )
    if name == "gspo":
        assert all(0 <= r["policy/seq_clip_frac"] <= 1 for r in steps)
