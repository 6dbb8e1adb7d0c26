"""The ``verl.plugins`` entry point: importing this module installs the plug-in.

verl imports it from ``verl/__init__.py`` on the driver and on every Ray worker and hides any
exception at DEBUG level, so this module never raises: it logs a WARNING naming what failed.
``OTBRL_VERL_PLUGIN=0`` skips it (logged at INFO).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("otbrl.integrations.verl")

# What the last load did: {"estimators": bool, ...}, {} when skipped, None when it failed.
STATE: dict[str, bool] | None = {}


def load() -> dict[str, bool] | None:
    """Install the plug-in unless disabled; returns the active parts, ``{}`` when skipped and
    ``None`` when installing failed (the failure is logged as a warning, never raised)."""
    global STATE
    if os.environ.get("OTBRL_VERL_PLUGIN", "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("otbrl verl plug-in disabled by OTBRL_VERL_PLUGIN")
        STATE = {}
        return STATE
    try:
        from otbrl.integrations.verl import install

        STATE = install()
    except Exception as err:
        logger.warning(
            "otbrl verl plug-in not installed (verl runs unchanged): %s: %s",
            type(err).__name__,
            err,
        )
        STATE = None
    return STATE


load()
