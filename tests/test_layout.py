"""The layout of docs/layout.md holds: the engine's layers (each module imports only from the
layers below its own), no two modules importing each other (annotations included), the core's
short argument lists, and the config ending at the top of the run, read from the source with
`ast`; and the budgets that count structure, each figure under a ceiling that only goes down: the
way a real run takes to its first optimizer step (traced), the engine's size, the strategy
protocol and the hooks' points (tests/structure.py counts them)."""

import ast
import json
import sys
from pathlib import Path

import pytest
import structure
from conftest import REPO, defaults_for_tests, make_dataset, offline_env, ok, run, run_train_py_here

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
    ["entry"],
    ["app"],
]
LAYER = {part: number for number, parts in enumerate(LAYERS) for part in parts}
# Where the composed config is read: the top of the run (app.py, and build.py for the classes its
# groups name), config.py (which turns it into typed settings), errors.py (a node built into a
# dataclass, its mistakes told), the launcher (which hands it to the processes it starts),
# debug=equivalence (an entry point, as train.py is), and the two Hydra callbacks, which Hydra
# hands it. Below them only typed settings travel.
READS_THE_CONFIG = {
    "engine/build.py",
    "engine/config.py",
    "engine/errors.py",
    "engine/launch/__init__.py",
    "engine/tools/equivalence.py",
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
    if module == "src.engine.tools.equivalence":  # an entry point, as app.train: app.py calls it
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


# Budgets that count structure (docs/layout.md, "The way to `optimizer.step()`"; issue 57): each
# figure as measured on 2026-12-08 is its ceiling, which may only go down (lower it as the engine
# meets its target, written beside it). What the run counts: tests/structure.py.
LOOP_FILES = 7  # the loop's way to the first step, parallel=none: target 8 files
LOOP_FILES_DDP = 7  # the same, parallel=ddp on 2 processes: target 9 files
MAIN_FILES, MAIN_FUNCTIONS = 18, 119  # main to the first step, set-up included: target 18, 120
ENGINE_LINES = 3781  # src/engine/'s code lines, refusals and log calls left out: target 3,400
SRC_LINES = 6870  # src/**/*.py, every line (wc -l): target 6,268
STRATEGY_MEMBERS = 11  # the public names Strategy declares: target 12
LONE_POINTS = 0  # the hooks' points with a single implementer: target 0
# A run that reaches its first step fast, on tiny data of its own: a first run's way (the splits
# decoded, and cached beside them) every time. No wandb: its start waits on a timeout.
TRACED = ["logger=none", "trainer.max_steps=1"]


def traced(tmp_path: Path, nproc: int | None = None, *overrides: str) -> dict:
    """The figures of the ways to the first optimizer step of train.py with `overrides`, traced
    in this process (parallel=none) or, with `nproc`, in torchrun's rank 0."""
    out, data = tmp_path / "structure.json", make_dataset(tmp_path / "data")
    args = [f"data.root={data}", *TRACED, *overrides, *defaults_for_tests(list(overrides))]
    command = [sys.executable, str(REPO / "train.py"), *args, f"paths.log_dir={tmp_path}/outputs"]
    if nproc is None:  # here whatever TESTS_IN_SUBPROCESSES says: the tracer is this process's
        with structure.traced(out):
            ok(run_train_py_here(command, tmp_path, offline_env()))
    else:  # tests/structure.py runs train.py in each worker, traced
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        script = [*launcher, str(REPO / "tests/structure.py"), str(out)]
        ok(run([sys.executable, *script, *command[1:]], tmp_path))
    assert out.exists(), "the run made no optimizer step"
    return json.loads(out.read_text())


def shown(way: dict) -> str:
    """A way's figures and the functions it entered, file by file."""
    files = "\n".join(f"  {f}: {', '.join(names)}" for f, names in way["by_file"].items())
    return f"{way['files']} files, {way['functions']} functions, {way['lines']} lines:\n{files}"


def test_the_way_to_the_first_optimizer_step_reads_in_a_few_files(tmp_path):
    ways = traced(tmp_path)
    loop, main = ways["loop"], ways["main"]
    assert "src/engine/core/loop.py" in loop["by_file"], shown(loop)  # the tracer saw the loop
    assert loop["files"] <= LOOP_FILES, shown(loop)
    assert main["files"] <= MAIN_FILES and main["functions"] <= MAIN_FUNCTIONS, shown(main)


@pytest.mark.slow
def test_the_way_to_the_first_optimizer_step_under_ddp_reads_in_a_few_files(tmp_path):
    loop = traced(tmp_path, 2, "parallel=ddp")["loop"]
    assert "src/engine/core/loop.py" in loop["by_file"], shown(loop)
    assert loop["files"] <= LOOP_FILES_DDP, shown(loop)


@pytest.mark.unit
def test_the_engine_stays_within_its_size():
    assert (lines := structure.engine_lines()) <= ENGINE_LINES, f"src/engine/: {lines} code lines"
    assert (lines := structure.src_lines()) <= SRC_LINES, f"src/: {lines} lines"


@pytest.mark.unit
def test_the_strategy_protocol_and_the_hooks_stay_small():
    members = structure.strategy_members()
    assert len(members) <= STRATEGY_MEMBERS, members
    lone = {point: by for point, by in structure.hook_points().items() if len(by) < 2}  # 1 or 0
    assert len(lone) <= LONE_POINTS, lone
