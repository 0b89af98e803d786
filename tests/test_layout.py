"""The layout of docs/layout.md holds: the engine's layers (each module imports only from the
layers below its own), no two modules importing each other (annotations included), the core's
short argument lists, and the config ending at the top of the run. Read from the source with
`ast`."""

import ast
import functools
import io
import tokenize
from pathlib import Path

import pytest
from conftest import REPO

SRC = REPO / "src"
ENGINE = SRC / "engine"
# docs/layout.md's table, from the bottom up: a module imports only from a lower layer, or from
# its own package. The fork's files (src/*.py) sit above the core and below the guards; app.py
# (train.py's main, and a script's of your own) is the top.
LAYERS = [
    ["errors"],
    ["launch"],
    ["parallel"],
    ["storage"],
    ["config"],
    ["data", "logger", "checkpoint"],
    ["core"],
    ["fork"],
    ["guards"],
    ["tools"],
    ["build"],
    ["run", "entry"],
    ["app"],
]
LAYER = {part: number for number, parts in enumerate(LAYERS) for part in parts}
# Where the composed config is read: the top of the run (run.py, and build.py for the classes its
# groups name), config.py (which turns it into typed settings), errors.py (a node built into a
# dataclass, its mistakes told), the launcher (which hands it to the processes it starts),
# debug=equivalence (an entry point, as train.py is), and the two Hydra callbacks, which Hydra
# hands it. Below them only typed settings travel.
READS_THE_CONFIG = {
    "engine/run.py",
    "engine/build.py",
    "engine/config.py",
    "engine/errors.py",
    "engine/launch/__init__.py",
    "engine/tools/equivalence.py",
    "engine/tools/sweep.py",
    "engine/tools/presets.py",  # a Hydra callback, as sweep.py's: Hydra hands it the config
    "engine/storage.py",
    "engine/app.py",  # the command line's jobs: each config Hydra composed, to run or launch
}
MAX_PARAMETERS = 5  # the core's functions: a run context and a training state, not long lists


def part(module: str) -> str:
    """The layer's name of a dotted module of the package (src.engine.core.loop: core)."""
    names = module.split(".")
    if len(names) == 1:  # src/__init__.py
        return "engine"
    if names[1] != "engine":
        return "fork"
    if module == "src.engine.tools.equivalence":  # an entry point, as run.py: app.py calls it
        return "entry"
    return names[2] if len(names) > 2 else "engine"


