"""distca client: the thin shim a training loop calls once per attention layer."""

from distca_server.errors import DistCAError

from .client import DistCAClient

__all__ = ["DistCAClient", "DistCAError"]
