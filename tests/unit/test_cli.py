"""The distca command line: its subcommands parse without importing torch or ray, its tables,
and the errors a user meets before any Ray cluster is involved (one line, exit status 1)."""

import io
import os
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distca_cli import build_parser, format_status, main
from distca_cli.connect import CLIError, connect, worker_pythonpath

ROOT = Path(__file__).resolve().parents[2]


def test_subcommands_registered():
    parser = build_parser()
    for argv in (["up", "--servers", "2", "--mode", "inplace"], ["status", "--name", "x"], ["down"],
                 ["simulate", "--gpus", "16", "--context", "16K"]):
        args = parser.parse_args(argv)
        assert callable(args.func)
    assert parser.parse_args(["up"]).servers is None  # 1 in dedicated mode, refused in in-place mode
    up = parser.parse_args(["up", "--min-shard", "64", "--timeout", "30", "--failure-grace", "2",
                            "--start-timeout", "90", "--server-restarts", "3", "--scheduler-restarts", "0",
                            "--backend", "torch_cpu", "--address", "10.0.0.1:6379"])
    assert (up.min_shard, up.timeout_s, up.failure_grace_s, up.start_timeout_s, up.server_restarts,
            up.scheduler_restarts, up.backend, up.address) == (64, 30.0, 2.0, 90.0, 3, 0, "torch_cpu", "10.0.0.1:6379")
    st = parser.parse_args(["status", "--watch", "--interval", "0.5"])
    assert st.watch and not st.json and st.interval == 0.5
    with pytest.raises(SystemExit):  # --json and --watch exclude each other
        parser.parse_args(["status", "--json", "--watch"])


def test_cli_import_is_light():
    code = ("import sys; import distca_cli as c; import distca_sim.simulate, distca_sim.workloads; "
            "c.build_parser(); print('torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _run_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "distca_cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def test_servers_in_inplace_mode_refused_in_one_line():
    out = _run_cli("up", "--mode", "inplace", "--servers", "4")
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distca up: --servers 4 is for dedicated mode")
    assert "every client rank serves its share" in lines[0]


def test_bad_settings_refused_before_ray():
    for argv, words in ((["--min-shard", "0"], "min_shard must be a positive int, got 0"),
                        (["--epsilon", "-1"], "epsilon must be a finite number >= 0, got -1.0"),
                        (["--timeout", "0"], "timeout_s must be a finite number > 0, got 0.0"),
                        (["--start-timeout", "nan"], "start_timeout_s must be a finite number > 0, got nan"),
                        (["--transport", "tcp"], "transport must be one of ('torch_dist', 'shm', 'nvshmem'), got 'tcp'")):
        out = _run_cli("up", *argv, "--address", "127.0.0.1:1")  # never reached
        assert out.returncode == 1
        assert out.stderr.strip().splitlines() == [f"distca up: {words}"]


def test_no_cluster_at_the_address_is_one_line():
    with socket.socket() as s:  # a loopback port nobody listens at
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run_cli("status", "--address", f"127.0.0.1:{port}")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"distca status: cannot reach a Ray cluster at 127.0.0.1:{port}")
    with pytest.raises(CLIError, match="cannot reach"):
        connect(f"127.0.0.1:{port}")


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


def _status(**server):
    return {"name": "j", "mode": "dedicated", "world_size": 3, "clients": [0, 2], "clients_gone": [1],
            "epoch": 1, "next_step": 4, "steps_planned": 4, "last": {},
            "servers": [dict({"server": 0, "node": "127.0.0.1", "state": "serving", "rounds_served": 12,
                              "last_flops": 2.5e9, "last_tasks": 3, "last_error": "", "bytes_sent": 3 * 2**20},
                             **server),
                        {"server": 1, "node": "127.0.0.1", "state": "unreachable", "rounds_served": None,
                         "last_flops": None, "last_tasks": None, "last_error": None, "bytes_sent": None}]}


