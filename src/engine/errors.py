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
