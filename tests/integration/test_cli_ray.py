"""The ``distca`` command against real Ray clusters: one-line errors, ``status --json`` and
``--watch`` on a running job (live clients only, no stale load on a dead server), ``up``/``down``,
and Ray's token authentication with an explicit ``--address``.

The in-process tests share this module's local Ray instance (``main`` finds Ray initialised and
uses it); the token tests start their own head node with ``ray start --head`` on 127.0.0.1 (own
temp dir and ``HOME``, so its token is its own) and run the command as a user would, in a
subprocess.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from distca_cli import main  # noqa: E402
from scripts import ROOT  # noqa: E402
from timing import until  # noqa: E402

LENS = [[61, 3, 250], [140, 1, 1, 90]]


def _one_line(capsys, prefix):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix), err
    return err[0]


def _json_status(capsys, name):
    capsys.readouterr()
    assert main(["status", "--name", name, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_missing_job_is_one_line(local_ray, capsys):
    assert main(["status", "--name", "nope"]) == 1
    _one_line(capsys, "distca status: no distca job named 'nope' on this Ray cluster")
    assert main(["status", "--name", "nope", "--watch", "--count", "1"]) == 1
    _one_line(capsys, "distca status: no distca job named 'nope'")
    assert main(["down", "--name", "nope"]) == 1
    _one_line(capsys, "distca down: no distca job named 'nope'")


def test_status_json_watch_live_clients_and_dead_servers(local_ray, capsys):
    from ray_workers import TrainWorker
    assert main(["up", "--name", "cli", "--servers", "2", "--min-shard", "8", "--timeout", "10",
                 "--failure-grace", "1", "--server-restarts", "0"]) == 0
    assert "distca job 'cli' up: dedicated mode, 2 attention servers" in capsys.readouterr().out
    try:
        assert main(["up", "--name", "cli"]) == 1
        _one_line(capsys, "distca up: a distca job named 'cli' is already running")

        workers = [TrainWorker.remote("cli", r, 2, 10.0) for r in range(2)]
        results = ray.get([w.step.remote(LENS[r], 0) for r, w in enumerate(workers)], timeout=120)
        assert all(r["ok"] for r in results), results
        # a server counts a round just after sending its results: its clients can return first
        status_now = functools.partial(_json_status, capsys, "cli")
        st = until(status_now, ok=lambda s: all(row["rounds_served"] == 4 for row in s["servers"]), poll_s=0.5)
        assert st["clients"] == [0, 1] and st["clients_gone"] == [] and st["steps_planned"] == 1
        for row in st["servers"]:  # one step of 2 layers: 2 forward and 2 backward rounds
            assert row["state"] == "serving" and row["rounds_served"] == 4 and row["bytes_sent"] > 0
            assert row["last_flops"] > 0 and row["last_tasks"] >= 1 and row["last_error"] == ""

        ray.kill(workers[1], no_restart=True)  # a training worker dies: status lists live clients only
        st = until(status_now, ok=lambda s: s["clients_gone"] == [1], poll_s=0.5)
        assert st["clients_gone"] == [1] and st["clients"] == [0], st
        server1 = ray.get_actor("distca-server-cli-1", namespace="distca")
        ray.kill(server1, no_restart=True)  # a server dies: its row keeps no load from the last plan
        st = until(status_now, ok=lambda s: s["servers"][1]["state"] in ("dead", "unreachable"), poll_s=0.5)
        assert st["servers"][1]["state"] in ("dead", "unreachable"), st
        dead = st["servers"][1]
        assert dead["last_flops"] is None and dead["last_tasks"] is None and dead["rounds_served"] is None
        assert st["last"]["server_flops"]  # the plan record itself is kept

        assert main(["status", "--name", "cli", "--watch", "--count", "2", "--interval", "0.1"]) == 0
        out = capsys.readouterr().out
        assert "MiB" in out and dead["state"][:6] in out and "serving" in out  # rich wraps narrow columns
        assert main(["status", "--name", "cli"]) == 0
        table = capsys.readouterr().out.splitlines()
        assert "live [0], gone [1]" in table[0]
        assert table[-1].split() == ["1", dead["node"], dead["state"], "-", "-", "-", "-"]
    finally:
        main(["down", "--name", "cli"])
    assert "stopped 2 actors of job 'cli'" in capsys.readouterr().out  # the scheduler and server 0


# ---- Ray's token authentication, as a user meets it ------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def token_head():
    """A Ray head node on 127.0.0.1 with token authentication on (Ray's default), its token in
    its own ``HOME``; yields ``(address, env)``, env being what a user on the head has."""
    home, temp = Path(tempfile.mkdtemp(prefix="dch")), Path(tempfile.mkdtemp(prefix="dcr"))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # a head node on loopback
               PYTHONPATH=os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests" / "integration")))
    ray_cli = Path(sys.executable).parent / "ray"
    log = open(temp / "head.log", "w")
    # `ray start --head` turns token authentication on with RAY_AUTH_MODE=token (or a token already
    # in ~/.ray/auth_token), and wants the token made first. The users below do not set the mode.
    subprocess.run([str(ray_cli), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=120)
    head = subprocess.Popen([str(ray_cli), "start", "--head", f"--port={port}", f"--temp-dir={temp}",
                             "--include-dashboard=false", "--num-cpus=1", "--block"],
                            env=dict(env, RAY_AUTH_MODE="token"), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        ready = until(lambda: head.poll() is not None or
                       "Ray runtime started" in (temp / "head.log").read_text(errors="replace"), poll_s=0.5)
        ready = ready and head.poll() is None
        assert ready, (temp / "head.log").read_text(errors="replace")[-2000:]
        yield address, env
    finally:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        log.close()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)


def _distca(env, *argv):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "distca_cli", *argv], capture_output=True, text=True,
                         timeout=180, cwd=ROOT, env=env)
    return out, time.monotonic() - start


def _startup_s(env):
    """How long a subprocess takes to start Python and import what the command imports (Ray,
    torch): seconds on an idle machine, many more on a loaded one."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import distca_cli, ray"], check=True, capture_output=True,
                   timeout=180, cwd=ROOT, env=env)
    return time.monotonic() - start