def test_format_status_bytes_errors_and_gone_clients():
    text = format_status(_status(last_error="server 0: step 3 failed; lost: attention server 1"))
    assert "live [0, 2], gone [1]" in text.splitlines()[0]
    header, row0, row1 = text.splitlines()[-3:]
    assert "MiB sent" in header and header.endswith("last error")
    assert row0.split()[:7] == ["0", "127.0.0.1", "serving", "12", "2.50", "3", "3.0"]
    assert row0.endswith("lost: attention server 1")
    assert row1.split() == ["1", "127.0.0.1", "unreachable", "-", "-", "-", "-"]  # no stale load


def test_watch_redraws_until_count_and_keeps_the_last_table_on_errors():
    pytest.importorskip("rich")
    from rich.console import Console

    from distca_cli.watch import watch
    answers = [_status(rounds_served=12), CLIError("no distca job named 'j' on this Ray cluster"),
               _status(rounds_served=20)]
    fetched = []

    def fetch():
        a = answers[len(fetched)]
        fetched.append(a)
        if isinstance(a, Exception):
            raise a
        return a
    buf = io.StringIO()
    console = Console(file=buf, width=200, force_terminal=True, color_system=None)  # every frame written
    assert watch(fetch, interval_s=0.01, count=3, console=console) == 0
    assert len(fetched) == 3
    out = buf.getvalue()
    assert "no distca job named 'j'" in out and "unreachable" in out and "MiB sent" in out
    assert "20" in out.split("no distca job named")[-1]  # the table after the error is the new one
    with pytest.raises(CLIError, match="interval"):
        watch(fetch, interval_s=0)


_JSON_STATUS = """
import contextlib, sys
import ray
from distca_cli import main
ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, namespace="distca",
         log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": sys.argv[1]}})
with contextlib.redirect_stdout(sys.stderr):  # stdout carries what `status --json` prints, nothing else
    assert main(["up", "--name", "j", "--servers", "2", "--backend", "reference"]) == 0
try:
    code = main(["status", "--name", "j", "--json"])
finally:
    with contextlib.redirect_stdout(sys.stderr):
        main(["down", "--name", "j"])
    ray.shutdown()
sys.exit(code)
"""


