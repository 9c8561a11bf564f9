"""The ``distca`` command: ``up``, ``status``, ``down`` (the Ray runtime) and ``simulate``.

``up | status | down`` drive a job through :mod:`distca_server`'s top-level API (``launch``,
``status``, ``shutdown``); ``simulate`` is :mod:`distca_sim.cli`. ``up``'s flags are the fields of
:class:`~scheduler.config.JobConfig` and :class:`~scheduler.config.PlanConfig` (:mod:`.flags`). Importing this module imports
neither torch nor ray: the job API loads them when a runtime command runs. Every failure a user
can cause (no cluster, a refused token, no such job, bad flags, argparse's own complaints included)
is one line on stderr and exit status 1, not a traceback.

Examples::

    distca up --servers 4 --mode dedicated       # inside a Ray cluster (``ray start`` / ``ray up``)
    distca up --mode inplace --min-shard 256 --timeout-s 120 --scheduler-restarts -1
    distca status                                # the table once
    distca status --watch                        # a live table (needs the ``monitoring`` extra)
    distca status --json                         # for scripts
    distca down
    distca simulate --gpus 64 --tp 8 --context 128K
"""

from __future__ import annotations

import argparse
import json
import sys

from distca_server import DistCAError, launch, shutdown, status
from distca_sim import cli as simulate_cli
from scheduler.config import ConfigError

from .connect import CLIError, connect
from .flags import add_config_flags, config_from_args
from .watch import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, check_interval

