"""Data-path benchmark: what one forward+backward of ``attend`` copies, holds and costs around the
kernel, beside single-device ``varlen_attention`` in the same run.

The attention kernel is replaced by a stub backend that only allocates its outputs (``out``,
``lse`` / ``dq``, ``dk``, ``dv``), so every number below is the data path's own: gathering rows,
the in-process all-to-all, handing rows to the kernel, scattering results.

For T tokens per batch (one batch of real-looking documents, seed 0), S servers and each mode of
``DistCAClient.local`` (``inplace``: S ranks that are also servers; ``dedicated``: S ranks and S
servers), one step = ``attend`` forward, then backward with a random upstream gradient.

Columns (Q+K+V = the bytes of the three input tensors):
- ``copied``: bytes written by copy operations (index_select, cat, clone, dtype casts, copy_,
  index_copy_, index_add_, ...) in every thread of the process, as a multiple of Q+K+V. Counted
  with a ``TorchDispatchMode`` entered in every worker thread.
- ``moved``: of those, the bytes the plan moves between participants (``plan.comm_bytes()``,
  forward + backward): the in-process transport's copy, which a network transport does on the wire.
  With kept activations (the default) a round moves Q, K, V out and O, LSE back (forward), dO out
  and dQ, dK, dV back (backward): 3.35x Q+K+V for the default GQA 4:1 shape (O and dO are
  Q-sized), 2.68x for MHA. The floor of ``copied - moved`` is one gather and one scatter per moved
  byte plus the server's one copy of the Q, K, V rows it keeps for the backward (1.0x: the next
  round overwrites its receive buffer): 4.35x for GQA 4:1, 3.68x for MHA; one dedicated server
  reaches it. (Stateless plans, ``keep_activations=False``, send Q, K, V and O again with dO:
  moved and floor 5.0x for GQA, 4.0x for MHA.)
- ``peak``: the heap's peak growth during the step over the heap before the client was made
  (glibc ``mallinfo2``: arena bytes in use plus mmap-ed bytes, sampled after every tensor operation
  of every thread), as a multiple of Q+K+V: buffers the client keeps between steps count, and so
  do outputs and gradients (alive at the end).
- ``ms``: median wall time of the step (no instrumentation), ``--repeats`` runs after a warm-up.
  On this CPU it is mostly the copies themselves; on a GPU the copies are asynchronous kernels
  and the host's time is the launches, so:
- ``launches``: tensor operations of the step that would launch a device kernel (every aten op
  dispatched in every thread but views, reshapes and allocations), the host-time measure that
  carries over to a GPU.
- ``... before``: the same configuration measured in the same run on an earlier checkout of distca
  (``--before-tree``); ``ms vs before`` is the ratio of the times. Both trees are then measured
  the same way: each configuration in a fresh process per tree (``--worker``), the two back to
  back, alternating which goes first, so neither tree runs after the earlier configurations'
  heap and threads, and both see the same machine load. Without ``--before-tree`` every
  configuration runs in this process.

Usage::

    python bench/datapath.py                       # T = 4K/16K/32K, S = 1/2/4, both modes
    python bench/datapath.py --quick               # T = 4K, S = 1/2
    git worktree add /tmp/before 5e1a9bb && python bench/datapath.py --before-tree /tmp/before

Writes JSON to ``--json`` (default ``bench/results/datapath.json``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
# DISTCA_TREE: measure another checkout of distca (--before-tree runs this script there).
sys.path.insert(0, os.environ.get("DISTCA_TREE", str(ROOT)))

from distca_client import DistCAClient, varlen_attention  # noqa: E402
from distca_server import kernels  # noqa: E402
try:
    from scheduler.config import JobConfig, PlanConfig  # noqa: E402
except ImportError:  # a checkout from before the config (--before-tree): it takes keyword arguments
    JobConfig = PlanConfig = None

HQ, D, DTYPE = 8, 64, torch.bfloat16
aten = torch.ops.aten


# ---- the stub kernel --------------------------------------------------------------------------------
class StubBackend:
    """Allocates what a kernel returns and computes nothing (registered as backend "stub")."""

    name = "stub"
    device_types = None

    def supports(self, device) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                window=None, diagonals=None):
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return torch.empty_like(q), torch.empty(q.shape[:2], dtype=lse_dtype, device=q.device)

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, window=None, diagonals=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def stub_backend():
    """Backend "stub" is known while the block runs (and only then: tests import this script)."""
    kernels.BACKENDS["stub"] = StubBackend()
    try:
        yield
    finally:
        kernels.BACKENDS.pop("stub", None)


# ---- counting copies and heap growth in every thread -------------------------------------------------
def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# ops that launch no device kernel: views, metadata and allocations (everything else counts as a launch)
_NO_LAUNCH = {
    "view", "_unsafe_view", "_reshape_alias", "reshape", "view_as", "slice", "select", "narrow",
    "as_strided", "expand", "alias", "detach", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "split", "split_with_sizes", "unbind", "empty", "empty_like", "new_empty", "empty_strided",
    "new_empty_strided", "lift_fresh", "_to_copy_noop", "is_same_size", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset",
    "contiguous",  # composite: the copy it makes, if any, is counted as copy_/clone
    "item",  # only of distca's round tensor, which lives on the CPU by design (no device sync)
}

# op -> which argument holds the bytes written (None: the output)
_COPY_OPS = {
    aten.index_select: None, aten.cat: None, aten.clone: None, aten._to_copy: None,
    aten.stack: None, aten.gather: None, aten.index: None, aten.repeat: None,
    aten.repeat_interleave: None, aten.copy_: 1, aten.index_copy_: 3, aten.index_copy: 3,
    aten.index_add_: 3, aten.index_add: 3, aten.index_put_: 2, aten.scatter_: 3,
    aten.masked_scatter_: 2,
    aten._foreach_copy_: 0,  # a list of destinations (the replayed rounds' copies in and out)
}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_libc.mallinfo2.restype = _Mallinfo2


def heap_in_use() -> int:
    """Bytes the C heap holds for the process (arena in use + mmap-ed blocks)."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


