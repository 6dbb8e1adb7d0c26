"""otbrl's OTB / TIR-OTB installed under verl's names equal verl's own loops (real verl).

Runs in ``.venv-verl`` (``make test`` does it); skipped where verl is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402

from otbrl.integrations.verl import estimators, plugin  # noqa: E402


def _batch(seed: int, *, holes: bool, B: int = 30, L: int = 19):
    """Random rollouts: groups of 1..6 rows with string uids, unequal lengths (ties and a unique
    longest row both occur), scalar reward on the last trained token, optional tool holes."""
    g = torch.Generator().manual_seed(seed)
    sizes, total = [], 0
    while total < B:
        n = int(torch.randint(1, 7, (1,), generator=g))
        n = min(n, B - total)
        sizes.append(n)
        total += n
    uid = np.array([f"prompt-{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    perm = torch.randperm(B, generator=g)
    uid = uid[perm.numpy()]  # groups are not runs of rows in verl either
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    lengths[:3] = L  # a tie at the maximum somewhere
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    if holes:
        tool = torch.rand(B, L, generator=g) < 0.25
        tool[:, 0] = False
        mask = mask * (~tool).float()
    rewards = torch.zeros(B, L)
    last = torch.where(mask > 0, torch.arange(L)[None].expand(B, L), -1).amax(-1)
    has = last >= 0
    rewards[has, last[has]] = torch.randn(int(has.sum()), generator=g)
    old_log_probs = -torch.rand(B, L, generator=g) * 3
    p = old_log_probs.exp()  # Σπ² lies in [π_y², 1]
    sum_pi_squared = torch.rand(B, L, generator=g) * (1 - p**2) + p**2
    is_weights = torch.rand(B, L, generator=g) * 1.5 + 0.25
    return dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=uid,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
    ), is_weights


CASES = [
    (name, seed, zero_tail, use_is)
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline")
    for seed in (0, 1, 2)
    for zero_tail in (True, False)
    for use_is in (False, True)
]


def test_plugin_replaced_both_names():
    assert plugin.STATE == {
        "estimators": True,
        "fused_backend": True,
        "engine": True,
        "v1_trainer": True,
    }
    reg = core_algos.ADV_ESTIMATOR_REGISTRY
    assert reg["optimal_token_baseline"] is estimators.optimal_token_baseline_advantage
    assert reg["tir_optimal_token_baseline"] is estimators.tir_optimal_token_baseline_advantage
    # verl's own functions stay reachable under their module names.
    assert estimators.ORIGINALS["optimal_token_baseline"] is (
        core_algos.compute_optimal_token_baseline_advantage
    )


@pytest.mark.parametrize("name,seed,zero_tail,use_is", CASES)
def test_installed_estimator_equals_verl(name, seed, zero_tail, use_is):
    kwargs, isw = _batch(seed, holes=name.startswith("tir"))
    if use_is:
        kwargs["rollout_is_weights"] = isw
    ours = core_algos.get_adv_estimator_fn(name)(handle_zero_tail=zero_tail, config=None, **kwargs)
    theirs = estimators.ORIGINALS[name](handle_zero_tail=zero_tail, **kwargs)
    for a, b in zip(ours, theirs):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-5)
    assert ours[0].abs().sum() > 0  # the comparison is not between two zero tensors


def test_through_verl_compute_advantage():
    """verl's trainer entry point (``ray_trainer.compute_advantage``) reaches our function and
    returns verl's numbers."""
    kwargs, isw = _batch(5, holes=False)
    batch = {k: v for k, v in kwargs.items() if k != "index"}
    batch["rollout_is_weights"] = isw

    def run():
        data = DataProto.from_dict(tensors=dict(batch), non_tensors={"uid": kwargs["index"]})
        out = ray_trainer.compute_advantage(data, adv_estimator="optimal_token_baseline")
        return out.batch["advantages"], out.batch["returns"]

    ours = run()
    estimators.uninstall_estimators()
    try:
        theirs = run()
    finally:
        estimators.install_estimators()
    assert core_algos.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"] is (
        estimators.optimal_token_baseline_advantage
    )
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_non_default_epsilon_uses_verl_loop():
    kwargs, _ = _batch(3, holes=False)
    ours = estimators.optimal_token_baseline_advantage(epsilon=0.5, **kwargs)
    theirs = core_algos.compute_optimal_token_baseline_advantage(epsilon=0.5, **kwargs)
    torch.testing.assert_close(ours[0], theirs[0])


def test_bad_input_named():
    kwargs, _ = _batch(4, holes=False)
    kwargs["sum_pi_squared"] = kwargs["sum_pi_squared"][:, :-1]
    with pytest.raises(ValueError, match="sum_pi_squared"):
        estimators.optimal_token_baseline_advantage(**kwargs)


def test_install_is_idempotent():
    before = dict(estimators.ORIGINALS)
    estimators.install_estimators()
    estimators.install_estimators()
    assert before == estimators.ORIGINALS  # a second install does not record ours as "verl's"
