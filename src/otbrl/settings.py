"""How a component declares its configuration (floor 0: every floor may use it).

A component's settings are a plain dataclass next to the code that reads them (the engine's in
``otbrl.engine.config``, the rollouts' in ``otbrl.rollout.config``, ...); the CLI's schema
(``otbrl.config.schema``) only composes them into the dotted groups users set. Each field says
what it allows where it is declared — ``setting(default, choices=..., gt=..., ...)`` — and a
group with rules across its own fields adds a ``check(self, at)`` method. ``check_settings``
walks a tree of them and raises one ``ConfigError`` naming the dotted key.

Every field's description is the comment at the end of its line, or the comment lines right
above it (``otbrl.config.describe`` reads them from the owner's source for ``--help`` and
``--print-config``). These modules import no torch: the CLI starts without it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import Any

from otbrl.errors import ConfigError

TRISTATE = ("auto", "true", "false")  # a switch that "auto" sets from the rest of the config
# the precisions an engine holds a model in (otbrl.engine.precision: what each means): declared
# by two floors (model.precision in the engine's settings, algorithm.distill.precision in the
# algorithm's), so it lives below both
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def setting(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    choices: Sequence[str] | None = None,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    null: str | None = None,
) -> Any:
    """A dataclass field with its allowed values: ``choices`` (a closed set, declared by the
    component that acts on it; for a list, each entry), a range (``gt`` / ``ge`` / ``lt`` /
    ``le``; ``None`` is allowed when ``null`` says what it means)."""
    meta = {"choices": tuple(choices) if choices is not None else None, "null": null}
    meta |= {"gt": gt, "ge": ge, "lt": lt, "le": le}
    return field(default=default, default_factory=default_factory, metadata=meta)  # type: ignore[call-overload]


def range_text(meta: Mapping[str, Any]) -> str:
    """``"> 0"``, ``"in (0, 1]"``, ``">= 1 or null (all rows)"``: the range a field allows."""
    low = ("(", meta["gt"]) if meta.get("gt") is not None else ("[", meta.get("ge"))
    high = (")", meta["lt"]) if meta.get("lt") is not None else ("]", meta.get("le"))
    if low[1] is not None and high[1] is not None:
        text = f"in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
    elif low[1] is not None:
        text = f"{'>' if low[0] == '(' else '>='} {_num(low[1])}"
    elif high[1] is not None:
        text = f"{'<' if high[0] == ')' else '<='} {_num(high[1])}"
    else:
        return ""
    return text + (f" or null ({meta['null']})" if meta.get("null") else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _in_range(value: float, meta: Mapping[str, Any]) -> bool:
    return (
        (meta.get("gt") is None or value > meta["gt"])
        and (meta.get("ge") is None or value >= meta["ge"])
        and (meta.get("lt") is None or value < meta["lt"])
        and (meta.get("le") is None or value <= meta["le"])
    )


def type_name(f: Field) -> str:
    """A field's declared type as written (``"int"``, ``"str | None"``, ``"list[str]"``)."""
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def check_field(f: Field, value: Any, key: str) -> None:
    """One field's own rules (its type, finite, in its range, one of its choices);
    ``ConfigError``."""
    meta = f.metadata
    kind = type_name(f)
    if kind in ("int", "float") and (
        isinstance(value, bool) or not isinstance(value, int if kind == "int" else (int, float))
    ):
        raise ConfigError(
            f"'{key}' must be {'an int' if kind == 'int' else 'a number'}, got {value!r}", key
        )
    if isinstance(value, float) and not math.isfinite(value):
        # NaN passes every comparison and inf overflows at step 1
        raise ConfigError(f"'{key}' must be a finite number, got {value}", key)
    allowed = meta.get("choices")
    if allowed is not None and not (value is None and meta.get("null")):
        many = isinstance(value, Sequence) and not isinstance(value, str)  # a list of choices
        for item in value if many else [value]:
            if item not in allowed:
                close = difflib.get_close_matches(str(item), allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                what = "entries must be in" if many else "must be one of"
                raise ConfigError(f"'{key}' {what} {list(allowed)}, got '{item}'{hint}", key)
    text = range_text(meta)
    allowed_null = value is None and meta.get("null")
    if text and not allowed_null and (value is None or not _in_range(value, meta)):
        raise ConfigError(f"'{key}' must be {text}, got {value}", key)


def check_settings(node: Any, at: str = "") -> None:
    """Every field of the dataclass tree ``node`` against its own rules, each group's
    ``check(at)`` after its fields; ``at``: the dotted prefix its keys are named with."""
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            check_settings(value, f"{at}{f.name}.")
        else:
            check_field(f, value, f"{at}{f.name}")
    if hasattr(node, "check"):
        node.check(at)


def refuse_unset(
    node: Any, at: str, because: str, fix: str, keys: Sequence[str] | None = None
) -> None:
    """Keys of a switched-off part set anyway: ``ConfigError`` on the first of ``keys`` (None:
    every field) that differs from its default (``because``: what switched the part off;
    ``fix``: how to switch it on)."""
    defaults = type(node)()
    for key in keys if keys is not None else [f.name for f in fields(node)]:
        if getattr(node, key) != getattr(defaults, key):
            raise ConfigError(
                f"'{at}{key}' is set but {because}; {fix} or drop the key", f"{at}{key}"
            )


def choice_fields(cls: type, at: str = "") -> dict[str, tuple[str, ...]]:
    """``{dotted key: allowed values}`` for every field of ``cls``'s tree with a closed set."""
    out: dict[str, tuple[str, ...]] = {}
    for f in fields(cls):
        child = _child_type(f)
        if child is not None:
            out |= choice_fields(child, f"{at}{f.name}.")
        elif f.metadata.get("choices") is not None:
            out[f"{at}{f.name}"] = f.metadata["choices"]
    return out


def _child_type(f: Field) -> type | None:
    if f.default_factory is not MISSING and is_dataclass(f.default_factory):
        return f.default_factory  # type: ignore[return-value]
    return None
