"""How a component declares its configuration (floor 0: every floor may use it).

A component's settings are a plain dataclass next to the code that reads them (the engine's in
``otbrl.engine.config``, the rollouts' in ``otbrl.rollout.config``, ...); the CLI's schema
(``otbrl.config.schema``) only composes them into the dotted groups users set. Each field says
what it allows where it is declared — ``setting(default, choices=..., gt=..., ...)`` — and a
group with rules across its own fields adds a ``check(self, at)`` method. ``check_settings``
walks a tree of them and raises one ``ConfigError`` naming the dotted key.

What a key *is* is declared on its field too, never in a side table: whether it may change
when a run is resumed (``resume="may_differ"``: it changes no result — layout, micro-batching,
logging, saving, timeouts, where work runs; ``resume="fixed"``: changing it would mix two runs'
steps), the estimator option it sets (``estimator_option="gamma"``), and, from its type, whether
a bare command-line value is a one-element list (``list[...]``). ``leaf_fields`` walks a tree of
them; ``otbrl.config.keys`` derives the CLI schema's tables from it.

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
# setting(resume=...): a key that may change when a run is resumed (it changes no result), or one
# fixed for the run's life (changing it would mix two runs' steps)
RESUME_CLASSES = ("may_differ", "fixed")


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
    resume: str | None = None,
    estimator_option: str | None = None,
) -> Any:
    """A dataclass field with its allowed values: ``choices`` (a closed set, declared by the
    component that acts on it; for a list, each entry), a range (``gt`` / ``ge`` / ``lt`` /
    ``le``; ``None`` is allowed when ``null`` says what it means). ``resume``: ``"may_differ"``
    (the key may change when a run is resumed: it changes no result) or ``"fixed"``; every key
    of the CLI's schema declares it (``tests/test_config_keys.py``). ``estimator_option``: the
    keyword the advantage estimators take this key's value as (``"gamma"``)."""
    if resume is not None and resume not in RESUME_CLASSES:
        raise ValueError(f"resume: expected one of {list(RESUME_CLASSES)}, got {resume!r}")
    meta = {"choices": tuple(choices) if choices is not None else None, "null": null}
    meta |= {"gt": gt, "ge": ge, "lt": lt, "le": le}
    meta |= {"resume": resume, "estimator_option": estimator_option}
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


def is_list(f: Field) -> bool:
    """The field holds a list (``list[str]``): a bare command-line value is one entry."""
    return type_name(f).replace(" ", "").split("[", 1)[0] in ("list", "List")


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


def leaf_fields(cls: type, at: str = "") -> dict[str, Field]:
    """``{dotted key: its field}`` for every leaf field of ``cls``'s tree (a group's own fields
    and its nested groups' in declaration order); what each key declares is ``.metadata``."""
    out: dict[str, Field] = {}
    for f in fields(cls):
        child = _child_type(f)
        if child is not None:
            out |= leaf_fields(child, f"{at}{f.name}.")
        else:
            out[f"{at}{f.name}"] = f
    return out


def choice_fields(cls: type, at: str = "") -> dict[str, tuple[str, ...]]:
    """``{dotted key: allowed values}`` for every field of ``cls``'s tree with a closed set."""
    return {
        key: f.metadata["choices"]
        for key, f in leaf_fields(cls, at).items()
        if f.metadata.get("choices") is not None
    }


def _child_type(f: Field) -> type | None:
    if f.default_factory is not MISSING and is_dataclass(f.default_factory):
        return f.default_factory  # type: ignore[return-value]
    return None
