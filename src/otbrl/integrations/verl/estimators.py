"""otbrl's vectorized OTB / TIR-OTB under verl's two built-in estimator names.

verl's ``ray_trainer.compute_advantage`` hands ``sum_pi_squared``, ``old_log_probs`` and
``rollout_is_weights`` only to the names ``optimal_token_baseline`` and
``tir_optimal_token_baseline``, so a drop-in must take those two registry entries. verl's own
functions loop over groups in Python with a host sync per group; these compute the same
baselines with a handful of scatter ops (``otbrl.algos.otb``).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from otbrl.algos.otb import OTB_EPS, optimal_token_baseline, tir_optimal_token_baseline

logger = logging.getLogger("otbrl.integrations.verl")

VERL_NAMES = ("optimal_token_baseline", "tir_optimal_token_baseline")
# verl's own functions, kept when they are replaced (for a non-default epsilon, and for tests).
ORIGINALS: dict[str, object] = {}


def _verl_signature(fn, name: str, doc: str):
    """``fn`` (``otbrl.algos.otb``) behind the signature verl calls its estimator ``name`` with;
    verl's own function serves a non-default ``epsilon`` (otbrl's ε is fixed)."""

    def estimator(
        token_level_rewards: Tensor,
        response_mask: Tensor,
        index,
        old_log_probs: Tensor,
        sum_pi_squared: Tensor,
        rollout_is_weights: Tensor | None = None,
        handle_zero_tail: bool = True,
        epsilon: float = 1e-8,
        **kwargs,
    ) -> tuple[Tensor, Tensor]:
        tensors = dict(
            token_level_rewards=token_level_rewards,
            response_mask=response_mask,
            index=index,
            old_log_probs=old_log_probs,
            sum_pi_squared=sum_pi_squared,
            rollout_is_weights=rollout_is_weights,
            handle_zero_tail=handle_zero_tail,
        )
        if epsilon != OTB_EPS and name in ORIGINALS:
            return ORIGINALS[name](epsilon=epsilon, **tensors)
        if epsilon != OTB_EPS:
            raise ValueError(f"epsilon: otbrl's OTB uses {OTB_EPS}, got {epsilon}")
        with torch.no_grad():
            return fn(**tensors)

    estimator.__name__ = estimator.__qualname__ = f"{name}_advantage"
    estimator.__doc__ = doc
    return estimator


optimal_token_baseline_advantage = _verl_signature(
    optimal_token_baseline,
    "optimal_token_baseline",
    """verl's ``compute_optimal_token_baseline_advantage`` signature, otbrl's vectorized OTB.

    Shapes: ``[B, L]`` tensors, ``index`` ``[B]`` (verl's uid array: strings or ints) ->
    ``(advantages, returns)`` ``[B, L]`` float32. Extra keyword arguments verl passes
    (``config``, ...) are ignored, as verl's own function ignores them.
    """,
)
tir_optimal_token_baseline_advantage = _verl_signature(
    tir_optimal_token_baseline,
    "tir_optimal_token_baseline",
    """verl's ``compute_multi_turn_optimal_token_baseline_advantage`` signature, otbrl's
    vectorized TIR-OTB (tool-output holes in ``response_mask``). Shapes as in
    :func:`optimal_token_baseline_advantage`.""",
)


REPLACEMENTS = {
    "optimal_token_baseline": optimal_token_baseline_advantage,
    "tir_optimal_token_baseline": tir_optimal_token_baseline_advantage,
}


def install_estimators() -> bool:
    """Point verl's two OTB registry names at otbrl's functions; idempotent. Returns True."""
    from verl.trainer.ppo import core_algos

    registry = core_algos.ADV_ESTIMATOR_REGISTRY
    for name in VERL_NAMES:
        if name not in registry:
            raise RuntimeError(f"verl's ADV_ESTIMATOR_REGISTRY has no {name!r} entry to replace")
        current = registry[name]
        if current is REPLACEMENTS[name]:
            continue
        ORIGINALS[name] = current
        # register_adv_est refuses to rebind a name, so the entry is replaced directly.
        registry[name] = REPLACEMENTS[name]
    logger.info("otbrl: verl's OTB estimators now run otbrl's vectorized versions")
    return True


def uninstall_estimators() -> None:
    """Put verl's own OTB functions back (for tests and A/B comparisons)."""
    from verl.trainer.ppo import core_algos

    for name, fn in ORIGINALS.items():
        core_algos.ADV_ESTIMATOR_REGISTRY[name] = fn
