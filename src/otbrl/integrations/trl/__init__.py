"""otbrl inside TRL: ``OTBGRPOTrainer``, TRL's GRPO trainer with per-token OTB advantages.

``pip install 'otbrl[trl]'`` (tested with TRL 1.16; other versions are refused at import,
since the trainer hooks into TRL internals that changed between 1.10 and 1.16). See
docs/integrations.md for what is covered.
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from otbrl.quiet import quiet_vllm

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

# TRL warns about an untested vLLM version from each of its modules that checks it (5 identical
# warnings per import with vLLM 0.32, each with its source line): the first one says it all.
quiet_vllm()  # TRL imports vLLM when it is installed
with warnings.catch_warnings(record=True) as _caught:
    warnings.simplefilter("always")
    from otbrl.integrations.trl.config import OTBGRPOConfig
    from otbrl.integrations.trl.trainer import OTBGRPOTrainer
_seen: set[str] = set()
for _w in _caught:
    if str(_w.message) not in _seen:
        _seen.add(str(_w.message))
        warnings.warn_explicit(_w.message, _w.category, _w.filename, _w.lineno)

__all__ = ["TESTED_TRL", "OTBGRPOConfig", "OTBGRPOTrainer"]
