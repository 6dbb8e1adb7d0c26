"""otbrl inside verl (tested with verl 0.9.1; docs/integrations.md).

``import verl`` loads :mod:`otbrl.integrations.verl.plugin` through the ``verl.plugins`` entry
point, which calls :func:`install`:

- verl's two built-in OTB estimator names run otbrl's vectorized OTB / TIR-OTB
  (:mod:`.estimators`; opt out with ``OTBRL_VERL_ESTIMATORS=0``);
- ``actor_rollout_ref.model.fused_kernel_options.impl_backend=otbrl`` selects a fused forward
  that returns log-probs, entropy and Σπ² (:mod:`.fused_forward`);
- the FSDP engine accepts ``calculate_sum_pi_squared=True`` with ``use_fused_kernels=True``
  on packed batches (:mod:`.engine`);
- verl's V1 trainer (``trainer.use_v1=True``) asks the actor for Σπ² when the estimator needs
  it and hands it to the advantage step (:mod:`.trainer_v1`, patched when verl imports it).

``OTBRL_VERL_PLUGIN=0`` (or verl's own ``VERL_USE_EXTERNAL_PLUGINS=none``) skips all of it.
"""

from __future__ import annotations

import os

from otbrl.integrations.verl.engine import install_engine_patch
from otbrl.integrations.verl.estimators import (
    install_estimators,
    optimal_token_baseline_advantage,
    tir_optimal_token_baseline_advantage,
)
from otbrl.integrations.verl.fused_forward import forward_with_otbrl_backend, install_fused_backend
from otbrl.integrations.verl.trainer_v1 import check_v1_config, install_v1_trainer_patch

TESTED_VERL = "0.9.1"

__all__ = [
    "TESTED_VERL",
    "check_v1_config",
    "forward_with_otbrl_backend",
    "install",
    "install_engine_patch",
    "install_estimators",
    "install_fused_backend",
    "install_v1_trainer_patch",
    "optimal_token_baseline_advantage",
    "tir_optimal_token_baseline_advantage",
]


def _env_flag(name: str, default: bool = True) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}: expected 0/1/true/false, got {value!r}")


def install(*, estimators: bool | None = None) -> dict[str, bool]:
    """Install every part of the plug-in into the imported verl; idempotent.

    ``estimators=None`` reads ``OTBRL_VERL_ESTIMATORS`` (default on). Returns which parts are
    active, e.g. ``{"estimators": True, "fused_backend": True, "engine": True, "v1_trainer":
    True}``. Raises
    ``RuntimeError`` on a verl version other than the tested one.
    """
    import verl

    version = getattr(verl, "__version__", "unknown")
    if version != TESTED_VERL:
        raise RuntimeError(
            f"otbrl's verl plug-in is tested with verl=={TESTED_VERL}, found verl {version}: "
            "install otbrl[verl] for the tested pin, or set OTBRL_VERL_PLUGIN=0"
        )
    if estimators is None:
        estimators = _env_flag("OTBRL_VERL_ESTIMATORS")
    return {
        "estimators": install_estimators() if estimators else False,
        "fused_backend": install_fused_backend(),
        "engine": install_engine_patch(),
        "v1_trainer": install_v1_trainer_patch(),
    }
