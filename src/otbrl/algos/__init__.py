"""otbrl.algos: pure functions over ``[B, L]`` tensors (advantages, losses, metrics)."""

from otbrl.algos.advantages import (
    ESTIMATOR_ALIASES,
    ESTIMATORS,
    Estimator,
    compute_advantage,
    get_estimator,
    register_estimator,
)
from otbrl.algos.loss_math import KL_KINDS, LOSS_AGG_MODES, Normalizers, loss_normalizers
from otbrl.algos.loss_terms import LOSSES, Loss, build_loss, build_value_loss, register_loss
from otbrl.algos.reductions import masked_mean, masked_sum, masked_var, whiten

__all__ = [
    "ESTIMATORS",
    "ESTIMATOR_ALIASES",
    "KL_KINDS",
    "LOSSES",
    "LOSS_AGG_MODES",
    "Estimator",
    "Loss",
    "Normalizers",
    "build_loss",
    "build_value_loss",
    "compute_advantage",
    "get_estimator",
    "loss_normalizers",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "register_estimator",
    "register_loss",
    "whiten",
]
