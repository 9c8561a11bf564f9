"""The ``distca`` command: ``up``, ``status``, ``down`` (the Ray runtime) and ``simulate``.

``up | status | down`` drive a job through :mod:`distca_server`'s top-level API (``launch``,
``status``, ``shutdown``); ``simulate`` is :mod:`distca_sim.cli`. Importing this module imports
neither torch nor ray: the job API loads them when a runtime command runs.

Examples::

    distca up --servers 4 --mode dedicated       # inside a Ray cluster (``ray start`` / ``ray up``)
    distca status
    distca down
    distca simulate --gpus 64 --tp 8 --context 128K
"""

from __future__ import annotations

import argparse
import sys

from distca_server import launch, shutdown, status
from distca_sim import cli as simulate_cli

__all__ = ["build_parser", "format_status", "main"]


def _connect(address: str) -> None:
    import ray  # only the runtime commands need it
    if not ray.is_initialized():
        ray.init(address=address, namespace="distca", log_to_driver=False)


def _up(args) -> int:
    _connect(args.address)
    try:
        launch(name=args.name, servers=args.servers, mode=args.mode,
               epsilon=args.epsilon, timeout_s=args.timeout, detached=True)
    except ValueError as exc:  # e.g. a job of that name is running: one line, no traceback
        print(f"distca up: {exc}", file=sys.stderr)
        return 1
    print(f"distca job {args.name!r} up: {args.mode} mode"
          + (f", {args.servers} attention servers" if args.mode == "dedicated" else ""))
    return 0


def format_status(st: dict) -> str:
    """The ``distca status`` table of a job's status dict (:func:`distca_server.status`)."""
    last = st.get("last") or {}
    if st.get("scheduler", "running") != "running":
        lines = [f"job {st['name']}: scheduler {st['scheduler']}; {len(st['servers'])} attention "
                 f"servers found by name"]
    else:
        lines = [f"job {st['name']}: {st['mode']} mode, clients {st['world_size'] or 0} "
                 f"(registered {st['clients']}), group epoch {st['epoch']}, next step {st['next_step']}"]
    if last:
        lines.append(f"last plan: step {last['step']} batch {last['batch']}, imbalance "
                     f"{last['imbalance_before']:.3f} -> {last['imbalance_after']:.3f}, "
                     f"{last['num_tasks']} CA-tasks, forward {last['bytes']['forward'] / 2**20:.1f} MiB, "
                     f"backward {last['bytes']['backward'] / 2**20:.1f} MiB per round, plan {last['plan_ms']:.2f} ms, "
                     f"cut {last.get('cut_ms', 0.0):.2f} ms")
    header = f"{'server':>6}  {'node':<15}  {'state':<18}  {'rounds':>7}  {'last GFLOP':>10}  {'tasks':>5}"
    lines.append(header)
    for s in st["servers"]:
        flops = s.get("last_flops")
        lines.append(f"{s['server']:>6}  {s['node']:<15}  {s['state']:<18}  "
                     f"{'-' if s['rounds_served'] is None else s['rounds_served']:>7}  "
                     f"{'-' if flops is None else f'{flops / 1e9:.2f}':>10}  "
                     f"{'-' if s.get('last_tasks') is None else s['last_tasks']:>5}")
    return "\n".join(lines)


def _status(args) -> int:
    _connect(args.address)
    try:
        st = status(args.name)
    except ValueError as exc:  # no such job: one line, no traceback
        print(f"distca status: {exc}", file=sys.stderr)
        return 1
    print(format_status(st))
    return 0


def _down(args) -> int:
    _connect(args.address)
    n = shutdown(args.name)
    print(f"stopped {n} actors of job {args.name!r}")
    return 0


def _register_runtime(subparsers) -> None:
    up = subparsers.add_parser("up", help="start a job's scheduler and attention servers on Ray")
    up.add_argument("--name", default="default")
    up.add_argument("--servers", type=int, default=1)
    up.add_argument("--mode", choices=["dedicated", "inplace"], default="dedicated")
    up.add_argument("--epsilon", type=float, default=0.05)
    up.add_argument("--timeout", type=float, default=60.0, help="seconds before DistCAError")
    up.add_argument("--address", default="auto", help="Ray cluster address")
    up.set_defaults(func=_up)
    st = subparsers.add_parser("status", help="print a job's servers, load and bytes")
    st.add_argument("--name", default="default")
    st.add_argument("--address", default="auto")
    st.set_defaults(func=_status)
    down = subparsers.add_parser("down", help="stop a job's actors")
    down.add_argument("--name", default="default")
    down.add_argument("--address", default="auto")
    down.set_defaults(func=_down)


def build_parser() -> argparse.ArgumentParser:
    """The ``distca`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="distca", description="Core attention disaggregation runtime.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _register_runtime(sub)
    simulate_cli.register(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``distca`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
