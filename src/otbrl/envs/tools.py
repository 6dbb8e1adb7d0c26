"""The tool loop as one environment among others: a model turn's tool calls run, their results
are the observation, and a turn without a call ends the episode (its answer scored by the
reward function, the environment's own rewards 0)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from otbrl.tools import ToolCallFormat, ToolExecutor, tools_for_row


class ToolEnv:
    """One sample's tool episode. ``allowed``: the tool names its row may call; ``max_turns``:
    the model turns of the episode — the calls of the last one are not run (nothing would read
    their results). ``step``'s ``info`` counts ``tool_calls`` and ``tool_errors``."""

    def __init__(
        self,
        fmt: ToolCallFormat,
        executor: ToolExecutor,
        allowed: list[str] | None,
        max_turns: int,
    ):
        self.fmt, self.executor, self.allowed, self.max_turns = fmt, executor, allowed, max_turns
        self.turns = 0

    def reset(self, seed: int | None = None, options: dict | None = None):
        """No observation: the prompt is the row's."""
        self.turns = 0
        return None, {}

    def step(self, action: str):
        """Run the calls ``action`` holds; no call (or the last turn): the episode ends."""
        self.turns += 1
        calls = self.fmt.parse(action)
        if not calls or self.turns >= self.max_turns:
            return None, 0.0, True, False, {}
        answers = self.executor.run(calls, [self.allowed] * len(calls))
        messages = [{"role": "tool", "name": a.name, "content": a.text} for a in answers]
        info = {"tool_calls": len(answers), "tool_errors": sum(a.error for a in answers)}
        return messages, 0.0, False, False, info


def tool_env_factory(
    fmt: ToolCallFormat, executor: ToolExecutor, max_turns: int
) -> Callable[[Mapping], ToolEnv]:
    """``make(row) -> ToolEnv`` over ``executor``'s tools, each row allowed its own
    (``otbrl.tools.tools_for_row``)."""

    def make(row: Mapping) -> ToolEnv:
        return ToolEnv(fmt, executor, tools_for_row(row, executor.tools), max_turns)

    return make
