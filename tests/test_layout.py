"""The layout of docs/layout.md holds: which package imports which, the core's short argument
lists, and the config ending at the top of the run. Read from the source with `ast`."""

import ast
from pathlib import Path

import pytest
from conftest import REPO

SRC = REPO / "src" / "engine"
LAYERS = ("core", "guards", "launch", "tools")
# What each layer may not import (docs/layout.md's table); the leaves are src/*.py.
E = "src.engine"
FORBIDDEN = {
    "leaf": {
        f"{E}.core",
        f"{E}.guards",
        f"{E}.launch",
        f"{E}.tools",
        f"{E}.run",
        f"{E}.build",
    },
    "core": {
        f"{E}.guards",
        f"{E}.launch",
        f"{E}.tools",
        f"{E}.run",
        f"{E}.build",
        "hydra",
        "omegaconf",
    },
    "guards": {f"{E}.launch", f"{E}.tools", f"{E}.run", f"{E}.build"},
    "tools": {f"{E}.guards", f"{E}.launch", f"{E}.run"},
    "launch": {
        f"{E}.core",
        f"{E}.guards",
        f"{E}.tools",
        f"{E}.run",
        f"{E}.build",
    },
}
# The exceptions the table names: the leaves may import the core's contracts (the task, the
# training state), which import nothing of the template; debug=equivalence is an entry point
# (train.py runs it with the config) that builds runs as src/engine/run.py does, processes included.
ALLOWED = {
    "leaf": {f"{E}.core.state", f"{E}.core.task"},
    "tools/equivalence.py": {
        f"{E}.build",
        f"{E}.launch",
        f"{E}.launch.process",
        f"{E}.guards",
    },
}
# Where the composed config is read: the top of the run (run.py, and build.py for the classes its
# groups name), settings.py (which turns it into typed settings), the launcher (which hands it to
# the processes it starts), debug=equivalence (an entry point, as train.py is), and the two Hydra
# callbacks, which Hydra hands it. Below them only typed settings travel.
READS_THE_CONFIG = {
    "run.py",
    "build.py",
    "settings.py",
    "launch/__init__.py",
    "tools/equivalence.py",
    "tools/sweep.py",
    "storage.py",
}
MAX_PARAMETERS = 5  # the core's functions: a run context and a training state, not long lists


def layer(path: Path) -> str:
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 and parts[0] in LAYERS else "leaf"


def imported(tree: ast.Module) -> set[str]:
    """The modules a file imports at its top level or in functions (not those imported only
    for annotations, under `if TYPE_CHECKING`)."""
    names: set[str] = set()
    checking = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    ]
    hidden = {id(n) for block in checking for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)


@pytest.mark.unit
@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_each_module_imports_only_what_its_layer_may(path):
    name = str(path.relative_to(SRC))
    if name in ("run.py", "build.py"):  # the composition root imports everything
        return
    kind = layer(path)
    allowed = ALLOWED.get(kind, set()) | ALLOWED.get(name, set())
    wrong = sorted(
        module
        for module in imported(ast.parse(path.read_text()))
        if module not in allowed
        and any(module == f or module.startswith(f + ".") for f in FORBIDDEN[kind])
        and not any(module == a or module.startswith(a + ".") for a in allowed)
    )
    assert not wrong, f"src/{name} ({kind}) imports {wrong}: see docs/layout.md"


@pytest.mark.unit
def test_the_core_takes_short_argument_lists_and_no_config():
    for path in sorted((SRC / "core").glob("*.py")):
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
        for path in modules()
        if "DictConfig" in path.read_text() or "omegaconf" in imported(ast.parse(path.read_text()))
    }
    assert readers <= READS_THE_CONFIG, f"{sorted(readers - READS_THE_CONFIG)} read the config"
