"""The DistCA paper's experiments (arXiv 2510.18121, §6), in simulation, beside the paper's figures.

Every number comes from :mod:`distca_sim.simulate` (analytic GPU rates, no measured tables yet) on
batches of the paper's Pretrain and ProLong length traces (:mod:`distca_sim.workloads`):

- **Fig. 4** — data-parallel imbalance of fixed-length packing (idle GPU time) and of
  variable-length packing (its idle time and memory divergence) against DP size, Llama-3-8B,
  TP 8, H200 (:func:`distca_sim.simulate.packing_imbalance`, 4 steps averaged).
- **Fig. 9** — 3D parallelism (TP 8 × DP, no pipeline): distca (best of ε = 0, 0.05, 0.1) against
  WLB-ideal (best CP degree) over GPUs, contexts (tokens per rank), 8B and 34B, both traces.
- **Fig. 10** — 4D parallelism (TP 8 × DP × PP 4, 8 microbatches, 1F1B): the same, with distca
  serving CA-tasks from ranks idle in pipeline bubbles, the best of kept-activation servers
  (each backward pinned to its forward tick's servers) and stateless ones (``servers``).
- **Fig. 12** — distca's all-to-all bytes, CA imbalance, step time and exposed communication
  against ε (Llama-3-8B, Pretrain, 128K tokens per rank, 128 H200).

Usage::

    python bench/paper.py --quick     # 8 + 8 configurations, Fig. 4 and Fig. 12: seconds
    python bench/paper.py             # full grids (72 + 60 configurations): a few minutes
    python bench/paper.py --smoke     # 2 configurations, for tests
    python bench/paper.py --quick --measured --planner both
                                      # the GPU's measured attention tables, and distca's FLOP
                                      # and time planners side by side (DistCA §4.2)

Writes ``--json`` (default ``bench/results/paper.json``): a list of rows with keys
``experiment, model, gpus, context, dataset, system, throughput_tokens_s, speedup_vs_wlb`` and
more; and ``fig4.png``, ``fig9.png``, ``fig10.png``, ``fig12.png`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from distca_sim.simulate import (ParallelConfig, Workload, format_table,  # noqa: E402
                                 packing_imbalance, simulate)

K = 1024
GIB = 2 ** 30
MODELS = ("llama3-8b", "llama-34b")
DATASETS = ("pretrain", "prolong")
EPSILONS = (0.0, 0.05, 0.1)
FIG12_EPSILONS = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)
PP_4D, MICROBATCHES_4D = 4, 8

# (model, dataset, gpus, tokens per rank)
FULL_3D = [(mo, ds, g, c) for mo in MODELS for ds in DATASETS for g in (16, 32, 64, 128, 256, 512)
           for c in (128 * K, 256 * K, 512 * K)]
FULL_4D = [(mo, ds, g, c) for mo in MODELS for ds in DATASETS for g in (32, 64, 128, 256, 512)
           for c in (128 * K, 256 * K, 512 * K)]
QUICK_3D = [("llama3-8b", "pretrain", 32, 128 * K), ("llama3-8b", "pretrain", 256, 512 * K),
            ("llama3-8b", "prolong", 64, 128 * K), ("llama3-8b", "prolong", 512, 256 * K),
            ("llama-34b", "pretrain", 128, 128 * K), ("llama-34b", "pretrain", 512, 512 * K),
            ("llama-34b", "prolong", 64, 256 * K), ("llama-34b", "prolong", 512, 128 * K)]
QUICK_4D = [("llama3-8b", "pretrain", 64, 128 * K), ("llama3-8b", "pretrain", 512, 512 * K),
            ("llama3-8b", "prolong", 128, 256 * K), ("llama3-8b", "prolong", 256, 128 * K),
            ("llama-34b", "pretrain", 128, 128 * K), ("llama-34b", "pretrain", 512, 256 * K),
            ("llama-34b", "prolong", 64, 512 * K), ("llama-34b", "prolong", 512, 128 * K)]
SMOKE_3D = [("llama3-8b", "pretrain", 16, 64 * K)]
SMOKE_4D = [("llama3-8b", "prolong", 32, 64 * K)]

MODES = {
    "full": {"3d": FULL_3D, "4d": FULL_4D, "pp": PP_4D, "microbatches": MICROBATCHES_4D,
             "dps": (1, 2, 4, 8, 16, 32, 64), "fig4_contexts": (128 * K, 512 * K), "steps": 4,
             "fig12": (128, 128 * K, FIG12_EPSILONS)},
    "quick": {"3d": QUICK_3D, "4d": QUICK_4D, "pp": PP_4D, "microbatches": MICROBATCHES_4D,
              "dps": (1, 2, 4, 8, 16, 32), "fig4_contexts": (128 * K, 512 * K), "steps": 4,
              "fig12": (128, 128 * K, FIG12_EPSILONS)},
    "smoke": {"3d": SMOKE_3D, "4d": SMOKE_4D, "pp": 2, "microbatches": 4, "dps": (2, 4),
              "fig4_contexts": (64 * K,), "steps": 1, "fig12": (16, 64 * K, (0.0, 0.1))},
}

# The paper's reported speedups of DistCA over WLB-ideal (ranges over its sweep), as given in
# this project's issue: Fig. 9 (3D) per trace; Fig. 10 (4D) per model and trace ("up to" for 34B).
PAPER = {
    ("3d", "llama3-8b", "pretrain"): (1.07, 1.20), ("3d", "llama-34b", "pretrain"): (1.07, 1.20),
    ("3d", "llama3-8b", "prolong"): (1.05, 1.12), ("3d", "llama-34b", "prolong"): (1.05, 1.12),
    ("4d", "llama3-8b", "pretrain"): (1.15, 1.30), ("4d", "llama3-8b", "prolong"): (1.10, 1.35),
    ("4d", "llama-34b", "pretrain"): (None, 1.15), ("4d", "llama-34b", "prolong"): (None, 1.25),
}
PAPER_IDLE = {4: 0.19, 8: 0.55}  # Fig. 4: idle fraction at DP = 4 and 8


def paper_text(lo_hi) -> str:
    lo, hi = lo_hi
    return f"up to {hi:.2f}x" if lo is None else f"{lo:.2f}-{hi:.2f}x"


def row(experiment, model, gpus, context, dataset, system, throughput, speedup, **extra) -> dict:
    return dict(experiment=experiment, model=model, gpus=gpus, context=context, dataset=dataset,
                system=system, throughput_tokens_s=throughput, speedup_vs_wlb=speedup, **extra)


# ---- Fig. 4 --------------------------------------------------------------------------------------
def fig4(dps, contexts, gpu, steps):
    rows, table = [], []
    for context in contexts:
        for dp in dps:
            r = packing_imbalance("llama3-8b", gpu, Workload("pretrain", context), tp=8, dp=dp,
                                  steps=steps)
            paper = PAPER_IDLE.get(dp)
            common = dict(dp=dp, tp=8, pp=1)
            rows.append(row("fig4", "llama3-8b", 8 * dp, context, "pretrain", "packing",
                            r["throughput_packing"], None, idle_fraction=r["idle_packing"],
                            paper_idle_fraction=paper, **common))
            rows.append(row("fig4", "llama3-8b", 8 * dp, context, "pretrain", "varlen_packing",
                            r["throughput_varlen"], None, idle_fraction=r["idle_varlen"],
                            memory_divergence=r["memory_divergence_varlen"], **common))
            table.append([f"{context // K}K", str(dp), f"{100 * r['idle_packing']:.1f}",
                          f"{100 * paper:.0f}" if paper is not None else "-",
                          f"{100 * r['idle_varlen']:.1f}", f"{r['memory_divergence_varlen']:.2f}"])
    text = format_table(["context", "DP", "idle % packing", "paper idle %", "idle % var-len",
                         "mem max/mean var-len"], table)
    return rows, text


# ---- Fig. 9 / 10 ---------------------------------------------------------------------------------
def speedup_grid(experiment, configs, gpu, pp, microbatches, progress, planner="flops", measured=False):
    rows, table, summary = [], [], {}
    dim = "3d" if pp == 1 else "4d"
    for model, dataset, gpus, context in progress(configs, desc=experiment):
        par = ParallelConfig.from_gpus(gpus, tp=8, pp=pp,
                                       microbatches=microbatches if pp > 1 else 1)
        # In a pipeline kept activations pin each backward to its forward tick's servers, so
        # stateless servers (every tick planned afresh) can be faster: distca is the best of both.
        cmps = [simulate(model, with_tables(gpu, model, measured), par, Workload(dataset, context),
                         epsilons=EPSILONS, planner=planner, keep_activations=keep)
                for keep in ((True, False) if pp > 1 else (True,))]
        cmp = replace(cmps[0], results=cmps[0].results + [
            r for c in cmps[1:] for r in c.results if r.system.startswith("distca")])
        wlb = cmp.get("wlb_ideal")
        best = cmp.get("distca")
        paper = PAPER[(dim, model, dataset)]
        for r in cmp.results:
            rows.append(row(experiment, model, gpus, context, dataset, r.system,
                            r.throughput_tokens_s, r.throughput_tokens_s / wlb.throughput_tokens_s,
                            tp=8, dp=par.dp, pp=pp, microbatches=par.microbatches,
                            step_time_s=r.step_time_s, comm_exposed_s=r.comm_exposed_s,
                            idle_fraction=r.idle_fraction, memory_gib=r.memory_bytes / GIB,
                            fits=r.fits, details=r.details, paper_speedup=paper_text(paper),
                            best_distca=r is best,
                            best_of_planner=(r is cmp.get("distca-time") if r.system.startswith("distca-time")
                                             else r is cmp.get("distca-flops") if r.system.startswith("distca")
                                             else None)))
        sp = cmp.speedup()
        summary.setdefault((model, dataset), []).append(sp)
        table.append([model, dataset, str(gpus), f"{context // K}K", str(par.dp),
                      f"{best.throughput_tokens_s:,.0f}", f"{wlb.throughput_tokens_s:,.0f}",
                      f"{sp:.3f}", paper_text(paper), f"{best.details['epsilon']:g}",
                      "kept" if best.details["keep_activations"] else "stateless",
                      str(wlb.details["cp"]),
                      f"{cmp.speedup('per_doc_cp'):.2f}", f"{cmp.speedup('packing'):.2f}",
                      f"{100 * best.idle_fraction:.1f}", f"{100 * wlb.idle_fraction:.1f}",
                      cmp.get("packing").details["recompute"]]
                     + ([f"{cmp.speedup('distca-flops'):.3f}", f"{cmp.speedup('distca-time'):.3f}"]
                        if planner == "both" else []))
    text = format_table(["model", "dataset", "GPUs", "context", "DP", "distca tok/s", "WLB tok/s",
                         "speedup", "paper", "best eps", "servers", "WLB cp", "CP/WLB", "pack/WLB",
                         "distca idle %", "WLB idle %", "recompute"]
                        + (["FLOP planner", "time planner"] if planner == "both" else []), table)
    lines = [f"  {m} {d}: ours {min(v):.2f}-{max(v):.2f}x over {len(v)} configs; paper "
             f"{paper_text(PAPER[(dim, m, d)])}" for (m, d), v in summary.items()]
    return rows, text + "\n" + "\n".join(lines), summary


# ---- Fig. 12 -------------------------------------------------------------------------------------
def fig12(gpu, gpus, context, epsilons):
    par = ParallelConfig.from_gpus(gpus, tp=8)
    w = Workload("pretrain", context)
    ping = simulate("llama3-8b", gpu, par, w, epsilons=epsilons,
                    systems=("distca", "wlb_ideal"))
    seq = simulate("llama3-8b", gpu, par, w, epsilons=epsilons, systems=("distca",),
                   ping_pong=False)
    wlb = ping.get("wlb_ideal")
    rows, table = [], []
    for e in epsilons:
        a = ping.get(f"distca eps={e:g}")
        b = seq.get(f"distca eps={e:g}")
        ca = a.per_rank["attention_s"]
        imb = float(ca.max() / ca.mean())
        gib = a.details["ca_bytes_per_step"] / GIB
        sp = a.throughput_tokens_s / wlb.throughput_tokens_s
        rows.append(row("fig12", "llama3-8b", gpus, context, "pretrain", a.system,
                        a.throughput_tokens_s, sp, epsilon=e, ca_bytes_gib=gib,
                        ca_imbalance=imb, step_time_s=a.step_time_s,
                        comm_exposed_s=a.comm_exposed_s, step_time_sequential_s=b.step_time_s,
                        comm_exposed_sequential_s=b.comm_exposed_s, tp=8, dp=par.dp, pp=1))
        table.append([f"{e:g}", f"{gib:,.1f}", f"{imb:.3f}", f"{a.step_time_s:.3f}",
                      f"{a.comm_exposed_s:.3f}", f"{b.step_time_s:.3f}",
                      f"{b.comm_exposed_s:.3f}", f"{sp:.3f}"])
    text = format_table(["eps", "CA GiB/step", "CA max/mean", "step s", "exposed s",
                         "step s no ping-pong", "exposed s no ping-pong", "vs WLB"], table)
    return rows, text


# ---- plots ---------------------------------------------------------------------------------------
def plot(rows, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    f4 = [r for r in rows if r["experiment"] == "fig4"]
    if f4:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for ctx in sorted({r["context"] for r in f4}):
            for sysname, style in (("packing", "-o"), ("varlen_packing", "--s")):
                pts = sorted((r["dp"], r["idle_fraction"]) for r in f4
                             if r["context"] == ctx and r["system"] == sysname)
                a1.plot(*zip(*pts), style, label=f"{sysname} {ctx // K}K")
            pts = sorted((r["dp"], r["memory_divergence"]) for r in f4
                         if r["context"] == ctx and r["system"] == "varlen_packing")
            a2.plot(*zip(*pts), "-o", label=f"{ctx // K}K")
        a1.plot(list(PAPER_IDLE), list(PAPER_IDLE.values()), "k*", ms=12, label="paper")
        a1.set(xscale="log", xlabel="DP size", ylabel="idle fraction", title="Fig. 4: idle time")
        a2.set(xscale="log", xlabel="DP size", ylabel="max / mean tokens",
               title="variable-length packing: memory divergence")
        a1.legend(fontsize=7)
        a2.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / "fig4.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    for exp, title in (("fig9", "Fig. 9: 3D parallelism"), ("fig10", "Fig. 10: 4D parallelism")):
        best = [r for r in rows if r["experiment"] == exp and r.get("best_distca")]
        if not best:
            continue
        keys = sorted({(r["model"], r["dataset"]) for r in best})
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
        for ax, (m, d) in zip(axes[0], keys):
            sel = [r for r in best if r["model"] == m and r["dataset"] == d]
            for ctx in sorted({r["context"] for r in sel}):
                pts = sorted((r["gpus"], r["speedup_vs_wlb"]) for r in sel if r["context"] == ctx)
                ax.plot(*zip(*pts), "-o", label=f"{ctx // K}K")
            lo, hi = PAPER[("3d" if exp == "fig9" else "4d", m, d)]
            ax.axhspan(lo if lo is not None else 1.0, hi, color="tab:green", alpha=0.15,
                       label="paper")
            ax.axhline(1.0, color="k", lw=0.8)
            gpus = sorted({r["gpus"] for r in sel})
            ax.set(xscale="log", xlabel="GPUs", ylabel="distca / WLB-ideal", title=f"{m} {d}")
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xticks(gpus, [str(g) for g in gpus])
            ax.legend(fontsize=7)
        fig.suptitle(title)
        fig.tight_layout()
        written.append(out_dir / f"{exp}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    f12 = sorted((r for r in rows if r["experiment"] == "fig12"), key=lambda r: r["epsilon"])
    if f12:
        eps = [r["epsilon"] for r in f12]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        a1.plot(eps, [r["ca_bytes_gib"] for r in f12], "-o")
        a1.set(xlabel="epsilon", ylabel="GiB per step (cluster)", title="Fig. 12: bytes moved")
        a2.plot(eps, [r["step_time_s"] for r in f12], "-o", label="ping-pong")
        a2.plot(eps, [r["step_time_sequential_s"] for r in f12], "--s", label="sequential")
        a2.set(xlabel="epsilon", ylabel="step time, s", title="step time")
        a2.legend()
        fig.tight_layout()
        written.append(out_dir / "fig12.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


NOTES = """\
Why our numbers differ from the paper's (read with the tables above):
- Simulation, not measurement: analytic GPU rates (0.6 of peak for linear layers, 0.55 / 0.45
  for attention forward / backward, 0.8 of link bandwidth), no measured kernel or NCCL tables,
  no kernel interference between overlapped communication and compute. Absolute tokens/s are
  model outputs, not predictions of a real cluster.
