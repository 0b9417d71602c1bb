"""The SWE tools as tools in the model's own format (``tool_mode: tools``): the same view, search,
edit, run, test and submit, each a typed function whose schema the chat template renders, each call's
arguments handed to the same code the text commands run (``tools.py``; ``run`` and ``test`` in the
sandbox). The functions here only describe the tools: the environment runs them on its workspace."""

from __future__ import annotations

from lit_marl.envs.swe.tools import ToolError, parse
from lit_marl.tools.formats import ToolCall
from lit_marl.tools.spec import call_problem, load_tools


def view(path: str, start: int = 1, end: int | None = None) -> str:
    """Show lines of a file, numbered.

    Args:
        path: The file, relative to the repository root.
        start: The first line to show.
        end: The last line to show (default: 60 lines from start).
    """


def search(text: str, path: str | None = None) -> str:
    """Find the lines that hold a text.

    Args:
        text: The text to look for.
        path: A file to search (default: every file).
    """


def replace(path: str, search: str, replace: str) -> str:
    """Replace lines of a file.

    Args:
        path: The file, relative to the repository root.
        search: The old lines, exactly as in the file (they must occur once).
        replace: The new lines.
    """


def insert(path: str, line: int, content: str) -> str:
    """Insert lines into a file.

    Args:
        path: The file, relative to the repository root.
        line: Insert after this line (0: at the top).
        content: The lines to insert.
    """


def create(path: str, content: str) -> str:
    """Create a new file.

    Args:
        path: The new file, relative to the repository root.
        content: Its lines.
    """


def run(command: str) -> str:
    """Run a shell command in the repository.

    Args:
        command: The command line.
    """


def test() -> str:
    """Run the visible tests that must keep passing."""


def submit() -> str:
    """Finish: your changes are scored by the tests."""


SWE_TOOLS = tuple(load_tools([view, search, replace, insert, create, run, test, submit], "swe tools"))
"""The tools of ``tool_mode: tools``, in the order the prompt lists them."""

TOOLS_HELP = (
    "Use the tools to read and change the repository: view and search files, edit them (replace, insert, create), "
    "run commands and the visible tests; call submit when you are done: your changes are then scored by the tests."
)


def arguments_of(call: ToolCall) -> dict:
    """A call's arguments checked against its tool (``ToolError`` says what is wrong)."""
    problem = call_problem(call, {tool.name: tool for tool in SWE_TOOLS})
    if problem:
        raise ToolError(problem)
    return call.arguments


def from_text_call(text: str) -> ToolCall:
    """A text-mode call (``tools.as_calls``: the expert's) as the same call in tools mode."""
    call = parse(text)
    if call.name in ("replace", "insert", "create"):
        opener = {"replace": "<<<<<<< SEARCH", "insert": "<<<<<<< INSERT", "create": "<<<<<<< CONTENT"}[call.name]
        body = call.body[call.body.index(opener) + 1 :]
        if call.name == "replace":
            middle, end = body.index("======="), body.index(">>>>>>> REPLACE")
            parts = {"search": body[:middle], "replace": body[middle + 1 : end]}
        else:
            parts = {"content": body[: body.index(">>>>>>> END")]}
        texts = {key: "".join(line + "\n" for line in lines) for key, lines in parts.items()}
        if call.name == "insert":
            return ToolCall("insert", {"path": call.args[0], "line": int(call.args[1]), **texts})
        return ToolCall(call.name, {"path": call.args[0], **texts})
    if call.name == "view":
        numbers = [int(a) for a in call.args[1:]]
        return ToolCall("view", {"path": call.args[0], **dict(zip(("start", "end"), numbers))})
    if call.name == "run":
        return ToolCall("run", {"command": call.rest})
    if call.name == "search":
        return ToolCall("search", {"text": call.rest})
    return ToolCall(call.name, {})
