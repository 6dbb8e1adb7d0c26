"""Plain values for a run directory's JSON and YAML files: configs as nested dicts, metrics
and summaries as JSON-ready numbers. Duck-typed, so it imports neither torch nor NumPy (tools
that only read runs start fast)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


def plain_value(value: Any) -> Any:
    """``value`` with mappings and sequences as dicts and lists, leaves as JSON scalars (other
    objects, e.g. paths, as their ``str``)."""
    if isinstance(value, Mapping):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_value(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)  # paths, enums: a config file must hold plain values only


def to_plain_dict(config: Any) -> dict[str, Any]:
    """A resolved config (dict, dataclass instance or OmegaConf node) as plain nested dicts."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return plain_value(dataclasses.asdict(config))
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return plain_value(OmegaConf.to_container(config, resolve=True))
    if isinstance(config, Mapping):
        return plain_value(config)
    raise TypeError(
        f"config: expected a dict, dataclass or OmegaConf config, got {type(config).__name__}"
    )


def json_safe(value: Any) -> Any:
    """A JSON-ready copy: NaN/inf -> None (JSON has neither), tensors and NumPy scalars ->
    numbers, tuples -> lists, keys -> str."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # tensors, NumPy scalars
        return json_safe(to_number("final", value))
    return value


def to_number(key: str, value: Any) -> int | float:
    """A metric value as an int or float: numbers, one-element tensors, NumPy scalars; a
    ``TypeError`` naming ``key`` otherwise."""
    # Duck-typed so this module stays importable without torch (a cheap import for tools).
    if hasattr(value, "numel") and callable(value.numel):  # torch.Tensor
        if value.numel() != 1:
            raise TypeError(
                f"metrics[{key!r}]: expected a number or a one-element tensor, "
                f"got a tensor of shape {tuple(value.shape)}"
            )
        value = value.item()
    elif hasattr(value, "item") and callable(value.item):  # numpy scalars
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    raise TypeError(f"metrics[{key!r}]: expected a number, got {type(value).__name__}")
