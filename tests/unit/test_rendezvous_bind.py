"""The rendezvous ``TCPStore`` of a group epoch listens on the node's address only, never on every
interface (docs/security.md): two members form a gloo group over it and exchange rows, while
``/proc/net/tcp`` shows the store's port bound to 127.0.0.1."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from distca_server.errors import DistCAError
from distca_server.transport.torch_dist import join_group, listen_on

_LISTEN = "0A"  # TCP state code of a listening socket in /proc/net/tcp


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as the kernel prints them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == _LISTEN:
                found.append(addr)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_store_listens_on_the_node_address_and_the_group_works():
    published, ready = {}, threading.Event()
    members, errors, listening = [None, None], [], []

    def member(rank):
        try:
            def publish(host, port):
                published["address"] = (host, port)
                listening.extend(_listeners(port))  # while the store is up
                ready.set()

            def lookup():
                assert ready.wait(30)
                return published["address"]

            members[rank] = join_group(epoch=3, rank=rank, world_size=2, host="127.0.0.1", timeout_s=30,
                                       device=torch.device("cpu"), publish=publish, lookup=lookup)
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    host, port = published["address"]
    assert host == "127.0.0.1" and port > 0
    assert listening == ["0100007F"], f"store on port {port} listens on {listening}, not 127.0.0.1 only"

    # The group formed over that store moves rows between the two members.
    outs = [torch.empty(2, dtype=torch.uint8) for _ in range(2)]

    def exchange(rank):
        send = torch.tensor([10 * rank, 10 * rank + 1], dtype=torch.uint8)  # byte segments
        members[rank].exchange([send], [[1, 1]], [outs[rank]], [[1, 1]]).wait()

    threads = [threading.Thread(target=exchange, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outs[0].tolist() == [0, 10] and outs[1].tolist() == [1, 11]
    for m in members:
        m.close()


def test_an_address_not_of_this_node_is_refused():
    with pytest.raises(OSError):
        listen_on("203.0.113.7")  # TEST-NET-3: documentation only, not a local address
    with pytest.raises(DistCAError, match="could not form group epoch 0 as rank 0 of 1"):
        join_group(epoch=0, rank=0, world_size=1, host="203.0.113.7", timeout_s=5,
                   device=torch.device("cpu"), publish=lambda h, p: None, lookup=lambda: None)
