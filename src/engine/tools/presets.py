"""A `debug=` preset's own keys given another value on the command line (`debug=fast
trainer.max_steps=50`): allowed, as any override is, and told in one warning before the job, since
the run is then no longer the preset's smoke run, verdict or trace as its file describes it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("train")


class PresetOverridden(Callback):
    """conf/config.yaml's hydra.callbacks: before each job (a sweep's too), on rank 0."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        name = OmegaConf.select(config, "hydra.runtime.choices.debug")
        if not name or int(os.environ.get("RANK", 0)) > 0:
            return
        preset = preset_keys(config, f"debug/{name}.yaml")
        given = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
        changed = [
            o for o in given if o.key_or_group in preset and preset[o.key_or_group] != value(o)
        ]
        if not changed:
            return
        sets = ", ".join(f"{o.key_or_group}={preset[o.key_or_group]}" for o in changed)
        replaced = " ".join(o.input_line for o in changed)
        verb = "replaces" if len(changed) == 1 else "replace"
        log.warning(
            f"debug={name} sets {sets}, which the command line's {replaced} {verb}: the run is "
            f"debug={name} as you changed it."
        )


def value(override: Override) -> Any:
    """An override's value as the preset's YAML would hold it; a deletion's is none."""
    return None if override.is_delete() else override.value()


def preset_keys(config: DictConfig, file: str) -> dict[str, Any]:
    """The keys a preset `file` of the config's folders sets (dotted: trainer.max_steps) and the
    groups it picks (logger), with their values; not its own section (`debug.*`), whose keys are
    the preset's settings."""
    sources = config.hydra.runtime.config_sources
    paths = [Path(str(source.path)) / file for source in sources if source.schema == "file"]
    path = next((path for path in paths if path.is_file()), None)
    if path is None:  # a preset packaged elsewhere: nothing to compare
        return {}
    node = OmegaConf.to_container(OmegaConf.load(path))
    keys = {}
    for entry in node.pop("defaults", []):  # {"override /logger": "none"}
        if isinstance(entry, dict):
            keys |= {k.split("/")[-1]: v for k, v in entry.items()}
    node.pop("debug", None)
    stack = [("", node)]
    while stack:
        prefix, values = stack.pop()
        for key, value in values.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))
            else:
                keys[f"{prefix}{key}"] = value
    return keys
