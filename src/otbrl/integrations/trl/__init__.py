"""otbrl inside TRL: ``OTBGRPOTrainer``, TRL's GRPO trainer with per-token OTB advantages.

``pip install 'otbrl[trl]'`` (tested with TRL 1.16; other versions are refused at import,
since the trainer hooks into TRL internals that changed between 1.10 and 1.16). See
docs/integrations.md for what is covered.
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from otbrl.quiet import quiet_trl, quiet_vllm

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

# TRL warns that the installed vLLM is outside its tested range (5 times per import with vLLM
# 0.32, once per module that checks): otbrl tests this integration against the vLLM it installs,
# so that warning is dropped (here and on TRL's later checks); any other is shown once.
quiet_vllm()  # TRL imports vLLM when it is installed
quiet_trl()
with warnings.catch_warnings(record=True) as _caught:
    warnings.simplefilter("always")
    quiet_trl()
    from otbrl.integrations.trl.config import OTBGRPOConfig
    from otbrl.integrations.trl.trainer import OTBGRPOTrainer
_seen: set[str] = set()
for _w in _caught:
    if str(_w.message) not in _seen:
        _seen.add(str(_w.message))
        warnings.warn_explicit(_w.message, _w.category, _w.filename, _w.lineno)

__all__ = ["TESTED_TRL", "OTBGRPOConfig", "OTBGRPOTrainer"]