@pytest.mark.slow  # a local Ray instance and a job's actors (the unit tier starts no Ray)
def test_json_status_is_json():
    out = subprocess.run([sys.executable, "-c", _JSON_STATUS, str(ROOT)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    st = json.loads(out.stdout)  # the whole output is one JSON object
    assert (st["name"], st["mode"], st["scheduler"]) == ("j", "dedicated", "running")
    assert [s["server"] for s in st["servers"]] == [0, 1]
    assert all(s["node"] and s["state"] not in ("dead", "unreachable") for s in st["servers"])


def test_worker_pythonpath_puts_the_dirs_first_and_keeps_this_process_path(monkeypatch):
    """Ray workers find the project first and, after it, whatever this process found on its own
    PYTHONPATH (Ray itself, where wheels were installed with pip --target)."""
    sep = os.pathsep
    monkeypatch.setenv("PYTHONPATH", sep.join(["/tmp/site", "/repo", ""]))
    assert worker_pythonpath(Path("/repo"), "/repo/examples") == sep.join(["/repo", "/repo/examples", "/tmp/site"])
    monkeypatch.delenv("PYTHONPATH")
    assert worker_pythonpath("/repo") == "/repo"


# ---- one line, exit status 1, before Ray: the rest of the user errors -----------------------------------
def test_a_bad_backend_is_refused_before_connecting():
    """launch's checks of this machine (a backend name some install knows) run before connect."""
    out = _run_cli("up", "--backend", "nope", "--address", "127.0.0.1:1")  # were it reached: "cannot reach"
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distca up: backend must be 'auto' or one of"), lines
    assert "'nope'" in lines[0]


def test_values_past_the_bounds_are_one_line_before_ray(capsys):
    for argv, field, value in ((["--min-shard", "99999999999999999999999"], "min_shard", "99999999999999999999999"),
                               (["--max-report-tokens", str(2**63)], "max_report_tokens", str(2**63)),
                               (["--scheduler-restarts", str(2**63)], "scheduler_restarts", str(2**63)),
                               (["--timeout-s", "1e10"], "timeout_s", "10000000000.0"),
                               (["--servers", str(2**20 + 1)], "servers", str(2**20 + 1))):
        assert main(["up", *argv, "--address", "127.0.0.1:1"]) == 1  # were Ray reached: "cannot reach"
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"distca up: {field} must be"), lines
        assert lines[0].endswith(f"got {value}"), lines
    out = _run_cli("up", "--min-shard", "99999999999999999999999", "--address", "127.0.0.1:1")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distca up: min_shard must be")
    assert "99999999999999999999999" in lines[0]


@pytest.mark.parametrize("argv, start, prog", [
    (["up", "--min-shard", "abc"], "argument --min-shard: invalid int value: 'abc'", "distca up"),
    (["simulate", "--gpus", "abc"], "argument --gpus: invalid int value: 'abc'", "distca simulate"),
    (["simulate", "--context", "0"], "argument --context: token count must be positive: '0'", "distca simulate"),
    (["status", "--json", "--watch"], "argument --watch: not allowed with argument --json", "distca status"),
    (["down", "--nme", "x"], "unrecognized arguments: --nme x", "distca"),
    (["launch"], "argument COMMAND: invalid choice: 'launch'", "distca"),
])
def test_argparse_errors_are_one_line_and_exit_status_1(argv, start, prog, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: {start}") and lines[0].endswith(f"(see {prog} --help)"), lines


def test_argparse_errors_exit_1_from_the_command_line():
    out = _run_cli("up", "--min-shard", "abc")
    assert out.returncode == 1 and out.stderr.splitlines() == [
        "distca up: argument --min-shard: invalid int value: 'abc' (see distca up --help)"]


def test_simulate_bad_input_exits_1(capsys):
    assert main(["simulate", "--gpus", "0"]) == 1
    assert capsys.readouterr().err.splitlines() == ["distca simulate: error: gpus must be an int >= 1, got 0"]


@pytest.mark.parametrize("argv, words", [
    (["--interval", "5"], "--interval 5 is the seconds between --watch redraws; add --watch, or drop --interval"),
    (["--json", "--interval", "5"], "--interval 5 is the seconds between --watch redraws"),
    (["--watch", "--interval", "inf"], "--interval must be a number of seconds in (0, 3600], got inf"),
    (["--watch", "--interval", "1e10"], "--interval must be a number of seconds in (0, 3600], got 10000000000.0"),
    (["--watch", "--interval", "nan"], "--interval must be a number of seconds in (0, 3600], got nan"),
    (["--watch", "--interval", "0"], "--interval must be a number of seconds in (0, 3600], got 0.0"),
])
def test_status_interval_is_checked_before_ray(argv, words, capsys):
    assert main(["status", *argv, "--address", "127.0.0.1:1"]) == 1  # were Ray reached: "cannot reach"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"distca status: {words}"), lines


def test_watch_refuses_an_interval_sleep_cannot_take():
    from distca_cli.watch import MAX_INTERVAL_S, watch
    for bad in (float("inf"), 1e10, MAX_INTERVAL_S + 1):
        with pytest.raises(CLIError, match=r"--interval must be a number of seconds in \(0, 3600\]"):
            watch(lambda: pytest.fail("fetched"), interval_s=bad)


def test_up_synopsis_in_the_docs_lists_every_flag():
    from distca_cli.flags import flag
    from scheduler.config import JOB_FIELDS, PLAN_FIELDS
    text = (ROOT / "docs" / "cli.md").read_text()
    synopsis = text.split("## `distca up`", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    for name in PLAN_FIELDS + JOB_FIELDS + ("name", "address"):
        assert flag(name) in synopsis, name


def test_servers_help_says_what_inplace_mode_does_with_it():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    help_text = next(a.help for a in sub.choices["up"]._actions if a.dest == "servers")
    assert "ignored" not in help_text and "distca up refuses --servers" in help_text
    assert "ignored in in-place mode" not in (ROOT / "docs" / "config.md").read_text()
