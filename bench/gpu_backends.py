"""Issue 21's GPU measurements in one run: every attention backend against torch's FlashAttention-2
(``torch_varlen``) on the same inputs, each backend's fused-shard ratio, and a plan run for real
with the FLOP planner and the time planner.

``speed`` — for each backend that runs here (CUDA: cudnn, fa4, flash_attn, torch_varlen; CPU:
    torch_cpu), head shape (``--shapes``, default 32/8/128 and 64/8/128) and document length L
    (``--lengths``, default 8K, 32K, 128K): one causal varlen call over ``max(1, --min-tokens // L)``
    documents of L tokens, forward and backward TFLOP/s (FLOPs: ``CostModel.doc_flops``, the
    backward 2.5x the forward, as ``bench/gpu_kernels.py`` counts) and their ratio to the
    baseline measured in the same run (``torch_varlen`` on CUDA, ``torch_cpu`` on the CPU). Guard
    before any timing: each backend's out, LSE, dQ, dK, dV against the baseline's on the same
    inputs (``gpu_kernels.REL_TOL`` / ``LSE_TOL``); a backend that fails it, or fails to run, is
    reported and not timed. Target (issue 21, H100, 32/8/128 at 32K): >= 480 forward, >= 400
    backward TFLOP/s.
``shards`` — ``bench/gpu_kernels.py``'s fused-shard section for each backend (2 documents of 32K
    tokens, 32/8/128, shards of 128 ... 4096 tokens): each kernel's fused-shard ratio.
``plan`` — ``DistCAClient.local(num_servers=4)`` forward + backward of a Pretrain-trace batch
    (``4 x --plan-tokens`` tokens, the attention shape and dtype the time table was measured for,
    the backend ``auto`` picks), planned by the FLOP planner and by the time planner (``PlanConfig(attn_profile=...)``, the
    table of ``--attn-profile``: default the shipped one of this GPU). Guard: distca's out, dQ,
    dK, dV against the direct call. Then each server's fused call (its ``ServerLayout``: the
    plan's own CA-tasks) is timed alone, forward + backward, after the same warm-up: measured
    seconds per server and their max/mean, beside the time model's predicted max/mean and the
    FLOP max/mean of both plans. Target: the time planner's measured max/mean <= 1 + eps + 0.02.

Usage::

    python bench/gpu_backends.py                          # CUDA: every section
    python bench/gpu_backends.py --device cpu --quick     # seconds, torch_cpu (the CPU test)

Writes ``--json`` (default ``bench/results/gpu/<device-name-slug>/backends.json``; CPU:
``bench/results/backends_cpu.json``) and a PNG beside it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.gpu_kernels import (DTYPES, FULL, LSE_TOL, QUICK, REL_TOL, Timer, bench_shards,  # noqa: E402
                               cu_seqlens, device_slug, gpu_bench_parser, guard, randn)
from bench.report import finish  # noqa: E402
from distca_client import DistCAClient  # noqa: E402
from distca_server.executor import ServerExecutor  # noqa: E402
from distca_server.kernels import available_backends, get_backend  # noqa: E402
from distca_server.refs import relative_error  # noqa: E402
from distca_sim.simulate import format_table  # noqa: E402
from distca_sim.workloads import sample_batch  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402
from scheduler.cost import CostModel  # noqa: E402
from scheduler.layout import server_layout  # noqa: E402
from scheduler.time_cost import TimeModel  # noqa: E402

SECTIONS = ("speed", "shards", "plan")
PROFILES = ROOT / "distca_sim" / "data" / "profiles"
PLAN_SERVERS = 4
PLAN_SLACK = 0.02  # issue 21: the time planner's measured max/mean within 1 + eps + this
# (shapes, lengths, min_tokens, plan_tokens, shard cfg) of a full and a quick run
FULL_RUN = dict(shapes=[(32, 8, 128), (64, 8, 128)], lengths=[8192, 32768, 131072], min_tokens=32768,
                plan_tokens=32768, shards=dict(FULL, docs=2, shard_sizes=[128 << i for i in range(6)]))
QUICK_RUN = dict(shapes=[(2, 1, 32)], lengths=[256, 1024], min_tokens=1024, plan_tokens=1024, shards=QUICK)


def run_backends(device: torch.device, names: list[str] | None) -> list:
    """The backends to compare, the baseline first: ``names``, else every one that runs on ``device``
    except the float64 reference (an O(L²)-memory oracle, not a kernel)."""
    names = names or [n for n in available_backends(device) if n != "reference"]
    base = "torch_varlen" if device.type == "cuda" else "torch_cpu"
    names = sorted(names, key=lambda n: n != base)
    return [get_backend(n, device) for n in names]


# ---- section 1: kernel speed against the baseline -------------------------------------------------
def bench_speed(args, run, backends, timer, checks, errors) -> list[dict]:
    rows = []
    for hq, hkv, dim in run["shapes"]:
        cost = CostModel(hq, hkv, dim, dtype_bytes=args.dtype.itemsize)
        scale = dim ** -0.5
        for L in run["lengths"]:
            docs = max(1, run["min_tokens"] // L)
            gen = torch.Generator(args.device).manual_seed(L + hq)
            q, k, v, dout = (randn(docs * L, h, dim, args.dtype, gen) for h in (hq, hkv, hkv, hq))
            cu = cu_seqlens([L] * docs, args.device)
            call = (cu, cu, L, L, scale)
            flops = docs * cost.doc_flops(L)
            base, base_row = None, None
            for b in backends:
                where = f"speed {b.name} {hq}/{hkv}/{dim} L={L}"
                try:
                    out, lse = b.forward(q, k, v, *call)
                    grads = b.backward(dout, q, k, v, out, lse, *call)
                    if base is None:
                        base = (out, lse, *grads)
                    else:
                        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (base[0], *base[2:])):
                            guard(f"{where}: {name}", relative_error(got, want), REL_TOL[args.dtype], checks)
                        guard(f"{where}: lse", float((lse.float() - base[1].float()).abs().max()),
                              LSE_TOL[args.dtype], checks)
                    t_f = timer.median_s(lambda: b.forward(q, k, v, *call))
                    t_b = timer.median_s(lambda: b.backward(dout, q, k, v, out, lse, *call))
                except Exception as exc:  # noqa: BLE001 - one backend's failure costs the others nothing
                    traceback.print_exc()
                    errors[where] = f"{type(exc).__name__}: {exc}"
                    continue
                row = dict(backend=b.name, shape=f"{hq}/{hkv}/{dim}", doc_len=L, docs=docs, fwd_ms=t_f * 1e3,
                           bwd_ms=t_b * 1e3, fwd_tflops=flops / t_f / 1e12, bwd_tflops=2.5 * flops / t_b / 1e12)
                base_row = base_row or row  # the baseline, or the first backend that ran if it failed
                row["baseline"] = base_row["backend"]
                row["fwd_vs_base"] = row["fwd_tflops"] / base_row["fwd_tflops"]
                row["bwd_vs_base"] = row["bwd_tflops"] / base_row["bwd_tflops"]
                rows.append(row)
                out = lse = grads = None
            q = k = v = dout = base = None  # freed before the next length's tensors
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---- section 2: each kernel's fused-shard ratio ---------------------------------------------------
def bench_backend_shards(args, run, backends, timer, checks, errors) -> list[dict]:
    rows = []
    for b in backends:
        try:
            rows += [dict(r, backend=b.name) for r in bench_shards(args, run["shards"], b, timer, checks)]
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            errors[f"shards {b.name}"] = f"{type(exc).__name__}: {exc}"
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- section 3: a plan run for real, FLOP planner against time planner ---------------------------
def default_profile(device_name: str) -> Path:
    """The shipped measured table of this GPU (h100 or h200; h200 elsewhere), Llama-3-8B at TP 8."""
    kind = "h100" if "h100" in device_name.lower() else "h200"
    return PROFILES / kind / "llama3-8b-tp8"


def server_seconds(plan, backend, device, dtype, cost: CostModel, timer) -> list[tuple[float, float]]:
    """Each server's fused call of ``plan`` alone: median (forward, backward) seconds on fresh rows
    of its received sizes (0, 0 for a server without tasks)."""
    scale = cost.head_dim ** -0.5
    gen = torch.Generator(device).manual_seed(1)
    out = []
    for s in range(plan.num_servers):
        lay = server_layout(plan, s)
        if lay.num_tasks == 0:
            out.append((0.0, 0.0))
            continue
        ex = ServerExecutor(lay, backend, device, window=plan.window)
        nq, nkv = sum(lay.q_rows), sum(lay.kv_rows)
        q, dout = (randn(nq, cost.num_heads_q, cost.head_dim, dtype, gen) for _ in range(2))
        k, v = (randn(nkv, cost.num_heads_kv, cost.head_dim, dtype, gen) for _ in range(2))
        o, lse = ex.forward(q, k, v, scale)
        out.append((timer.median_s(lambda: ex.forward(q, k, v, scale)),
                    timer.median_s(lambda: ex.backward(dout, q, k, v, o, lse, scale))))
    return out


def _max_mean(xs) -> float:
    xs = np.asarray(xs, dtype=np.float64)
    return float(xs.max() / xs.mean()) if xs.mean() > 0 else 1.0


def bench_plan(args, run, backend, timer, checks) -> dict:
    table = Path(args.attn_profile or default_profile(args.device_name))
    model = TimeModel.from_dir(table)
    cost = model.cost
    if cost is None:
        raise ValueError(f"{table}: the tables name no attention shape (meta.cost)")
    dtype = {2: torch.bfloat16, 4: torch.float32}[cost.dtype_bytes]
    lens = sample_batch("pretrain", 1, PLAN_SERVERS * run["plan_tokens"], seed=0, step=0)[0]
    T, scale = sum(lens), cost.head_dim ** -0.5
    gen = torch.Generator(args.device).manual_seed(7)
    q, k, v, dout = (randn(T, h, cost.head_dim, dtype, gen)
                     for h in (cost.num_heads_q, cost.num_heads_kv, cost.num_heads_kv, cost.num_heads_q))
    cu, mx = cu_seqlens(lens, args.device), max(lens)
    o_d, l_d = backend.forward(q, k, v, cu, cu, mx, mx, scale)
    want = (o_d, *backend.backward(dout, q, k, v, o_d, l_d, cu, cu, mx, mx, scale))
    result = dict(table=str(table.relative_to(ROOT) if table.is_relative_to(ROOT) else table),
                  table_backend=model.forward.meta.get("backend"), table_device=model.forward.meta.get("device"),
                  shape=cost.to_dict(), tokens=T, docs=len(lens), max_doc=mx, servers=PLAN_SERVERS,
                  epsilon=args.epsilon, planners={})
    for planner, profile in (("flop", None), ("time", str(table))):
        job = JobConfig(servers=PLAN_SERVERS, backend=backend.name,
                        plan=PlanConfig(epsilon=args.epsilon, attn_profile=profile))
        with DistCAClient.local(config=job) as client:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            t0 = time.perf_counter()
            o = client.attend(*leaves, lens, softmax_scale=scale)
            o.backward(dout)
            plan = client.last_plan
            for name, a, b in zip(("out", "dq", "dk", "dv"), (o.detach(), *(t.grad for t in leaves)), want):
                guard(f"plan {planner}: {name}", relative_error(a, b), REL_TOL[dtype], checks)
            first_s = time.perf_counter() - t0
        measured = server_seconds(plan, backend, args.device, dtype, cost, timer)
        total = [f + b for f, b in measured]
        predicted = model.server_seconds(plan.task_array, PLAN_SERVERS, plan.window)
        result["planners"][planner] = dict(
            min_shard=plan.min_shard, tasks=len(plan.task_array), first_step_s=first_s,
            server_fwd_ms=[f * 1e3 for f, _ in measured], server_bwd_ms=[b * 1e3 for _, b in measured],
            server_ms=[t * 1e3 for t in total], predicted_ms=(predicted * 1e3).tolist(),
            measured_max_mean=_max_mean(total), predicted_max_mean=_max_mean(predicted),
            flop_max_mean=plan.imbalance()[1], max_server_ms=max(total) * 1e3)
    time_row = result["planners"]["time"]
    result["target"] = 1 + args.epsilon + PLAN_SLACK
    result["meets_target"] = time_row["measured_max_mean"] <= result["target"]
    result["time_vs_flop_max_server"] = time_row["max_server_ms"] / result["planners"]["flop"]["max_server_ms"]
    return result


# ---- report -------------------------------------------------------------------------------------
def show(result: dict) -> None:
    if result.get("speed"):
        print(format_table(["backend", "shape", "doc", "docs", "fwd ms", "bwd ms", "fwd TF/s", "bwd TF/s",
                            "fwd vs base", "bwd vs base"],
                           [[r["backend"], r["shape"], r["doc_len"], r["docs"], f"{r['fwd_ms']:.2f}",
                             f"{r['bwd_ms']:.2f}", f"{r['fwd_tflops']:.1f}", f"{r['bwd_tflops']:.1f}",
                             f"{r['fwd_vs_base']:.2f}", f"{r['bwd_vs_base']:.2f}"] for r in result["speed"]]))
    if result.get("shards"):
        print(format_table(["backend", "shard", "fwd TF/s", "bwd TF/s", "fwd ratio", "bwd ratio"],
                           [[r["backend"], r["shard"], f"{r['fwd_tflops']:.1f}", f"{r['bwd_tflops']:.1f}",
                             f"{r['fwd_ratio']:.2f}", f"{r['bwd_ratio']:.2f}"] for r in result["shards"]]))
    plan = result.get("plan")
    if plan:
        print(f"plan: {plan['tokens']} tokens, {plan['docs']} documents, {plan['servers']} servers, "
              f"table {plan['table']} ({plan['table_backend']}, {plan['table_device']})")
        print(format_table(["planner", "min_shard", "server ms (fwd+bwd)", "measured max/mean",
                            "predicted max/mean", "FLOP max/mean"],
                           [[name, p["min_shard"], " ".join(f"{x:.2f}" for x in p["server_ms"]),
                             f"{p['measured_max_mean']:.3f}", f"{p['predicted_max_mean']:.3f}",
                             f"{p['flop_max_mean']:.3f}"] for name, p in plan["planners"].items()]))


def headline(result: dict) -> list[str]:
    lines = []
    for r in result.get("speed") or []:
        if r["shape"] == "32/8/128" and r["doc_len"] == 32768:
            lines.append(f"{r['backend']} at 32K, 32/8/128: {r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} TFLOP/s "
                         f"fwd / bwd ({r['fwd_vs_base']:.2f} / {r['bwd_vs_base']:.2f}x the baseline)")
    plan = result.get("plan")
    if plan:
        p = plan["planners"]
        lines.append(f"plan run: measured max/mean {p['flop']['measured_max_mean']:.3f} FLOP planner, "
                     f"{p['time']['measured_max_mean']:.3f} time planner (target <= {plan['target']:.2f}: "
                     f"{'met' if plan['meets_target'] else 'NOT met'}); slowest server "
                     f"{plan['time_vs_flop_max_server']:.3f}x the FLOP plan's")
    return lines


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    speed = [r for r in result.get("speed") or [] if r["shape"] == (result["speed"][0]["shape"])]
    for name in dict.fromkeys(r["backend"] for r in speed):
        mine = [r for r in speed if r["backend"] == name]
        for kind, style in (("fwd", "o-"), ("bwd", "s--")):
            axes[0].plot([r["doc_len"] for r in mine], [r[f"{kind}_tflops"] for r in mine], style,
                         label=f"{name} {kind}")
    axes[0].set_xscale("log", base=2)
    axes[0].set(xlabel="document length (tokens)", ylabel="TFLOP/s",
                title=f"causal varlen, {speed[0]['shape'] if speed else ''}")
    axes[0].legend(fontsize=7)
    plan = result.get("plan")
    if plan:
        width = 0.4
        for i, (name, p) in enumerate(plan["planners"].items()):
            xs = np.arange(len(p["server_ms"])) + (i - 0.5) * width
            axes[1].bar(xs, p["server_ms"], width, label=f"{name} planner (max/mean {p['measured_max_mean']:.3f})")
        axes[1].set(xlabel="server", ylabel="fused call ms (fwd + bwd)", title="plan run: each server's kernel time")
        axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = gpu_bench_parser(__doc__, SECTIONS)
    p.add_argument("--backends", nargs="+", default=None, help="default: every backend that runs here")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="speed and shards: default bfloat16 on CUDA, "
                                                                 "float32 on CPU (plan: the table's)")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="speed: document lengths")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs (default 2, quick 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs, median (default 5, quick 3)")
    p.add_argument("--max-kv-rows", type=int, default=None, help="shards: cap on one call's KV rows")
    p.add_argument("--attn-profile", default=None, help="plan: the time planner's table folder (default: the "
                                                         "shipped one of this GPU, Llama-3-8B at TP 8)")
    p.add_argument("--epsilon", type=float, default=PlanConfig.epsilon, help="plan: the planners' tolerance")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-png", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    run = dict(QUICK_RUN if args.quick else FULL_RUN)
    if args.lengths:
        run["lengths"] = args.lengths
    args.dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    args.device_name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1 if args.quick else torch.get_num_threads())
    timer = Timer(args.device, args.warmup if args.warmup is not None else (1 if args.quick else 2),
                  args.repeats if args.repeats is not None else (3 if args.quick else 5))
    if args.json is None:
        args.json = (ROOT / "bench" / "results" / "gpu" / device_slug(args.device_name) / "backends.json" if cuda
                     else ROOT / "bench" / "results" / "backends_cpu.json")
    backends = run_backends(args.device, args.backends)
    checks: list[dict] = []
    errors: dict = {}
    result = dict(device=args.device_name, device_type=args.device.type, torch=torch.__version__,
                  cuda=torch.version.cuda, dtype=str(args.dtype).removeprefix("torch."), quick=args.quick,
                  backends=[b.name for b in backends], baseline=backends[0].name, sections=args.sections,
                  warmup=timer.warmup, repeats=timer.repeats, checks=checks, errors=errors)
    print(f"{args.device_name}: backends {result['backends']} (baseline {result['baseline']}), "
          f"{result['dtype']}, torch {torch.__version__}", flush=True)
    runs = {"speed": lambda: bench_speed(args, run, backends, timer, checks, errors),
            "shards": lambda: bench_backend_shards(args, run, backends, timer, checks, errors),
            "plan": lambda: bench_plan(args, run, get_backend("auto", args.device), timer, checks)}
    for section in SECTIONS:
        if section not in args.sections:
            continue
        print(f"-- {section}", flush=True)
        try:
            result[section] = runs[section]()
        except Exception as exc:  # noqa: BLE001 - reported; the exit status is 1
            traceback.print_exc()
            errors[section] = f"{type(exc).__name__}: {exc}"
        finish_partial(args.json, result)
    finish(lambda: show(result), headline(result), time.perf_counter() - t_start, args.json, result)
    if not args.no_png and (result.get("speed") or result.get("plan")):
        png = args.json.with_suffix(".png")
        try:
            plot(result, png)
            print(f"wrote {png}")
        except ImportError:
            print("matplotlib not installed: no chart")
    for where, error in errors.items():
        print(f"FAILED {where}: {error}", file=sys.stderr)
    return 1 if errors else 0


def finish_partial(path: Path, result: dict) -> None:
    """The sections so far, written after each one (a run cut short keeps them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(result, partial=True), indent=1))


if __name__ == "__main__":
    sys.exit(main())
