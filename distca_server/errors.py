"""Errors raised by the distca runtime."""


class DistCAError(RuntimeError):
    """A participant of a round was lost or did not answer within the timeout.

    Raised on every surviving participant instead of hanging; the message names the peer(s) and
    the round. Bad *input* is reported with ``ValueError`` instead, before any byte moves.
    """
