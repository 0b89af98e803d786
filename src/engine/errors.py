"""The one exception for mistakes a user can fix (bad config, missing data, wrong launcher), how
a sentence quotes another error, and config sections whose fields check their ranges as built."""

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import field, fields
from pathlib import Path
from typing import Any, ClassVar

from hydra.errors import CompactHydraException


class UserError(CompactHydraException):
    """A mistake the user can fix, told in a sentence or two on what to do: Hydra prints it alone,
    without a traceback (bugs keep ordinary exceptions). `every_rank`: each rank of a DDP group
    raises it alike (a shared config's check, a gathered verdict); one rank per machine tells it."""

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
    try:
        path = Path(inspect.getsourcefile(cls) or "")
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)
    except TypeError:
        return cls.__module__


def refuse(key: str, value: Any, allowed: str) -> None:
    """Stop on a value of `key` training cannot use, saying what is `allowed`."""
    raise UserError(not_allowed(key, value, allowed), every_rank=True)


def not_allowed(key: str, value: Any, allowed: str) -> str:
    """The sentence that refuses a value of `key`, saying what is `allowed` (YAML's words for
    None, True and False, as the user writes them)."""
    if value is None or isinstance(value, bool):
        value = "null" if value is None else str(value).lower()
    return f"{key}={value} is not allowed: use {allowed}."


# A setting's range or choices, declared with its field (`epochs: int = least(1, 1)`), checked by
# `Checked` as the section is built; each says what it allows in the message that refuses it.
# `nullable`: null is allowed too, said first ("null or at least 1"); a string says what null
# means ("null (no clipping) or a norm above 0").
def least(low: float, default: Any, nullable: bool | str = False, said: str | None = None) -> Any:
    """A field of at least `low`."""
    said = said or (f"at least {low}" if low else "0 or more")
    return _checked_field(default, lambda v: v >= low, said, nullable)


def above(low: float, default: Any, nullable: bool | str = False, said: str | None = None) -> Any:
    """A field of more than `low`."""
    return _checked_field(default, lambda v: v > low, said or f"a number above {low}", nullable)


def between(
    low: float,
    high: float,
    default: Any,
    *,
    low_open: bool = False,
    high_open: bool = True,
    nullable: bool | str = False,
    said: str | None = None,
) -> Any:
    """A field from `low` up to below `high`, as `range` counts ("0 up to below 1"); `low_open`
    leaves `low` out ("above 0"), `high_open=False` takes `high` in ("0 to 1")."""
    said = said or (
        (f"above {low}" if low_open else f"{low}")
        + (" and " if low_open and high_open else " up to " if low_open or high_open else " to ")
        + (f"below {high}" if high_open else f"{high}")
    )

    def allows(v: Any) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    return _checked_field(default, allows, said, nullable)


def one_of(*choices: Any, default: Any, said: str | None = None) -> Any:
    """A field that takes one of `choices` (None among them: null, said where it stands)."""
    shown = ["null" if c is None else str(c).lower() if c in (True, False) else str(c)
             for c in choices]  # fmt: skip
    said = said or f"{', '.join(shown[:-1])} or {shown[-1]}"
    return _checked_field(default, lambda v: v in choices, said, None in choices, null_said=True)


def _checked_field(
    default: Any, allows: Any, said: str, nullable: bool | str, null_said: bool = False
) -> Any:
    """The field, with its check and what it allows: `said`, null put first where `nullable`
    (unless `said` already says null)."""
    null = "null or " if nullable is True else f"null ({nullable}) or " if nullable else ""
    null = "" if null_said else null
    return field(
        default=default,
        metadata={"allows": allows, "null": bool(nullable), "said": null + said, "range": said,
                  "null said": null},
    )  # fmt: skip


class Checked:
    """A config section (a dataclass) whose fields' ranges and choices are checked as it's built."""

    section: ClassVar[str] = ""  # a field is `<section>.<field>` in the sentence that refuses it

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if "allows" not in f.metadata or str(value).startswith("${"):  # an interpolation
                continue
            if not (f.metadata["null"] if value is None else f.metadata["allows"](value)):
                key = f"{self.section}.{f.name}" if self.section else f.name
                refuse(key, value, f.metadata["said"])