__all__ = ["build_parser", "format_status", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, except that a bad flag is one line and exit status 1, as every other user error
    of the command (argparse prints the whole usage block and exits 2)."""

    def error(self, message):
        self.exit(1, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _up(args) -> int:
    if args.mode == "inplace" and args.servers is not None:
        raise CLIError(f"--servers {args.servers} is for dedicated mode: in in-place mode every client "
                       f"rank serves its share of attention (the job has as many servers as clients); "
                       f"drop --servers, or use --mode dedicated")
    try:  # every setting checked here, before any Ray call: the fields, then what launch checks here
        config = config_from_args(args)
        from distca_server.runtime.job import check_here  # imports torch and ray (a runtime command)
        check_here(config)
    except ConfigError as exc:
        raise CLIError("; ".join(exc.problems)) from None
    connect(args.address)
    try:
        launch(name=args.name, config=config, detached=True)
    except (ValueError, DistCAError) as exc:  # a job of that name is running, bad settings, no room
        raise CLIError(str(exc)) from None
    except Exception as exc:  # an actor that failed in its constructor: Ray's error, first line
        raise CLIError(f"job {args.name!r} did not start: {_first_line(exc)}") from None
    print(f"distca job {args.name!r} up: {config.plan.mode} mode"
          + (f", {config.servers} attention servers" if config.plan.mode == "dedicated" else ""))
    return 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def status_header(st: dict) -> list[str]:
    """The lines above the server table: the job, its clients, and the last plan."""
    last = st.get("last") or {}
    if st.get("scheduler", "running") != "running":
        lines = [f"job {st['name']}: scheduler {st['scheduler']}; {len(st['servers'])} attention "
                 f"servers found by name"]
    else:
        gone = st.get("clients_gone") or []
        lines = [f"job {st['name']}: {st['mode']} mode, clients {st['world_size'] or 0} "
                 f"(live {st['clients']}" + (f", gone {gone}" if gone else "") + f"), "
                 f"group epoch {st['epoch']}, next step {st['next_step']}"]
    if last:
        lines.append(f"last plan: step {last['step']} batch {last['batch']}, imbalance "
                     f"{last['imbalance_before']:.3f} -> {last['imbalance_after']:.3f}, "
                     f"{last['num_tasks']} CA-tasks, forward {last['bytes']['forward'] / 2**20:.1f} MiB, "
                     f"backward {last['bytes']['backward'] / 2**20:.1f} MiB per round, plan {last['plan_ms']:.2f} ms, "
                     f"cut {last.get('cut_ms', 0.0):.2f} ms")
    return lines


# (title, width, cell of a server row): the one column list of the table and of the --watch view
def _num(value, fmt="{}"):
    return "-" if value is None else fmt.format(value)


COLUMNS = (
    ("server", 6, lambda s: str(s["server"])),
    ("node", 15, lambda s: str(s["node"])),
    ("state", 18, lambda s: str(s["state"])),
    ("rounds", 7, lambda s: _num(s.get("rounds_served"))),
    ("last GFLOP", 10, lambda s: _num(None if s.get("last_flops") is None else s["last_flops"] / 1e9, "{:.2f}")),
    ("tasks", 5, lambda s: _num(s.get("last_tasks"))),
    ("MiB sent", 9, lambda s: _num(None if s.get("bytes_sent") is None else s["bytes_sent"] / 2**20, "{:.1f}")),
    ("last error", 0, lambda s: s.get("last_error") or ""),
)


def format_status(st: dict) -> str:
    """The ``distca status`` table of a job's status dict (:func:`distca_server.status`)."""
    lines = status_header(st)
    def row(cells):
        return "  ".join(c.ljust(w) if i in (1, 2) else (c.rjust(w) if w else c)
                         for i, ((_, w, _), c) in enumerate(zip(COLUMNS, cells))).rstrip()
    lines.append(row([title for title, _, _ in COLUMNS]))
    for s in st["servers"]:
        lines.append(row([cell(s) for _, _, cell in COLUMNS]))
    return "\n".join(lines)


def job_status(name: str) -> dict:
    """:func:`distca_server.status` of job ``name``.

    Raises:
        CLIError: no such job (one line).
    """
    try:
        return status(name)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _status(args) -> int:
    if args.interval is not None and not args.watch:  # it would do nothing: say so, not ignore it
        raise CLIError(f"--interval {args.interval:g} is the seconds between --watch redraws; "
                       f"add --watch, or drop --interval")
    interval = DEFAULT_INTERVAL_S if args.interval is None else check_interval(args.interval)
    connect(args.address)
    if args.watch:
        from .watch import watch
        return watch(lambda: job_status(args.name), interval_s=interval, count=args.count)
    st = job_status(args.name)
    print(json.dumps(st, indent=1, sort_keys=True, default=str) if args.json else format_status(st))
    return 0


def _down(args) -> int:
    connect(args.address)
    n = shutdown(args.name)
    if n == 0:
        raise CLIError(f"no distca job named {args.name!r} on this Ray cluster")
    print(f"stopped {n} actors of job {args.name!r}")
    return 0


def _register_runtime(subparsers) -> None:
    address = dict(default="auto", help="Ray cluster address host:port (default: RAY_ADDRESS, else the "
                                         "cluster started on this machine); Ray's token is sent if one is found")
    up = subparsers.add_parser("up", help="start a job's scheduler and attention servers on Ray")
    up.add_argument("--name", default="default")
    add_config_flags(up)  # one flag per JobConfig / PlanConfig field: --min-shard sets min_shard
    up.add_argument("--address", **address)
    up.set_defaults(func=_up)
    st = subparsers.add_parser("status", help="print a job's servers, load, bytes and errors")
    st.add_argument("--name", default="default")
    view = st.add_mutually_exclusive_group()
    view.add_argument("--json", action="store_true", help="the status as JSON, for scripts")
    view.add_argument("--watch", action="store_true", help="a live table, refreshed every --interval s")
    st.add_argument("--interval", type=float, default=None,
                    help=f"with --watch: seconds between refreshes (default {DEFAULT_INTERVAL_S:g}, "
                         f"at most {MAX_INTERVAL_S:g})")
    st.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)  # --watch: stop after N
    st.add_argument("--address", **address)
    st.set_defaults(func=_status)
    down = subparsers.add_parser("down", help="stop a job's actors")
    down.add_argument("--name", default="default")
    down.add_argument("--address", **address)
    down.set_defaults(func=_down)


def build_parser() -> argparse.ArgumentParser:
    """The ``distca`` argument parser with every subcommand registered."""
    parser = _Parser(prog="distca", description="Core attention disaggregation runtime.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)  # each a _Parser too
    _register_runtime(sub)
    simulate_cli.register(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``distca`` console script; returns the exit status (1 after a one-line
    error on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"distca {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
