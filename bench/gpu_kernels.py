"""GPU kernel measurements of issue 10 item 4: fused-shard throughput, distca's overhead, a ProfileTable.

One script a GPU session runs blind (``bench/gpu_session.sh``); ``--device cpu --quick`` runs the
same code on the CPU backend in seconds (tests/integration/test_bench_gpu_kernels.py). It imports
no Ray. Three sections (``--sections``, default all), run in this order: ``shards``, ``profile``
(whose tables the session's ``backends`` stage reads), then the costly ``overhead``:

``shards`` — the paper's Fig. 5 claim (DistCA §3: shards of >= 128 tokens keep the kernel's full
    speed). ``--docs`` documents of ``--doc-len`` tokens are cut into shards of ``s`` tokens
    (128 ... 8192), each one CA-task as distca's planner makes them: query rows
    ``[q_start, q_end)`` against its whole causal prefix, keys ``[0, q_end)`` (bottom-right
    causal). **One** varlen call of distca's backend (``get_backend(name, device)``, the object
    the servers call) runs over all shards (``cu_seqlens_q/k`` from the shards, the prefix KV
    rows copied per shard, as the servers receive them), forward and backward, against one call
    over the whole documents. TFLOP/s = ``CostModel.task_flops`` (forward ``4·d·H_q·pairs``,
    backward 2.5×) over the median time; ``ratio`` = shard TFLOP/s / whole-document TFLOP/s
    (target >= 0.95 at >= 128 tokens). Shards are taken in head–tail pairs ``(i, n-1-i)``:
    every pair holds the same pairs and the same ``(n + 1)·s`` KV rows, so when all shards' KV
    copies would not fit in ``--max-kv-rows`` (default: 60% of the GPU memory a call can get:
    free plus what PyTorch's allocator caches unused), an evenly spaced subset of pairs is an
    exact sample of the work (the JSON says how many ran). Correctness guard, before any timing
    and with the outputs' freed blocks poisoned (NaN): every size's shard call's O, LSE and dQ
    equal the whole call's on the same rows, and (all pairs present) its dK, dV summed back per
    document equal the whole call's; a mismatch raises, so no number of a wrong kernel is
    written. Then each size's forward and backward alternate in rounds; ``fwd_ms`` is the median,
    ``fwd_ms_min`` / ``fwd_ms_max`` the spread (``bwd_`` likewise).

``overhead`` — ``DistCAClient.local(config=JobConfig(servers=P, backend=..., plan=PlanConfig()))``
    ``attend`` forward + backward against the direct backend call (forward + backward) on the same
    packed batch (Pretrain-trace document lengths,
    ``distca_sim.workloads.sample_batch("pretrain", 1, tokens)``), 8K–128K tokens, for
    :data:`OVERHEAD_RUNS`: one participant (no exchange at all), and two participants exchanging
    rows either in lock step on one thread (``lockstep``) or over the in-process symmetric heap,
    device-driven once the plan's routes are installed (``heap``; issue 22 item 2a), and the same
    with its rounds replayed from CUDA graphs (``graphs``, 8K–32K; issue 22 item 4: ``host ms``
    with and without graphs). All timed by
    the host clock around a synchronised step, median of ``--repeats``; overhead = distca / direct
    − 1 (target <= 3%). ``host ms``: the host's time from the call to its return, before
    synchronising (the launches and Python of one layer's forward + backward: issue 22's host
    time per layer). Guard: distca's out and dQ, dK, dV equal the direct call's.

``profile`` — a measured :class:`distca_sim.profile.ProfileTable` pair (forward, backward) for
    the per-GPU attention shape of ``--profile-models`` (``model:tp``, e.g. ``llama3-8b:8`` ->
    ``ModelConfig.cost_model(8)``), over an octave grid of ``(q_len, kv_len)``, ``q_len <= kv_len``.
    The simulator sums task latencies inside one fused call, so an entry is a task's share of a
    fused call: one call over ``N`` copies of the task (``N`` fills the chip: ``N·q_len >=
    --profile-rows``, within ``--max-kv-rows``), latency = time / N. Grid points with
    ``q_len > kv_len`` (never real tasks) repeat the ``(kv_len, kv_len)`` entry, whose causal work
    is the same. Guard: at the points with ``q_len·kv_len <= 2^22`` the call's first task equals
    distca's reference backend. Written as ``<json stem>_profile/<model>-tp<tp>/{forward,backward}.json`` for
    ``distca simulate --attn-profile DIR``. Each point's first forward and backward call is timed
    apart (``meta.first_call_ms``; the row's ``first_call_s`` and ``first_call_extra_s``, the
    latter over the median calls: what building a kernel for a new shape cost, e.g. cudnn's graph
    per shape bucket), and ``graph_builds`` counts the graphs a backend that counts them built.

Timing: CUDA events around the call after ``--warmup`` runs, median of ``--repeats`` (overhead:
host clock after ``torch.cuda.synchronize``); CPU: ``time.perf_counter``. Inputs are fresh
``randn`` (never zeros). Default JSON: ``bench/results/gpu/<device-name-slug>/kernels.json`` on
CUDA, ``bench/results/kernels_cpu.json`` on CPU; a PNG of TFLOP/s against shard size beside it.
The JSON is rewritten after every row and section with ``"partial": true`` (and, after SIGTERM,
``"interrupted"``), so a run the session's ``timeout`` stops keeps what it finished; the last
write, at the end, has no ``partial``.

Usage::

    python bench/gpu_kernels.py                      # the full run (CUDA if available)
    python bench/gpu_kernels.py --device cpu --quick # seconds, the CPU backend
    python bench/gpu_kernels.py --sections shards --json /tmp/k.json
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from distca_client import DistCAClient  # noqa: E402
from distca_server.kernels import BACKENDS, get_backend  # noqa: E402
from distca_server.refs import relative_error  # noqa: E402
from distca_server.transport.local_heap import heap_bytes_for  # noqa: E402
from distca_sim.hardware import get_model  # noqa: E402
from distca_sim.profile import ProfileTable  # noqa: E402
from distca_sim.simulate import format_table  # noqa: E402
from distca_sim.workloads import sample_batch  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402
from scheduler.cost import CostModel  # noqa: E402
from bench.gpu_timing import Timer, kv_row_limit, poison_freed, run_sections, spread_ms  # noqa: E402
from bench.report import finish  # noqa: E402

# profile before overhead: the backends stage reads the tables profile writes, and overhead is the
# costly one, so a run stopped at the stage's limit should lose overhead's rows, not the tables
SECTIONS = ("shards", "profile", "overhead")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# ‖a − b‖ / ‖b‖ allowed between two calls that compute the same attention with different tilings:
# both round the same exact result once to the dtype (bf16: 2^-8 per element; fp16: 2^-11).
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
REFERENCE_PAIRS = 1 << 22  # profile points small enough to check against the O(q·kv)-memory reference
LSE_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}  # absolute, float32 LSE
FULL = dict(shape=(32, 8, 128), docs=4, doc_len=32768, shard_sizes=[128 << i for i in range(7)],
            tokens=[8192 << i for i in range(5)], q_grid=[128 << i for i in range(8)],
            kv_grid=[128 << i for i in range(11)], profile_rows=16384)
QUICK = dict(shape=(2, 1, 32), docs=2, doc_len=512, shard_sizes=[128, 256],
             tokens=[512, 1024], q_grid=[128], kv_grid=[128, 256], profile_rows=128)


# ---- guards and inputs ---------------------------------------------------------------------------
def guard(name: str, err: float, tol: float, checks: list) -> None:
    """Record a correctness check; raise at once when it fails (or is NaN)."""
    ok = math.isfinite(err) and err <= tol
    checks.append({"check": name, "error": err, "tol": tol, "ok": ok})
    if not ok:
        raise RuntimeError(f"correctness guard failed: {name}: error {err:.3e} > tol {tol:.1e}; "
                           f"refusing to time a kernel that computes the wrong attention")


def cu_seqlens(lens, device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out.to(device)


def randn(rows: int, heads: int, dim: int, dtype, gen) -> torch.Tensor:
    """Fresh normal rows [rows, heads, dim], made on the generator's device (GBs on the GPU)."""
    return torch.randn(rows, heads, dim, generator=gen, device=gen.device, dtype=dtype)


