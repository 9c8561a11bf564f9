"""distca server side: kernels, the per-server executor, transports, participants."""

from .errors import DistCAError

__all__ = ["DistCAError"]
