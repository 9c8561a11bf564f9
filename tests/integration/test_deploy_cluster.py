"""``ray up deploy/local.yaml`` on this machine: a real Ray cluster launch through Ray's local
(on-premise) provider, a head at 127.0.0.1 and a worker host at 127.0.0.2 that the head's
autoscaler sets up, then ``distca up`` (the YAML's own head start command), a two-worker job with
one training worker per node, ``distca status`` and ``ray down``, each through
``ray up``/``ray exec`` as a user would.

Ray's fake multi-node provider cannot be used with ``ray up`` without Docker (its head only exists
inside ``ray start --autoscaling-config`` with ``RAY_FAKE_CLUSTER=1``, and ``ray up`` tries to
terminate and relaunch it); the closest Ray offers on one machine is the local provider with this
machine's loopback addresses as its hosts. What differs from a real on-premise cluster: Ray's SSH
and rsync calls go to :mod:`loopback_ssh` (the command runs here, in the host's own PID and mount
namespaces and home directory; files are copied here), the ``pip install`` setup line is replaced
by an import check of the synced checkout (on ``PYTHONPATH``, with the ``distca`` console script
as a two-line shim), and the worker host's Ray gets its own address and ports.

Isolation: everything runs in fresh Linux network, PID and mount namespaces (``unshare``): the
only network is a private loopback, so nothing can reach beyond 127.0.0.0/8, Ray's ports cannot
clash with other Ray instances on the machine, ``ray stop`` (which ``ray up``/``ray down`` run)
only sees this cluster's processes, and ``/tmp`` is a private tmpfs (Ray's SSH control paths and
config cache); leaving the namespace ends every process in it. ``HOME`` and ``RAY_TMPDIR`` are a
temporary directory, so the auth token and session files are the test's own.

Run directly (``python tests/integration/test_deploy_cluster.py``) it prints each phase's time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml") if __name__ != "__main__" else __import__("yaml")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
JOB_LENS = [[[61, 3, 250], [140, 1, 1, 90]], [[400], [7, 7, 7, 100]]]
HEAD, WORKERS = "127.0.0.1", ["127.0.0.2"]  # the worker host is this machine's second loopback address


def _namespaces_available() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(["unshare", "--net", "--pid", "--mount", "--fork", "--mount-proc", "sh", "-c",
                            "ip link set lo up && mount -t tmpfs tmpfs /tmp"], capture_output=True, timeout=30)
    return probe.returncode == 0


def cluster_config(work: Path) -> dict:
    """deploy/local.yaml for the hosts :data:`HEAD` and :data:`WORKERS` in the test's namespaces."""
    config = yaml.safe_load((ROOT / "deploy" / "local.yaml").read_text())
    config["cluster_name"] = f"distca-test-{os.getpid()}"
    config["provider"].update(head_ip=HEAD, worker_ips=WORKERS)
    # Two nodes share this machine: the worker's Ray runs on its own loopback address (a real host
    # has its own address, which Ray finds by itself), and on ports of its own (Ray binds the
    # object manager, metrics and dashboard agent of a non-loopback node on all interfaces).
    start = config["worker_start_ray_commands"]
    for port, other in (("--object-manager-port=8076", "--object-manager-port=8077"),
                        ("--metrics-export-port=8080", "--metrics-export-port=8081")):
        assert port in start[-1], start
        start[-1] = start[-1].replace(port, other)
    start[-1] += f" --dashboard-agent-listen-port=52366 --node-ip-address={WORKERS[0]}"
    config["auth"] = {"ssh_user": os.environ.get("USER", "root"), "ssh_private_key": str(work / "id_test")}
    # The one line that needs a package index: the checkout synced to ~/distca is already
    # importable (PYTHONPATH in ~/.bashrc); check that it is the synced copy that imports.
    install = config["setup_commands"][0]
    assert "pip install" in install and "distca[gpu]" in install, install
    config["setup_commands"][0] = ('python -c "import distca_cli, distca_server, os; '
                                   'assert distca_server.__file__.startswith(os.path.expanduser(\'~/distca/\'))"')
    return config


def _env(work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTHON"))}
    env.update(HOME=str(work / "home"), RAY_TMPDIR=str(work / "ray"), RAY_USAGE_STATS_ENABLED="0",
               LOOPBACK_SSH_HOMES=str(work / "nodes"),
               PATH=os.pathsep.join([str(work / "bin"), str(Path(sys.executable).parent), env.get("PATH", "")]))
    return env


def prepare(work: Path) -> Path:
    """The shims, the user's and the head's home directories (the head's ~/.bashrc stands for a
    node image's environment), the user's auth token; returns the cluster config's path."""
    (work / "bin").mkdir()
    for tool in ("ssh", "rsync"):
        shim = work / "bin" / tool
        shim.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'loopback_ssh.py'} \"$0\" \"$@\"\n")
        shim.chmod(0o755)
    # The console script `pip install` would make from pyproject's [project.scripts].
    (work / "bin" / "distca").write_text(f"#!/bin/sh\nexec {sys.executable} -m distca_cli \"$@\"\n")
    (work / "bin" / "distca").chmod(0o755)
    (work / "id_test").write_text("not a key: loopback_ssh does not use it\n")
    (work / "home").mkdir()  # the user's: where `ray get-auth-token --generate` writes the token
    for host in [HEAD] + WORKERS:  # each node's home
        home = work / "nodes" / host
        home.mkdir(parents=True)
        (home / ".bashrc").write_text(f"export PATH={work / 'bin'}:{Path(sys.executable).parent}:$PATH\n"
                                      f"export PYTHONPATH=$HOME/distca\n")
    (work / "ray").mkdir()
    subprocess.run(["ray", "get-auth-token", "--generate"], env=_env(work), check=True,
                   capture_output=True, timeout=120)
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster_config(work)))
    return path


