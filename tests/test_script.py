"""The engine from a script of your own (docs/layout.md, "Your own script"): the wheel built from
this checkout, installed into a new virtual environment (and the checkout installed editable), and
the page's script run with it in a folder outside the checkout, in the launch modes it starts."""

import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, defaults_for_tests, offline_env, ok, printed, read_test, run
from omegaconf import OmegaConf

from src.engine import app
from src.engine.errors import UserError
from src.engine.parallel.ddp import DDP

# The page's script, as written there.
LAYOUT = (REPO / "docs" / "layout.md").read_text()
SCRIPT = re.search(r"### Your own script\n.*?```python\n(.*?)```", LAYOUT, re.S).group(1)
# The presets the page shows a script's folder adding: a model from the template's MLP
# (model=mine), and a primary config from the template's (config_name="mine").
PRESETS = {
    "model/mine.yaml": "# The template's MLP, narrower.\ndefaults: [mlp, _self_]\nhidden: 32\n",
    "mine.yaml": (
        "# The template's config, with my model and two epochs.\n"
        "defaults: [config, override model: mine, _self_]\ntrainer:\n  epochs: 2\n"
    ),
}
# The page's script with the folder's primary config, and one that forgets the guard.
OWN_PRIMARY = SCRIPT.replace('config_dir="conf")', 'config_dir="conf", config_name="mine")')
UNGUARDED = "from src.engine.app import main\n\nmain()\n"


