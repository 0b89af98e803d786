"""The one exception for mistakes a user can fix: bad config, missing data, wrong launcher; how
a sentence quotes another error; and the classes a config group names, built with their
mistakes told in one sentence."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hydra.errors import CompactHydraException, InstantiationException
from hydra.utils import instantiate


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


# What Python says when a call's keywords do not fit the function: a key the class does not take.
_SIGNATURE = ("unexpected keyword argument", "required positional argument", "multiple values")


def instantiated(group: str, node: Any, *args: Any, values: bool = False, **kwargs: Any) -> Any:
    """`instantiate(node, *args, **kwargs)` for the config group `group` (model, data, optimizer,
    scheduler, task). A class that cannot be imported, a key its class does not take, or, with
    `values`, a value it refuses (torch's optimizers and schedulers check theirs) is one sentence
    naming the group; the class's own UserError stays its sentence; anything else keeps its
    traceback."""
    try:
        return instantiate(node, *args, **kwargs)
    except InstantiationException as err:
        cause, target = err.__cause__, node.get("_target_")
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, ImportError):
            raise UserError(
                f"{group}._target_={target} cannot be imported: check its module and class name "
                f"(or choose a {group} config: python train.py --help lists them).",
                every_rank=True,
            ) from None
        signature = isinstance(cause, TypeError) and any(s in str(cause) for s in _SIGNATURE)
        if not (signature or (values and isinstance(cause, (TypeError, ValueError)))):
            raise
        refused = "does not take these keys" if signature else "refuses a value"
        raise UserError(
            f"{group}: {target} {refused} ({first_line(cause)}). Fix the {group}.* keys "
            "(python train.py --cfg job shows them).",
            every_rank=True,
        ) from None


def typed(cls: type, node: Any, section: str, exclude: tuple[str, ...] = ()) -> Any:
    """The dataclass `cls` built from the config `node` (a DictConfig or a dict): OmegaConf checks
    each value against its field's type, `cls.__post_init__` its range and choices. A value of
    the wrong type, or a key `cls` has no field for, is one sentence naming it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, ValidationError

    untyped(cls, section)
    if not isinstance(node, dict):
        node = OmegaConf.to_container(node, resolve=True)
    values = {key: value for key, value in node.items() if key not in exclude}
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except ConfigKeyError as err:
        raise UserError(
            f"{section}.{err.key} is not a key of {section}: {cls.__name__} ({where(cls)}) has "
            "no field of that name. Check its spelling (python train.py --cfg job shows the keys).",
            every_rank=True,
        ) from None
    except ValidationError as err:
        value = values.get(err.full_key, err.value)
        raise UserError(
            f"{section}.{err.full_key}={value} is not allowed: {first_line(err)} (the type of "
            f"{cls.__name__}.{err.full_key}).",
            every_rank=True,
        ) from None


def untyped(cls: type, section: str) -> None:
    """Refuse a setting a fork declared without a type (`rate = 0.1` in a dataclass is a class
    attribute, no field, and no key of the config)."""
    shared = {name for c in cls.__mro__ for name, t in vars(c).get("__annotations__", {}).items()
              if "ClassVar" in str(t)}  # fmt: skip
    fields = getattr(cls, "__dataclass_fields__", {})
    for c in cls.__mro__[:-1]:
        for name, value in vars(c).items():
            if name.startswith("_") or name in fields or name in shared:
                continue
            if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                continue
            raise UserError(
                f"{where(c)}: {c.__name__}.{name} = {value!r} has no type, so it is no key of "
                f"{section}: declare it as a field, `{name}: {type(value).__name__} = {value!r}`.",
                every_rank=True,
            )


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


def at_least(key: str, value: int | float | None, low: int, nullable: bool = False) -> None:
    """Refuse a `value` of `key` below `low` (None where it is `nullable`)."""
    if value is None and nullable:
        return
    if value is None or value < low:
        allowed = f"at least {low}" if low else "0 or more"
        refuse(key, value, f"null or {allowed}" if nullable else allowed)