def _run(phase: str, cmd: list[str], env: dict, times: dict, log: Path, timeout: float = 300) -> str:
    """Run one phase; its output goes to ``log`` (appended) and is returned."""
    start = time.monotonic()
    with open(log, "a") as f:
        f.write(f"\n==== {phase}: {' '.join(cmd)}\n")
        f.flush()
        begin = f.tell()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    times[phase] = round(time.monotonic() - start, 1)
    with open(log) as f:
        f.seek(begin)
        output = f.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{phase} failed ({proc.returncode}):\n{output[-6000:]}")
    return output


def in_namespace(work: Path) -> dict:
    """Inside the namespaces: ray up, a two-worker job, distca status, ray down (always)."""
    env, times, out, log = _env(work), {}, {}, work / "phases.log"
    config = str(work / "cluster.yaml")
    try:
        out["up"] = _run("ray up", ["ray", "up", "-y", "--no-config-cache", config], env, times, log)
        job = f"python $HOME/distca/tests/integration/{Path(__file__).name} job"
        out["job"] = _run("job", ["ray", "exec", config, job], env, times, log)
        out["status"] = _run("distca status", ["ray", "exec", config, "distca status"], env, times, log)
        out["listening"] = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout \
            if shutil.which("ss") else ""
    finally:
        out["down"] = _run("ray down", ["ray", "down", "-y", config], env, times, log)
    out["times"] = times
    return out


def two_worker_job() -> dict:
    """On the head: two training workers of job ``default`` (started by ``distca up``), two
    steps, each checked against the float64 reference."""
    import ray
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    ray.init(address="auto", namespace="distca", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), here])}})
    from ray_workers import TrainWorker
    deadline = time.monotonic() + 240  # the autoscaler adds the worker host after the head is up
    while len([n for n in ray.nodes() if n["Alive"]]) < 1 + len(WORKERS):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes alive: {[n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]}")
        time.sleep(1)
    workers = [TrainWorker.options(scheduling_strategy="SPREAD").remote("default", r, 2, 30.0) for r in range(2)]
    nodes = sorted(ray.get([w.node_id.remote() for w in workers], timeout=120))
    results = []
    for step, lens in enumerate(JOB_LENS):
        results += ray.get([w.step.remote(lens[r], step) for r, w in enumerate(workers)], timeout=240)
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return {"ok": all(r["ok"] for r in results), "error": max(r.get("error", 1.0) for r in results),
            "nodes": [addresses[n] for n in nodes], "results": results}


def run_cluster() -> dict:
    # Short (Ray's socket paths live under it), and not under /tmp, which the namespace replaces.
    work = Path(tempfile.mkdtemp(prefix="dca", dir="/var/tmp"))
    try:
        prepare(work)
        cmd = ["unshare", "--net", "--pid", "--mount", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
               f'ip link set lo up && mount -t tmpfs tmpfs /tmp && exec "{sys.executable}" "{__file__}" cluster "{work}"']
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(work))
        if proc.returncode != 0:
            log = (work / "phases.log").read_text()[-8000:] if (work / "phases.log").exists() else ""
            raise RuntimeError(f"cluster run failed:\n{log}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        out = json.loads((work / "result.json").read_text())
        out["times"]["total"] = round(time.monotonic() - start, 1)
        return out
    finally:
        if not os.environ.get("DISTCA_KEEP_CLUSTER_DIR"):  # set it to look at the logs of a run
            shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(not _namespaces_available(), reason="needs unshare (network, PID, mount namespaces) and ip")
def test_ray_up_distca_up_job_status_down():
    out = run_cluster()
    # The job prints one JSON line; Ray's own log lines come around it.
    job = json.loads(next(line for line in out["job"].splitlines()[::-1] if line.startswith('{"ok"')))
    assert job["ok"] and job["error"] <= 1e-5, job
    assert sorted(job["nodes"]) == sorted([HEAD] + WORKERS), job["nodes"]  # one training worker per node
    assert "job default: inplace mode, clients 2" in out["status"], out["status"]
    # The dashboard answers on loopback only; the metrics port is the pinned one.
    listening = out["listening"]
    if listening:
        assert "127.0.0.1:8265" in listening and "0.0.0.0:8265" not in listening, listening
        assert ":8080" in listening, listening
    print(json.dumps(out["times"]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["cluster"]:
        work = Path(sys.argv[2])
        (work / "result.json").write_text(json.dumps(in_namespace(work)))
    elif sys.argv[1:2] == ["job"]:
        print(json.dumps(two_worker_job()))
    else:
        print(json.dumps(run_cluster()["times"]))
