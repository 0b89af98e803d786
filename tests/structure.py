"""What a reader meets, counted (docs/layout.md, "The way to `optimizer.step()`"): the functions of
train.py and src/ that a real run enters on its way to its first optimizer step, and, read with
`ast` and `tokenize`, the engine's lines, the strategy protocol's members and the hooks' points.

    python tests/structure.py OUT.json train.py OVERRIDES...   # under torchrun too: rank 0 writes

runs train.py in this process, traced, and writes OUT.json at its first optimizer step."""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import json
import os
import re
import runpy
import sys
import threading
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
ENGINE = SRC / "engine"
# Where each way starts: the entry of app.py's main, and of the loop's fit.
STARTS = {"main": ("src/engine/app.py", "main"), "loop": ("src/engine/core/loop.py", "fit")}


@functools.cache
def code_lines(file: str) -> frozenset[int]:
    """The lines of `file` (from the repository root) with code on them: not blank, not only a
    comment, no line of a docstring (a module's, a class's or a function's first string)."""
    source = (REPO / file).read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        if isinstance(node, documented) and ast.get_docstring(node) is not None:
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    no_code = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (*no_code, tokenize.ENDMARKER):
            code.update(range(token.start[0], token.end[0] + 1))
    return frozenset(code - docstrings)


@functools.cache
def functions(file: str) -> dict[tuple[str, int], range]:
    """Each `def` of `file` by its name and first line (its first decorator's, as a code object
    has it), with the lines it spans."""
    found = {}
    for node in ast.walk(ast.parse((REPO / file).read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found[(node.name, first)] = range(first, node.end_lineno + 1)
    return found


def own_file(filename: str) -> str | None:
    """`filename` from the repository root where it is train.py or in src/, else None."""
    path = Path(filename)
    if path == REPO / "train.py" or SRC in path.parents:
        return str(path.relative_to(REPO))
    return None


@contextlib.contextmanager
def traced(out: Path) -> Iterator[None]:
    """Trace this process to its first optimizer step, then write to `out` (rank 0's, under
    torchrun) the figures of each way of STARTS: the functions of train.py and src/ entered from its
    start (a `def`: not a lambda, a comprehension, a class's or a module's body)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import src.engine.app  # noqa: F401 - imported untraced (the count starts at main): faster

    entered: dict[str, dict[tuple, None]] = {way: {} for way in STARTS}
    began: set[str] = set()
    known: dict = {}  # a code object: its (file, name, first line), or None if not ours

    def called(frame, event, arg):  # the global trace function: called at each call only
        code = frame.f_code
        if code not in known:
            file = own_file(code.co_filename)
            ours = file and (code.co_name, code.co_firstlineno) in functions(file)
            known[code] = (file, code.co_qualname, code.co_firstlineno) if ours else None
        if (function := known[code]) is None:
            return
        began.update(way for way, start in STARTS.items() if start == function[:2])
        for way in began:
            entered[way].setdefault(function)

    def stop(optimizer, args, kwargs):
        sys.settrace(None)
        threading.settrace(None)
        handle.remove()
        if os.environ.get("RANK", "0") == "0":
            ways = {way: figures(list(found)) for way, found in entered.items()}
            out.write_text(json.dumps(ways, indent=1))

    handle = register_optimizer_step_pre_hook(stop)
    threading.settrace(called)
    sys.settrace(called)
    try:
        yield
    finally:
        sys.settrace(None)
        threading.settrace(None)
        handle.remove()


def figures(entered: list[tuple[str, str, int]]) -> dict:
    """Files, functions and code lines (each line once, however many entered functions span it)
    of what a way entered, and each file's functions."""
    lines: dict[str, set[int]] = {}
    by_file: dict[str, list[str]] = {}
    for file, name, first in entered:
        span = functions(file)[(name.rpartition(".")[2], first)]
        lines.setdefault(file, set()).update(code_lines(file) & set(span))
        by_file.setdefault(file, []).append(name)
    return {
        "files": len(by_file),
        "functions": len(entered),
        "lines": sum(map(len, lines.values())),
        "by_file": {file: sorted(names) for file, names in sorted(by_file.items())},
    }


# What a reader is not charged for: a refusal (`raise`, `refuse...(...)`, `sys.exit("...")`) and a
# log call are a sentence each, which helps; so are the docstrings and comments code_lines drops.
LEVELS = ("debug", "info", "warning", "error", "exception", "critical", "warn")


def said(statement: ast.stmt) -> bool:
    """Whether `statement` is a refusal or a log call."""
    if isinstance(statement, ast.Raise):
        return True
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return False
    called = ast.unparse(statement.value.func)
    logs = re.fullmatch(rf"(log|logging|warnings)\.({'|'.join(LEVELS)})", called)
    words = [a for a in statement.value.args if isinstance(a, ast.Constant | ast.JoinedStr)]
    message = called == "sys.exit" and bool(words)
    return bool(logs or message or called.rpartition(".")[2].startswith("refuse"))


def engine_lines() -> int:
    """src/engine/'s code lines (code_lines), less those of its refusals and log calls."""
    total = 0
    for path in sorted(ENGINE.rglob("*.py")):
        file = str(path.relative_to(REPO))
        spoken = {
            line
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.stmt) and said(node)
            for line in range(node.lineno, node.end_lineno + 1)
        }
        total += len(code_lines(file) - spoken)
    return total


def src_lines() -> int:
    """All the lines of src/'s Python files, as `wc -l` counts them."""
    return sum(path.read_text().count("\n") for path in SRC.rglob("*.py"))


def class_bodies() -> dict[str, tuple[list[str], ast.ClassDef]]:
    """Every class of src/, by name: its bases' names and its node."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found[node.name] = ([ast.unparse(b).rpartition(".")[2] for b in node.bases], node)
    return found


def members(node: ast.ClassDef) -> list[str]:
    """The public names a class's body declares: its fields, class variables and methods."""
    names = []
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            names.append(item.name)
        elif isinstance(item, ast.AnnAssign | ast.Assign):
            targets = [item.target] if isinstance(item, ast.AnnAssign) else item.targets
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [name for name in names if not name.startswith("_")]


def strategy_members() -> list[str]:
    """What a mode's author reads on `Strategy` (src/engine/parallel/__init__.py): each public name
    it declares (PROTOCOL's, which a strategy must have, and its `section`)."""
    return members(class_bodies()["Strategy"][1])


def hook_points() -> dict[str, list[str]]:
    """Each point of core/context.py's Hook, with the classes of src/ (Hook's subclasses, however
    deep) that override it."""
    classes = class_bodies()

    def is_hook(name: str) -> bool:
        bases = classes.get(name, ([], None))[0]
        return any(base == "Hook" or is_hook(base) for base in bases)

    hooks = {name: members(node) for name, (_, node) in classes.items() if is_hook(name)}
    points = members(classes["Hook"][1])
    return {point: sorted(n for n, own in hooks.items() if point in own) for point in points}


if __name__ == "__main__":
    out, script = (Path(arg).resolve() for arg in sys.argv[1:3])
    # As `python train.py ARGS` has them: torchrun's workers exit at the run's end, past `with`.
    sys.argv, sys.path[0] = [str(script), *sys.argv[3:]], str(script.parent)
    with traced(out):
        runpy.run_path(str(script), run_name="__main__")
