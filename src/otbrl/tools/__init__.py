"""otbrl.tools: tools as Python functions, their schemas, calling formats and safe execution.

No torch here (floor 2): the agent loop that uses them lives in ``otbrl.rollout.agent``.
"""

from otbrl.tools.calculator import calculator
from otbrl.tools.executor import ToolCall, ToolExecutor, ToolResult
from otbrl.tools.formats import (
    FORMATS,
    TOOL_TOKENS,
    ChatTurns,
    CompactFormat,
    HermesFormat,
    ToolCallFormat,
    check_prefix_preserving,
    get_format,
)
from otbrl.tools.registry import (
    BUILTIN_TOOLS,
    Tool,
    make_tool,
    resolve_tools,
    tool_schemas,
    tools_for_row,
)

__all__ = [
    "BUILTIN_TOOLS",
    "FORMATS",
    "TOOL_TOKENS",
    "ChatTurns",
    "CompactFormat",
    "HermesFormat",
    "Tool",
    "ToolCall",
    "ToolCallFormat",
    "ToolExecutor",
    "ToolResult",
    "calculator",
    "check_prefix_preserving",
    "get_format",
    "make_tool",
    "resolve_tools",
    "tool_schemas",
    "tools_for_row",
]
