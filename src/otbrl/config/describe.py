"""The configuration described: one line per key, from the comments of the settings' own
source, and the resolved configuration as commented YAML (``otbrl train --print-config``,
``--help``).

Each key is documented once, where its component declares it: the comment at the end of its
line, else the comment lines right above it (``tests/test_config.py`` checks every key has one).
A field a group inherits (the optimizer keys of ``actor`` and ``critic``) is described by the
class that declares it last.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import textwrap
from dataclasses import fields, is_dataclass
from typing import Any

from otbrl.config.schema import Config, to_dict


@functools.cache
def _class_comments(cls: type) -> dict[str, str]:
    """``{field: its comment}`` for the fields ``cls``'s own source declares."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    notes: dict[str, str] = {}
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            notes[item.target.id] = _comment(lines, item.lineno - 1, item.end_lineno - 1)
    return notes


@functools.cache
def key_comments() -> dict[str, str]:
    """``{dotted key: its one-line description}`` for every leaf key of the schema."""
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            default = getattr(cls(), f.name)
            if is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
                continue
            owners = [c for c in cls.__mro__ if f.name in _declared(c)]
            out[f"{prefix}{f.name}"] = _class_comments(owners[0]).get(f.name, "") if owners else ""

    walk(Config, "")
    return out


def _declared(cls: type) -> set[str]:
    return set(inspect.get_annotations(cls)) if is_dataclass(cls) else set()


def _comment(lines: list[str], first: int, last: int) -> str:
    """The comment ending line ``last`` (a field's own line), else the block above ``first``."""
    tail = lines[last].split("  # ", 1)
    if len(tail) == 2 and not tail[1].startswith("type:"):
        return tail[1].strip()
    block = []
    i = first - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        block.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(block)


def _scalar(value: Any) -> str:
    # JSON is valid YAML for every value a config holds (null, bools, numbers, strings, lists)
    return json.dumps(value, ensure_ascii=False)


def commented_yaml(cfg: Config) -> str:
    """Every key of ``cfg`` as YAML, each with its description; a value that is not the
    schema's default also says the default it replaces (set by a preset or by the user).
    Loading the text back (``--config``) gives the same configuration."""
    comments, defaults = key_comments(), to_dict(Config())
    out: list[str] = []

    def walk(node: dict, default: dict, prefix: str, indent: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict):
                out.append(f"{indent}{name}:")
                walk(value, default.get(name, {}), f"{key}.", indent + "  ")
                continue
            note = comments.get(key, "")
            if name in default and default[name] != value:
                note = f"{note} [default: {_scalar(default[name])}]".strip()
            out.append(f"{indent}{name}: {_scalar(value)}" + (f"  # {note}" if note else ""))

    walk(to_dict(cfg), defaults, "", "")
    return "\n".join(out) + "\n"


def keys_help() -> str:
    """Every key with its default and description, one per line (``otbrl train --help``)."""
    defaults: dict[str, Any] = {}

    def flat(node: dict, prefix: str) -> None:
        for name, value in node.items():
            if isinstance(value, dict):
                flat(value, f"{prefix}{name}.")
            else:
                defaults[f"{prefix}{name}"] = value

    flat(to_dict(Config()), "")
    width = max(len(k) for k in defaults)
    return "\n".join(
        f"  {key:<{width}} = {_scalar(value)}  {key_comments().get(key, '')}".rstrip()
        for key, value in defaults.items()
    )
