"""otbrl.algos: pure functions over ``[B, L]`` tensors (advantages, losses, metrics)."""

from otbrl.algos._common import masked_mean, masked_sum, masked_var, whiten
from otbrl.algos.advantages import (
    ESTIMATOR_ALIASES,
    ESTIMATORS,
    Estimator,
    compute_advantage,
    get_estimator,
    register_estimator,
)
from otbrl.algos.losses import (
    KL_KINDS,
    LOSS_AGG_MODES,
    LOSSES,
    Loss,
    Normalizers,
    build_loss,
    build_value_loss,
    loss_normalizers,
    register_loss,
)

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