def imported(tree: ast.Module, annotations: bool = True) -> set[str]:
    """The modules a file imports, at its top level or in functions, and those it imports for
    its annotations only (under `if TYPE_CHECKING`) where `annotations`."""
    checking = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    ]
    hidden = set() if annotations else {id(n) for block in checking for n in ast.walk(block)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def modules() -> dict[str, Path]:
    """Every module of the package `src`, by its dotted name."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        names = path.relative_to(REPO).with_suffix("").parts
        found[".".join(names[:-1] if names[-1] == "__init__" else names)] = path
    return found


MODULES = modules()


def engine_imports(path: Path) -> set[str]:
    """The modules of the package `src` that `path` imports (a name imported from a module is
    the module)."""
    found = set()
    for name in imported(ast.parse(path.read_text())):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


@pytest.mark.unit
@pytest.mark.parametrize("module", sorted(MODULES), ids=str)
def test_each_module_imports_only_from_the_layers_below_its_own(module):
    own = part(module)
    if own in ("engine",):  # src/engine/__init__.py, src/__init__.py: nothing
        return
    wrong = sorted(
        name
        for name in engine_imports(MODULES[module])
        if part(name) != own and part(name) != "engine" and LAYER[part(name)] >= LAYER[own]
    )
    assert not wrong, f"{module} (layer {own}) imports {wrong}: see docs/layout.md"


@pytest.mark.unit
def test_no_modules_import_each_other():
    """No circle, however long, and annotations' imports count: a reader can take the modules in
    one order, each knowing only those before it."""
    graph = {name: engine_imports(path) - {name} for name, path in MODULES.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError(
                f"a circle of imports: {' -> '.join([*path[path.index(name) :], name])}"
            )
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.unit
def test_the_core_takes_short_argument_lists_and_no_config():
    for path in sorted((ENGINE / "core").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args
                names = [a.arg for a in arguments.posonlyargs + arguments.args]
                names += [a.arg for a in arguments.kwonlyargs]
                count = len([n for n in names if n not in ("self", "cls")])
                where = f"src/engine/core/{path.name}: {node.name}"
                assert count <= MAX_PARAMETERS, f"{where} takes {count} parameters"
        assert "DictConfig" not in path.read_text(), f"src/engine/core/{path.name} reads the config"


@pytest.mark.unit
def test_the_config_ends_at_the_top_of_the_run():
    readers = {
        str(path.relative_to(SRC))
        for path in MODULES.values()
        if "DictConfig" in path.read_text() or "omegaconf" in imported(ast.parse(path.read_text()))
    }
    assert readers <= READS_THE_CONFIG, f"{sorted(readers - READS_THE_CONFIG)} read the config"


# What a reader follows to one optimizer step: the call stack at `optimizer.step()` (app.py's job,
# which train.py's main runs → run.train → fit → train_epoch → train_step), and each function of the
# engine that the loop's three call on the way there, before the first step (a property read counts;
# a Protocol's `...` does not: the fork's task is what runs). The set-up train() calls before fit
# (building the model, the data, the parts) is read when a reader wants it. It counts code lines:
# a docstring, a comment or a blank line is none (they help the reader; never trim one to fit).
STACK = [
    ("src/engine/app.py", "job", "train"),
    ("src/engine/run.py", "train", "fit"),
    ("src/engine/core/loop.py", "fit", "train_epoch"),
    ("src/engine/core/loop.py", "train_epoch", "train_step"),
    ("src/engine/core/loop.py", "train_step", "step"),  # scaler.step(optimizer)
]
# The classes the loop holds (run, its hooks, strategy, data and trainer; the training state):
# where a method's name is defined in several classes, theirs is the one the loop calls.
HELD = (
    "Run",
    "Hooks",
    "Strategy",
    "Data",
    "Trainer",
    "Progress",
    "Schedule",
    "Best",
    "Checkpointer",
)


def definitions() -> dict[str, list[tuple[str, str, ast.FunctionDef]]]:
    """Every function and method of train.py and src/, by name: (file, class or "", node)."""
    found: dict[str, list] = {}
    for path in [REPO / "train.py", *MODULES.values()]:
        for node in ast.parse(path.read_text()).body:
            owned = [(n, node.name) for n in node.body] if isinstance(node, ast.ClassDef) else []
            for n, owner in owned or [(node, "")]:
                if isinstance(n, ast.FunctionDef):
                    found.setdefault(n.name, []).append((str(path.relative_to(REPO)), owner, n))
    return found


def before(node: ast.AST, callee: str) -> tuple[list[ast.AST], bool]:
    """What `node`'s body runs up to its call of `callee`, in order (a compound statement's head,
    then its body), and whether that call was reached."""
    taken = []
    for statement in getattr(node, "body", []):
        compound = isinstance(getattr(statement, "body", None), list)
        heads = [v for k, v in ast.iter_fields(statement) if k not in ("body", "orelse")]
        for head in heads:  # a loop's target and iterator, a with's context managers, an if's test
            taken += [
                h for h in (head if isinstance(head, list) else [head]) if isinstance(h, ast.AST)
            ]
        if not compound:
            taken.append(statement)
        calls = [c for c in ast.walk(statement) if isinstance(c, ast.Call)]
        if any(getattr(c.func, "id", getattr(c.func, "attr", None)) == callee for c in calls):
            taken += before(statement, callee)[0] if compound else []
            return taken, True
        exits = compound and isinstance(statement.body[-1], ast.Return | ast.Raise)
        if compound and not exits:  # an early exit (nothing left to train) is no way to a step
            taken += before(statement, callee)[0]
    return taken, False


def lines(file: str, node: ast.FunctionDef) -> int:
    """The code lines of a function, its decorators included."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return len([n for n in code_lines(file) if first <= n <= node.end_lineno])


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


@pytest.mark.unit
def test_the_way_to_an_optimizer_step_reads_in_a_few_files():
    found = definitions()
    followed = {}
    for file, name, callee in STACK:
        (node,) = [n for f, _, n in found[name] if f == file]
        followed[(file, name)] = node
        if not file.endswith("loop.py"):
            continue
        for statement in before(node, callee)[0]:
            for sub in ast.walk(statement):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
                    used, kind = sub.func.id, "function"
                elif isinstance(sub, ast.Call):
                    used, kind = getattr(sub.func, "attr", None), "method"
                elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load):
                    used, kind = sub.attr, "property"
                else:
                    continue
                for f, owner, n in found.get(used, []):
                    decorators = [getattr(d, "id", None) for d in n.decorator_list]
                    stub = len(n.body) == 1 and isinstance(n.body[0], ast.Expr)  # a Protocol's ...
                    if stub or ("property" in decorators) != (kind == "property"):
                        continue
                    if (kind == "function") == (not owner) and (not owner or owner in HELD):
                        followed.setdefault((f, f"{owner}.{n.name}" if owner else n.name), n)
                        break
    total = sum(lines(f, n) for (f, _), n in followed.items())
    files = sorted({f for f, _ in followed})
    shown = "\n".join(f"{lines(f, n):4d} {f}:{name}" for (f, name), n in sorted(followed.items()))
    assert total <= 200 and len(files) <= 6, f"{total} lines over {len(files)} files:\n{shown}"
