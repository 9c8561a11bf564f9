"""Errors raised by the distca runtime."""


class DistCAError(RuntimeError):
    """A participant of a round was lost or did not answer within the timeout.

    Raised on every surviving participant instead of hanging; the message names the peer(s) and
    the round. Bad *input* is reported with ``ValueError`` instead, before any byte moves.
    """


def first_cause(errors: list) -> BaseException:
    """Of the errors a round's participants raised (non-empty, in participant order), the one to
    raise: the first that is not a :class:`DistCAError` (a participant's own failure, the cause),
    else the first (every one was a peer's abort or timeout)."""
    return next((e for e in errors if not isinstance(e, DistCAError)), errors[0])
