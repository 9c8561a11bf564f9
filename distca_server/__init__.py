"""distca server side: kernels, the per-server executor, transports, participants, runtimes.

``launch``, ``shutdown`` and ``status`` control a job on Ray (see :mod:`distca_server.runtime.job`);
they import Ray only when called.
"""

from .errors import DistCAError

__all__ = ["DistCAError", "launch", "shutdown", "status"]


def launch(*args, **kwargs):
    """Start a distca job on the current Ray cluster (see :func:`distca_server.runtime.job.launch`)."""
    from .runtime.job import launch as _launch
    return _launch(*args, **kwargs)


def shutdown(name: str = "default") -> int:
    """Stop a distca job (see :func:`distca_server.runtime.job.shutdown`)."""
    from .runtime.job import shutdown as _shutdown
    return _shutdown(name)


def status(name: str = "default") -> dict:
    """A distca job's state (see :func:`distca_server.runtime.job.status`)."""
    from .runtime.job import status as _status
    return _status(name)
