"""Timestamped, levelled logs of distca's actors (scheduler, attention servers, clients).

Ray writes what an actor's process prints to stderr into that worker's log file, which the Ray
dashboard's log view (and ``ray logs``) shows. Python's ``logging`` prints nothing below WARNING
and without a time unless a handler is configured, so every actor calls :func:`configure_logging`
when it starts: one stderr handler on distca's package loggers, with time, level, component and
logger name on every line. ``DISTCA_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``...) sets the
level; the default is ``INFO``.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOG_LEVEL_ENV", "PACKAGES", "configure_logging"]

LOG_LEVEL_ENV = "DISTCA_LOG_LEVEL"
PACKAGES = ("scheduler", "distca_server", "distca_client")  # the loggers distca logs under
_MARK = "_distca_handler"


def configure_logging(component: str, level: str | int | None = None) -> logging.Handler:
    """Send distca's log records to stderr as
    ``2026-01-01 12:00:00,123 INFO distca-server-job-0 distca_server.runtime.server_actor: ...``.

    Idempotent: a second call in the same process replaces the component name and level.

    Args:
        component: what the process is, e.g. ``"distca-scheduler-default"`` (on every line).
        level: a ``logging`` level or its name; default ``$DISTCA_LOG_LEVEL`` or ``INFO``.

    Returns:
        The handler (tests attach it to other streams).

    Raises:
        ValueError: an unknown level name.
    """
    level = level if level is not None else os.environ.get(LOG_LEVEL_ENV, "INFO")
    if isinstance(level, str):
        name = level.strip().upper()
        if not isinstance(logging.getLevelName(name), int):
            raise ValueError(f"unknown log level {level!r} (from {LOG_LEVEL_ENV} or the argument); "
                             f"use DEBUG, INFO, WARNING, ERROR or CRITICAL")
        level = logging.getLevelName(name)
    formatter = logging.Formatter(f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s")
    handler = None
    for package in PACKAGES:
        logger = logging.getLogger(package)
        for h in logger.handlers:
            if getattr(h, _MARK, False):
                handler = h
        if handler is None:
            handler = logging.StreamHandler(sys.stderr)
            setattr(handler, _MARK, True)
        if handler not in logger.handlers:
            logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False  # a root handler (Ray's logging config, pytest) would print it twice
    handler.setFormatter(formatter)
    return handler
