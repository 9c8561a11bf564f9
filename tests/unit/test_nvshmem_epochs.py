"""NVSHMEM across group epochs on the GPU (transport/nvshmem.py): the same processes form two
epochs; the second reuses the first's NVSHMEM world and heap (started once per process), its
exchanges are byte-for-byte LocalTransport's although the signal words hold the first epoch's
values, and every NVSHMEM call ran on the runtime's host thread. Then NVSHMEM is finalized once.

Skipped without nvshmem4py and a CUDA device (``pytest -m nvshmem tests/unit/test_nvshmem_epochs.py``).
The CPU twin of these checks is tests/unit/test_heap_lifecycle.py.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from test_transport_nvshmem import get_result
from test_transport_symmetric import TIMEOUT_S, expected_digests, run_rounds

pytestmark = pytest.mark.nvshmem


def _worker(rank: int, P: int, rounds: int, boots, results) -> None:
    from distca_server.transport.nvshmem import join_nvshmem, runtime
    from distca_server.transport.symmetric_words import DATA, GEN_SHIFT
    device = torch.device("cuda", rank % torch.cuda.device_count())
    out = {}
    for epoch in (1, 2):
        transport = join_nvshmem(rank=rank, world_size=P, timeout_s=TIMEOUT_S, device=device, epoch=epoch,
                                 publish=lambda v, e=epoch: [boots[e].put(v) for _ in range(P - 1)],
                                 lookup=lambda e=epoch: boots[e].get(timeout=120), heap_bytes=64 << 20)
        words = transport.heap.signals().tolist()
        out[f"gens_at_start_{epoch}"] = sorted({w >> GEN_SHIFT for w in words if w})
        out[f"digests_{epoch}"] = run_rounds(transport, 10 + epoch, rounds, device=str(device))
        out[f"data_gen_{epoch}"] = int(transport.heap.signals()[DATA * P + (rank + 1) % P]) >> GEN_SHIFT
        transport.close()
    rt = runtime()
    out["starts"] = rt.starts
    out["finalized"] = rt.finalize(timeout_s=60)
    results.put((rank, out))
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.parametrize("P", [2, 3])
def test_two_epochs_reuse_one_nvshmem_world_and_heap(P):
    rounds = 6
    ctx = mp.get_context("spawn")
    boots = {1: ctx.Queue(), 2: ctx.Queue()}
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, P, rounds, boots, results)) for r in range(P)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        got = dict(get_result(results, procs, deadline) for _ in range(P))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for epoch in (1, 2):
        want = expected_digests(10 + epoch, rounds, P)
        for r in range(P):
            assert got[r][f"digests_{epoch}"] == want[r], (epoch, r)
            assert got[r][f"data_gen_{epoch}"] == epoch
    for r in range(P):
        assert got[r]["starts"] == 1 and got[r]["finalized"] is True
        assert 1 in got[r]["gens_at_start_2"]  # epoch 2 began on words epoch 1 had written
