"""Write ``src/racer/bench/data/code_edit.jsonl``: code-editing requests over real
functions of CPython's standard library (PSF License 2.0), each an instruction whose
answer rewrites most of the code it carries: add type hints, add a docstring, rename a
local variable, fix a bug planted in one comparison. Run with the CPython the data
README names (the functions are read from its ``Lib``):

    python scripts/make_code_edit.py
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
import textwrap
from pathlib import Path

MODULES = ("textwrap", "shlex", "fnmatch", "heapq", "bisect", "colorsys", "calendar", "difflib", "statistics",
           "string", "html", "glob", "posixpath", "base64", "quopri", "gettext", "tokenize", "ipaddress",
           "fractions", "locale", "mimetypes", "urllib.parse", "email.utils", "json.decoder")
PER_TASK = 12
LINES = (10, 40)
FENCE = "```"
REPLY = f" Reply with the whole function in one {FENCE}python code block and nothing else."


def functions():
    """(module, name, source without its docstring, tree) of top-level functions of
    ``LINES`` lines, in a fixed order."""
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        source = Path(module.__file__).read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
                continue
            if node.args.args and any(a.annotation for a in node.args.args) or node.returns:
                continue
            text = ast.get_source_segment(source, node)
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines = text.splitlines()
                start, end = body[0].lineno - node.lineno, body[0].end_lineno - node.lineno
                if end + 1 >= len(lines):
                    continue
                text = "\n".join(lines[:start] + lines[end + 1 :])
            text = textwrap.dedent(text)
            if LINES[0] <= len(text.splitlines()) <= LINES[1]:
                yield module_name, node.name, text, ast.parse(text).body[0]


def local_name(tree: ast.FunctionDef) -> str | None:
    params = {a.arg for a in tree.args.args + tree.args.kwonlyargs}
    stored = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    uses = {name: sum(isinstance(n, ast.Name) and n.id == name for n in ast.walk(tree)) for name in stored}
    picks = [name for name in dict.fromkeys(stored) if name not in params and len(name) >= 2 and uses[name] >= 3]
    return picks[0] if picks else None


def planted_bug(text: str) -> tuple[str, str, str] | None:
    """The function with its first strict comparison made non-strict: (buggy text,
    the wrong expression's line, the right one)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for right, wrong in ((" < ", " <= "), (" > ", " >= ")):
            if right in line and not line.lstrip().startswith("#"):
                bad = line.replace(right, wrong, 1)
                return "\n".join(lines[:i] + [bad] + lines[i + 1 :]), bad.strip(), line.strip()
    return None


def main() -> None:
    out = {"type_hints": [], "docstring": [], "rename": [], "fix_bug": []}
    for module, name, text, tree in functions():
        code = f"{FENCE}python\n{text}\n{FENCE}"
        where = f"`{name}` (from Python's `{module}` module)"
        if len(out["type_hints"]) < PER_TASK and len(out["type_hints"]) <= len(out["docstring"]):
            out["type_hints"].append(f"Add type hints to every parameter and the return value of {where}."
                                     f"{REPLY}\n\n{code}")
        elif len(out["docstring"]) < PER_TASK:
            out["docstring"].append(f"Add a docstring to {where} that says what it does, its parameters and what "
                                    f"it returns.{REPLY}\n\n{code}")
        old = local_name(tree)
        if old and len(out["rename"]) < PER_TASK:
            out["rename"].append(f"Rename the local variable `{old}` to `{old}_value` everywhere in {where}; change "
                                 f"nothing else.{REPLY}\n\n{code}")
            continue
        bug = planted_bug(text)
        if bug and len(out["fix_bug"]) < PER_TASK:
            buggy, bad, good = bug
            out["fix_bug"].append(f"{where} has a bug: the line `{bad}` should be `{good}`. Fix it and change "
                                  f"nothing else.{REPLY}\n\n{FENCE}python\n{buggy}\n{FENCE}")
    target = Path(__file__).resolve().parents[1] / "src/racer/bench/data/code_edit.jsonl"
    with open(target, "w", encoding="utf-8") as lines:
        for category, prompts in out.items():
            for i, prompt in enumerate(prompts):
                record = {"question_id": f"{category}-{i}", "category": category, "turns": [prompt]}
                lines.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{target}: {', '.join(f'{k} {len(v)}' for k, v in out.items())} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
