"""``ssh`` and ``rsync`` for ``ray up`` on one machine: the commands Ray's local provider would run
on a node over SSH run here instead (the test cluster's nodes are this machine), and files Ray
would copy to a node are copied locally. Only loopback destinations are accepted. Each node has
its own home directory, ``$LOOPBACK_SSH_HOMES/<host>``: what ``ray up`` copies to ``~`` on a node
(the checkout, the auth token, the bootstrap config) really travels there. Each node also has
its own PID and mount namespaces (made on first contact, entered with ``nsenter``), so the
``ray stop`` that Ray runs on one node stops that node's processes only, as on separate hosts.

Installed as ``<bin>/ssh`` and ``<bin>/rsync`` by tests/integration/test_deploy_cluster.py, which
puts ``<bin>`` first on ``PATH`` of ``ray up``/``ray down``. Usage is that of the real tools as
Ray's ``SSHCommandRunner`` calls them (``ssh [opts] user@host command...``,
``rsync --rsh CMD -avz [--exclude P] SRC DST`` with one side ``user@host:path``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

_SSH_VALUE_FLAGS = set("BbcDEeFIiJLlmOopQRSWw")  # ssh options that take a value


def _host(destination: str) -> str:
    host = destination.rsplit("@", 1)[-1]
    if not host.startswith("127."):
        sys.exit(f"loopback_ssh: refusing non-loopback destination {destination!r}")
    return host


def _node(host: str) -> int:
    """The pid of the init process of ``host``'s PID and mount namespaces, made on first use."""
    pidfile = os.path.join(os.environ["LOOPBACK_SSH_HOMES"], f"{host}.pid")
    with open(pidfile + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the head's autoscaler and ray up may race
        if os.path.exists(pidfile):
            return int(Path(pidfile).read_text())
        unshare = subprocess.Popen(["unshare", "--pid", "--mount", "--fork", "--mount-proc", "sleep", "infinity"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
        for _ in range(500):  # unshare forks the namespace's init (sleep) right away
            pids = children.read_text().split()
            if pids:
                break
            time.sleep(0.01)
        Path(pidfile).write_text(pids[0])
        return int(pids[0])


def _home(host: str) -> str:
    home = os.path.join(os.environ["LOOPBACK_SSH_HOMES"], host)
    os.makedirs(home, exist_ok=True)
    return home


def ssh(args: list[str]) -> None:
    i = 0
    while i < len(args) and args[i].startswith("-"):
        flag = args[i]
        i += 2 if len(flag) == 2 and flag[1] in _SSH_VALUE_FLAGS else 1
    host = _host(args[i])
    home = _home(host)
    command = " ".join(args[i + 1:]) or "true"
    # Like ssh, return when the command exits: daemons it started (ray start) keep the pipe of
    # its output open, and Ray reads our output until EOF.
    node = ["nsenter", "-t", str(_node(host)), "-p", "-m", "--wd=" + home, "--"]
    proc = subprocess.Popen(node + ["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HOME=home))
    relay = threading.Thread(target=_relay, args=(proc.stdout,), daemon=True)
    relay.start()
    code = proc.wait()
    relay.join(1.0)
    sys.stdout.flush()
    os._exit(code)


def _relay(pipe) -> None:
    for line in iter(pipe.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


def _local(path: str) -> str:
    """``user@host:path`` -> ``path`` with ``~`` the node's home (as the remote shell would
    expand it); a local path as it is."""
    if ":" in path and "@" in path.split(":", 1)[0]:
        remote, path = path.split(":", 1)
        home = _home(_host(remote))
        if path == "~" or path.startswith("~/"):
            path = home + path[1:]
        return path
    return os.path.expanduser(path)


def rsync(args: list[str]) -> None:
    excludes, paths, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a in ("--rsh", "-e", "--filter"):
            i += 2
            continue
        if a == "--exclude":
            excludes.append(Path(args[i + 1]).name)
            i += 2
            continue
        if not a.startswith("-"):
            paths.append(a)
        i += 1
    src, dst = (_local(p) for p in paths[-2:])
    if os.path.isdir(src):  # Ray passes directories with a trailing "/": copy their contents
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True,
                        ignore=shutil.ignore_patterns(*excludes))
    else:
        if dst.endswith("/") or os.path.isdir(dst):
            dst = os.path.join(dst, os.path.basename(src))
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        shutil.copy2(src, dst)


if __name__ == "__main__":
    {"ssh": ssh, "rsync": rsync}[Path(sys.argv[1]).name](sys.argv[2:])  # argv[1]: the shim's own path
