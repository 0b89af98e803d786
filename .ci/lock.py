"""Pin the set of packages this environment holds for the requirements: requirements-lock.txt.

.ci/run installs the newest releases the requirements allow into a fresh virtual environment,
tests them, and then writes the lock from that environment, so the file names the exact versions
of the last green run. Users who want exactly that set install with it as constraints:

    pip install -r requirements-dev.txt -c requirements-lock.txt

    python .ci/lock.py                  # write requirements-lock.txt from this environment
    python .ci/lock.py --out FILE       # write FILE instead
    python .ci/lock.py --diff           # print what differs from requirements-lock.txt

Only the requirements and what they need, found through each installed package's metadata, are
pinned: whatever else a developer installed by hand stays out.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ("requirements-dev.txt",)  # the whole tested set: it names the others
LOCK = ROOT / "requirements-lock.txt"


def read_requirements(path: Path) -> list[Requirement]:
    """The requirements of a requirements file, following its `-r other.txt` lines."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r"):
            found += read_requirements(path.parent / line[2:].strip())
        elif line:
            found.append(Requirement(line))
    return found


def installed_closure(requirements: list[Requirement]) -> dict[str, str]:
    """{name: installed version} of the requirements and, recursively, what they require here."""
    pinned: dict[str, str] = {}
    todo = [(req, "") for req in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({**default_environment(), "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{req.name} is required but not installed: install the requirements first.")
        first_visit = name not in pinned
        pinned[name] = dist.version
        # A package's own needs once; those of each extra asked for (wandb[media]) as asked.
        extras = ([""] if first_visit else []) + sorted(req.extras)
        todo += [(Requirement(r), e) for r in dist.requires or [] for e in extras]
    return dict(sorted(pinned.items()))


def lock_text(pinned: dict[str, str]) -> str:
    header = (
        "# The exact set of the last green CI run (.ci/run), written by .ci/lock.py: do not edit.\n"
        "# For exactly this set: pip install -r requirements-dev.txt -c requirements-lock.txt\n"
        f"# Python {platform.python_version()} on {platform.system()} {platform.machine()}\n"
    )
    return header + "".join(f"{name}=={version}\n" for name, version in pinned.items())


def read_lock(path: Path) -> dict[str, str]:
    pins = re.findall(r"^([\w.-]+)==(\S+)$", path.read_text() if path.is_file() else "", re.M)
    return dict(pins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=LOCK, help="file to write")
    parser.add_argument("--diff", action="store_true", help="compare with the lock, write nothing")
    args = parser.parse_args()
    requirements = [r for name in REQUIREMENTS for r in read_requirements(ROOT / name)]
    pinned = installed_closure(requirements)
    if args.diff:
        locked = read_lock(LOCK)
        changed = [
            f"  {name}: {locked.get(name, '-')} -> {pinned.get(name, '-')}"
            for name in sorted(set(locked) | set(pinned))
            if locked.get(name) != pinned.get(name)
        ]
        print(f"Installed beside {LOCK.name}: " + ("\n".join(["", *changed]) or "the same set"))
        return
    args.out.write_text(lock_text(pinned))
    print(f"Wrote {args.out}: {len(pinned)} packages")


if __name__ == "__main__":
    main()
