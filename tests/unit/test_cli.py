"""The distca command line parses its subcommands without importing torch or ray."""

import subprocess
import sys

from distca_cli import build_parser, format_status


def test_subcommands_registered():
    parser = build_parser()
    for argv in (["up", "--servers", "2", "--mode", "inplace"], ["status", "--name", "x"], ["down"],
                 ["simulate", "--gpus", "16", "--context", "16K"]):
        args = parser.parse_args(argv)
        assert callable(args.func)
    assert parser.parse_args(["up"]).servers == 1


def test_cli_import_is_light():
    code = ("import sys; import distca_cli as c; import distca_sim.simulate, distca_sim.workloads; "
            "c.build_parser(); print('torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_format_status_table():
    st = {"name": "j", "mode": "dedicated", "world_size": 2, "clients": [0, 1], "epoch": 3, "next_step": 9,
          "steps_planned": 8,
          "last": {"step": 8, "batch": 0, "imbalance_before": 1.9, "imbalance_after": 1.05, "num_tasks": 12,
                   "bytes": {"forward": 2**21, "backward": 2**22}, "plan_ms": 0.4},
          "servers": [{"server": 0, "node": "node-a", "state": "serving", "rounds_served": 40,
                       "last_flops": 3e9, "last_tasks": 7},
                      {"server": 1, "node": "node-b", "state": "dead", "rounds_served": None,
                       "last_flops": None, "last_tasks": None}]}
    text = format_status(st)
    assert "1.900 -> 1.050" in text and "2.0 MiB" in text
    lines = text.splitlines()
    assert lines[-2].split()[:4] == ["0", "node-a", "serving", "40"]
    assert lines[-1].split()[:3] == ["1", "node-b", "dead"]