class CopyCounter(TorchDispatchMode):
    """Sums bytes written by copy operations and samples the heap after every operation."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.copied = 0
        self.launches = 0
        self.by_op: dict[str, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "distca":  # distca's custom ops: count the operations their body runs
            body = torch._library.custom_ops.OPDEFS[func.name()]._init_fn
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet.__name__ not in _NO_LAUNCH:
            with self.lock:
                self.launches += 1
        if packet in _COPY_OPS:
            where = _COPY_OPS[packet]
            if "out" in kwargs:
                n = _nbytes(kwargs["out"])
            elif where is None:
                n = sum(_nbytes(t) for t in (out if isinstance(out, (tuple, list)) else [out]))
            else:
                n = _nbytes(args[where]) if where < len(args) else 0
                if packet is aten.copy_:
                    n = _nbytes(args[0])
                elif packet is aten._foreach_copy_:
                    n = sum(_nbytes(t) for t in args[0])
            with self.lock:
                self.copied += n
                self.by_op[packet.__name__] = self.by_op.get(packet.__name__, 0) + n
        h = heap_in_use()
        if h > self.peak:
            with self.lock:
                self.peak = max(self.peak, h)
        return out


_submit = concurrent.futures.ThreadPoolExecutor.submit
_thread_run = threading.Thread.run


def counting_in_threads(counter: CopyCounter):
    """Make every ThreadPoolExecutor task, and every thread started from now on (the CPU stand-in
    of a graph replay runs the recorded round on one), run under ``counter`` (dispatch modes are
    per thread). Threads already running (a routed transport's stream thread, whose puts are the
    transfer itself) are not counted."""
    def submit(self, fn, /, *args, **kwargs):
        @functools.wraps(fn)
        def run(*a, **kw):
            with counter:
                return fn(*a, **kw)
        return _submit(self, run, *args, **kwargs)

    def thread_run(self):
        with counter:
            _thread_run(self)
    concurrent.futures.ThreadPoolExecutor.submit = submit
    threading.Thread.run = thread_run


def restore_threads() -> None:
    concurrent.futures.ThreadPoolExecutor.submit = _submit
    threading.Thread.run = _thread_run


# ---- the workload ---------------------------------------------------------------------------------------
def doc_lens(total: int, seed: int = 0) -> list[int]:
    """Documents of a packed batch: a few long ones and many short ones, odd lengths included."""
    rng = np.random.default_rng(seed)
    lens, left = [], total
    while left > 0:
        n = int(min(left, max(1, rng.lognormal(6.5, 1.4))))
        lens.append(n)
        left -= n
    return lens


def inputs(total: int, hkv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(total, h, D, generator=g).to(DTYPE) for h in (HQ, hkv, hkv, HQ))
    return q, k, v, dout


def one_step(attn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


def measure(attn, q, k, v, dout, repeats: int, base: int | None = None, replays=None) -> dict:
    """Copies, peak heap growth over ``base`` (default: the heap before the measured step; pass
    the heap before the client existed to count what it holds between steps) and time;
    ``replays``: a count of replayed rounds, read around the counted step (``counted_replays``)."""
    qkv = sum(_nbytes(t) for t in (q, k, v))
    one_step(attn, q, k, v, dout)  # warm-up: plans, threads, buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_step(attn, q, k, v, dout)
        times.append(time.perf_counter() - start)
    counter = CopyCounter()
    counting_in_threads(counter)
    try:
        gc.collect()
        base = heap_in_use() if base is None else base
        counter.peak = base
        replayed = replays() if replays else 0
        with counter:
            result = one_step(attn, q, k, v, dout)
        replayed = replays() - replayed if replays else None
        del result
    finally:
        restore_threads()
    return {"counted_replays": replayed, "copied_x_qkv": counter.copied / qkv, "peak_x_qkv": (counter.peak - base) / qkv,
            "ms": statistics.median(times) * 1e3, "copied_by_op": dict(sorted(counter.by_op.items())),
            "launches": counter.launches,
            "qkv_bytes": qkv}


def run_config(total: int, mode: str, servers: int, heads_kv: int, repeats: int) -> dict:
    """One row: ``attend`` through ``DistCAClient.local`` (mode ``varlen_attention``: the local
    kernel call) on one batch of ``total`` tokens."""
    torch.set_num_threads(1)  # participants are threads already; keep timings steady on 2 cores
    with stub_backend():
        return _run_config(total, mode, servers, heads_kv, repeats)


def _run_config(total: int, mode: str, servers: int, heads_kv: int, repeats: int) -> dict:
    lens = doc_lens(total)
    q, k, v, dout = inputs(total, heads_kv)
    if mode == "varlen_attention":
        row = measure(lambda a, b, c: varlen_attention(a, b, c, lens, backend="stub"), q, k, v, dout,
                      repeats)
    else:
        base_mode, _, path = mode.partition(" ")  # "inplace", or "inplace shm" / "inplace shm+graphs"
        gc.collect()
        before_client = heap_in_use()  # buffers and plans the client keeps count as its memory
        with contextlib.ExitStack() as stack:
            if JobConfig is None:
                client = DistCAClient.local(servers, backend="stub", mode=base_mode)
            else:
                extra = {}
                if path:
                    extra = dict(transport="shm", cuda_graphs=path == "shm+graphs", timeout_s=120)
                if path == "shm+graphs":
                    from distca_server.runtime.cpu_replay import cpu_replays
                    stack.enter_context(cpu_replays())  # every replay runs the recorded round again
                client = DistCAClient.local(config=JobConfig(servers=servers, backend="stub",
                                                             plan=PlanConfig(mode=base_mode), **extra))
            stack.enter_context(client)
            graphs = client._runtime.graphs if path == "shm+graphs" else None
            row = measure(lambda a, b, c: client.attend(a, b, c, lens), q, k, v, dout, repeats,
                          base=before_client, replays=None if graphs is None else (lambda: graphs.replays))
            comm = client.last_plan.comm_bytes()
            if graphs is not None and row["counted_replays"] != 2:
                raise AssertionError(f"{mode}: {row['counted_replays']} of the counted step's 2 rounds were "
                                     f"replayed (more warm-up steps needed: --repeats)")
        row["moved_x_qkv"] = (comm["forward"]["total"] + comm["backward"]["total"]) / row["qkv_bytes"]
    row.update(tokens=total, servers=servers, mode=mode)
    return row


def run_worker(tree: Path, cfg: dict) -> dict:
    """One configuration measured on the checkout ``tree`` (this one or ``--before-tree``) in a
    fresh process of this script: started, placed and run alike for either tree."""
    from distca_cli.connect import worker_pythonpath
    env = dict(os.environ, DISTCA_TREE=str(tree), PYTHONPATH=worker_pythonpath(tree))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)],
                         env=env, capture_output=True, text=True, check=True, cwd=str(tree))
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_both(before_tree: Path, cfg: dict, before_first: bool) -> tuple[dict, dict]:
    """``(this tree's row, the earlier tree's row)`` of one configuration, each in its own fresh
    process, ``before_first`` saying which runs first."""
    order = [("before", before_tree), ("current", ROOT)]
    got = {name: run_worker(tree, cfg) for name, tree in (order if before_first else order[::-1])}
    return got["current"], got["before"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["inplace", "dedicated"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads-kv", type=int, default=2, help=f"KV heads (q heads: {HQ})")
    parser.add_argument("--quick", action="store_true", help="T = 4K, S = 1 and 2, 2 repeats")
    parser.add_argument("--graphs", action="store_true",
                        help="also each mode over the in-process routed heap (transport shm), eagerly and with "
                             "its rounds captured and replayed (cuda_graphs; on the CPU a stand-in replays "
                             "each recording by running it again): what replaying adds to the copies")
    parser.add_argument("--before-tree", type=Path, default=None,
                        help="a checkout of an earlier distca (e.g. `git worktree add /tmp/before "
                             "5e1a9bb`): each configuration is also measured there, in this run")
    parser.add_argument("--label", default="current")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "datapath.json")
    args = parser.parse_args(argv)
    if args.worker is not None:  # one configuration in a fresh process, for --before-tree
        print(json.dumps(dict(run_config(**json.loads(args.worker)), process=os.getpid())))
        return 0
    if args.quick:
        args.tokens, args.servers, args.repeats = [4096], [1, 2], 2
    from bench.report import finish

    started = time.perf_counter()
    rows = []
    configs = [(t, "varlen_attention", 0) for t in args.tokens]
    modes = list(args.modes)
    if args.graphs:
        modes += [f"{m} {path}" for m in args.modes for path in ("shm", "shm+graphs")]
    configs += [(t, m, s) for t in args.tokens for m in modes for s in args.servers
                if not (s == 1 and m.endswith("graphs"))]  # one client rank: its rounds are never captured
    before_tree = None if args.before_tree is None else args.before_tree.resolve()
    pairs = 0
    for total, mode, servers in sorted(configs):
        cfg = dict(total=total, mode=mode, servers=servers, heads_kv=args.heads_kv, repeats=args.repeats)
        if before_tree is None:
            row = run_config(**cfg)
        elif mode == "varlen_attention":  # no before: still a fresh process, as this tree's other rows
            row = run_worker(ROOT, cfg)
        else:
            before_first = pairs % 2 == 1
            pairs += 1
            row, old = run_both(before_tree, cfg, before_first)
            row.update(first="before" if before_first else "current", process_before=old["process"],
                       ms_before=old["ms"], copied_before=old["copied_x_qkv"],
                       peak_before=old["peak_x_qkv"], ms_vs_before=row["ms"] / old["ms"],
                       launches_before=old["launches"],
                       launches_vs_before=row["launches"] / old["launches"] if old["launches"] else None)
        rows.append(row)
        print(f"  T={total} {mode} S={servers}: copied {row['copied_x_qkv']:.2f}x, "
              f"peak {row['peak_x_qkv']:.2f}x, {row['ms']:.2f} ms, {row['launches']} launches"
              + (f" (before: {row['copied_before']:.2f}x, {row['peak_before']:.2f}x, "
                 f"{row['ms_before']:.2f} ms, {row['launches_before']} launches)" if "ms_before" in row else ""),
              flush=True)
    varlen = {r["tokens"]: r for r in rows if r["mode"] == "varlen_attention"}
    for r in rows:
        if r["mode"] != "varlen_attention":
            r["ms_vs_varlen"] = r["ms"] / varlen[r["tokens"]]["ms"]
    elapsed = time.perf_counter() - started

    def table():
        print(f"\ndata path per forward+backward step ({args.label}), Q+K+V multiples; kernel stubbed; "
              f"hq={HQ} hkv={args.heads_kv} d={D} {str(DTYPE).removeprefix('torch.')}")
        print(f"{'T':>6} {'mode':<20} {'S':>2} {'copied':>7} {'moved':>6} {'peak':>6} {'ms':>8} "
              f"{'vs varlen':>9} {'launches':>8} {'copied before':>13} {'peak before':>11} {'ms before':>9} "
              f"{'ms vs before':>12} {'launches before':>15} {'launches vs before':>18}")
        for r in rows:
            def opt(key, fmt):
                return format(r[key], fmt) if r.get(key) is not None else "-"
            print(f"{r['tokens']:>6} {r['mode']:<20} {r['servers'] or '-':>2} {r['copied_x_qkv']:>7.2f} "
                  f"{opt('moved_x_qkv', '.2f'):>6} {r['peak_x_qkv']:>6.2f} {r['ms']:>8.2f} "
                  f"{opt('ms_vs_varlen', '.1f'):>9} {r['launches']:>8} {opt('copied_before', '.2f'):>13} "
                  f"{opt('peak_before', '.2f'):>11} {opt('ms_before', '.2f'):>9} "
                  f"{opt('ms_vs_before', '.2f'):>12} {opt('launches_before', 'd'):>15} "
                  f"{opt('launches_vs_before', '.2f'):>18}")

    runs = [r for r in rows if r["mode"] != "varlen_attention"]
    worst = max(runs, key=lambda r: r["copied_x_qkv"])
    headline = [f"worst copies: {worst['copied_x_qkv']:.2f}x Q+K+V (T={worst['tokens']}, {worst['mode']}, "
                f"S={worst['servers']}); worst peak: {max(r['peak_x_qkv'] for r in runs):.2f}x"]
    compared = [r for r in runs if "ms_vs_before" in r]
    # None: the earlier tree launched nothing there (no ratio); 0.0 (now none) is a ratio
    launches = [r["launches_vs_before"] for r in compared if r["launches_vs_before"] is not None]
    if compared:
        headline.append(f"time vs the earlier data path (both in fresh processes, alternating): "
                        f"{min(r['ms_vs_before'] for r in compared):.2f}"
                        f"-{max(r['ms_vs_before'] for r in compared):.2f}x "
                        f"(median {statistics.median(r['ms_vs_before'] for r in compared):.2f}); launches: "
                        + (f"{min(launches):.2f}-{max(launches):.2f}x" if launches else "none before"))
    finish(table, headline, elapsed, args.json,
           {"label": args.label, "before_tree": None if before_tree is None else str(before_tree),
            "shape": {"num_heads_q": HQ, "num_heads_kv": args.heads_kv,
                                           "head_dim": D, "dtype": str(DTYPE)}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