def new_environment(folder: Path, *install: str) -> Path:
    """A new virtual environment over this Python's packages (torch, Hydra: nothing downloaded)
    with `install` installed by pip, no dependency, no index: its python."""
    command = [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", folder]
    ok(run(command, cwd=folder.parent))
    python = folder / "bin" / "python"
    # Where this Python is a virtual environment itself (CI's), --system-site-packages gives the
    # base interpreter's packages, not its own: they are listed, each folder (not read as a site:
    # an editable `src` of theirs stays out).
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = Path(subprocess.check_output([python, "-c", where], text=True).strip())
    (purelib / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation"]
    ok(run([*pip, *install], cwd=folder.parent))
    return python


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """What a wheel is built from, copied out of this checkout (the build writes into its
    folder): pyproject.toml, setup.py, src/ and conf/."""
    copy = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(REPO / name, copy)
    for name in ("src", "conf"):
        shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory, checkout) -> Path:
    """The python of a new environment where the wheel built from the checkout is installed."""
    dist = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    ok(run([*build, "--no-index", "-w", dist, checkout], cwd=dist))
    (wheel,) = dist.glob("*.whl")
    return new_environment(tmp_path_factory.mktemp("venv") / "venv", str(wheel))


def project(tmp_path: Path, script: str = SCRIPT) -> Path:
    """A folder outside the checkout with `script` (my_train.py) and the presets it adds."""
    folder = tmp_path / "project"
    for name, text in PRESETS.items():
        (folder / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "conf" / name).write_text(text)
    (folder / "my_train.py").write_text(script)
    return folder


def train_script(python: Path, folder: Path, tiny_data: Path, *overrides: str):
    """`python my_train.py` in its folder, with nothing on PYTHONPATH (the checkout's src/ is
    nowhere to import from), on the tiny data."""
    env = offline_env()
    for name in ("PYTHONPATH", "PROJECT_ROOT"):
        env.pop(name, None)
    args = [f"data.root={tiny_data}", "logger=none", *overrides]
    command = [str(python), "my_train.py", *args, *defaults_for_tests(args)]
    return run(command, cwd=folder, env=env, timeout=300)


def run_folder(folder: Path) -> Path:
    """The one run folder, in outputs/ beside the script (its folder is the project's root)."""
    (hydra,) = (folder / "outputs").rglob(".hydra")
    return hydra.parent


def config_sources(run_dir: Path) -> dict[str, str]:
    """Where the run's YAML files came from, by Hydra's provider: main (the template's conf/),
    command-line (the script's folder)."""
    sources = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.config_sources
    return {source.provider: source.path for source in sources}


@pytest.mark.slow
def test_the_page_script_trains_self_launched_ddp_with_the_installed_wheel(
    tmp_path, tiny_data, wheel_python
):
    folder = project(tmp_path)
    result = ok(train_script(wheel_python, folder, tiny_data, "parallel=ddp",
                             "parallel.nproc_per_node=2"))  # fmt: skip
    run_dir = run_folder(folder)
    assert "test/acc" in read_test(run_dir)
    assert "DDP: 2 processes" in printed(result)
    assert (run_dir / "my_train.log").is_file()  # the log named for the script
    # The installed copy ran: its conf/ is in the wheel's src/ (app.py finds it beside itself).
    site_packages = wheel_python.parents[1] / "lib"
    main = Path(config_sources(run_dir)["main"])
    assert main.parts[-2:] == ("src", "conf") and main.is_relative_to(site_packages), main
    assert not main.is_relative_to(REPO)


@pytest.mark.slow
def test_the_page_script_adds_its_own_preset_in_one_process(tmp_path, tiny_data, wheel_python):
    folder = project(tmp_path)
    ok(train_script(wheel_python, folder, tiny_data, "parallel=none", "model=mine"))
    run_dir = run_folder(folder)
    assert "test/acc" in read_test(run_dir)
    assert OmegaConf.load(run_dir / "config_resolved.yaml").model.hidden == 32  # its preset
    assert config_sources(run_dir)["command-line"] == str(folder / "conf")


@pytest.mark.slow
def test_an_editable_install_and_a_primary_config_of_your_own(
    tmp_path, tiny_data, checkout, tmp_path_factory
):
    """`pip install -e .`: the checkout's conf/, beside src/; `config_name` picks the folder's
    primary config, which starts from the template's."""
    assert OWN_PRIMARY != SCRIPT
    python = new_environment(tmp_path_factory.mktemp("venv") / "editable", "-e", str(checkout))
    folder = project(tmp_path, OWN_PRIMARY)
    ok(train_script(python, folder, tiny_data))
    run_dir = run_folder(folder)
    config = OmegaConf.load(run_dir / "config_resolved.yaml")
    assert (config.model.hidden, config.trainer.epochs) == (32, 2)
    assert "test/acc" in read_test(run_dir)
    assert config_sources(run_dir)["main"] == str(checkout / "conf")


@pytest.mark.slow
def test_main_unguarded_in_a_script_is_one_sentence_in_each_started_process(
    tmp_path, tiny_data, wheel_python
):
    folder = project(tmp_path, UNGUARDED)
    result = train_script(wheel_python, folder, tiny_data, "parallel=ddp",
                          "parallel.nproc_per_node=2")  # fmt: skip
    assert result.returncode != 0
    assert 'call it under `if __name__ == "__main__":`' in printed(result)
    assert "Traceback" not in printed(result)
    assert not (folder / "outputs").exists()  # the refused run's folder removed; none made after


@pytest.mark.unit
def test_a_file_of_yours_named_as_one_of_the_templates_is_refused(tmp_path):
    assert app.CONFIG == REPO / "conf"  # in a checkout: beside src/
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("hidden: 32\n")
    assert app.own_folder(tmp_path) == tmp_path
    (tmp_path / "model" / "mlp.yaml").write_text("hidden: 32\n")
    with pytest.raises(SystemExit, match=r"model/mlp.yaml is never read: the template's conf/"):
        app.own_folder(tmp_path)


@pytest.mark.unit
def test_ddp_with_no_launchers_variable_says_how_to_launch(monkeypatch):
    """run.train under parallel=ddp in a process nothing started as a rank (a script of its own
    around it): what to do, not a "partial" environment of nothing."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError) as refused:
        DDP().setup("cpu", None)
    assert str(refused.value) == (
        "parallel=ddp trains in one process per device, and none of torchrun's variables (RANK, "
        "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is set: launch with torchrun, or "
        "through src.engine.app.main (as train.py does), which starts the processes itself."
    )
