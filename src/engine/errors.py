"""The one exception for mistakes a user can fix (bad config, missing data, wrong launcher), how
a sentence quotes another error, and config sections whose fields check their ranges as built."""

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import field, fields
from operator import ge, gt, le, lt
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
    return checked(lambda v: v >= low, default, said, nullable)


def above(low: float, default: Any, nullable: bool | str = False, said: str | None = None) -> Any:
    """A field of more than `low`."""
    return checked(lambda v: v > low, default, said or f"a number above {low}", nullable)


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
    over, under = (gt if low_open else ge), (lt if high_open else le)
    ends = (f"above {low}" if low_open else f"{low}", f"below {high}" if high_open else f"{high}")
    joint = " and " if low_open and high_open else " up to " if low_open or high_open else " to "
    said = said or joint.join(ends)
    return checked(lambda v: over(v, low) and under(v, high), default, said, nullable)


def one_of(*choices: Any, default: Any, said: str | None = None) -> Any:
    """A field that takes one of `choices` (None among them: null, said where it stands)."""
    shown = ["null" if c is None else str(c).lower() if c in (True, False) else str(c)
             for c in choices]  # fmt: skip
    said = said or f"{', '.join(shown[:-1])} or {shown[-1]}"
    return checked(lambda v: v in choices, default, said, None in choices, null="")


def checked(
    allows: Any, default: Any, said: str, nullable: bool | str = False, null: str | None = None
) -> Any:
    """A field whose values `allows` takes (a function), saying what they are: `said`, after
    `null`, the words for null put first where `nullable` (by default "null or ")."""
    if null is None:
        null = "null or " if nullable is True else f"null ({nullable}) or " if nullable else ""
    return field(
        default=default, metadata={"allows": allows, "null": bool(nullable), "range": said,
                                   "null said": null}
    )  # fmt: skip


class Checked:
    """A config section (a dataclass) whose fields' ranges and choices are checked as it's built."""

    section: ClassVar[str] = ""  # a field is `<section>.<field>` in the sentence that refuses it

    def __post_init__(self) -> None:
        for f in fields(self):
            value, said = getattr(self, f.name), f.metadata.get("range")
            if said is None or str(value).startswith("${"):  # no range; an interpolation
                continue
            if not (f.metadata["null"] if value is None else f.metadata["allows"](value)):
                key = f"{self.section}.{f.name}" if self.section else f.name
                refuse(key, value, f.metadata["null said"] + said)
