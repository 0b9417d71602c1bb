"""The agent's tools: one tool call per reply, in one text format (``HELP`` is what the first
observation shows), parsed here; the file tools run here on the workspace, ``run`` and ``test``
in the sandbox (``env.py``). A malformed call raises ``ToolError``, whose message becomes the
observation: the episode goes on."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from lit_marl.envs.swe.workspace import Workspace

TOOLS = ("view", "search", "replace", "insert", "create", "run", "test", "submit")
HELP = """Reply with exactly one tool call; its first line names the tool:
view FILE [START [END]]   show lines START..END of FILE, numbered (default: the first 60)
search TEXT [FILE]        the lines holding TEXT, in FILE or in every file
replace FILE              replace text in FILE, given after this line as
<<<<<<< SEARCH
the old lines, exactly as in the file (they must occur once)
=======
the new lines
>>>>>>> REPLACE
insert FILE LINE          insert the lines of a <<<<<<< INSERT ... >>>>>>> END block after line LINE (0: at the top)
create FILE               a new file with the lines of a <<<<<<< CONTENT ... >>>>>>> END block
run COMMAND               run a shell command in the repository
test                      run the visible tests that must keep passing
submit                    finish: your changes are scored by the tests"""

VIEW_LINES = 60
SEARCH_HITS = 40


class ToolError(ValueError):
    """A malformed or impossible tool call; the message tells the agent what to fix."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: list[str]
    rest: str
    """The first line after the tool's name, as written."""
    body: list[str]
    """The lines after the first."""


def parse(reply: str) -> ToolCall:
    """The tool call of a reply: its first line whose first word is a tool (text before it, and a
    surrounding code fence, are allowed)."""
    lines = [line for line in reply.strip().splitlines() if not line.strip().startswith("```")]
    for index, line in enumerate(lines):
        words = line.strip().split(None, 1)
        if words and words[0].lower() in TOOLS:
            rest = words[1] if len(words) > 1 else ""
            try:
                args = shlex.split(rest) if words[0].lower() not in ("run", "search") else []
            except ValueError as err:
                raise ToolError(f"{words[0]}: cannot read its arguments ({err})") from err
            return ToolCall(words[0].lower(), args, rest.strip(), lines[index + 1 :])
    raise ToolError(f"no tool call found: start a line with one of {', '.join(TOOLS)}")


def _block(body: list[str], opener: str, closer: str, tool: str) -> list[str]:
    starts = [i for i, line in enumerate(body) if line.strip() == opener]
    if not starts:
        raise ToolError(f"{tool}: no '{opener}' line after the tool's line")
    ends = [i for i, line in enumerate(body) if line.strip() == closer and i > starts[0]]
    if not ends:
        raise ToolError(f"{tool}: no '{closer}' line closing the '{opener}' block")
    return body[starts[0] + 1 : ends[0]]


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _read(ws: Workspace, rel: str, tool: str) -> tuple[object, str]:
    try:
        target = ws.resolve(rel)
    except ValueError as err:
        raise ToolError(f"{tool}: {err}") from err
    if not target.is_file():
        raise ToolError(f"{tool}: no file {rel!r} (search or run 'ls' to find it)")
    try:
        return target, target.read_text()
    except UnicodeDecodeError as err:
        raise ToolError(f"{tool}: {rel!r} is not a text file") from err


def _write(ws: Workspace, target, text: str) -> None:
    ws.write(str(target.relative_to(ws.path.resolve())), text.encode())


def view(ws: Workspace, call: ToolCall) -> str:
    if not 1 <= len(call.args) <= 3:
        raise ToolError("view: give FILE [START [END]], e.g. 'view src/app.py 1 40'")
    _, text = _read(ws, call.args[0], "view")
    try:
        numbers = [int(a) for a in call.args[1:]]
    except ValueError as err:
        raise ToolError("view: START and END are line numbers") from err
    lines = text.splitlines()
    start = max(1, numbers[0]) if numbers else 1
    end = min(len(lines), numbers[1] if len(numbers) > 1 else start + VIEW_LINES - 1)
    shown = "\n".join(f"{n:4d} {lines[n - 1]}" for n in range(start, end + 1))
    return f"{call.args[0]} (lines {start}-{end} of {len(lines)}):\n{shown}" if lines else f"{call.args[0]} is empty"


def search(ws: Workspace, call: ToolCall) -> str:
    """``search TEXT [FILE]``: TEXT in quotes, or unquoted (then a last word naming a file is FILE)."""
    rest, path = call.rest, None
    if rest[:1] in ("'", '"'):
        try:
            words = shlex.split(rest)
        except ValueError as err:
            raise ToolError(f"search: cannot read its arguments ({err})") from err
        needle, path = words[0], (words[1] if len(words) > 1 else None)
    else:
        head, _, last = rest.rpartition(" ")
        needle = rest
        if head and (ws.path / last).is_file():
            needle, path = head, last
    return search_text(ws, needle, path)


def search_text(ws: Workspace, needle: str, path: str | None = None) -> str:
    """The lines holding ``needle``, in ``path`` or in every file."""
    if not needle:
        raise ToolError("search: give the TEXT to look for, e.g. 'search def merge'")
    files = {path: _read(ws, path, "search")[1].encode()} if path else ws.files()
    hits = []
    for rel in sorted(files):
        for n, line in enumerate(files[rel].decode(errors="replace").splitlines(), 1):
            if needle in line:
                hits.append(f"{rel}:{n}: {line.strip()}")
    if not hits:
        return f"no line holds {needle!r}"
    more = f"\n[{len(hits) - SEARCH_HITS} more]" if len(hits) > SEARCH_HITS else ""
    return "\n".join(hits[:SEARCH_HITS]) + more


