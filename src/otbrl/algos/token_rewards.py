"""The rewards an estimator sees, per token: the task's scores, minus the in-reward KL to the
reference, plus on-policy distillation's per-token signal from a teacher::

    r = s·[task_reward] − β·KL(π ‖ π_ref)·m + c·(log π_teacher − log π)·m

Both terms are ``kl_in_reward``'s k1 equation (``otbrl.algos.loss_math``): the distillation one
with the teacher in the reference's place and −c as its weight, i.e. the per-token reverse KL
of the policy about to be updated (π: ``old_log_probs``, the trainer's own numerics — a teacher
equal to the policy gives exactly 0). Rewards are data: no gradient flows.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from otbrl.algos.loss_math import kl_in_reward
from otbrl.algos.reductions import masked_mean


def token_level_rewards(
    batch: Mapping[str, Tensor],
    *,
    kl_coef: float | None,
    distill_coef: float | None,
    task_reward: bool,
) -> tuple[Tensor, dict[str, float]]:
    """The token rewards [B, L] and their metrics, from ``batch``'s ``token_level_scores`` [B, L]
    (the scalar reward on each row's last trained token) and ``response_mask``. ``kl_coef``
    (None: off) subtracts β·KL of ``old_log_probs`` to ``ref_log_probs``; ``distill_coef``
    (None: no teacher) adds c·(``teacher_log_probs`` − ``old_log_probs``), and without
    ``task_reward`` the scores are left out (the teacher's signal alone). Every log-prob is
    [B, L], read from ``batch`` only when its term is on.

    Metrics: ``train/kl_in_reward`` (the mean KL) with ``kl_coef``; ``distill/reverse_kl``
    and ``distill/teacher_log_prob`` (means over trained tokens) with ``distill_coef``.
    """
    metrics: dict[str, float] = {}
    rewards, mask = batch["token_level_scores"], batch["response_mask"]
    if distill_coef is not None and not task_reward:
        rewards = rewards.new_zeros(rewards.shape)  # still scored: reward/* is logged
    if kl_coef is not None:
        rewards, kl = kl_in_reward(
            rewards, batch["old_log_probs"], batch["ref_log_probs"], mask, coef=kl_coef
        )
        metrics["train/kl_in_reward"] = float(kl)
    if distill_coef is not None:
        teacher = batch["teacher_log_probs"]
        rewards, reverse_kl = kl_in_reward(
            rewards, batch["old_log_probs"], teacher, mask, coef=distill_coef
        )
        metrics["distill/reverse_kl"] = float(reverse_kl)
        metrics["distill/teacher_log_prob"] = float(masked_mean(teacher, mask))
    return rewards, metrics
