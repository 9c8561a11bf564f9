"""distca client: the thin shim a training loop calls once per attention layer."""

from distca_server.errors import DistCAError

from .client import AttendHandle, DistCAClient
from .functional import varlen_attention

__all__ = ["AttendHandle", "DistCAClient", "DistCAError", "varlen_attention"]
