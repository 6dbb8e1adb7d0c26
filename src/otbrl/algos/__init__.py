"""otbrl.algos: pure functions over ``[B, L]`` tensors (advantages, losses, metrics)."""

from otbrl.algos.advantages import (
    ESTIMATOR_ALIASES,
    ESTIMATORS,
    Estimator,
    compute_advantage,
    get_estimator,
    register_estimator,
)

__all__ = [
    "ESTIMATORS",
    "ESTIMATOR_ALIASES",
    "Estimator",
    "compute_advantage",
    "get_estimator",
    "register_estimator",
]
