"""otbrl.algos: pure functions over ``[B, L]`` tensors (advantages, losses, metrics)."""

from otbrl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "advantages": (
            "ESTIMATOR_ALIASES",
            "ESTIMATORS",
            "Estimator",
            "compute_advantage",
            "get_estimator",
            "register_estimator",
        ),
        "loss_math": (
            "KL_KINDS",
            "LOSS_AGG_MODES",
            "Normalizers",
            "loss_normalizers",
        ),
        "loss_terms": (
            "LOSSES",
            "Loss",
            "build_loss",
            "build_value_loss",
            "register_loss",
        ),
        "reductions": (
            "masked_mean",
            "masked_sum",
            "masked_var",
            "whiten",
        ),
    },
)
