"""Write ``src/racer/bench/data/agent_sessions.jsonl``: replayed sessions of a coding agent
that fixes a bug in a real function of CPython's standard library (PSF License 2.0).

Each session is the conversation an agent framework resends on every call: one system
prompt with the tools (the same in every session, as a framework's is), the task, then
turns of a tool call (the assistant) and its observation (the tool's output, sent back
as a user message, as text-based agents such as ReAct and SWE-agent do). The tool calls
are scripted and the observations are real: ``search`` greps the module's file,
``read_file`` prints the function's lines numbered (with the planted bug: its first
strict comparison made non-strict), ``edit_file`` prints the fixed lines. The model
answers after every observation, so a session of four user messages is four requests,
each carrying the whole conversation before it; the last asks for the whole fixed
function. Run with the CPython the data README names:

    python scripts/make_agent_sessions.py
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

MODULES = ("textwrap", "shlex", "fnmatch", "heapq", "bisect", "colorsys", "calendar", "difflib", "statistics",
           "string", "html", "glob", "posixpath", "base64", "quopri", "gettext", "tokenize", "ipaddress",
           "fractions", "locale", "mimetypes", "urllib.parse", "email.utils", "json.decoder", "argparse",
           "configparser", "csv", "datetime", "decimal", "functools", "inspect", "pathlib", "pprint", "random",
           "shutil", "subprocess", "tarfile", "zipfile", "uuid", "pydoc", "optparse", "ntpath", "copy", "codecs",
           "ast", "dis", "pickle", "ftplib", "imaplib", "smtplib", "http.cookies", "email.message", "wave",
           "aifc", "sched", "netrc", "plistlib", "selectors", "trace", "cmd", "code", "dataclasses", "enum",
           "sre_parse", "sre_compile", "gzip", "lzma", "bz2", "mailbox", "nturl2path", "pstats", "tabnanny",
           "traceback", "tracemalloc", "unittest.case", "unittest.mock", "xml.dom.minidom",
           "xml.etree.ElementTree", "zipapp", "asyncio.base_events", "asyncio.streams", "logging", "logging.handlers",
           "email._header_value_parser", "http.client", "http.server", "urllib.request", "wsgiref.handlers")
SESSIONS = 96
PER_MODULE = 3
LINES = (8, 50)
FENCE = "```"

SYSTEM = f"""You are a coding agent working in a checkout of the CPython repository. You fix bugs with tools.

Tools, one call per reply, written on a line of its own:
- search("pattern"): the lines of the repository matching the pattern, with file and line number.
- read_file("path", start, end): the file's lines from start to end, numbered.
- edit_file("path", line, "new text"): replace one line of the file with new text.

Reply with a short thought and one tool call, as:
Thought: what you will do and why.
Action: tool(arguments)

When the bug is fixed, reply with the whole corrected function in one {FENCE}python code block and a
one-line summary of the change."""


def candidates():
    """(module file as shown, source lines, function node, bug line index, bad, good) of
    public functions and methods of ``LINES`` lines holding a strict comparison, in a fixed order."""
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        path = Path(module.__file__)
        shown = "Lib/" + path.as_posix().split("/lib/python3.11/", 1)[-1]
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        taken = 0
        tree = ast.parse(source)
        for node in tree.body + [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]:
            if taken >= PER_MODULE:
                break
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            if not LINES[0] <= node.end_lineno - node.lineno + 1 <= LINES[1]:
                continue
            compares = sorted(c.lineno for c in ast.walk(node) if isinstance(c, ast.Compare)
                              and c.lineno == c.end_lineno and any(isinstance(o, (ast.Lt, ast.Gt)) for o in c.ops))
            for index in (n - 1 for n in compares):
                line = lines[index]
                pair = next(((r, w) for r, w in ((" < ", " <= "), (" > ", " >= ")) if r in line), None)
                if pair:
                    yield shown, lines, node, index, line.replace(pair[0], pair[1], 1), line
                    taken += 1
                    break


def numbered(lines: list[str], start: int, end: int) -> str:
    """Lines ``start``..``end`` (1-based, inclusive) as ``cat -n`` prints them."""
    return "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1))


def session(shown: str, lines: list[str], node: ast.FunctionDef, index: int, bad: str, good: str) -> list[dict]:
    name, first, last = node.name, node.lineno, node.end_lineno
    buggy = lines[:index] + [bad] + lines[index + 1:]
    hits = [f"{shown}:{n}:{text}" for n, text in enumerate(buggy, 1) if name in text][:10]
    tail = min(len(buggy), last + 3)
    fixed_from, fixed_to = max(first, index - 2), min(last, index + 4)
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task: `{name}` in `{shown}` gives wrong results at a boundary: "
                                    f"a comparison in it lets one case too many through. Find the bug and fix it."},
        {"role": "assistant", "content": f"Thought: I need to find where `{name}` is defined.\n"
                                         f"Action: search(\"def {name}\")"},
        {"role": "user", "content": "Observation:\n" + "\n".join(hits)},
        {"role": "assistant", "content": f"Thought: `{name}` is defined at line {first} of {shown}; I will read "
                                         f"the whole function.\nAction: read_file(\"{shown}\", {first}, {tail})"},
        {"role": "user", "content": "Observation:\n" + numbered(buggy, first, tail)},
        {"role": "assistant", "content": f"Thought: line {index + 1} reads `{bad.strip()}`; the comparison should "
                                         f"be strict.\nAction: edit_file(\"{shown}\", {index + 1}, "
                                         f"{json.dumps(good)})"},
        {"role": "user", "content": f"Observation: {shown} line {index + 1} replaced. Lines {fixed_from} to "
                                    f"{fixed_to} now read:\n" + numbered(lines, fixed_from, fixed_to)},
    ]


def main() -> None:
    target = Path(__file__).resolve().parents[1] / "src/racer/bench/data/agent_sessions.jsonl"
    written = 0
    with open(target, "w", encoding="utf-8") as out:
        for found in candidates():
            if written == SESSIONS:
                break
            record = {"question_id": f"session-{written}", "category": "fix_bug", "messages": session(*found)}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    if written < SESSIONS:
        raise SystemExit(f"only {written} functions found; widen MODULES")
    print(f"{target}: {written} sessions (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
