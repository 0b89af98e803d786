"""requirements-lock.txt, the set CI last tested, agrees with the requirements files."""

import importlib.util
from importlib import metadata

import pytest
from conftest import REPO, skip_for_extra
from packaging.utils import canonicalize_name

spec = importlib.util.spec_from_file_location("lock", REPO / ".ci" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)

REQUIREMENTS = [r for name in lock.REQUIREMENTS for r in lock.read_requirements(REPO / name)]


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
    missing = []
    for requirement in REQUIREMENTS:
        try:
            metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(requirement.name)
    if missing:
        skip_for_extra(f"needs {', '.join(missing)}: pip install -r requirements-dev.txt")
    pinned = lock.installed_closure(REQUIREMENTS)
    assert {"torch", "hydra-core", "submitit", "cloudpickle", "omegaconf"} <= set(pinned)
    assert "hypothesis" not in pinned  # installed here by hand, perhaps, but needed by nothing
    out = tmp_path / "lock.txt"
    out.write_text(lock.lock_text(pinned))
    assert lock.read_lock(out) == pinned
