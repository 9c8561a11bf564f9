"""Reporting of the training demo: the per-step line, the summary table, the distca-vs-local
check and the two plots (loss.png, balance.png). Pure functions of the runs' metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llama_data import PackedStream
    from llama_worker import TrainConfig

# The demo's check that distca and local attention train the same model: over the first steps
# (before rounding differences compound through the optimizer) the losses agree to this relative
# difference, a few float32 roundings of a loss near ln 256 (float32 machine epsilon is 1.2e-7).
AGREE_STEPS, AGREE_RTOL = 10, 1e-5
# The same check per compute dtype (TrainConfig.dtype). Under bf16 autocast every matrix product and
# attention output is rounded to bf16 (8 significant bits: machine epsilon 2^-7, unit roundoff
# u = 2^-8 = 3.9e-3). distca computes a split document in pieces (each query shard against its
# keys; key and value gradients summed over the shards in float32), a different summation order
# from one kernel call per document, so some bf16 outputs differ by one rounding, as two kernels'
# would; those differences pass through every later bf16 layer and the optimizer, so no
# float32-sized bound holds. The check asks that the two float32 losses be the same number at
# bf16's precision: each within one bf16 rounding of the other,
# |a - b| <= u |b| (about 0.02 nats near ln 256). Measured well inside it: 1.9e-5 over 10 steps of
# a 2-layer model on the CPU (2 workers x 1,024 tokens, transport shm, 2026-11-27).
AGREE_RTOLS = {"float32": AGREE_RTOL, "bfloat16": float(2.0 ** -8)}


def agree_rtol(dtype: str) -> float:
    """The loss-agreement tolerance for runs computing in ``dtype`` (``"float32"``, ``"bfloat16"``).

    Raises:
        ValueError: a dtype without one, naming it.
    """
    try:
        return AGREE_RTOLS[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"no loss-agreement tolerance for dtype={dtype!r} (one of {', '.join(AGREE_RTOLS)})") from None


def rank_flops(cost, doc_lens_per_rank: list[list[int]]) -> list[float]:
    """Forward attention FLOPs (one layer) of each rank's own documents: the load with no balancing."""
    return [sum(cost.doc_flops(n) for n in lens) for lens in doc_lens_per_rank]


