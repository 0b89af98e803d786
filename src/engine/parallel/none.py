"""parallel=none: one process on one device; the protocol's own answers."""

from dataclasses import dataclass

from src.engine.parallel import Strategy


@dataclass
class Single(Strategy):
    """One process, one device."""
