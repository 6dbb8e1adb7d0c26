"""otbrl inside TRL: ``OTBGRPOTrainer``, TRL's GRPO trainer with per-token OTB advantages.

``pip install 'otbrl[trl]'`` (tested with TRL 1.16; other versions are refused at import,
since the trainer hooks into TRL internals that changed between 1.10 and 1.16). See
docs/integrations.md for what is covered.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

TESTED_TRL = (Version("1.16.0"), Version("1.17"))


def _check_trl() -> None:
    try:
        found = version("trl")
    except PackageNotFoundError:
        raise ImportError("otbrl.integrations.trl needs TRL: pip install 'otbrl[trl]'") from None
    low, high = TESTED_TRL
    if not (low <= Version(found) < high):
        raise ImportError(
            f"otbrl.integrations.trl is tested with trl>={low},<{high}; found trl {found}. "
            "Install the tested range with pip install 'otbrl[trl]'"
        )


_check_trl()

from otbrl.integrations.trl.config import OTBGRPOConfig  # noqa: E402
from otbrl.integrations.trl.trainer import OTBGRPOTrainer  # noqa: E402

__all__ = ["TESTED_TRL", "OTBGRPOConfig", "OTBGRPOTrainer"]
