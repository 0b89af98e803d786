"""requirements-lock.txt, the set CI last tested, agrees with the requirements files."""

import importlib.util
from importlib import metadata

import pytest
from conftest import EXTRAS, REPO, skip_for_extra
from packaging.utils import canonicalize_name

spec = importlib.util.spec_from_file_location("lock", REPO / ".ci" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)

REQUIREMENTS = [r for name in lock.REQUIREMENTS for r in lock.read_requirements(REPO / name)]
REQUIREMENTS_TXT = lock.read_requirements(REPO / "requirements.txt")


def installed(requirement) -> bool:
    try:
        metadata.distribution(requirement.name)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.unit
def test_the_lock_pins_every_requirement_to_a_version_it_allows():
    pinned = lock.read_lock(lock.LOCK)
    lines = [line for line in lock.LOCK.read_text().splitlines() if not line.startswith("#")]
    assert len(lines) == len(pinned), "every line but the comments is name==version"
    for requirement in REQUIREMENTS:
        version = pinned.get(canonicalize_name(requirement.name))
        assert version, f"{requirement.name} is not in {lock.LOCK.name}"
        assert requirement.specifier.contains(version, prereleases=True), (requirement, version)


@pytest.mark.unit
def test_the_lock_is_what_this_environment_holds_for_the_requirements(tmp_path):
    """Written from the installed packages' metadata: the requirements and all they need."""
    missing = [requirement.name for requirement in REQUIREMENTS if not installed(requirement)]
    if missing:
        skip_for_extra(f"needs {', '.join(missing)}: pip install -r requirements-dev.txt")
    pinned = lock.installed_closure(REQUIREMENTS)
    assert {"torch", "hydra-core", "submitit", "cloudpickle", "omegaconf"} <= set(pinned)
    assert "hypothesis" not in pinned  # installed here by hand, perhaps, but needed by nothing
    out = tmp_path / "lock.txt"
    out.write_text(lock.lock_text(pinned))
    assert lock.read_lock(out) == pinned


@pytest.mark.unit
def test_a_missing_extra_skips_with_its_install_command_and_fails_where_ci_asks(monkeypatch):
    reason = "needs the optuna extra (x): pip install -r requirements-optuna.txt"
    monkeypatch.delenv("TESTS_NEED_EXTRAS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="pip install -r requirements-optuna.txt"):
        skip_for_extra(reason)
    monkeypatch.setenv("TESTS_NEED_EXTRAS", "1")
    with pytest.raises(pytest.fail.Exception, match="no test may skip for a missing extra"):
        skip_for_extra(reason)
    # Each extra's module is what its own requirements install: where they are installed, the
    # marker finds it (a wrong name would skip a test that could run).
    for name, (module, requirements) in EXTRAS.items():
        own = [r for r in lock.read_requirements(REPO / requirements) if r not in REQUIREMENTS_TXT]
        assert own, name
        if all(map(installed, own)):
            assert importlib.util.find_spec(module), (name, module)


@pytest.mark.slow
def test_pip_install_e_makes_the_engine_importable_from_any_folder(tmp_path):
    """`pip install -e .` installs the package `src` (the engine in src/engine, the fork's files
    beside it) and no top-level `core` or `tools`, with the dependencies that training needs."""
    import subprocess
    import sys

    prefix = tmp_path / "prefix"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO),
         "--prefix", str(prefix)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    site = next(prefix.rglob("site-packages"))
    probe = (
        f"import site, sys; sys.path.remove(''); site.addsitedir({str(site)!r}); "
        "import src.engine.app, src.models, importlib.util as u; "
        "print(src.engine.app.__file__, [n for n in ('core', 'tools') if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True,
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    assert out == [str(REPO / "src" / "engine" / "app.py"), "[]"]
    text = next(site.glob("hydra_ddp_mnist*.dist-info/METADATA")).read_text()
    for name in ("torch", "hydra-core", "omegaconf", "wandb", "tqdm", "matplotlib"):
        assert f"Requires-Dist: {name}" in text, name