def replace(ws: Workspace, call: ToolCall) -> str:
    if len(call.args) != 1:
        raise ToolError("replace: give one FILE on the tool's line, the SEARCH/REPLACE block below it")
    old = _block(call.body, "<<<<<<< SEARCH", "=======", "replace")
    new = _block(call.body, "=======", ">>>>>>> REPLACE", "replace")
    return replace_text(ws, call.args[0], _text(old), _text(new))


def replace_text(ws: Workspace, path: str, old_text: str, new_text: str) -> str:
    """``old_text`` (it must occur once in ``path``) replaced by ``new_text``."""
    target, text = _read(ws, path, "replace")
    old, new = old_text.splitlines(), new_text.splitlines()
    if not old_text.strip():
        raise ToolError("replace: the SEARCH part is empty; use insert to add lines")
    count = text.count(old_text)
    if count == 0 and not text.endswith("\n") and text.endswith(old_text[:-1]):
        text += "\n"
        count = 1
    if count != 1:
        where = "does not occur" if count == 0 else f"occurs {count} times"
        raise ToolError(f"replace: the SEARCH lines {where} in {path} (view the file, copy them exactly)")
    _write(ws, target, text.replace(old_text, new_text, 1))
    return f"replaced {len(old)} line(s) of {path} with {len(new)}"


def insert(ws: Workspace, call: ToolCall) -> str:
    if len(call.args) != 2 or not call.args[1].lstrip("-").isdigit():
        raise ToolError("insert: give FILE LINE on the tool's line, e.g. 'insert app.py 12'")
    new = _block(call.body, "<<<<<<< INSERT", ">>>>>>> END", "insert")
    return insert_text(ws, call.args[0], int(call.args[1]), _text(new))


def insert_text(ws: Workspace, path: str, at: int, new_text: str) -> str:
    """``new_text``'s lines inserted after line ``at`` of ``path`` (0: at the top)."""
    target, text = _read(ws, path, "insert")
    new = new_text.splitlines()
    new_text = _text(new)
    lines = text.splitlines(keepends=True)
    if not 0 <= at <= len(lines):
        raise ToolError(f"insert: LINE must be in 0..{len(lines)} for {path}")
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    _write(ws, target, "".join(lines[:at]) + new_text + "".join(lines[at:]))
    return f"inserted {len(new)} line(s) after line {at} of {path}"


def create(ws: Workspace, call: ToolCall) -> str:
    if len(call.args) != 1:
        raise ToolError("create: give one FILE on the tool's line, the CONTENT block below it")
    lines = _block(call.body, "<<<<<<< CONTENT", ">>>>>>> END", "create")
    return create_text(ws, call.args[0], _text(lines))


def create_text(ws: Workspace, path: str, content: str) -> str:
    """A new file ``path`` holding ``content``'s lines."""
    try:
        target = ws.resolve(path)
    except ValueError as err:
        raise ToolError(f"create: {err}") from err
    if target.exists():
        raise ToolError(f"create: {path} exists; use replace or insert")
    lines = content.splitlines()
    ws.write(str(target.relative_to(ws.path.resolve())), _text(lines).encode())
    return f"created {path} ({len(lines)} lines)"


FILE_TOOLS = {"view": view, "search": search, "replace": replace, "insert": insert, "create": create}


def trim(hunk, text: str):
    """``hunk`` without the context lines its old and new sides share at both ends, as long as its
    old side still occurs exactly once in ``text`` (the file it applies to): shorter calls."""
    old, new = hunk.old.splitlines(keepends=True), hunk.new.splitlines(keepends=True)

    def once(lines):
        return bool(lines) and text.count("".join(lines)) == 1

    while len(old) > 1 and len(new) > 1 and old[0] == new[0] and once(old[1:]):
        old, new = old[1:], new[1:]
    while len(old) > 1 and len(new) > 1 and old[-1] == new[-1] and once(old[:-1]):
        old, new = old[:-1], new[:-1]
    return type(hunk)(hunk.path, "".join(old), "".join(new), hunk.created, hunk.deleted)


def view_call(path: str, text: str, old: str, context: int) -> str:
    """``view`` of the lines ``old`` spans in ``text`` with ``context`` lines around them."""
    first = text[: text.index(old)].count("\n") + 1
    last = first + max(old.count("\n"), 1) - 1
    return f"view {path} {max(1, first - context)} {last + context}"


def as_calls(hunks, files: dict[str, bytes] | None = None, view_context: int | None = None) -> list[str]:
    """The known fix (a patch's hunks) as tool calls, one per hunk, then ``submit``; with the base
    ``files`` each replace is trimmed to the lines that change (``trim``) and, with ``view_context``,
    preceded by a ``view`` of its lines and that many around them (look, then edit)."""
    calls = []
    files = dict(files or {})
    for hunk in hunks:
        if files and not hunk.created and not hunk.deleted and hunk.path in files:
            text = files[hunk.path].decode(errors="replace")
            hunk = trim(hunk, text)
            if view_context is not None:
                calls.append(view_call(hunk.path, text, hunk.old, view_context))
            files[hunk.path] = text.replace(hunk.old, hunk.new, 1).encode()
        if hunk.created:
            calls.append(f"create {hunk.path}\n<<<<<<< CONTENT\n{hunk.new}>>>>>>> END")
        elif hunk.deleted:
            calls.append(f"run rm {shlex.quote(hunk.path)}")
        else:
            calls.append(f"replace {hunk.path}\n<<<<<<< SEARCH\n{hunk.old}=======\n{hunk.new}>>>>>>> REPLACE")
    return calls + ["submit"]
