"""How the ``distca`` command joins a Ray cluster: the address, Ray's token authentication, and
one line instead of a traceback when it cannot.

Ray (2.5x and later) turns token authentication on for the clusters it starts, and a process that
joins one must send the cluster's token. ``ray.init`` finds the token by itself only when it
looks for a local cluster (``address="auto"`` with no ``RAY_ADDRESS``); with an explicit address
it sends one only when ``RAY_AUTH_MODE=token`` is set, and otherwise retries for half a minute on
``InvalidAuthToken`` and ends in a traceback. :func:`connect` applies Ray's own rule to every
address: if ``RAY_AUTH_MODE`` is unset and a token is available (``RAY_AUTH_TOKEN``, the file named
by ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``), it is sent. Before ``ray.init`` it takes
one quick look at a named cluster (its port, then its control store), so an address nobody
listens at, or a cluster that refuses the token (or wants one this machine lacks), is one line
naming what to do, within seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

__all__ = ["AUTH_HELP", "CLIError", "connect", "explicit_address", "worker_pythonpath"]

_PROBE_S = 5.0  # how long the first look at the cluster's port may take

# Ray's words for a refused or missing token (ray.exceptions.AuthenticationError and the GCS status
# its retry loop re-raises as a RuntimeError), matched in the error's text.
_AUTH_SIGNS = ("InvalidAuthToken", "Unauthenticated", "UNAUTHENTICATED")
AUTH_HELP = ("copy the head node's ~/.ray/auth_token (`ray get-auth-token` on the head prints it) to "
             "this machine's ~/.ray/auth_token, or set RAY_AUTH_TOKEN=<token> (or RAY_AUTH_TOKEN_PATH=<file>)")


class CLIError(Exception):
    """A failure the ``distca`` command reports as one line (no traceback), exit status 1."""


def _use_token_if_available() -> bool:
    """Send Ray's token if ``RAY_AUTH_MODE`` is unset and one is available (Ray's own rule for
    local clusters); returns whether token authentication is on for this process."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication: nothing to send
        return False
    quiet = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "token authentication is enabled" warning is not news here
    try:
        return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


def explicit_address(address: str | None) -> str | None:
    """The ``host:port`` the user named (``--address``, else ``RAY_ADDRESS``), or None for
    ``auto`` with no ``RAY_ADDRESS`` (Ray then finds the cluster started on this machine)."""
    if address not in (None, "", "auto"):
        return address
    return os.environ.get("RAY_ADDRESS") or None


def _preflight(address: str) -> bool:
    """One quick look at the cluster before ``ray.init``, which retries for half a minute or more
    on an address nobody listens at and on a refused token: reach its port, then (sending the
    token where one is found) ask its control store (GCS) for the cluster id, which is where a
    token is checked. Returns whether a token is sent.

    Raises:
        CLIError: nothing listens at ``address``, or the token is missing or refused.
    """
    host, _, port = address.rpartition(":")
    if address.startswith("ray://") or not host or not port.isdigit():
        return _use_token_if_available()  # Ray Client addresses and other forms: ray.init reports on them
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_S).close()
    except OSError as exc:
        raise CLIError(f"cannot reach a Ray cluster at {address}: {exc.strerror or exc}") from None
    token = _use_token_if_available()
    try:
        from ray._raylet import GcsClient  # the client ray.init itself builds first
        with _native_stderr_muted():  # Ray's C++ side logs each refusal to stderr; the line below says it
            GcsClient(address=address)
    except ImportError:
        return token
    except Exception as exc:  # AuthenticationError on a token refused or missing; others: ray.init says
        if type(exc).__name__ == "AuthenticationError" or any(sign in str(exc) for sign in _AUTH_SIGNS):
            raise CLIError(_auth_line(address, token)) from None
    return token


@contextlib.contextmanager
def _native_stderr_muted():
    """Send file descriptor 2 (where C++ code writes) to /dev/null for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _auth_line(address: str, token: bool) -> str:
    refused = "refused the token this machine sent" if token else "wants an authentication token"
    return f"the Ray cluster at {address} {refused}: {AUTH_HELP}"


def connect(address: str | None = "auto") -> None:
    """``ray.init`` the cluster at ``address`` (``"auto"``: ``RAY_ADDRESS`` or the local one) in
    namespace ``distca``, quietly, sending Ray's authentication token where one is available.

    Raises:
        CLIError: no cluster at that address, or a token that is missing or refused.
    """
    import ray  # only the runtime commands need it
    if ray.is_initialized():
        return
    named = explicit_address(address)
    token = _preflight(named) if named is not None else False
    try:
        ray.init(address=address, namespace="distca", log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:  # ConnectionError, RuntimeError, AuthenticationError, ...
        where = named or "this machine (address auto)"
        if type(exc).__name__ == "AuthenticationError" or any(sign in str(exc) for sign in _AUTH_SIGNS):
            raise CLIError(_auth_line(where, token)) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CLIError(f"cannot reach a Ray cluster at {where}: {first}") from None


def worker_pythonpath(*dirs) -> str:
    """The ``PYTHONPATH`` for a Ray ``runtime_env`` whose workers must import from ``dirs``: those
    first, then this process's own ``PYTHONPATH`` (each entry once). Ray starts a worker from a
    script inside its package, so a Ray (or any dependency) found only through this process's
    ``PYTHONPATH``, as on a machine where wheels were installed with ``pip --target``, is found
    by the workers only if that path goes along."""
    given = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(dict.fromkeys([str(d) for d in dirs] + [p for p in given.split(os.pathsep) if p]))
