"""``actor.policy_loss=gspo|cispo`` equal verl's own ``compute_policy_loss_gspo`` /
``compute_policy_loss_cispo`` on the same tensors (real verl: loss, gradient, clip fraction).

Runs in ``.venv-verl`` (``make test`` does it); skipped where verl is not installed. verl's GSPO
is the paper's token form (GSPO-token) and its CISPO clips the weight on both sides, as ours.
"""

from __future__ import annotations

import pytest
import torch

verl = pytest.importorskip("verl")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from otbrl.algos.config import POLICY_LOSS_AGG  # noqa: E402
from otbrl.algos.loss_math import loss_normalizers  # noqa: E402
from otbrl.algos.loss_terms import build_loss  # noqa: E402

B, L = 6, 9
LOW, HIGH = 0.1, 0.15


def _batch(seed):
    """Log-probs around the old ones (ratios on both sides of the band), per-token advantages
    of both signs, rows of unequal lengths, a hole in one row, rollout weights."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, L, generator=g) * 3
    lp = old + torch.randn(B, L, generator=g) * 0.3
    mask = torch.ones(B, L)
    for i, n in enumerate((9, 4, 7, 1, 6, 8)):
        mask[i, n:] = 0
    mask[2, 3] = 0
    adv = torch.randn(B, L, generator=g)
    isw = 0.5 + torch.rand(B, L, generator=g)
    return lp, old, adv, mask, isw


@pytest.mark.parametrize("name", ["gspo", "cispo"])
@pytest.mark.parametrize("weighted", [False, True])
def test_our_loss_equals_verls(name, weighted):
    lp, old, adv, mask, isw = _batch(11)
    agg = POLICY_LOSS_AGG[name]
    weights = isw if weighted else None
    theirs_fn = {
        "gspo": core_algos.compute_policy_loss_gspo,
        "cispo": core_algos.compute_policy_loss_cispo,
    }
    config = ActorConfig(
        strategy="fsdp", clip_ratio_low=LOW, clip_ratio_high=HIGH, ppo_micro_batch_size_per_gpu=1,
        ppo_mini_batch_size=4, rollout_n=1,
    )  # fmt: skip
    x = lp.clone().requires_grad_(True)
    want, metrics = theirs_fn[name](
        old, x, adv, mask, loss_agg_mode=agg, config=config, rollout_is_weights=weights
    )
    want.backward()
    y = lp.clone().requires_grad_(True)
    batch = {"response_mask": mask, "old_log_probs": old, "advantages": adv}
    if weighted:
        batch["rollout_is_weights"] = isw
    ours = build_loss(policy_loss=name, loss_agg_mode=agg, clip_ratio_low=LOW, clip_ratio_high=HIGH)
    got, ours_metrics = ours({"log_probs": y}, batch, loss_normalizers(mask))
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    keep = mask != 0
    torch.testing.assert_close(y.grad[keep], x.grad[keep], rtol=1e-5, atol=1e-7)
    assert 0 < metrics["actor/pg_clipfrac"] < 1  # both sides of the band: not vacuous
    assert ours_metrics["policy/clip_frac"].item() == pytest.approx(metrics["actor/pg_clipfrac"])
