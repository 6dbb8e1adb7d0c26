"""Tools as Python functions: the built-in ones, user files, schemas, and which rows may use what.

A tool is any callable with type hints and a Google-style docstring (``Args:``); its JSON schema
comes from ``transformers.utils.get_json_schema``, the format chat templates that take
``tools=`` expect. ``rollout.multi_turn.tools`` lists built-in names (``calculator``) or
``path/to/file.py:function``; a file is executed once per process (like ``reward.function``),
and a user tool whose name is a built-in's replaces the built-in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from otbrl.tools.calculator import calculator
from otbrl.user_code import load_user_function

BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator}


@dataclass(frozen=True)
class Tool:
    """One callable tool: ``name`` (what the model calls), ``fn``, its JSON ``schema``
    (``{"type": "function", "function": {"name", "description", "parameters"}}``), and its
    parameter names in order (``required`` ones first in the schema's sense)."""

    name: str
    fn: Callable
    schema: dict
    parameters: tuple[str, ...]
    required: tuple[str, ...]


def make_tool(fn: Callable, *, source: str = "") -> Tool:
    """A ``Tool`` from a function with type hints and an ``Args:`` docstring.

    ``source`` names where it came from in error messages. Raises ``TypeError`` for a
    non-callable and ``ValueError`` when ``get_json_schema`` cannot describe the function
    (missing hints or docstring).
    """
    where = source or getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise TypeError(f"tool {where}: expected a callable, got {type(fn).__name__}")
    from transformers.utils import get_json_schema  # imports no torch

    try:
        schema = get_json_schema(fn)
    except (
        Exception
    ) as err:  # transformers raises its own TypeHintParsingException/DocstringParsingException
        raise ValueError(
            f"tool {where}: cannot build its JSON schema ({type(err).__name__}: {err}); a tool "
            "needs type hints on every argument and a docstring with an 'Args:' section"
        ) from None
    params = schema["function"].get("parameters", {})
    names = tuple(params.get("properties", {}))
    return Tool(
        name=schema["function"]["name"],
        fn=fn,
        schema=schema,
        parameters=names,
        required=tuple(params.get("required", ())),
    )


def resolve_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """``rollout.multi_turn.tools`` -> ``{name: Tool}`` in the order given.

    Each spec is a built-in name or ``"path/to/file.py:function"``. A user tool named like a
    built-in replaces it (wherever either appears in the list); two user tools with one name,
    an unknown name, a missing file or function are ``ValueError`` naming the spec.
    """
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise TypeError(f"tools: expected a list of tool specs, got {type(specs).__name__}")
    loaded: list[tuple[bool, Tool]] = []  # (is built-in, tool) in list order
    user: dict[str, Tool] = {}
    for spec in specs:
        if not isinstance(spec, str) or not spec:
            raise TypeError(f"tools: expected a name or 'path/file.py:fn', got {spec!r}")
        if spec in BUILTIN_TOOLS:
            loaded.append((True, make_tool(BUILTIN_TOOLS[spec], source=f"built-in {spec!r}")))
            continue
        if ":" not in spec:
            raise ValueError(
                f"tools: {spec!r} is neither a built-in tool ({sorted(BUILTIN_TOOLS)}) nor "
                "'path/to/file.py:function'"
            )
        tool = make_tool(load_user_function(spec, "tools"), source=repr(spec))
        if tool.name in user:
            raise ValueError(f"tools: two tools are named {tool.name!r} ({spec!r} is the second)")
        user[tool.name] = tool
        loaded.append((False, tool))
    out: dict[str, Tool] = {}
    for builtin, tool in loaded:
        out.setdefault(tool.name, user.get(tool.name, tool) if builtin else tool)
    return out


def tools_for_row(row: Mapping, available: Mapping[str, Tool]) -> list[str]:
    """The tool names a row may call: ``extra_info.tools`` (a list of names) or the keys of
    ``extra_info.tools_kwargs`` (verl's schema), else every configured tool.

    A name that is not configured is a ``ValueError`` naming the row's ``extra_info`` key.
    """
    extra = row.get("extra_info") or {}
    names = extra.get("tools")
    key = "extra_info.tools"
    if names is None and isinstance(extra.get("tools_kwargs"), Mapping):
        names, key = list(extra["tools_kwargs"]), "extra_info.tools_kwargs"
    if names is None:
        return list(available)
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ValueError(f"{key}: expected a list of tool names, got {names!r}")
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(
            f"{key}: tools {unknown} are not configured (rollout.multi_turn.tools has "
            f"{sorted(available)})"
        )
    return list(names)


def tool_schemas(names: Sequence[str], available: Mapping[str, Tool]) -> list[dict]:
    """The JSON schemas of ``names``, for a chat template's ``tools=`` argument."""
    return [available[n].schema for n in names]
