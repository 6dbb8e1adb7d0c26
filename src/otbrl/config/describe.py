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
from collections.abc import Iterator
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


def _groups(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, type, list]]:
    """Each settings group of the schema, a group before the groups nested in it, as
    ``(dotted prefix, its class, [(field, schema default), ...] of its leaf keys)``."""
    node = cls()
    leaves, nested = [], []
    for f in fields(cls):
        value = getattr(node, f.name)
        (nested if is_dataclass(value) else leaves).append((f, value))
    yield prefix, cls, leaves
    for f, value in nested:
        yield from _groups(type(value), f"{prefix}{f.name}.")


@functools.cache
def key_comments() -> dict[str, str]:
    """``{dotted key: its one-line description}`` for every leaf key of the schema."""
    out: dict[str, str] = {}
    for prefix, cls, leaves in _groups():
        for f, _ in leaves:
            owners = [c for c in cls.__mro__ if f.name in _declared(c)]
            out[f"{prefix}{f.name}"] = _class_comments(owners[0]).get(f.name, "") if owners else ""
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
    # JSON is valid YAML for every value a config holds (null, bools, numbers, strings, lists,
    # mappings)
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
            if isinstance(value, dict) and key not in comments:  # a group, not a dict-valued key
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
    leaves = key_comments()

    def flat(node: dict, prefix: str) -> None:
        for name, value in node.items():
            if isinstance(value, dict) and f"{prefix}{name}" not in leaves:
                flat(value, f"{prefix}{name}.")
            else:
                defaults[f"{prefix}{name}"] = value

    flat(to_dict(Config()), "")
    width = max(len(k) for k in defaults)
    return "\n".join(
        f"  {key:<{width}} = {_scalar(value)}  {key_comments().get(key, '')}".rstrip()
        for key, value in defaults.items()
    )


def reference_markdown() -> str:
    """Every key of the schema as Markdown for the documentation site: one section per group
    (``data``, ``rollout.vllm``, ...), one table row per key with its type, schema default,
    allowed values, whether it may change when a run is resumed, and description — all read
    from the declarations, none written by hand."""
    from otbrl.settings import range_text, type_name

    comments = key_comments()
    sections: list[str] = []

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    for prefix, cls, leaves in _groups():
        if not leaves:
            continue
        rows = []
        for f, value in leaves:
            key = f"{prefix}{f.name}"
            allowed = []
            if f.metadata.get("choices") is not None:
                many = isinstance(value, list)
                names = ", ".join(f"`{c}`" for c in f.metadata["choices"])
                allowed.append(f"{'each of' if many else 'one of'} {names}")
            if text := range_text(f.metadata):
                allowed.append(text)
            value_cell = f"`{cell(type_name(f))}` = `{cell(_scalar(value))}`"
            if allowed:
                value_cell += "<br>" + cell("; ".join(allowed))
            if f.metadata.get("resume") == "may_differ":
                value_cell += "<br>may change on resume"
            rows.append(f"| `{key}` | {value_cell} | {cell(comments.get(key, ''))} |")
        doc = inspect.getdoc(cls) or ""
        # a dataclass without a docstring gets its signature as one: not a description
        intro = "" if doc.startswith(f"{cls.__name__}(") else doc.split("\n\n")[0]
        sections.append(
            "\n".join(
                [
                    f"## `{prefix.rstrip('.')}`",
                    "",
                    *([intro.replace("\n", " "), ""] if intro else []),
                    "| key | type = default, allowed | description |",
                    "|---|---|---|",
                    *rows,
                ]
            )
        )
    return "\n\n".join(sections) + "\n"
