"""What resuming a run compares: two resolved configurations, key by key, as the schema knows
them (a key one of them lacks counts as its default; a renamed key under its name now). The
run directory (``otbrl.store.rundir``) refuses every difference outside
``otbrl.config.keys.RESUME_MAY_DIFFER``. Importing this imports no torch.
"""

from __future__ import annotations

from typing import Any

from otbrl.config.load import upgrade_saved
from otbrl.config.schema import Config, to_dict


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, current value)}`` where two resolved configs differ. A key
    one of them lacks (another otbrl version) counts as the schema's default; a key an earlier
    version named otherwise is compared under its name now (``upgrade_saved``)."""
    defaults = flat_config(to_dict(Config()))
    a, b = flat_config(upgrade_saved(saved)), flat_config(current)
    out = {}
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, defaults.get(key)), b.get(key, defaults.get(key))
        if x != y:
            out[key] = (x, y)
    return out
