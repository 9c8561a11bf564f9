"""distca server side: kernels, the per-server executor, transports, participants."""

from .errors import DistCAError

__all__ = ["DistCAError", "launch", "shutdown", "status"]


def launch(*args, **kwargs):
    """Start a distca job on the current Ray cluster (see :func:`distca_server.job.launch`)."""
    from .job import launch as _launch
    return _launch(*args, **kwargs)


def shutdown(name: str = "default") -> int:
    """Stop a distca job (see :func:`distca_server.job.shutdown`)."""
    from .job import shutdown as _shutdown
    return _shutdown(name)


def status(name: str = "default") -> dict:
    """A distca job's state (see :func:`distca_server.job.status`)."""
    from .job import status as _status
    return _status(name)
