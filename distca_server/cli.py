"""The ``distca`` command line: ``up``, ``status``, ``down`` (Ray runtime) and ``simulate``.

Each subcommand lives with the code it drives and registers itself here through a
``register(subparsers)`` function; importing this module imports neither torch nor ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it adds); a module whose import fails is reported, not fatal to the others.
_SUBCOMMAND_MODULES = (
    "distca_server.launch_cli",
    "scheduler.simulate_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distca", description="Core attention disaggregation runtime.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
