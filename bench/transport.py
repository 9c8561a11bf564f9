"""The one-sided exchange, host-driven and device-driven, against the collective all-to-all, for
the same ragged splits.

``--transport shm`` (CPU): :class:`~distca_server.transport.symmetric.SymmetricTransport` over the
shared-memory heap (:mod:`distca_server.transport.shm`) against
:class:`~distca_server.transport.torch_dist.TorchDistTransport` on gloo (``alltoall_base``), between
``P`` processes of this machine. ``--transport nvshmem`` (GPU machine): the same transport over the
NVSHMEM heap against NCCL's ``all_to_all_single`` when there is a GPU per PE; with fewer GPUs (PEs
share them round-robin, and NCCL refuses two ranks on one device) against a plain device copy of the
bytes each PE receives (``copy``: the bandwidth ceiling on one GPU).

Splits: each participant sends ``size`` bytes in all, cut between the other participants by seeded
random weights with one zero-byte peer per sender when ``P >= 3`` (the raggedness of a CA round);
nothing to itself (rows that stay home never pass through a transport). The symmetric transport
receives into its ``buffer`` (symmetric memory after the first exchange grew it), the baseline into a
preallocated tensor. Both endpoints live in the same processes and run each size back to back.

The one-sided exchange runs three ways per size: host-driven (no route: every exchange announces
its offsets and the host waits for every signal), device-driven (a route, installed by its first
exchanges: :mod:`distca_server.transport.routed`; on the CPU its "stream" is a thread) and graphed
(the device-driven exchange captured once and replayed: :mod:`distca_server.transport.exchange_graph`).
Every exchange's received bytes are compared: device-driven and graphed against host-driven always,
and against the baseline where it is an all-to-all (not ``copy``). Every timed device-driven and
graphed exchange must have run device-driven (the transport's ``device_exchanges``, read after the
warm-up, equals the row's timed count on every participant); a row where one did not is named in
the headline and the script exits 1, like a row whose bytes differ. Besides each exchange's time, the
host's part is reported: how long ``exchange`` (or ``replay``) holds the caller before it returns.

Per size: ``--warmup`` exchanges, then ``--iters`` timed ones (fewer for large sizes: at least 3,
at most enough to move ~2 GiB); a participant's time is its median exchange (GPU: synchronized);
``ms`` is the slowest participant's, ``GB/s`` the bytes one participant sends off-rank divided by it
(10^9 bytes per second).

``--transport local``: the participants are threads of this process over an in-process symmetric
heap (plain tensors on ``--device``, default CUDA where there is one: no NVSHMEM, no context
switches between PEs); the baseline is the in-process transport (copies behind barriers).

Usage::

    python bench/transport.py                      # shm vs gloo, P = 2 and 4, 64 KiB .. 64 MiB
    python bench/transport.py --quick              # P = 2, 64 KiB .. 4 MiB
    python bench/transport.py --transport nvshmem --procs 2 4 --max-size 1GiB   # on the GPU machine

Writes JSON to ``--json`` (default ``bench/results/transport_shm.json``, on GPU
``bench/results/gpu/transport_nvshmem.json`` with the device name).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.report import finish  # noqa: E402
from distca_server.transport.base import DONE  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def parse_size(text: str) -> int:
    """``64KiB``, ``4MiB``, ``1GiB`` or a byte count."""
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * mult)
    return int(text)


def fmt_size(n: int) -> str:
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def ragged_splits(P: int, size: int, seed: int = 0) -> list[list[int]]:
    """``splits[src][dst]`` bytes, each row summing to ``size`` (rounded down to 16-byte rows), 0 to
    itself and to one other peer when ``P >= 3``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for src in range(P):
        w = torch.rand(P, generator=g) + 0.25
        w[src] = 0
        if P >= 3:
            others = [d for d in range(P) if d != src]
            w[others[int(torch.randint(0, P - 1, (1,), generator=g))]] = 0
        parts = [int(size * float(x) / float(w.sum())) // 16 * 16 for x in w]
        out.append(parts)
    return out


def heap_bytes(P: int, sizes: list[int]) -> int:
    """Arena per PE: the receive buffer's generations (each at least twice the last, never
    reused) stay under twice the largest receive, plus room for the tables."""
    most = max(sum(ragged_splits(P, size, seed=size)[src][dst] for src in range(P))
               for size in sizes for dst in range(P))
    return 2 * most + 16 * MiB


def _time_exchanges(transport, send, ss, recv_of, rs, iters: int, warmup: int, cuda: bool,
                    **route) -> float:
    return _time_calls(lambda: transport.exchange([send], [ss], [recv_of()], [rs], **route), iters, warmup, cuda)[0]


def _time_calls(issue, iters: int, warmup: int, cuda: bool, timed_start=None) -> tuple[float, float]:
    """Medians of ``issue().wait()`` (GPU: the caller's stream synchronized) and of ``issue()``
    alone (the host's part: how long the caller is held before it may queue more work).
    ``timed_start``: called once after the warm-up, before the first timed call (to read a
    counter over the timed calls alone).

    Only the caller's current stream is synchronized, never the device: ``wait()`` made that stream
    wait for the exchange, which is all it must see. A device-wide synchronize would also wait for
    every other participant's streams, and where participants are threads of one process
    (``--transport local``) a peer's stream may be held in a device-side wait for rows this thread
    has not sent yet: the two would wait for each other until the watchdog's deadline
    (``memop_stream``'s module doc)."""
    times, issued = [], []
    for i in range(warmup + iters):
        if cuda:
            torch.cuda.current_stream().synchronize()
        if i == warmup and timed_start is not None:
            timed_start()
        t0 = time.perf_counter()
        handle = issue()
        t1 = time.perf_counter()
        handle.wait()
        if cuda:
            torch.cuda.current_stream().synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            issued.append(t1 - t0)
    return statistics.median(times), statistics.median(issued)


class _CopyOnly:
    """The baseline where NCCL cannot run (several PEs on one GPU: NCCL refuses two ranks on one
    device): each participant copies the bytes it receives from one of its buffers into another,
    the memory-bandwidth floor of any exchange on one GPU. Not an all-to-all: no bytes compared."""

    def exchange(self, send, send_splits, recv, recv_splits, route=None):
        n = recv[0].numel()
        recv[0].copy_(send[0][:n] if send[0].numel() >= n else recv[0])
        return DONE

    def close(self):
        pass


def _worker(rank: int, P: int, kind: str, baseline: str, sizes: list[int], iters: int, warmup: int,
            graph: bool, handle, uids, stores, results) -> None:
    from distca_server.transport.torch_dist import join_group
    cuda = kind == "nvshmem"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        from distca_server.transport.nvshmem import join_nvshmem
        sym = join_nvshmem(rank=rank, world_size=P, timeout_s=120, device=device,
                           publish=lambda uid: [uids.put(uid) for _ in range(P - 1)],
                           lookup=lambda: uids.get(timeout=120), heap_bytes=heap_bytes(P, sizes))
    else:
        from distca_server.transport.routed import RoutedTransport
        from distca_server.transport.shm import ShmHeap
        sym = RoutedTransport(ShmHeap(handle, rank), timeout_s=120)
    if baseline == "copy":
        base = _CopyOnly()
    else:
        base = join_group(epoch=0, rank=rank, world_size=P, host="127.0.0.1", timeout_s=120, device=device,
                          publish=lambda host, port: [stores.put((host, port)) for _ in range(P - 1)],
                          lookup=lambda: stores.get(timeout=120))
    results.put((rank, _measure(rank, P, sym, base, baseline, sizes, iters, warmup, device, graph)))
    sym.close()
    base.close()
    if cuda:
        results.close()
        results.join_thread()
        os._exit(0)  # NVSHMEM's teardown is collective; the measurement is done


def _measure(rank: int, P: int, sym, base, baseline: str, sizes: list[int], iters: int, warmup: int,
             device: torch.device, graph: bool = True) -> list[dict]:
    """One participant's rows: per size, its median host-driven, device-driven, captured
    (``graph``; None where off or failed, the failure in ``graph_error``) and baseline exchange,
    and whether they delivered the same bytes."""
    cuda = device.type == "cuda"
    rows = []
    for size in sizes:
        splits = ragged_splits(P, size, seed=size)
        ss = splits[rank]
        rs = [splits[src][rank] for src in range(P)]
        send = torch.randint(0, 256, (sum(ss),), dtype=torch.uint8, device=device)
        n = max(3, min(iters, (2 * GiB) // max(size, 1)))
        recv_base = torch.empty(sum(rs), dtype=torch.uint8, device=device)
        route = {"route": ("bench", size)}
        # The timed exchanges alone, each of which must have run device-driven (the warm-up's
        # last ones may already have: they are not counted, nor allowed to make up for a timed
        # one that was host-driven).
        counted = {"from": 0}

        def mark():
            counted["from"] = sym.device_exchanges
        # warmup >= 2: a route's first exchanges grow its buffer and install it
        t_routed, issue_routed = _time_calls(
            lambda: sym.exchange([send], [ss], [sym.buffer("bench", sum(rs))], [rs], **route), n, max(2, warmup), cuda,
            timed_start=mark)
        device_driven = sym.device_exchanges - counted["from"]
        t_sym = _time_exchanges(sym, send, ss, lambda: sym.buffer("bench", sum(rs)), rs, n, warmup, cuda)
        t_base = _time_exchanges(base, send, ss, lambda: recv_base, rs, n, warmup, cuda)
        # Every way delivered the same bytes.
        a = sym.buffer("bench", sum(rs))
        sym.exchange([send], [ss], [a], [rs], **route).wait()
        routed = a.clone()
        sym.exchange([send], [ss], [a], [rs]).wait()
        base.exchange([send], [ss], [recv_base], [rs]).wait()
        row = {"size": size, "sent": sum(ss), "iters": n, "sym_s": t_sym, "routed_s": t_routed,
               "graph_s": None, "issue_routed_s": issue_routed, "issue_graph_s": None, "base_s": t_base,
               "device_driven": device_driven, "graph_device_driven": None,
               "equal": bool(torch.equal(routed, a)) and (baseline == "copy" or bool(torch.equal(a, recv_base)))}
        rows.append(row)
        if graph:  # last: the same exchange captured (exchange_graph), one replay per exchange
            host_driven = a.clone()
            try:
                captured = sym.graph(lambda: sym.exchange([send], [ss], [a], [rs], **route))
                # a replay counts the device-driven exchanges it holds: one each here
                row["graph_s"], row["issue_graph_s"] = _time_calls(captured.replay, n, warmup, cuda, timed_start=mark)
                row["graph_device_driven"] = sym.device_exchanges - counted["from"]
                row["equal"] = row["equal"] and bool(torch.equal(a, host_driven))
            except Exception as exc:  # noqa: BLE001 - reported; the rows measured so far stand
                row["graph_error"] = f"{type(exc).__name__}: {exc}"
                graph = False  # the group may be broken: later sizes would fail on it anyway
    return rows


def run_local(P: int, device: torch.device, sizes: list[int], iters: int, warmup: int, graph: bool = True) -> dict:
    """``--transport local``: the P participants are threads of this process over an in-process
    symmetric heap (:mod:`distca_server.transport.local_heap`: plain tensors on ``device``, no
    NVSHMEM, no context switches); the baseline is the in-process transport (each receiver copies
    its rows from the senders' buffers, behind two barriers)."""
    import threading

    from distca_server.transport.local import LocalGroup
    from distca_server.transport.local_heap import LocalHeap
    from distca_server.transport.routed import RoutedTransport
    heap = LocalHeap(P, heap_bytes(P, sizes), device)
    group = LocalGroup(P, timeout_s=120)
    syms = [RoutedTransport(heap.endpoint(r), timeout_s=120) for r in range(P)]
    per_rank, errors = {}, []

    def one(r):
        # Each participant thread issues on a CUDA stream of its own: on the legacy default stream,
        # which they would share, one participant's wait for a peer's exchange (a marker's join,
        # the host-driven path's quiet) would hold up the peers' work behind it.
        own = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()
        try:
            with own:
                per_rank[r] = _measure(r, P, syms[r], group.endpoint(r, device), "local", sizes, iters, warmup,
                                       device, graph)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            group.abort(r, str(exc))
    threads = [threading.Thread(target=one, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in syms:
        t.close()
    if errors:
        raise SystemExit(f"local participants failed: {errors}")
    return per_rank


def run(P: int, kind: str, baseline: str, sizes: list[int], iters: int, warmup: int,
        device: torch.device | None = None, graph: bool = True) -> list[dict]:
    if kind == "local":
        return _rows(P, sizes, run_local(P, device, sizes, iters, warmup, graph))
    from distca_server.transport.shm import create_heap, destroy_heap
    ctx = mp.get_context("spawn" if kind == "nvshmem" else "forkserver")  # CUDA does not survive fork
    if kind == "shm":
        ctx.set_forkserver_preload(["torch"])
    handle = create_heap(P, heap_bytes=heap_bytes(P, sizes)) if kind == "shm" else None
    uids, stores, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, P, kind, baseline, sizes, iters, warmup, graph, handle, uids,
                                               stores, results)) for r in range(P)]
    try:
        for p in procs:
            p.start()
        per_rank: dict = {}
        while len(per_rank) < P:
            try:
                rank, rows = results.get(timeout=5)
                per_rank[rank] = rows
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"participants {dead} failed (exit codes "
                                     f"{[procs[r].exitcode for r in dead]}); see their tracebacks above")
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if handle is not None:
            destroy_heap(handle)
    return _rows(P, sizes, per_rank)


def _rows(P: int, sizes: list[int], per_rank: dict) -> list[dict]:
    """One row per size from every participant's: the slowest participant's medians."""
    rows = []
    for i, size in enumerate(sizes):
        mine = [per_rank[r][i] for r in range(P)]
        sym, base = max(m["sym_s"] for m in mine), max(m["base_s"] for m in mine)
        routed, sent = max(m["routed_s"] for m in mine), statistics.mean(m["sent"] for m in mine)
        graphed = None if any(m["graph_s"] is None for m in mine) else max(m["graph_s"] for m in mine)
        rows.append({"procs": P, "size": size, "iters": mine[0]["iters"], "sym_ms": 1e3 * sym,
                     "routed_ms": 1e3 * routed, "base_ms": 1e3 * base, "sym_gbs": sent / sym / 1e9,
                     "routed_gbs": sent / routed / 1e9, "base_gbs": sent / base / 1e9,
                     "speedup": base / sym, "routed_speedup": sym / routed,
                     "graph_ms": None if graphed is None else 1e3 * graphed,
                     "issue_routed_us": 1e6 * max(m["issue_routed_s"] for m in mine),
                     "issue_graph_us": None if graphed is None else 1e6 * max(m["issue_graph_s"] for m in mine),
                     "graph_errors": sorted({m["graph_error"] for m in mine if "graph_error" in m}),
                     # the fewest timed exchanges any participant ran device-driven (of iters)
                     "device_driven": min(m["device_driven"] for m in mine),
                     "graph_device_driven": None if graphed is None else min(m["graph_device_driven"] for m in mine),
                     "equal": all(m["equal"] for m in mine)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=["shm", "nvshmem", "local"], default="shm",
                    help="local: participants are threads of one process over an in-process heap")
    ap.add_argument("--device", default=None, help="local: cpu or cuda (default cuda when there is one)")
    ap.add_argument("--procs", type=int, nargs="+", default=None, help="participants (default 2 4)")
    ap.add_argument("--min-size", default="64KiB")
    ap.add_argument("--max-size", default="64MiB")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="P = 2, 64 KiB .. 4 MiB, 5 iterations")
    ap.add_argument("--baseline", choices=["auto", "gloo", "nccl", "copy"], default="auto",
                    help="auto: gloo for shm; for nvshmem NCCL with a GPU per PE, else a device copy "
                         "(nccl forces NCCL, e.g. to see whether it runs several ranks on one GPU)")
    ap.add_argument("--graph", choices=["on", "off"], default="on",
                    help="also time the exchange captured and replayed (last per size; a failure is reported "
                         "in the JSON's graph_errors and stops graphs for the later sizes)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    procs = args.procs or ([2] if args.quick else [2, 4])
    lo, hi = parse_size(args.min_size), parse_size("4MiB" if args.quick else args.max_size)
    iters = 5 if args.quick else args.iters
    sizes = []
    s = lo
    while s <= hi:
        sizes.append(s)
        s *= 4
    baseline = "gloo"
    if args.transport == "nvshmem":  # NCCL needs a GPU per rank
        baseline = "nccl" if torch.cuda.device_count() >= max(procs) else "copy"
    if args.transport == "local":
        baseline = "local"  # the in-process transport: an all-to-all too, so bytes are compared
    elif args.baseline != "auto":
        baseline = args.baseline
    local_device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = args.transport == "nvshmem" or local_device.type == "cuda" and args.transport == "local"
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    json_path = args.json or (ROOT / "bench" / "results" / (
        f"gpu/transport_{args.transport}.json" if on_gpu else f"transport_{args.transport}.json"))
    t0 = time.perf_counter()
    rows = [row for P in procs for row in run(P, args.transport, baseline, sizes, iters, args.warmup,
                                              device=local_device, graph=args.graph == "on")]
    elapsed = time.perf_counter() - t0

    def opt(x, spec: str) -> str:
        return "–" if x is None else format(x, spec)

    def table() -> None:
        t = args.transport
        print(f"| P | bytes sent per participant | {t} host-driven ms | {t} device-driven ms | graphed ms | "
              f"{baseline} ms | device-driven GB/s | {baseline} GB/s | host/device-driven time | "
              f"{baseline}/host-driven time | host µs to queue: device-driven, graphed | same bytes |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['procs']} | {fmt_size(r['size'])} | {r['sym_ms']:.3f} | {r['routed_ms']:.3f} | "
                  f"{opt(r['graph_ms'], '.3f')} | {r['base_ms']:.3f} | {r['routed_gbs']:.2f} | {r['base_gbs']:.2f} | "
                  f"{r['routed_speedup']:.2f} | {r['speedup']:.2f} | {r['issue_routed_us']:.0f}, "
                  f"{opt(r['issue_graph_us'], '.0f')} | {r['equal']} |")

    big = [r for r in rows if r["size"] == sizes[-1]]
    small = [r for r in rows if r["size"] == sizes[0]]
    headline = [f"{args.transport} (device-driven, host-driven) vs {baseline} on {device}: at {fmt_size(sizes[-1])} "
                + ", ".join(f"P={r['procs']} {r['routed_gbs']:.2f}, {r['sym_gbs']:.2f} vs {r['base_gbs']:.2f} GB/s"
                            for r in big),
                f"latency at {fmt_size(sizes[0])} (device-driven, host-driven, {baseline}): "
                + ", ".join(f"P={r['procs']} {r['routed_ms']:.3f}, {r['sym_ms']:.3f}, {r['base_ms']:.3f} ms"
                            for r in small)]
    # Each row's own timed count (iters is capped per size), every participant's exchanges of it.
    host_driven = [f"P={r['procs']} {fmt_size(r['size'])} ({r['device_driven']} of {r['iters']}"
                   + ("" if r["graph_device_driven"] in (None, r["iters"]) else
                      f"; graphed {r['graph_device_driven']} of {r['iters']}") + ")"
                   for r in rows if r["device_driven"] != r["iters"]
                   or r["graph_device_driven"] not in (None, r["iters"])]
    if host_driven:
        headline.append("NOT DEVICE-DRIVEN: timed exchanges that did not all run device-driven (route not "
                        "installed), so those rows' device-driven and graphed times are not what they claim: "
                        + ", ".join(host_driven))
    if not all(r["equal"] for r in rows):
        headline.append("MISMATCH: the two transports delivered different bytes")
    errors = sorted({e for r in rows for e in r["graph_errors"]})
    if errors:
        headline.append(f"GRAPHS FAILED (captured exchanges not timed from there on): {errors[0]}")
    # issue 22's summary keys, from this run: in-process participants (local) or processes
    summary = {}
    where = "" if args.transport == "local" else "_processes"
    for r in rows:
        if r["procs"] == 2 and r["size"] == 64 * KiB:
            summary = {f"exchange_us_64KiB_2pe{where}": 1e3 * r["routed_ms"],
                       f"exchange_us_64KiB_2pe{where}_host_driven": 1e3 * r["sym_ms"],
                       f"exchange_us_64KiB_2pe{where}_graphed": None if r["graph_ms"] is None else 1e3 * r["graph_ms"],
                       # the caller's part: how long exchange() / replay() held it
                       f"exchange_host_us_64KiB_2pe{where}": r["issue_routed_us"],
                       f"exchange_host_us_64KiB_2pe{where}_graphed": r["issue_graph_us"]}
    finish(table, headline, elapsed, json_path, {
        "benchmark": "transport", "transport": args.transport, "baseline": baseline, "device": device,
        "procs": procs, "sizes": sizes, "iters": iters, "warmup": args.warmup, "rows": rows,
        "summary": summary})
    if not all(r["equal"] for r in rows) or host_driven:
        sys.exit(1)


if __name__ == "__main__":
    main()
