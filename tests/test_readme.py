"""Every training command the README and its pages (docs/*.md, bench/README.md) show runs as
written, on tiny data for a few steps; the README stays the door to those pages.

The set-up commands (pip, apt-get), `pytest` itself and writing Fashion-MNIST as an image folder
are run by .ci/run, the benchmarks by tests/test_bench.py (bench/memory.py and bench/startup.py
too) and tests/test_scaling.py.
"""

import re
import shlex
import sys
import time

import pytest
from conftest import (
    DOCUMENTS,
    REPO,
    defaults_for_tests,
    mode_command,
    offline_env,
    ok,
    read_metrics,
    readme_commands,
    run,
    write_image_folder,
)
from hydra import compose, initialize_config_dir
from test_equivalence import MODES as FLOAT32_MODES
from test_float64 import MODES as FLOAT64_MODES

RUNS = ("python train.py", "torchrun ", "WANDB_MODE=", "python -m torch.distributed.launch")
SLOW_COMMANDS = ("_fast", "torch.distributed.launch")
SET_UP = ("pip install", "apt-get install", "pytest", "wandb sync", "python bench/run.py",
          "python bench/write_image_folder.py", "python bench/scaling.py",
          "python bench/memory.py", "python bench/startup.py")  # fmt: skip


@pytest.mark.unit
def test_readme_commands_are_all_known():
    """A command the README or its pages show is either run below or by .ci/run."""
    commands = readme_commands()
    assert {
        "python train.py",
        "python train.py parallel=dp",
        "pytest",
        "torchrun --nproc_per_node=4 train.py parallel=ddp",
        "python train.py -m optimizer.lr=0.1,0.01 model=mlp,cnn",
    } <= set(commands)
    unknown = [c for c in commands if not c.startswith(RUNS + SET_UP)]
    assert not unknown, f"README commands no test runs: {unknown}"


@pytest.mark.unit
def test_the_readme_is_the_door_and_the_docs_hold_the_depth():
    """The README shows the quick start, the launch lines, the outputs and the layout itself, in at
    most 300 lines, and links each page of docs/, where the depth went."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, f"{len(readme.splitlines())} lines: move depth to docs/"
    sections = {"Quickstart", "Launching", "Make it your project", "Layout", "Tests",
                "Outputs, checkpoints and resuming"}  # fmt: skip
    assert sections <= set(re.findall(r"^## (.+)$", readme, re.M))
    shown = "".join(re.findall(r"```bash\n(.*?)```", readme, re.S))
    door = ["pip install -r requirements.txt && python train.py", "python train.py parallel=dp",
            "torchrun --nproc_per_node=4 train.py parallel=ddp", "python train.py parallel=fsdp",
            "python train.py -m optimizer.lr=0.1,0.01 model=mlp,cnn",
            "python train.py debug=fast"]  # fmt: skip
    missing = [c for c in door if c not in shown]
    assert not missing, f"the README's own blocks lack {missing}"
    unlinked = [p.name for p in (REPO / "docs").glob("*.md") if f"](docs/{p.name}" not in readme]
    assert not unlinked, f"pages the README does not link: {unlinked}"


def anchors(page) -> set[str]:
    """The anchors GitHub gives the headings of a page (code blocks left out)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.unit
def test_every_link_between_the_pages_leads_to_a_file_and_heading():
    """A relative link of the README or its pages names a file that exists and, after `#`, one of
    its headings: depth moved from one page to another keeps the links to it."""
    broken = []
    for page in DOCUMENTS:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            name, _, anchor = target.partition("#")
            if "://" in name:
                continue
            path = (page.parent / name) if name else page
            if not path.exists() or (anchor and anchor not in anchors(path)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def run_readme_command(command: str, tmp_path, tiny_data) -> None:
    words = shlex.split(command)
    env = offline_env(HOME=str(tmp_path))  # wandb, if used, goes offline without asking
    while "=" in words[0]:  # VAR=value before the command
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] == "python":
        words[0] = sys.executable
    root = tiny_data
    if "data=image_folder" in words:  # a folder of PNG files instead of IDX files
        root = write_image_folder(tmp_path / "images", {"a": 40, "b": 40, "c": 40}, (28, 28), "L")
    # debug=overfit's verdict needs its 200 steps (on one batch: two seconds).
    words += [f"data.root={root}", f"paths.log_dir={tmp_path}/outputs"]
    words += [] if "debug=overfit" in words else ["trainer.max_steps=2"]
    words += defaults_for_tests(words)  # a validation split the tiny data holds; no pictures
    ok(run(words, cwd=REPO, env=env, timeout=300))
    runs = [p.parent for p in (tmp_path / "outputs").rglob("metrics.jsonl")]
    assert runs and all(read_metrics(r)[1] for r in runs), "every run evaluated"


