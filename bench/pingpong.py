"""Ping-pong: does distca hide its communication behind the other nano-batch's work? (the DistCA
paper's Fig. 11, §4.1; issue 22's ``pingpong_vs_signal_only``).

A layer stand-in per nano-batch: a projection to Q, K, V (``x @ W_qkv``), core attention through
``DistCAClient.local`` with P participants over the in-process heap (device-driven exchanges once
the plan's routes are installed), and an output projection (``o @ W_o``). Two nano-batches per
layer, ``--layers`` layers, forward only. Three runs on the same inputs, interleaved: each of
``--repeats`` repeats runs all three, in an order rotated per repeat (after ``--warmup`` rounds of
the same), so none always runs first or after the same one:

- ``single``: one nano-batch after the other (``attend``): nothing overlaps.
- ``pingpong``: nano-batch 0's attention runs (``attend_async``) while nano-batch 1 projects, and
  nano-batch 1's while nano-batch 0 finishes its output projection.
- ``signal-only``: ``pingpong`` with every device-driven transfer cut to 1 byte per peer and segment
  (the transport's ``signal_only`` control: the same plan, signals and waits, almost no bytes).
  Its outputs are garbage and not checked.

The transport's counters are read around every timed run: the script fails unless each timed
exchange of every run (signal-only's above all: its control acts on device-driven puts only) ran
device-driven, and checks ping-pong against single again after the timed runs.

``pingpong / signal-only`` near 1 means the bytes cost nothing that the overlap did not hide
(target: within 3%). ``single / pingpong`` is what the overlap bought. The guard: ``pingpong``'s
outputs equal ``single``'s. On the CPU the numbers only show that the mechanism runs; the GPU
session's ``pingpong`` stage measures it.

Usage::

    python bench/pingpong.py                  # CUDA if there is one, else the CPU (small sizes)
    python bench/pingpong.py --tokens 16384 --participants 2 --layers 8

Writes JSON (``--json``; default ``bench/results/pingpong.json``, on a GPU
``bench/results/gpu/pingpong.json``) with ``summary.pingpong_vs_signal_only``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.report import finish  # noqa: E402
from distca_client import DistCAClient  # noqa: E402
from distca_server.transport.local_heap import heap_bytes_for  # noqa: E402
from distca_sim.workloads import sample_batch  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402


def make_layers(args, device, dtype):
    g = torch.Generator(device).manual_seed(0)
    d, hq, hkv, dim = args.model_dim, args.heads_q, args.heads_kv, args.head_dim
    qkv_out = (hq + 2 * hkv) * dim
    return [(torch.randn(d, qkv_out, generator=g, device=device, dtype=dtype) / d ** 0.5,
             torch.randn(hq * dim, d, generator=g, device=device, dtype=dtype) / (hq * dim) ** 0.5)
            for _ in range(args.layers)]


def split_qkv(h, args):
    T = h.shape[0]
    hq, hkv, dim = args.heads_q, args.heads_kv, args.head_dim
    q, k, v = h.split([hq * dim, hkv * dim, hkv * dim], dim=1)
    return q.reshape(T, hq, dim), k.reshape(T, hkv, dim).contiguous(), v.reshape(T, hkv, dim).contiguous()


def run_single(client, layers, xs, lens, args):
    for w_qkv, w_o in layers:
        out = []
        for x, doc_lens in zip(xs, lens):
            o = client.attend(*split_qkv(x @ w_qkv, args), doc_lens)
            out.append(x + o.reshape(x.shape[0], -1) @ w_o)
        xs = out
    return xs


def run_pingpong(client, layers, xs, lens, args):
    x0, x1 = xs
    for w_qkv, w_o in layers:
        h0 = client.attend_async(*split_qkv(x0 @ w_qkv, args), lens[0])
        qkv1 = split_qkv(x1 @ w_qkv, args)  # overlaps nano-batch 0's attention
        o0 = h0.wait()
        h1 = client.attend_async(*qkv1, lens[1])
        x0 = x0 + o0.reshape(x0.shape[0], -1) @ w_o  # overlaps nano-batch 1's attention
        x1 = x1 + h1.wait().reshape(x1.shape[0], -1) @ w_o
    return [x0, x1]


RUNS = ("single", "pingpong", "signal-only")


def exchange_counts(endpoints) -> list[tuple[int, int]]:
    """Per endpoint: (exchanges so far, of them device-driven). ``_seq`` numbers every exchange of
    the group epoch, host-driven and device-driven alike (the transport's own count of them)."""
    return [(t._seq, t.device_exchanges) for t in endpoints]


def timed_runs(variants: dict, endpoints, device, warmup: int, repeats: int) -> dict:
    """Time every variant (``run -> (fn, signal_only)``) ``repeats`` times, interleaved: repeat i
    runs them in an order rotated by i, so no variant always runs first or after the same one
    and all see the same machine load. Per variant: the median time and, per endpoint, the
    exchanges its timed calls made and how many of them ran device-driven (warm-up excluded)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def call(run):
        fn, signal_only = variants[run]
        for t in endpoints:  # signal_only changes only device-driven puts (routed.py)
            t.signal_only = signal_only
        try:
            return fn()
        finally:
            for t in endpoints:
                t.signal_only = False
    names = list(variants)
    for i in range(warmup):
        for run in names[i % len(names):] + names[:i % len(names)]:
            call(run)
    times = {run: [] for run in names}
    counts = {run: [[0, 0] for _ in endpoints] for run in names}
    for i in range(repeats):
        for run in names[i % len(names):] + names[:i % len(names)]:
            sync()
            before = exchange_counts(endpoints)
            t0 = time.perf_counter()
            call(run)
            sync()
            times[run].append(time.perf_counter() - t0)
            for c, (a, da), (b, db) in zip(counts[run], before, exchange_counts(endpoints)):
                c[0] += b - a
                c[1] += db - da
    return {run: {"s": statistics.median(times[run]), "times_s": times[run],
                  "exchanges": [c[0] for c in counts[run]], "device_driven": [c[1] for c in counts[run]]}
            for run in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--participants", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=None, help="per nano-batch (default 16384 on CUDA, 1024 on CPU)")
    ap.add_argument("--layers", type=int, default=None, help="default 8 on CUDA, 2 on CPU")
    ap.add_argument("--model-dim", type=int, default=None, help="default 4096 on CUDA, 256 on CPU")
    ap.add_argument("--heads-q", type=int, default=None)
    ap.add_argument("--heads-kv", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    for name, big, small in (("tokens", 16384, 1024), ("layers", 8, 2), ("model_dim", 4096, 256),
                             ("heads_q", 32, 4), ("heads_kv", 8, 2), ("head_dim", 128, 32)):
        if getattr(args, name) is None:
            setattr(args, name, big if gpu else small)
    lens = sample_batch("pretrain", 2, args.tokens, seed=0, step=0)
    g = torch.Generator(device).manual_seed(1)
    xs = [torch.randn(sum(doc_lens), args.model_dim, generator=g, device=device, dtype=dtype) for doc_lens in lens]
    layers = make_layers(args, device, dtype)
    row_bytes = (args.heads_q + 2 * args.heads_kv) * args.head_dim * dtype.itemsize
    heap = heap_bytes_for(args.tokens, row_bytes)
    job = JobConfig(servers=args.participants, transport="nvshmem" if gpu else "shm", heap_bytes=heap,
                    plan=PlanConfig(), timeout_s=120)
    t_start = time.perf_counter()
    with torch.no_grad(), DistCAClient.local(config=job) as client:
        want = run_single(client, layers, xs, lens, args)
        got = run_pingpong(client, layers, xs, lens, args)
        tol = 2e-2 if gpu else 1e-5
        errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want)]
        if max(errors) > tol:
            raise SystemExit(f"pingpong's outputs differ from single's: relative errors {errors} > {tol}")
        endpoints = list(client._runtime._group._endpoints.values())
        got = timed_runs({"single": (lambda: run_single(client, layers, xs, lens, args), False),
                          "pingpong": (lambda: run_pingpong(client, layers, xs, lens, args), False),
                          "signal-only": (lambda: run_pingpong(client, layers, xs, lens, args), True)},
                         endpoints, device, args.warmup, args.repeats)
        # The comparison means something only if every timed exchange ran device-driven: the
        # signal-only control cuts device-driven puts alone, and ping-pong's claim is the overlap
        # of device-driven exchanges with the other nano-batch's work.
        for run in RUNS:
            total, dev = got[run]["exchanges"], got[run]["device_driven"]
            if min(total) == 0 or dev != total:
                raise SystemExit(f"{run}: not every timed exchange ran device-driven (per participant, "
                                 f"device-driven {dev} of {total} exchanges over {args.repeats} runs): "
                                 f"its time is not the device-driven path's")
        again = run_pingpong(client, layers, xs, lens, args)  # signal_only was set back everywhere
        errors += [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(again, want)]
        if max(errors) > tol:
            raise SystemExit(f"pingpong's outputs differ from single's after the timed runs: relative errors "
                             f"{errors} > {tol}")
    elapsed = time.perf_counter() - t_start
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    rows = [{"run": run, "ms": 1e3 * got[run]["s"], "runs_ms": [1e3 * t for t in got[run]["times_s"]],
             "exchanges_per_run": got[run]["exchanges"][0] / args.repeats,
             "device_driven_per_run": got[run]["device_driven"][0] / args.repeats} for run in RUNS]
    t_single, t_pp, t_signal = (got[run]["s"] for run in RUNS)
    device_driven = min(got["signal-only"]["device_driven"])

    def table() -> None:
        print("| run | ms per step | vs signal-only | exchanges per participant and step, all device-driven |")
        print("|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['run']} | {r['ms']:.3f} | {r['ms'] / rows[2]['ms']:.3f} | {r['exchanges_per_run']:g} |")

    headline = [f"{name}, {args.participants} participants, 2 x {args.tokens:,} tokens, {args.layers} layers: "
                f"pingpong / signal-only {t_pp / t_signal:.3f} (target <= 1.03); single / pingpong "
                f"{t_single / t_pp:.3f}; pingpong equals single (max relative error {max(errors):.1e}); "
                f"every timed exchange device-driven ({args.repeats} interleaved repeats; signal-only "
                f"{device_driven} per participant)"]
    json_path = args.json or ROOT / "bench" / "results" / ("gpu/pingpong.json" if gpu else "pingpong.json")
    finish(table, headline, elapsed, json_path, {
        "benchmark": "pingpong", "device": name, "participants": args.participants, "tokens": args.tokens,
        "layers": args.layers, "model_dim": args.model_dim, "dtype": str(dtype), "rows": rows,
        "warmup": args.warmup, "repeats": args.repeats, "order": "interleaved, rotated per repeat",
        "device_driven": device_driven, "max_rel_error": max(errors),
        "summary": {"pingpong_vs_signal_only": t_pp / t_signal}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
