"""Running parsed tool calls: concurrently, each under a timeout, never raising.

Whatever goes wrong — a parse error, an unknown or not-allowed tool name, arguments that do not
fit the signature, a tool that raises or runs past ``timeout_s`` — the call's result is an
error observation (``ToolResult(error=True)``) the model reads and the trainer counts
(``tool/errors``); a run is never stopped by a tool. Python cannot kill a thread: a tool that
times out keeps running in its daemon thread until it returns, its result discarded. So that a
tool that hangs for good cannot pile up threads for the rest of a run, at most ``max_hung``
such threads of one tool may be alive at once; past that, calls of that tool are answered with
an error without starting (the run says so once), and the other tools run as before.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from otbrl.tools.registry import Tool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool ``name`` and its ``arguments`` (a dict of keyword
    arguments, or a str for the tool's single parameter), or the ``error`` that made it
    unreadable (bad JSON, an unterminated call...)."""

    name: str | None
    arguments: dict | str | None = None
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The observation text of one call and whether it is an error message."""

    name: str
    text: str
    error: bool


class ToolExecutor:
    """Runs calls against ``tools`` with a per-call ``timeout_s`` (seconds, > 0); at most
    ``max_hung`` timed-out calls of one tool may still be running at once."""

    def __init__(self, tools: Mapping[str, Tool], *, timeout_s: float = 5.0, max_hung: int = 32):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a number of seconds > 0, got {timeout_s!r}")
        if isinstance(max_hung, bool) or not isinstance(max_hung, int) or max_hung < 1:
            raise ValueError(f"max_hung: expected an int >= 1, got {max_hung!r}")
        self.tools = dict(tools)
        self.timeout_s = float(timeout_s)
        self.max_hung = max_hung
        self._hung: dict[str, list[threading.Thread]] = {}  # timed out, maybe still running
        self._warned = False

    def run(
        self, calls: Sequence[ToolCall], allowed: Sequence[Sequence[str] | None] | None = None
    ) -> list[ToolResult]:
        """One result per call, in order. ``allowed[i]``: the tool names call i may use (None:
        every configured tool). All calls run at once, each in its own thread, and the whole
        batch takes at most about ``timeout_s``."""
        allowed = allowed if allowed is not None else [None] * len(calls)
        if len(allowed) != len(calls):
            raise ValueError(f"allowed: expected {len(calls)} entries, got {len(allowed)}")
        results: list[ToolResult | None] = [None] * len(calls)
        threads: list[tuple[int, threading.Thread, list]] = []
        self._hung = {
            name: alive
            for name, threads_ in self._hung.items()
            if (alive := [t for t in threads_ if t.is_alive()])
        }
        for i, (call, names) in enumerate(zip(calls, allowed)):
            tool, problem = self._check(call, names)
            hung = len(self._hung.get(call.name or "", ()))
            if problem is None and hung >= self.max_hung:
                problem = (
                    f"error: tool {call.name!r} not run: {hung} earlier calls of it are still "
                    f"running past their {self.timeout_s:g} s timeout"
                )
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "tools: %d calls of tool %r still run past their timeout; its new "
                        "calls are answered with an error until they end",
                        hung,
                        call.name,
                    )
            if problem is not None:
                results[i] = ToolResult(call.name or "", problem, True)
                continue
            box: list = []
            thread = threading.Thread(target=_invoke, args=(tool, call.arguments, box), daemon=True)
            thread.start()
            threads.append((i, thread, box))
        deadline = time.monotonic() + self.timeout_s
        for i, thread, box in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            name = calls[i].name or ""
            if thread.is_alive() or not box:
                if thread.is_alive():
                    self._hung.setdefault(name, []).append(thread)
                text = f"error: tool {name!r} timed out after {self.timeout_s:g} s"
                results[i] = ToolResult(name, text, True)
            else:
                ok, value = box[0]
                results[i] = ToolResult(name, value, not ok)
        return results  # type: ignore[return-value]

    def _check(self, call: ToolCall, names: Sequence[str] | None) -> tuple[Tool | None, str | None]:
        if call.error is not None:
            return None, f"error: {call.error}"
        offered = list(self.tools) if names is None else list(names)
        if call.name not in self.tools or call.name not in offered:
            return None, f"error: unknown tool {call.name!r}; available: {', '.join(offered)}"
        return self.tools[call.name], None


def _invoke(tool: Tool, arguments, box: list) -> None:
    """Call the tool; put ``(ok, text)`` in ``box``. Runs in the call's thread."""
    try:
        if isinstance(arguments, str):
            if len(tool.parameters) != 1:
                raise TypeError(
                    f"takes {len(tool.parameters)} arguments {list(tool.parameters)}; "
                    "pass them by name as a JSON object"
                )
            value = tool.fn(arguments)
        else:
            value = tool.fn(**(arguments or {}))
        box.append((True, value if isinstance(value, str) else _to_text(value)))
    except Exception as err:  # the tool's own failure becomes the observation
        box.append((False, f"error: {tool.name} raised {type(err).__name__}: {err}"))


def _to_text(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