- WLB-ideal is *ideal* here: free and exact packing of the whole step's documents, a token cap
  set only by HBM (on H200 that often leaves room for var-len packing), each CP member running
  exactly 1/cp of every document at full kernel speed, and the best CP degree per configuration.
  Only the CP K/V all-gather is charged (exposed). The paper's measured baseline pays real
  kernel, packing and scheduling overheads, so its 3D gaps are larger than ours.
- Our planner (scheduler/planner.py) bounds the maximum load (max/mean <= 1 + eps) and counts KV
  bytes once per server, and ping-pong hides nearly all of its traffic, so eps = 0 is usually best
  here; the paper tunes eps against measured communication cost.
- Tensor-parallel communication is modelled as exposed (Megatron without --tp-comm-overlap) and
  is the same for every system; it dilutes all speedups.
- 4D: pipeline stages run in ticks (every stage one forward or one backward per tick); ranks idle
  in warm-up and drain ticks serve CA-tasks of busy stages. 8 microbatches on 4 stages leave
  large bubbles for distca to fill; more microbatches would shrink both the bubbles and the gain.
  Kept activations pin each backward to the servers of its forward tick, which were balanced
  with other microbatches than the backward tick runs with; without recomputation that can cost
  more than the resent bytes of stateless servers, so each row shows the better of the two.