# ---- section 1: fused shards ---------------------------------------------------------------------
def shard_tasks(num_docs: int, doc_len: int, s: int, max_kv_rows: float) -> tuple[list, int]:
    """CA-tasks ``(doc, q_start, q_end)`` (keys ``[0, q_end)``) of head–tail pairs of ``s``-token
    shards, an evenly spaced subset of pairs when all of them would exceed ``max_kv_rows``.
    Returns (tasks, total pairs available)."""
    n = doc_len // s
    if n * s != doc_len or n % 2:
        raise ValueError(f"doc_len={doc_len} must be an even number of shards of s={s} tokens")
    pairs = [(d, i) for d in range(num_docs) for i in range(n // 2)]
    keep = max(1, int(min(len(pairs), max_kv_rows / ((n + 1) * s))))
    chosen = [pairs[round(j * len(pairs) / keep)] for j in range(keep)]
    tasks = [(d, j * s, (j + 1) * s) for d, i in chosen for j in (i, n - 1 - i)]
    return tasks, len(pairs)


def shard_inputs(q, k, v, dout, doc_len: int, tasks: list):
    """One fused call's inputs for ``tasks`` (each shard's query rows and its copied KV prefix, as a
    server receives them): ``(qi, ki, cu_q, cu_k, max_k, (q, k, v, dout) rows)``."""
    dev = q.device
    qi = torch.cat([torch.arange(d * doc_len + a, d * doc_len + b) for d, a, b in tasks]).to(dev)
    ki = torch.cat([torch.arange(d * doc_len, d * doc_len + b) for d, _, b in tasks]).to(dev)
    cq, ck = cu_seqlens([b - a for _, a, b in tasks], dev), cu_seqlens([b for _, _, b in tasks], dev)
    return qi, ki, cq, ck, max(b for _, _, b in tasks), (q[qi], k[ki], v[ki], dout[qi])


def _output_likes(q, k) -> list[tuple]:
    """(shape, dtype) of a call's outputs, for :func:`poison_freed`: out and dQ like q, dK and dV
    like k, the float32 LSE [rows, H_q]."""
    return [(q.shape, q.dtype), (k.shape, k.dtype), (q.shape[:2], torch.float32)]


def _guard_shards(args, cfg, b, inputs, layouts, checks, label: str) -> None:
    """The shard calls of ``b`` against its whole-document call (module doc), poisoned outputs."""
    dtype, (hq, hkv, dim) = args.dtype, cfg["shape"]
    q, k, v, dout, cu, doc_len = inputs
    scale = dim ** -0.5
    poison_freed(args.device, _output_likes(q, k))
    out, lse = b.forward(q, k, v, cu, cu, doc_len, doc_len, scale)
    poison_freed(args.device, _output_likes(q, k))
    dq, dk, dv = b.backward(dout, q, k, v, out, lse, cu, cu, doc_len, doc_len, scale)
    for s, (tasks, pairs_all) in layouts.items():
        qi, ki, cq, ck, mk, (qs, ks, vs, dos) = shard_inputs(q, k, v, dout, doc_len, tasks)
        poison_freed(args.device, _output_likes(qs, ks))
        o_s, l_s = b.forward(qs, ks, vs, cq, ck, s, mk, scale)
        poison_freed(args.device, _output_likes(qs, ks))
        dq_s, dk_s, dv_s = b.backward(dos, qs, ks, vs, o_s, l_s, cq, ck, s, mk, scale)
        guard(f"{label} {s}: out", relative_error(o_s, out[qi]), REL_TOL[dtype], checks)
        guard(f"{label} {s}: lse", float((l_s - lse[qi]).abs().max()), LSE_TOL[dtype], checks)
        guard(f"{label} {s}: dq", relative_error(dq_s, dq[qi]), REL_TOL[dtype], checks)
        if 2 * pairs_all == len(tasks):  # every shard present: dK, dV add up to the documents'
            guard(f"{label} {s}: dk", relative_error(torch.zeros_like(dk, dtype=torch.float32).index_add_(
                0, ki, dk_s.float()), dk), REL_TOL[dtype], checks)
            guard(f"{label} {s}: dv", relative_error(torch.zeros_like(dv, dtype=torch.float32).index_add_(
                0, ki, dv_s.float()), dv), REL_TOL[dtype], checks)
        # freed before the next size's copies: each size may take 60% of the memory
        del qs, ks, vs, dos, o_s, l_s, dq_s, dk_s, dv_s


def bench_shards(args, cfg, backends: list, timer, checks, on_row=None, errors=None) -> list[dict]:
    """The fused-shard rows (module doc) of each of ``backends``: first every backend's guard (all
    shard sizes, before any timing), then each size timed in rounds alternating over the backends
    that passed (:meth:`Timer.rounds_s`). Times in ms (median, min, max of the rounds), TFLOP/s
    from the median. ``on_row(row)`` gets each row as soon as it is timed. A backend that fails its
    guard or raises: with ``errors`` ({where: message}) it is recorded there and not timed, without
    it the exception propagates (no number of a wrong kernel)."""
    dev, dtype, (hq, hkv, dim) = args.device, args.dtype, cfg["shape"]
    cost = CostModel(hq, hkv, dim, dtype_bytes=dtype.itemsize)
    scale = dim ** -0.5
    gen = torch.Generator(dev).manual_seed(0)
    docs, doc_len = cfg["docs"], cfg["doc_len"]
    q, k, v, dout = (randn(docs * doc_len, h, dim, dtype, gen) for h in (hq, hkv, hkv, hq))
    cu = cu_seqlens([doc_len] * docs, dev)
    limit = kv_row_limit(args, hq, hkv, dim)  # once: the guard and the timing run the same calls
    layouts = {s: shard_tasks(docs, doc_len, s, limit) for s in cfg["shard_sizes"]}
    passed = []
    for b in backends:  # labels as one backend's run always named them; with several, the backend too
        try:
            _guard_shards(args, cfg, b, (q, k, v, dout, cu, doc_len), layouts, checks,
                          "shards" if len(backends) == 1 else f"shards {b.name}")
            passed.append(b)
        except Exception as exc:  # noqa: BLE001 - one backend's failure costs the others nothing
            if errors is None:
                raise
            traceback.print_exc()
            errors[f"shards {b.name}"] = f"{type(exc).__name__}: {exc}"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    rows, whole = [], {}
    if not passed:
        return rows
    for shard, layout in [("whole", None), *layouts.items()]:
        if layout is None:
            call = (q, k, v, dout, cu, cu, doc_len, doc_len)
            flops, info = docs * cost.doc_flops(doc_len), dict(tasks=docs, pairs_run=None, kv_rows=docs * doc_len)
        else:  # this size's prefix copies, made here: one size's at a time
            tasks, pairs_all = layout
            _, ki, cq, ck, mk, copies = shard_inputs(q, k, v, dout, doc_len, tasks)
            call, copies = (*copies, cq, ck, shard, mk), None
            flops = sum(cost.task_flops(a, b, 0, b) for _, a, b in tasks)
            info = dict(tasks=len(tasks), pairs_run=len(tasks) // 2, pairs_all=pairs_all, kv_rows=int(ki.numel()))
        try:
            times = _alternate(timer, passed, call, scale)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the next size may fit
            if errors is None:
                raise
            traceback.print_exc()
            errors[f"shards {shard}"] = f"{type(exc).__name__}: {exc}"
            if layout is None:  # no whole-document rate: no ratio for any size
                return rows
            continue
        finally:
            call = None  # freed before the next size's copies are made
        for b in passed:
            row = dict(backend=b.name, shard=shard, **info, **spread_ms("fwd", times[f"{b.name} fwd"]),
                       **spread_ms("bwd", times[f"{b.name} bwd"]))
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9  # FLOPs / (ms · 1e-3) / 1e12
            row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
            base = whole.setdefault(b.name, row)  # the whole-document row is each backend's first
            row["fwd_ratio"] = row["fwd_tflops"] / base["fwd_tflops"]
            row["bwd_ratio"] = row["bwd_tflops"] / base["bwd_tflops"]
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def _alternate(timer, backends, call, scale) -> dict[str, list[float]]:
    """Seconds of each backend's forward and backward of one call ``(q, k, v, dout, cu_q, cu_k,
    max_q, max_k)``, in rounds alternating over ``backends`` (``"<name> fwd"`` / ``"<name> bwd"``)."""
    q, k, v, dout, cq, ck, mq, mk = call
    fns = {}
    for b in backends:
        out, lse = b.forward(q, k, v, cq, ck, mq, mk, scale)  # this backend's own, for its backward
        fns[f"{b.name} fwd"] = lambda b=b: b.forward(q, k, v, cq, ck, mq, mk, scale)
        fns[f"{b.name} bwd"] = lambda b=b, o=out, l=lse: b.backward(dout, q, k, v, o, l, cq, ck, mq, mk, scale)
    return timer.rounds_s(fns)


# ---- section 2: distca's overhead ------------------------------------------------------------------
OVERHEAD_RUNS = ((1, "lockstep"), (2, "lockstep"), (2, "heap"), (2, "graphs"))
"""(participants, exchange) of the overhead section: ``graphs`` is ``heap`` with its rounds captured
as CUDA graphs after their warm-up (``JobConfig(cuda_graphs=True)``; on the CPU it runs as
``heap``), on the three smallest batches (the host time per layer is read at 8K)."""


def bench_overhead(args, cfg, backend, timer, checks, on_row=None) -> list[dict]:
    """One row per (run, batch) of :data:`OVERHEAD_RUNS` (module doc), ``on_row(row)`` at each."""
    rows = []
    for participants, exchange in OVERHEAD_RUNS:
        rows += _overhead_run(args, cfg, backend, timer, checks, participants, exchange, on_row)
    return rows


def _overhead_run(args, cfg, backend, timer, checks, participants: int, exchange: str, on_row=None) -> list[dict]:
    dev, dtype, (hq, hkv, dim) = args.device, args.dtype, cfg["shape"]
    scale, rows = dim ** -0.5, []
    all_tokens = cfg["tokens"][:3] if exchange == "graphs" else cfg["tokens"]
    heap_bytes = heap_bytes_for(max(all_tokens), (hq + 2 * hkv) * dim * dtype.itemsize)
    job = JobConfig(servers=participants, backend=backend.name, plan=PlanConfig(),
                    transport="torch_dist" if exchange == "lockstep" else "nvshmem", heap_bytes=heap_bytes,
                    cuda_graphs=exchange == "graphs")
    client = DistCAClient.local(config=job)
    try:
        for tokens in all_tokens:
            lens = sample_batch("pretrain", 1, tokens, seed=0, step=0)[0]
            gen = torch.Generator(dev).manual_seed(tokens)
            q, k, v, dout = (randn(tokens, h, dim, dtype, gen) for h in (hq, hkv, hkv, hq))
            cu, mx = cu_seqlens(lens, dev), max(lens)

            def direct():
                o, l = backend.forward(q, k, v, cu, cu, mx, mx, scale)
                return o, backend.backward(dout, q, k, v, o, l, cu, cu, mx, mx, scale)

            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def distca():
                for t in leaves:
                    t.grad = None
                o = client.attend(*leaves, lens, softmax_scale=scale)
                o.backward(dout)
                return o.detach(), tuple(t.grad for t in leaves)

            (o_d, g_d), (o_c, g_c) = direct(), distca()
            for name, a, b in zip(("out", "dq", "dk", "dv"), (o_c, *g_c), (o_d, *g_d)):
                guard(f"overhead {tokens} {participants}x{exchange}: {name}", relative_error(a, b),
                      REL_TOL[dtype], checks)
            t_direct = timer.median_s(direct, host=True)
            t_distca = timer.median_s(distca, host=True)
            t_host = timer.host_s(distca)
            if args.trace is not None and tokens == cfg["tokens"][0] and participants == 1:
                trace_steps(args.trace, direct, distca, args.device)
            graphs = client._runtime.graphs
            rows.append(dict(tokens=tokens, participants=participants, exchange=exchange, docs=len(lens), max_doc=mx,
                             direct_ms=t_direct * 1e3, distca_ms=t_distca * 1e3, overhead=t_distca / t_direct - 1,
                             host_ms=t_host * 1e3, replays=0 if graphs is None else graphs.replays,
                             graphs_off=None if graphs is None else graphs.disabled))
            if on_row is not None:
                on_row(rows[-1])
    finally:
        client.close()
    return rows


def trace_steps(path: Path, direct, distca, device: torch.device, steps: int = 3) -> None:
    """Where distca's time over the direct call goes: ``steps`` of each under torch.profiler
    (host ops of every thread, device kernels), a table of the busiest host ops printed and a
    Chrome trace written to ``path`` (one step of each, marked ``direct`` / ``distca``)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for name, fn in (("direct", direct), ("distca", distca)):
            for _ in range(steps):
                with record_function(name):
                    fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    print(f"wrote {path}")


# ---- section 3: measured ProfileTable ---------------------------------------------------------------
def profile_tables(args, cfg, backend, timer, checks, cost: CostModel, label: str) -> tuple[ProfileTable, ProfileTable]:
    """(forward, backward) tables of one CA-task's share of a fused call (module doc)."""
    dev, dtype = args.device, args.dtype
    hq, hkv, dim = cost.num_heads_q, cost.num_heads_kv, cost.head_dim
    scale, gen = dim ** -0.5, torch.Generator(dev).manual_seed(1)
    qg, kg = cfg["q_grid"], cfg["kv_grid"]
    lat = {"forward": {}, "backward": {}}
    copies, first_ms, limit = {}, {}, kv_row_limit(args, hq, hkv, dim)
    builds = getattr(backend, "graph_builds", None)  # the cudnn backend counts the graphs it builds
    for ql in qg:
        for kl in kg:
            if ql > kl:
                continue
            n = max(1, int(min(math.ceil(cfg["profile_rows"] / ql), limit / kl)))
            q, dout = (randn(n * ql, hq, dim, dtype, gen) for _ in range(2))
            k, v = (randn(n * kl, hkv, dim, dtype, gen) for _ in range(2))
            cq, ck = cu_seqlens([ql] * n, dev), cu_seqlens([kl] * n, dev)
            # a first call may build a kernel for its shape (cuDNN: a graph per bucket): timed apart
            first_f, (out, lse) = timer.first_s(lambda: backend.forward(q, k, v, cq, ck, ql, kl, scale))
            first_b, _ = timer.first_s(lambda: backend.backward(dout, q, k, v, out, lse, cq, ck, ql, kl, scale))
            first_ms[f"{ql}x{kl}"] = [first_f * 1e3, first_b * 1e3]
            if ql * kl <= REFERENCE_PAIRS:  # the first copy against the plain-torch reference math
                ref, _ = BACKENDS["reference"].forward(q[:ql], k[:kl], v[:kl], cq[:2], ck[:2], ql, kl, scale)
                guard(f"profile {label} {ql}x{kl}: out", relative_error(out[:ql], ref), REL_TOL[dtype], checks)
            lat["forward"][ql, kl] = timer.median_s(
                lambda: backend.forward(q, k, v, cq, ck, ql, kl, scale)) / n
            lat["backward"][ql, kl] = timer.median_s(
                lambda: backend.backward(dout, q, k, v, out, lse, cq, ck, ql, kl, scale)) / n
            copies[f"{ql}x{kl}"] = n
            del q, k, v, dout, out, lse
    meta = dict(source="measured", bench="bench/gpu_kernels.py", model=label, cost=cost.to_dict(),
                backend=backend.name, device=args.device_name, dtype=str(dtype).removeprefix("torch."),
                torch=torch.__version__, copies_per_call=copies, first_call_ms=first_ms,
                graph_builds=None if builds is None else backend.graph_builds - builds,
                method="one varlen call over N copies of the task; latency = median call time / N; "
                       "q_len > kv_len entries repeat (kv_len, kv_len)")
    tables = []
    for kind in ("forward", "backward"):
        grid = [[lat[kind][min(ql, kl), kl] for kl in kg] for ql in qg]
        tables.append(ProfileTable(q_lens=qg, kv_lens=kg, latency_s=grid, meta=dict(meta, kind=kind)))
    return tables[0], tables[1]


def bench_profile(args, cfg, backend, timer, checks, on_row=None) -> list[dict]:
    """One row per ``--profile-models`` entry (its tables written first), ``on_row(row)`` at each:
    the corner's TFLOP/s, the smallest entry in µs, ``graph_builds`` (the backend's count, None
    where it keeps none) and ``first_call_s`` / ``first_call_extra_s``: seconds of every point's
    first forward + backward call, and their excess over the median calls (kernel or graph builds)."""
    rows = []
    for spec in args.profile_models:
        name, _, tp = spec.partition(":")
        if not tp.isdigit() or int(tp) < 1:
            raise ValueError(f"--profile-models entry {spec!r} must be MODEL:TP, e.g. llama3-8b:8")
        cost = get_model(name).cost_model(int(tp))
        cost = CostModel(cost.num_heads_q, cost.num_heads_kv, cost.head_dim, args.dtype.itemsize)
        fwd, bwd = profile_tables(args, cfg, backend, timer, checks, cost, spec)
        folder = args.json.with_name(args.json.stem + "_profile") / f"{name}-tp{tp}"
        folder.mkdir(parents=True, exist_ok=True)
        fwd.to_json(folder / "forward.json")
        bwd.to_json(folder / "backward.json")
        big_q, big_kv = fwd.q_lens[-1], fwd.kv_lens[-1]
        flops = cost.task_flops(big_kv - big_q, big_kv, 0, big_kv)
        rows.append(dict(model=spec, cost=cost.to_dict(), dir=str(folder), points=len(fwd.meta["copies_per_call"]),
                         corner=[big_q, big_kv],
                         corner_fwd_tflops=flops / fwd.latency(big_q, big_kv) / 1e12,
                         corner_bwd_tflops=2.5 * flops / bwd.latency(big_q, big_kv) / 1e12,
                         smallest_fwd_us=fwd.latency(fwd.q_lens[0], fwd.kv_lens[0]) * 1e6,
                         graph_builds=fwd.meta["graph_builds"], **first_call_seconds(fwd, bwd)))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def first_call_seconds(fwd: ProfileTable, bwd: ProfileTable) -> dict:
    """``first_call_s``: the first forward + backward calls of every measured point (``meta
    first_call_ms``), and ``first_call_extra_s``: their excess over the same calls' medians
    (entry × copies), what building kernels or graphs for new shapes cost."""
    first = extra = 0.0
    for point, (f_ms, b_ms) in fwd.meta["first_call_ms"].items():
        ql, kl = map(int, point.split("x"))
        n = fwd.meta["copies_per_call"][point]
        first += (f_ms + b_ms) / 1e3
        extra += (f_ms + b_ms) / 1e3 - n * (fwd.latency(ql, kl) + bwd.latency(ql, kl))
    return dict(first_call_s=first, first_call_extra_s=extra)


# ---- output ----------------------------------------------------------------------------------------
def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def show(result) -> None:
    def f(x, p=1):
        return "-" if x is None else f"{x:,.{p}f}"

    def g(x):  # TFLOP/s: four significant digits (CPU rates are far below 1)
        return f"{x:.4g}"
    if "shards" in result:
        print(format_table(["shard", "tasks", "KV rows", "fwd ms", "fwd TFLOP/s", "fwd ratio", "bwd ms",
                            "bwd TFLOP/s", "bwd ratio"],
                           [[str(r["shard"]), str(r["tasks"]), f"{r['kv_rows']:,}", f(r["fwd_ms"], 3),
                             g(r["fwd_tflops"]), f(r["fwd_ratio"], 3), f(r["bwd_ms"], 3),
                             g(r["bwd_tflops"]), f(r["bwd_ratio"], 3)] for r in result["shards"]]))
        print()
    if "overhead" in result:
        print(format_table(["tokens", "participants", "exchange", "docs", "longest", "direct ms", "distca ms",
                            "overhead %", "host ms"],
                           [[f"{r['tokens']:,}", str(r["participants"]), r["exchange"], str(r["docs"]),
                             f"{r['max_doc']:,}", f(r["direct_ms"], 3), f(r["distca_ms"], 3),
                             f(100 * r["overhead"], 2), f(r["host_ms"], 3)] for r in result["overhead"]]))
        print()
    if "profile" in result:
        print(format_table(["model:tp", "heads q/kv/d", "points", "corner", "fwd TFLOP/s", "bwd TFLOP/s",
                            "smallest fwd us"],
                           [[r["model"], "{num_heads_q}/{num_heads_kv}/{head_dim}".format(**r["cost"]),
                             str(r["points"]), "x".join(map(str, r["corner"])), g(r["corner_fwd_tflops"]),
                             g(r["corner_bwd_tflops"]), f(r["smallest_fwd_us"], 1)] for r in result["profile"]]))


def headline(result) -> list[str]:
    lines = []
    shards = [r for r in result.get("shards", []) if r["shard"] != "whole"]
    if shards:
        worst = min(shards, key=lambda r: min(r["fwd_ratio"], r["bwd_ratio"]))
        lines.append(f"fused shards: worst ratio to whole documents {min(worst['fwd_ratio'], worst['bwd_ratio']):.3f} "
                     f"at {worst['shard']} tokens (target >= 0.95 at >= 128 tokens)")
    for participants, exchange in OVERHEAD_RUNS:
        runs = [r for r in result.get("overhead", []) if (r["participants"], r["exchange"]) == (participants, exchange)]
        if runs:
            worst = max(runs, key=lambda r: r["overhead"])
            lines.append(f"distca overhead, {participants} participant(s), {exchange}: at most "
                         f"{100 * worst['overhead']:.2f}% ({worst['tokens']:,} tokens; target <= 3%); host time "
                         f"per layer (forward + backward) {min(r['host_ms'] for r in runs):.3f}–"
                         f"{max(r['host_ms'] for r in runs):.3f} ms")
    for r in result.get("profile", []):
        builds = "" if r["graph_builds"] is None else f"{r['graph_builds']} graph builds, "
        lines.append(f"profile {r['model']}: {r['points']} points, {builds}first calls {r['first_call_s']:.2f} s "
                     f"({r['first_call_extra_s']:.2f} s over their medians)")
    failed = [c["check"] for c in result["checks"] if not c["ok"]]
    lines.append(f"correctness guard: {len(result['checks']) - len(failed)} of {len(result['checks'])} "
                 f"checks passed" + (f"; FAILED: {failed}" if failed else ""))
    lines += [f"section {name} FAILED: {err}" for name, err in result["errors"].items()]
    if "interrupted" in result:
        lines.append(f"INTERRUPTED: {result['interrupted']}")
    return lines


def plot(rows, png: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shards = [r for r in rows if r["shard"] != "whole"]
    whole = next(r for r in rows if r["shard"] == "whole")
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, color in (("fwd", "tab:blue"), ("bwd", "tab:orange")):
        ax.plot([r["shard"] for r in shards], [r[f"{kind}_tflops"] for r in shards], "o-", color=color,
                label=f"{kind}, fused shards")
        ax.axhline(whole[f"{kind}_tflops"], color=color, ls="--", label=f"{kind}, whole documents")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("shard size (tokens)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def gpu_bench_parser(doc: str, sections: tuple) -> argparse.ArgumentParser:
    """The flags every GPU benchmark here takes: ``--device``, ``--quick`` and ``--sections``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU test): seconds")
    p.add_argument("--sections", nargs="+", choices=sections, default=list(sections))
    return p


def build_parser() -> argparse.ArgumentParser:
    """The command line; every ``--flag`` the module doc names is one of its options (a test checks)."""
    p = gpu_bench_parser(__doc__, SECTIONS)
    p.add_argument("--backend", default="auto", help="distca backend name, e.g. cudnn or torch_varlen "
                                                     "(auto: cudnn, flash_attn or torch_varlen on CUDA, "
                                                     "torch_cpu on CPU)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs (default 3, quick 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs, median (default 10, quick 5)")
    p.add_argument("--max-kv-rows", type=int, default=None,
                   help="cap on the KV rows of one call (default: 60%% of usable GPU memory; CPU: none)")
    p.add_argument("--docs", type=int, default=None, help="shards: documents (default 4, quick 2)")
    p.add_argument("--doc-len", type=int, default=None,
                   help="shards: tokens per document, an even number of every shard size (default 32768, quick 512)")
    p.add_argument("--profile-rows", type=int, default=None,
                   help="profile: query rows one call fills, N·q_len (default 16384, quick 128)")
    p.add_argument("--profile-models", nargs="+", default=None,
                   help="MODEL:TP shapes of the ProfileTable (default llama3-8b:8 llama-34b:8; quick: llama3-8b:8)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU intra-op threads (default: 1 with --quick on the CPU, whose OpenMP threads "
                        "slow down many-fold on a busy machine; else torch's)")
    p.add_argument("--trace", type=Path, default=None,
                   help="overhead section: profile the smallest batch's steps (torch.profiler), print "
                        "the busiest host ops and write a Chrome trace here")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None, help="default: the JSON path with .png")
    p.add_argument("--no-png", action="store_true")
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("docs", "doc_len", "profile_rows"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    args.dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.repeats = args.repeats if args.repeats is not None else (5 if args.quick else 10)
    args.device_name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    if args.threads is not None or (args.quick and not cuda):
        torch.set_num_threads(args.threads or 1)
    args.profile_models = args.profile_models or (["llama3-8b:8"] if args.quick else ["llama3-8b:8", "llama-34b:8"])
    if args.json is None:
        args.json = (ROOT / "bench" / "results" / "gpu" / device_slug(args.device_name) / "kernels.json" if cuda
                     else ROOT / "bench" / "results" / "kernels_cpu.json")
    backend = get_backend(args.backend, args.device)
    timer = Timer(args.device, args.warmup, args.repeats)
    checks: list[dict] = []
    result = dict(device=args.device_name, device_type=args.device.type, torch=torch.__version__,
                  cuda=torch.version.cuda, backend=backend.name, dtype=str(args.dtype).removeprefix("torch."),
                  quick=args.quick, sections=args.sections, cpu_threads=torch.get_num_threads(), warmup=args.warmup, repeats=args.repeats,
                  max_kv_rows=args.max_kv_rows,
                  shape=dict(zip(("num_heads_q", "num_heads_kv", "head_dim"), cfg["shape"])),
                  docs=cfg["docs"], doc_len=cfg["doc_len"], checks=checks, errors={})
    print(f"{args.device_name}: backend {backend.name}, {result['dtype']}, torch {torch.__version__}", flush=True)
    runs = {"shards": lambda on_row: bench_shards(args, cfg, [backend], timer, checks, on_row),
            "overhead": lambda on_row: bench_overhead(args, cfg, backend, timer, checks, on_row),
            "profile": lambda on_row: bench_profile(args, cfg, backend, timer, checks, on_row)}
    run_sections([s for s in SECTIONS if s in args.sections], runs, result, args.json, args.device)
    errors = result["errors"]
    finish(lambda: show(result), headline(result), time.perf_counter() - t_start, args.json, result)
    if "shards" in result and not args.no_png:
        png = args.png or args.json.with_suffix(".png")
        try:
            plot(result["shards"], png, f"{args.device_name}, {backend.name}, {result['dtype']}")
            print(f"wrote {png}")
        except ImportError:
            print("matplotlib not installed: no chart")
    for section, error in errors.items():
        print(f"FAILED {section}: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
