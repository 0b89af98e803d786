"""What pyproject.toml cannot say alone: the packages found under src/ and, beside them, conf/
installed inside the package as src/conf, so that the engine installed from a wheel finds the
template's YAML files (`CONFIG` in src/engine/app.py). The rest is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

setup(
    # The package `src`: the engine and the fork's files, nothing else; and conf/ as src.conf.
    packages=[
        *find_namespace_packages(include=["src", "src.*"], exclude=["*.__pycache__"]),
        "src.conf",
    ],
    package_dir={"src.conf": "conf"},
    package_data={"src.conf": ["**/*.yaml"]},
)