- Fig. 4: the paper's 19% / 55% idle at DP = 4 / 8 is for its own batch setup; ours averages 4
  steps of the sampler at 128K and 512K tokens per rank and includes linear work. Variable-length
  packing cannot split a context-length document, so beyond DP = 8 it is no better than fixed
  packing on these traces, while its memory divergence grows.
- Fig. 12 (no paper numbers quoted here): bytes fall as eps grows, the trade-off eps exists for;
  our step time still rises with eps because the traffic it saves is already hidden by
  ping-pong. Without ping-pong 0.23-0.49 s of a ~4.5 s step is exposed communication with
  kept activations (stateless servers: 0.34-0.72 s of ~4.7 s).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="reduced sweep (8 + 8 configurations)")
    mode.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gpu", default="h200", help="GPU preset (the paper used H200)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "paper.json")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results",
                    help="where the PNGs go")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--planner", default="flops", choices=("flops", "time", "both"),
                    help="distca's planner in Fig. 9 / 10: balance FLOPs, the seconds the attention "
                         "tables predict (DistCA §4.2), or both (one column each; speedup = the best)")
    ap.add_argument("--measured", action="store_true",
                    help="price attention with the GPU's measured tables (distca_sim/data/profiles) "
                         "where there are some for the model's shape, instead of the assumed rates")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        from tqdm import tqdm

        def progress(it, desc):
            return tqdm(it, desc=desc, unit="config", file=sys.stderr, leave=False)
    except ImportError:
        def progress(it, desc):
            return it

    cfg = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    pp, mb = cfg["pp"], cfg["microbatches"]
    rows, sections = [], []
    r4, t4 = fig4(cfg["dps"], cfg["fig4_contexts"], args.gpu, cfg["steps"])
    rows += r4
    sections.append(("Fig. 4 - DP imbalance: fixed-length vs variable-length packing "
                     f"(llama3-8b, TP 8, {args.gpu}, pretrain, mean of {cfg['steps']} steps)", t4))
    r9, t9, _ = speedup_grid("fig9", cfg["3d"], args.gpu, 1, 1, progress, args.planner,
                             args.measured)
    rows += r9
    sections.append((f"Fig. 9 - 3D parallelism (TP 8 x DP), distca vs WLB-ideal, {args.gpu}", t9))
    r10, t10, _ = speedup_grid("fig10", cfg["4d"], args.gpu, pp, mb, progress, args.planner,
                                args.measured)
    rows += r10
    sections.append((f"Fig. 10 - 4D parallelism (TP 8 x DP x PP {pp}, {mb} microbatches, 1F1B), "
                     f"distca vs WLB-ideal, {args.gpu}", t10))
    g12, ctx12, eps12 = cfg["fig12"]
    r12, t12 = fig12(args.gpu, g12, ctx12, eps12)
    rows += r12
    sections.append((f"Fig. 12 - distca against eps (llama3-8b, pretrain, {ctx12 // K}K tokens "
                     f"per rank, {g12}x {args.gpu}, TP 8)", t12))

    for title, text in sections:
        print(f"\n{title}\n{text}")
    print("\n" + NOTES)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1, default=_json_default) + "\n")
    print(f"wrote {len(rows)} rows to {args.json}")
    if not args.no_plots:
        for p in plot(rows, args.out_dir):
            print(f"wrote {p}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


def with_tables(gpu: str, model: str, measured: bool):
    """The GPU preset ``gpu``, with ``measured`` its measured attention tables for ``model``'s
    per-GPU shape at tp 8 where distca ships some (else the preset's assumed rates)."""
    if not measured:
        return gpu
    from distca_sim.hardware import get_gpu, get_model, load_attention_profile, measured_attention_profile
    cost = get_model(model).cost_model(8)
    folder = measured_attention_profile(gpu, cost)
    return gpu if folder is None else get_gpu(gpu).with_tables(*load_attention_profile(folder, cost))


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.bool_):
        return bool(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


if __name__ == "__main__":
    sys.exit(main())