def imbalance(loads: list[float]) -> float:
    """max/mean of per-rank or per-server FLOPs (1.0 when there is no load)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_step(r: dict) -> str:
    return (f"step {r['step']:4d}  loss {r['loss']:.4f}  time {r['step_time_s']:.2f} s  "
            f"imbalance {r['imbalance_before']:.2f} -> {r['imbalance_after']:.2f}  "
            f"moved {_mib(r['bytes'])}  docs {r['documents']:3d} (longest {r['longest']})")


def warm_steps(run: dict) -> list[dict]:
    """A run's steps less the first of each session (``session_starts``: step 0, then where each
    ``--resume`` continued), which warm up: kernels load, the transport's heap is made. A
    metrics.json of an older version has no ``session_starts``: only its step 0 is left out. All
    the steps when no other is left."""
    starts = set(run.get("session_starts", [0]))
    return [r for r in run["steps"] if r["step"] not in starts] or run["steps"]


def summary_table(runs: list[dict]) -> str:
    """One row per run: loss first -> last, step time and tokens/s (:func:`warm_steps`), imbalance,
    bytes moved, and the wall time of the session that ran last (marked so after a ``--resume``:
    earlier sessions' walls are not kept)."""
    head = ("run", "attention", "steps", "loss first", "loss last10", "step time", "tokens/s",
            "imbalance before", "after", "moved/step", "wall")
    rows = []
    for m in runs:
        s = m["steps"]
        how = m["attention"] + (f" ({m['mode']}, {m['servers']} servers)" if m["attention"] == "distca" else "")
        times = [r["step_time_s"] for r in warm_steps(m)]
        resumed = len(m.get("session_starts", [0])) > 1
        rows.append((m["name"], how, str(len(s)), f"{s[0]['loss']:.3f}",
                     f"{np.mean([r['loss'] for r in s[-10:]]):.3f}", f"{np.mean(times):.2f} s",
                     f"{m['tokens_per_step'] / np.mean(times):,.0f}",
                     f"{np.mean([r['imbalance_before'] for r in s]):.2f}",
                     f"{np.mean([r['imbalance_after'] for r in s]):.2f}",
                     _mib(np.mean([r["bytes"] for r in s])),
                     f"{m['wall_s']:.0f} s" + (" (this session)" if resumed else "")))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def runs_to_compare(cfg: TrainConfig) -> list[dict]:
    """Metrics of this run and its counterpart (``<name>-local`` or ``<name>`` without it)."""
    names = [cfg.name, cfg.name.removesuffix("-local") if cfg.name.endswith("-local") else cfg.name + "-local"]
    found = []
    for n in dict.fromkeys(names):
        path = Path(cfg.runs_dir) / n / "metrics.json"
        if path.exists():
            found.append(json.loads(path.read_text()))
    return found


def loss_agreement(distca: list[dict], local: list[dict], rtol: float = AGREE_RTOL) -> dict:
    """How closely two runs' per-step losses agree: ``first`` (steps compared at the start),
    ``max_rel_first`` (largest relative difference over them), ``max_abs_all`` (largest absolute
    difference over every shared step), ``rtol`` and ``agree`` (``max_rel_first <= rtol``; the
    default is float32's, :func:`agree_rtol` gives each dtype's).

    Raises:
        ValueError: the runs share no step, or ``rtol`` is not a finite number > 0.
    """
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 < rtol < float("inf"):
        raise ValueError(f"loss_agreement: rtol={rtol!r} (a finite number > 0)")
    pairs = [(a["loss"], b["loss"]) for a, b in zip(distca, local) if a["step"] == b["step"]]
    if not pairs:
        raise ValueError(f"loss_agreement: no common step ({len(distca)} and {len(local)} steps)")
    first = min(AGREE_STEPS, len(pairs))
    rel = max(abs(a - b) / abs(b) for a, b in pairs[:first])
    return {"first": first, "max_rel_first": rel, "max_abs_all": max(abs(a - b) for a, b in pairs),
            "steps": len(pairs), "rtol": rtol, "agree": rel <= rtol}


def step_time(run: dict) -> float:
    """A run's typical step time, seconds: the median over its :func:`warm_steps`, robust to a
    slow step or two."""
    return float(np.median([r["step_time_s"] for r in warm_steps(run)]))


def train_summary(runs: list[dict], agreement: dict | None, *, device: str) -> dict:
    """The figures of a distca-vs-local pair of runs (or of one run) as ``bench/gpu_session.sh``
    reports them: loss agreement over the first steps, step time and tokens/s of each run
    (:func:`step_time`; tokens per step = workers x context), the wall time of the session that
    ran last, the setup.

    Raises:
        ValueError: ``runs`` empty, or two runs of the same attention.
    """
    if not runs:
        raise ValueError("train_summary: no runs")
    by = {m["attention"]: m for m in runs}
    if len(by) != len(runs):
        raise ValueError(f"train_summary: runs of the same attention {[m['attention'] for m in runs]}")
    first = runs[0]
    cfg = first["config"]
    out = {"device": device, "dtype": cfg["dtype"], "transport": cfg["transport"],
           "device_kind": cfg["device"], "workers": first["workers"], "context": cfg["context"],
           "tokens_per_step": first["tokens_per_step"], "parameters": first["model"]["parameters"],
           "model": first["model"], "data": first["data"]}
    for attention, m in sorted(by.items()):
        t = step_time(m)
        out[f"train_step_time_s_{attention}"] = t
        out[f"train_tokens_per_s_{attention}"] = m["tokens_per_step"] / t
        out[f"train_steps_{attention}"] = len(m["steps"])
        out[f"train_wall_s_{attention}"] = m["wall_s"]
        out[f"train_losses_{attention}"] = [r["loss"] for r in m["steps"]]
        # What really ran (rank 0's records): a pass must be tied to the transport and kernel
        for field in ("transport_used", "kernel", "nvshmem_init_status"):
            seen = sorted({r[field] for r in m["steps"] if r.get(field) is not None})
            if seen:
                out[f"train_{field}_{attention}"] = seen
        heads = [(r.get("rounds"), r.get("header_rounds")) for r in warm_steps(m)]
        if heads and all(n is not None for pair in heads for n in pair):  # distca: rank 0's, warm steps
            out[f"train_rounds_per_step_{attention}"] = float(np.mean([n for n, _ in heads]))
            out[f"train_header_rounds_per_step_{attention}"] = float(np.mean([h for _, h in heads]))
    if agreement is not None:
        out.update({f"train_loss_max_rel_diff_{agreement['first']}_steps": agreement["max_rel_first"],
                    "train_loss_rtol": agreement["rtol"], "train_loss_agree": agreement["agree"],
                    "train_loss_max_abs_diff_all_steps": agreement["max_abs_all"]})
    if {"distca", "local"} <= set(by):
        out.update(first_step_differences(by["distca"], by["local"]))
    return out


def first_step_differences(distca: dict, local: dict) -> dict:
    """Relative differences of the two runs' first common step, where both start from the same
    weights and data, so only attention's rounding separates them (later steps add the optimizer's
    compounding): ``train_step0_loss_rel_diff`` and ``train_step0_grad_norm_rel_diff`` (the
    gradient norm before clipping; it sees every layer's attention backward), None where a run
    lacks the field. A tighter check than the 10-step loss agreement, once a device's natural
    noise is known. Empty when the runs share no step."""
    steps = {r["step"]: r for r in local["steps"]}
    common = [(r, steps[r["step"]]) for r in distca["steps"] if r["step"] in steps]
    if not common:
        return {}
    a, b = common[0]
    rel = lambda x, y: None if x is None or y is None else abs(x - y) / max(abs(y), 1e-30)  # noqa: E731
    return {"train_step0_step": a["step"], "train_step0_loss_rel_diff": rel(a.get("loss"), b.get("loss")),
            "train_step0_grad_norm_rel_diff": rel(a.get("grad_norm"), b.get("grad_norm"))}


def _where(cfg: dict) -> str:
    """ ", bfloat16 on cuda" for a run off the CPU demo's defaults (float32 on the CPU), else ""."""
    device, dtype = cfg.get("device", "cpu"), cfg.get("dtype", "float32")
    return "" if (device, dtype) == ("cpu", "float32") else f", {dtype} on {device}"


def plot_loss(path: Path, runs: list[dict]) -> None:
    """Loss per step of each run (distca solid, local dashed: they lie on top of each other)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for m in sorted(runs, key=lambda m: m["attention"]):
        s = m["steps"]
        distca = m["attention"] == "distca"
        ax.plot([r["step"] for r in s], [r["loss"] for r in s],
                color="C0" if distca else "C1", ls="-" if distca else (0, (4, 3)), lw=2 if distca else 1.6,
                label=f"{m['name']}: {m['attention']} attention"
                      + (f" ({m['mode']}, {m['servers']} servers)" if distca else " (varlen_attention)"))
    m = runs[0]
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(f"LlamaForCausalLM on bytes, {m['model']['parameters'] / 1e6:.2f} M parameters, "
                 f"{m['workers']} Ray Train workers x {m['config']['context']} tokens{_where(m['config'])}\n"
                 f"{m['data']['documents']} documents from {m['data']['source']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_balance(path: Path, stream: PackedStream, cfg: TrainConfig, cost, sample: dict) -> None:
    """Attention FLOPs of one step: per rank with no balancing, and per server under distca's plan.

    The plan is recomputed here with the scheduler's own planner and inputs (a pure function of
    them), so each bar can be drawn as its pieces: documents on the left, CA-tasks (shards) on the
    right, coloured by the rank whose documents they are.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scheduler import plan_batch
    lens = [c[1] for c in stream.batch(sample["step"], cfg.workers)]
    num_servers = cfg.num_servers
    plan = plan_batch(lens, num_servers, cost=cost, config=cfg.job_config().plan)
    gf = 1e-9
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True,
                                 gridspec_kw={"width_ratios": [cfg.workers, num_servers]})
    segment = {"edgecolor": "white", "linewidth": 0.8, "width": 0.7}
    for r, docs in enumerate(lens):
        bottom = 0.0
        for n in docs:
            a0.bar(r, cost.doc_flops(n) * gf, bottom=bottom, color=f"C{r}", **segment)
            bottom += cost.doc_flops(n) * gf
    for s, tasks in enumerate(plan.server_tasks):
        bottom = 0.0
        for t in tasks:
            flops = cost.task_flops(t.q_start, t.q_end, t.kv_start, t.kv_end) * gf
            a1.bar(s, flops, bottom=bottom, color=f"C{t.src_rank}", **segment)
            bottom += flops
    for r in range(cfg.workers):  # legend entries only
        a0.bar(0, 0, color=f"C{r}", label=f"rank {r}'s documents")
    for ax, loads, title in ((a0, plan.rank_loads(), "before: each rank's documents\n(one block per document)"),
                             (a1, plan.server_loads(), f"after: distca plan, {cfg.mode}\n(one block per CA-task)")):
        ax.axhline(np.mean(loads) * gf, color="k", ls="--", lw=1, label="mean")
        ax.set_title(f"{title}; max/mean {imbalance(loads):.2f}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    a0.set_xticks(range(cfg.workers), [f"rank {r}" for r in range(cfg.workers)])
    a1.set_xticks(range(num_servers), [f"server {s}" for s in range(num_servers)])
    a0.set_ylabel("forward attention GFLOPs per layer")
    a0.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"step {sample['step']} (the run's most imbalanced): {sample['documents']} documents, "
                 f"longest {sample['longest']} tokens; {_mib(sample['bytes'])} moved in the step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
