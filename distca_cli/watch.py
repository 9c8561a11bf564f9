"""``distca status --watch``: the status table, live, redrawn in place every few seconds (rich).

Rich is in the ``monitoring`` extra; without it ``--watch`` says so in one line. The table has the
columns of ``distca status`` (:data:`distca_cli.COLUMNS`): servers, their state, rounds served,
the last plan's load, bytes sent and their last error.
"""

from __future__ import annotations

import time
from typing import Callable

from .connect import CLIError

__all__ = ["DEFAULT_INTERVAL_S", "MAX_INTERVAL_S", "check_interval", "render", "watch"]

DEFAULT_INTERVAL_S = 2.0
MAX_INTERVAL_S = 3600.0  # a live view redrawn less than hourly is none (and time.sleep overflows past ~9e9 s)


def check_interval(interval_s) -> float:
    """``interval_s`` if it is a number of seconds in (0, :data:`MAX_INTERVAL_S`].

    Raises:
        CLIError: naming the value.
    """
    if not 0 < interval_s <= MAX_INTERVAL_S:  # NaN fails too
        raise CLIError(f"--interval must be a number of seconds in (0, {MAX_INTERVAL_S:g}], got {interval_s!r}")
    return interval_s


def render(st: dict, note: str = ""):
    """The rich table of a status dict, ``note`` under it; servers not serving in red."""
    from rich.table import Table

    from . import COLUMNS, status_header

    table = Table(*(title for title, _, _ in COLUMNS), title="\n".join(status_header(st)),
                  title_justify="left", caption=note or None, expand=False)
    for s in st["servers"]:
        state = s["state"]
        style = "red" if state in ("dead", "unreachable", "suspect", "unregistered", "gone") else None
        table.add_row(*(cell(s) for _, _, cell in COLUMNS), style=style)
    return table


def watch(fetch: Callable[[], dict], interval_s: float = DEFAULT_INTERVAL_S, count: int | None = None,
          console=None) -> int:
    """Redraw ``fetch()``'s status every ``interval_s`` seconds until Ctrl-C (or ``count``
    redraws). A fetch that fails with a one-line error (e.g. the job went down) keeps the last
    table and shows that line under it, and the watch goes on; a first fetch that fails ends it.

    Raises:
        CLIError: rich is not installed, a bad interval, or the first fetch failed.
    """
    check_interval(interval_s)
    try:
        from rich.live import Live
    except ImportError:
        raise CLIError("--watch needs rich: pip install 'distca[monitoring]'") from None
    st, error = fetch(), ""  # a missing job is an error before the live view starts
    shown = 0
    with Live(render(st), console=console, auto_refresh=False) as live:
        while True:
            note = time.strftime("%H:%M:%S") + f"  refreshed every {interval_s:g} s; Ctrl-C to stop"
            live.update(render(st, f"{error}\n{note}" if error else note), refresh=True)
            shown += 1
            if count is not None and shown >= count:
                return 0
            time.sleep(interval_s)
            try:
                st, error = fetch(), ""
            except CLIError as exc:  # keep the last table, say what went wrong under it
                error = str(exc)
