"""How long the others take to raise ``DistCAError`` after a peer dies mid-run (issue 22,
``dead_pe_error_s``), over the one-sided transport's device-driven exchange.

P processes form a group (``--transport shm``: the shared-memory heap; ``nvshmem`` on the GPU
machine: NVSHMEM, PEs sharing the GPU), install a route (64 KiB per peer) with a few exchanges,
then the last PE exits (``os._exit``, no goodbye) just before the next exchange. Each survivor
times its next exchange from the call until ``DistCAError``. The target is the exchange's
deadline (``--timeout``) plus at most 1 s; the survivors must not hang.

Usage::

    python bench/dead_peer.py                          # shm, P = 2 and 3, 2 s deadline
    python bench/dead_peer.py --transport nvshmem      # on the GPU machine

Writes JSON to ``--json`` (default ``bench/results/dead_peer_<transport>.json``, on the GPU
``bench/results/gpu/dead_peer_nvshmem.json``) with ``dead_pe_error_s``: the slowest survivor's time
at P = 2.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.report import finish  # noqa: E402

SIZE = 64 << 10  # bytes to each peer


def _worker(rank: int, P: int, kind: str, timeout_s: float, handle, uids, results) -> None:
    from distca_server.errors import DistCAError
    if kind == "nvshmem":
        from distca_server.transport.nvshmem import join_nvshmem
        device = torch.device("cuda", rank % torch.cuda.device_count())
        t = join_nvshmem(rank=rank, world_size=P, timeout_s=timeout_s, device=device,
                         publish=lambda uid: [uids.put(uid) for _ in range(P - 1)],
                         lookup=lambda: uids.get(timeout=120), heap_bytes=64 << 20)
    else:
        from distca_server.transport.routed import RoutedTransport
        from distca_server.transport.shm import ShmHeap
        device = torch.device("cpu")
        t = RoutedTransport(ShmHeap(handle, rank), timeout_s=timeout_s)
    splits = [SIZE if dst != rank else 0 for dst in range(P)]
    send = torch.randint(0, 256, (sum(splits),), dtype=torch.uint8, device=device)
    for _ in range(3):  # grow, install, one device-driven exchange
        t.exchange([send], [splits], [t.buffer("recv", sum(splits))], [splits], route="bench").wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    device_driven = t.device_exchanges
    if rank == P - 1:
        os._exit(0)  # dies with the route installed, before the next exchange
    t0 = time.monotonic()
    try:
        t.exchange([send], [splits], [t.buffer("recv", sum(splits))], [splits], route="bench").wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t.exchange([send], [splits], [t.buffer("recv", sum(splits))], [splits], route="bench").wait()
        outcome = "no error"
    except DistCAError as exc:
        outcome = str(exc)
    results.put((rank, time.monotonic() - t0, outcome, device_driven))
    results.close()
    results.join_thread()
    os._exit(0)  # a group with a dead PE cannot be torn down collectively


def run(P: int, kind: str, timeout_s: float) -> list[dict]:
    from distca_server.transport.shm import create_heap, destroy_heap
    ctx = mp.get_context("spawn" if kind == "nvshmem" else "forkserver")
    handle = create_heap(P, heap_bytes=16 << 20) if kind == "shm" else None
    uids, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, P, kind, timeout_s, handle, uids, results)) for r in range(P)]
    rows = []
    try:
        for p in procs:
            p.start()
        for _ in range(P - 1):
            try:
                rank, elapsed, outcome, device_driven = results.get(timeout=timeout_s + 120)
            except queue.Empty:
                raise SystemExit(f"P={P}: a survivor did not report within {timeout_s + 120:g} s (hung)") from None
            rows.append({"procs": P, "rank": rank, "timeout_s": timeout_s, "error_s": elapsed,
                         "raised": outcome != "no error", "device_driven_before": device_driven,
                         "message": outcome})
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if handle is not None:
            destroy_heap(handle)
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=["shm", "nvshmem"], default="shm")
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--timeout", type=float, default=2.0, help="the exchange's deadline, seconds")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    gpu = args.transport == "nvshmem"
    device = torch.cuda.get_device_name(0) if gpu else "cpu"
    json_path = args.json or ROOT / "bench" / "results" / (
        "gpu/dead_peer_nvshmem.json" if gpu else f"dead_peer_{args.transport}.json")
    t0 = time.perf_counter()
    rows = [row for P in args.procs for row in run(P, args.transport, args.timeout)]
    elapsed = time.perf_counter() - t0

    def table() -> None:
        print("| P | survivor | deadline s | DistCAError after s | over the deadline s | message |")
        print("|---:|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['procs']} | {r['rank']} | {r['timeout_s']:g} | {r['error_s']:.3f} | "
                  f"{r['error_s'] - r['timeout_s']:+.3f} | {r['message'][:90]} |")

    two = [r["error_s"] for r in rows if r["procs"] == 2]
    worst = max(r["error_s"] - r["timeout_s"] for r in rows)
    headline = [f"{args.transport} on {device}: every survivor raised DistCAError: "
                f"{all(r['raised'] for r in rows)}; at most {worst:+.3f} s past the deadline (target <= +1 s)"]
    finish(table, headline, elapsed, json_path, {
        "benchmark": "dead_peer", "transport": args.transport, "device": device, "rows": rows,
        "summary": {"dead_pe_error_s": max(two) if two else None}})
    if not all(r["raised"] for r in rows) or worst > 1.0:
        sys.exit(1)


if __name__ == "__main__":
    main()
