"""The one exception for mistakes a user can fix: bad config, missing data, wrong launcher; how
a sentence quotes another error; and the classes a config group names, built with their
mistakes told in one sentence."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from hydra.errors import CompactHydraException


class UserError(CompactHydraException):
    """A mistake the user can fix. Hydra prints its message alone, without a traceback.

    Raise it where the mistake enters, with one or two sentences that say what to do.
    Real bugs keep raising ordinary exceptions, with their tracebacks. `every_rank`: each rank of
    a DDP group raises this one alike (a check of the config they share, a verdict they gathered),
    so one rank per machine tells it.
    """

    def __init__(self, message: str, *, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


@contextmanager
def on_every_rank() -> Iterator[None]:
    """The UserError raised inside is one every rank raises alike: the checks of the config."""
    try:
        yield
    except UserError as err:
        err.every_rank = True
        raise


class Stopped(CompactHydraException):
    """Training stopped on a signal after saving its checkpoint; Hydra prints the message alone."""


def first_line(err: BaseException) -> str:
    """An error's first line, for a sentence that quotes it (its type, where it says nothing)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def where(cls: type) -> str:
    """The file a class is written in, relative to the working folder where it lies inside."""
    import inspect
    from pathlib import Path

    try:
        path = Path(inspect.getsourcefile(cls) or "")
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)
    except TypeError:
        return cls.__module__


def refuse(key: str, value: Any, allowed: str) -> None:
    """Stop on a value of `key` training cannot use, saying what is `allowed`."""
    if isinstance(value, bool):
        value = str(value).lower()
    raise UserError(f"{key}={value} is not allowed: use {allowed}.", every_rank=True)


# A setting's range or choices, declared with its field (`epochs: int = least(1, 1)`) and checked
# by `Checked` as the section is built: each says what it allows in the message that refuses it.
def least(low: float, default: Any, nullable: bool = False, said: str | None = None) -> Any:
    """A field of at least `low` (and null where `nullable`)."""
    said = said or (f"at least {low}" if low else "0 or more")
    return _checked_field(default, lambda v: v >= low, f"null or {said}" if nullable else said,
                          nullable)  # fmt: skip


def above(low: float, default: Any, nullable: bool = False, said: str | None = None) -> Any:
    """A field of more than `low` (and null where `nullable`)."""
    said = said or f"a number above {low}"
    return _checked_field(default, lambda v: v > low, f"null {said}" if nullable else said,
                          nullable)  # fmt: skip


def one_of(*choices: Any, default: Any, said: str | None = None) -> Any:
    """A field that takes one of `choices`."""
    shown = ["null" if c is None else str(c).lower() if c in (True, False) else str(c)
             for c in choices]  # fmt: skip
    said = said or f"{', '.join(shown[:-1])} or {shown[-1]}"
    return _checked_field(default, lambda v: v in choices, said, None in choices)


def _checked_field(default: Any, allows: Any, said: str, nullable: bool) -> Any:
    from dataclasses import field

    return field(default=default, metadata={"allows": allows, "said": said, "null": nullable})


class Checked:
    """A section of the config (a dataclass) whose fields' ranges and choices are checked as it
    is built, each named `<section>.<field>` in the sentence that refuses it."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        from dataclasses import fields

        for f in fields(self):
            value = getattr(self, f.name)
            if "allows" not in f.metadata or str(value).startswith("${"):  # an interpolation
                continue
            allowed = f.metadata["null"] if value is None else f.metadata["allows"](value)
            if not allowed:
                key = f"{self.section}.{f.name}" if self.section else f.name
                refuse(key, value, f.metadata["said"])
