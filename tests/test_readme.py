"""Every training command the README shows runs as written, on tiny data for a few steps.

The set-up commands (pip, apt-get) and `pytest` itself are run by .ci/run.
"""

import re
import shlex
import sys

import pytest
from conftest import REPO, offline_env, ok, read_metrics, run

README = (REPO / "README.md").read_text()
RUNS = ("python train.py", "torchrun ", "WANDB_MODE=")
SET_UP = ("pip install", "apt-get install", "pytest", "wandb sync")


def readme_commands() -> list[str]:
    """Each command in the README's bash blocks, comments dropped, `a && b` split in two."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def test_readme_commands_are_all_known():
    """A command the README shows is either run below or by .ci/run."""
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


def run_readme_command(command: str, tmp_path, tiny_data) -> None:
    words = shlex.split(command)
    env = offline_env(HOME=str(tmp_path))  # wandb, if used, goes offline without asking
    while "=" in words[0]:  # VAR=value before the command
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] == "python":
        words[0] = sys.executable
    words += [f"data.root={tiny_data}", "trainer.max_steps=2", f"paths.log_dir={tmp_path}/outputs"]
    ok(run(words, cwd=REPO, env=env, timeout=300))
    runs = [p.parent for p in (tmp_path / "outputs").rglob("metrics.jsonl")]
    assert runs and all(read_metrics(r)[1] for r in runs), "every run evaluated"


# The checkpoint commands build on each other (the run in my-run, then its checkpoints).
SEQUENCE = [c for c in readme_commands() if "my-run" in c]


@pytest.mark.parametrize(
    "command", [c for c in readme_commands() if c.startswith(RUNS) and c not in SEQUENCE]
)
def test_readme_command_runs(command, tmp_path, tiny_data):
    run_readme_command(command, tmp_path, tiny_data)


def test_readme_checkpoint_commands_run_in_order(tmp_path, tiny_data):
    assert len(SEQUENCE) == 5
    for command in SEQUENCE:
        run_readme_command(command, tmp_path, tiny_data)
    assert (tmp_path / "outputs" / "my-run" / "checkpoints" / "best.pt").is_file()