def test_token_missing_or_wrong_is_one_line_within_seconds(token_head):
    address, env = token_head
    no_home = tempfile.mkdtemp(prefix="dcn")
    try:
        cases = {"wants an authentication token": dict(env, HOME=no_home),
                 "refused the token this machine sent": dict(env, RAY_AUTH_TOKEN="0" * 32)}
        for words, case_env in cases.items():
            startup = _startup_s(case_env)  # measured beside the command: a cold start is no retry
            out, seconds = _distca(case_env, "status", "--address", address)
            lines = out.stderr.strip().splitlines()
            assert out.returncode == 1 and len(lines) == 1, out.stderr
            assert lines[0].startswith(f"distca status: the Ray cluster at {address} {words}")
            assert "~/.ray/auth_token" in lines[0]
            # not Ray's half-minute of retries: the command's own time, beyond starting up, is seconds
            assert seconds - startup < 20, (seconds, startup)
    finally:
        shutil.rmtree(no_home, ignore_errors=True)


def test_token_found_for_an_explicit_address(token_head):
    address, env = token_head  # RAY_AUTH_MODE unset: the CLI sends the token in ~/.ray/auth_token
    out, _ = _distca(env, "status", "--address", address)
    assert out.returncode == 1
    assert out.stderr.strip() == "distca status: no distca job named 'default' on this Ray cluster"
    out, _ = _distca(env, "up", "--address", address, "--name", "auth", "--mode", "inplace", "--timeout", "10")
    assert out.returncode == 0 and "distca job 'auth' up: inplace mode" in out.stdout, out.stderr
    out, _ = _distca(dict(env, RAY_ADDRESS=address), "status", "--name", "auth", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["mode"] == "inplace", out.stderr
    out, _ = _distca(env, "down", "--address", address, "--name", "auth")
    assert out.returncode == 0 and "stopped 1 actors of job 'auth'" in out.stdout, out.stderr
