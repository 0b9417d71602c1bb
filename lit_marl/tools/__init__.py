"""Tools an agent calls in its model's own format: Python functions as JSON-schema tools
(``spec``), the chat template's rendering and the reply's parsing into calls (``formats``), and the
calls run in order, each bounded in time (``calls``)."""

from lit_marl.tools.calls import Answer, ToolResult, ToolResults, run_calls
from lit_marl.tools.formats import PARSERS, ParsedReply, ToolCall, ToolFormat, parse_reply, tool_format
from lit_marl.tools.spec import Tool, load_tools

__all__ = [
    "PARSERS",
    "Answer",
    "ParsedReply",
    "Tool",
    "ToolCall",
    "ToolFormat",
    "ToolResult",
    "ToolResults",
    "load_tools",
    "parse_reply",
    "run_calls",
    "tool_format",
]