# The checkpoint commands build on each other (the run in my-run, then its checkpoints).
SEQUENCE = [c for c in readme_commands() if "my-run" in c]
# One command per machine: tests/test_equivalence.py runs it as two agents here.
MACHINES = [c for c in readme_commands() if "$HEAD_NODE" in c]
SLURM = [c for c in readme_commands() if "hydra/launcher=slurm" in c]  # needs a SLURM cluster
# Commands that the tests of what they do run as written, on the tiny data, and check in depth:
# - tests/test_debug_equivalence.py reads these tables;
EQUIVALENCE = ["python train.py debug=equivalence", "python train.py debug=equivalence model=cnn"]
# - tests/test_equivalence.py and tests/test_float64.py train each of their modes (as a command:
#   `mode_command`) with their recipe added, and compare their sums (the one-process modes, run in
#   the test's process, cost little and are run here too);
MODE_LAUNCHES = [*FLOAT32_MODES.values(), *((o, n) for o, n, _ in FLOAT64_MODES.values())]
LAUNCHED = {mode_command(overrides, nproc) for overrides, nproc in MODE_LAUNCHES
            if nproc or {"parallel=ddp", "parallel=fsdp"} & set(overrides)}  # fmt: skip
MODES = [c for c in readme_commands() if c in LAUNCHED]
# - tests/test_launch.py runs these sweeps' jobs, tests/test_config.py these searches.
SWEEPS = [
    c
    for c in readme_commands()
    if c.startswith(("python train.py -m parallel=ddp ", "python train.py -m hydra/launcher="))
    or "hparams_search=optuna" in c
]
SPECIAL = SEQUENCE + MACHINES + SLURM + EQUIVALENCE + MODES + SWEEPS


@pytest.mark.parametrize(
    "command",
    [
        # The legacy launcher and compiling are slow here; other tests cover them too.
        pytest.param(c, marks=[pytest.mark.slow] if any(s in c for s in SLOW_COMMANDS) else [])
        for c in dict.fromkeys(readme_commands())  # each once
        if c.startswith(RUNS) and c not in SPECIAL
    ],
)
def test_readme_command_runs(command, tmp_path, tiny_data):
    run_readme_command(command, tmp_path, tiny_data)


@pytest.mark.unit
@pytest.mark.extra("slurm")
def test_readme_slurm_command_composes():
    """Without a SLURM cluster, the SLURM command is composed (the sweep values picked)."""
    (command,) = SLURM
    overrides = [w.split(",")[0] for w in shlex.split(command)[2:] if w != "-m"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    assert cfg.hydra.launcher.partition == "gpu" and cfg.hydra.launcher.gpus_per_node == 4


@pytest.mark.slow  # tests/test_checkpoint.py tests what these commands do, one by one
def test_readme_checkpoint_commands_run_in_order(tmp_path, tiny_data):
    assert len(SEQUENCE) == 5
    for command in SEQUENCE:
        # A new second, as between commands typed by hand: the runs without hydra.run.dir get a
        # folder of their own (${now:%H-%M-%S}); the evaluation would be refused the folder of
        # the run trained just before it in the same second.
        time.sleep(1 - time.time() % 1)
        run_readme_command(command, tmp_path, tiny_data)
    assert (tmp_path / "outputs" / "my-run" / "checkpoints" / "best.pt").is_file()


@pytest.mark.unit
def test_every_test_the_fault_table_names_exists():
    """docs/faults.md names, for each fault, the test that injects it: each one is a real test."""
    named = set(re.findall(r"`(test_\w+)`", (REPO / "docs" / "faults.md").read_text()))
    defined = {
        name
        for path in (REPO / "tests").glob("test_*.py")
        for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)
    }
    assert len(named) >= 20 and not named - defined, named - defined


@pytest.mark.unit
def test_the_cpu_only_install_takes_the_pinned_torch_and_torchvision():
    """The README's CPU-only install (PyTorch's own index, which no test here reaches) asks for
    the versions requirements.txt pins, so `pip install -r requirements.txt` keeps that build."""
    readme = " ".join((REPO / "README.md").read_text().split())
    (line,) = re.findall(r"`(pip install [^`]*download\.pytorch\.org/whl/cpu)`", readme)
    pins = re.findall(r"^(torch(?:vision)?==\S+)", (REPO / "requirements.txt").read_text(), re.M)
    assert sorted(pins) == sorted(w for w in line.split() if "==" in w), (line, pins)
