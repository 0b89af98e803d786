"""The one exception for mistakes a user can fix: bad config, missing data, wrong launcher; and
how a sentence quotes another error."""

from hydra.errors import CompactHydraException


class UserError(CompactHydraException):
    """A mistake the user can fix. Hydra prints its message alone, without a traceback.

    Raise it where the mistake enters, with one or two sentences that say what to do.
    Real bugs keep raising ordinary exceptions, with their tracebacks.
    """


class Stopped(CompactHydraException):
    """Training stopped on a signal after saving its checkpoint; Hydra prints the message alone."""


def first_line(err: BaseException) -> str:
    """An error's first line, for a sentence that quotes it (its type, where it says nothing)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
