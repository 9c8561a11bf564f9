"""Collect issue 22's summary keys (and issue 21's kernel and plan-run numbers) from one GPU
session's JSON files into ``summary.json``.

Run on the development machine after a session's files were copied under
``bench/results/gpu/<device>/``::

    python bench/gpu_summary.py bench/results/gpu/nvidia-h100-80gb-hbm3

Each key comes from the benchmark that measured it; a key whose benchmark did not run (or that
nothing measures yet) is ``null``, with the reason under ``"missing"``:

| key | from |
|---|---|
| ``exchange_us_64KiB_2pe`` (``_host_driven``) | ``transport_local.json`` (in-process PEs) |
| ``exchange_us_64KiB_2pe_graphed`` | ``transport_local_graph.json`` (the ``graphs`` stage) |
| ``exchange_host_us_64KiB_2pe`` (``_graphed``) | the same two: how long ``exchange`` / ``replay`` held the host |
| ``exchange_us_64KiB_2pe_processes`` (``_host_driven``; ``_graphed``) | ``transport_nvshmem.json``; ``_graph.json`` |
| ``host_us_per_layer`` | ``kernels.json`` overhead, 2 participants over the heap, 8K tokens |
| ``host_us_per_layer_lockstep`` | the same, 2 participants in lock step |
| ``host_us_per_layer_graphed`` | the same, its rounds replayed from CUDA graphs |
| ``host_us_per_layer_graphed_8layers`` | ``host_path_cuda.json`` (the ``host`` stage): ``distca attend``'s host CPU time per layer, 8 replayed layers a step, 2 participants, 208 tokens |
| ``overhead_pct_8K_2participants`` | ``kernels.json`` overhead, 2 participants over the heap, 8K |
| ``overhead_pct_8K_2participants_lockstep`` | the same in lock step |
| ``pingpong_vs_signal_only`` | ``pingpong.json`` |
| ``train_loss_max_rel_diff_10_steps``, ``train_tokens_per_s_distca``, ``train_tokens_per_s_local`` | ``train.json`` |
| ``dead_pe_error_s`` | ``dead_peer_nvshmem.json`` |
| ``tagged_step_ratio_2clients``, ``tagged_attend_host_ratio_2clients`` | ``tagged_rounds.json`` (the ``tagged`` stage): an in-place Ray step's time, and an ``attend``'s host time, with tagged rounds over the header in every round, 2 clients, the smallest context |
| ``stages`` | ``session.log``: each stage's outcome, ``ok``, ``exit status N`` or ``skipped`` (out of ``BUDGET_S``) |
| ``kernel_tflops_32K`` | ``backends.json`` speed: ``{backend: [forward, backward]}`` TFLOP/s, 32/8/128 at 32K-token documents (issue 21) |
| ``plan_max_mean_flop``, ``plan_max_mean_time`` | ``backends.json`` plan: measured max/mean server kernel time of the FLOP and the time planner's plans |
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path



def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def _overhead(kernels: dict | None, exchange: str) -> dict | None:
    rows = [r for r in (kernels or {}).get("overhead", [])
            if r.get("participants") == 2 and r.get("exchange") == exchange and r.get("tokens") == 8192]
    return rows[0] if rows else None


def collect(folder: Path) -> dict:
    """The summary of the session whose files are in ``folder``."""
    out: dict = {}
    missing: dict = {}
    for name, where in (("transport_local", ""), ("transport_nvshmem", "_processes")):
        main = (_load(folder, name + ".json") or {}).get("summary") or {}
        graphs = (_load(folder, name + "_graph.json") or {}).get("summary") or {}
        prefix, host = "exchange_us_64KiB_2pe" + where, "exchange_host_us_64KiB_2pe" + where
        # the main stage's run (without graphs) first; the graphs stage's for the captured keys
        for key, first, then in ((prefix, main, graphs), (prefix + "_host_driven", main, graphs),
                                 (host, main, graphs), (prefix + "_graphed", graphs, main),
                                 (host + "_graphed", graphs, main)):
            out[key] = first.get(key, then.get(key))
            if out[key] is None:
                missing[key] = f"{name}.json / {name}_graph.json absent or without the 2-PE 64 KiB row"
    kernels = _load(folder, "kernels.json")
    for exchange, suffix in (("heap", ""), ("lockstep", "_lockstep"), ("graphs", "_graphed")):
        row = _overhead(kernels, exchange)
        if exchange == "graphs" and row is not None and not row.get("replays"):  # ran, but never replayed
            missing["host_us_per_layer_graphed"] = (f"the graphs run replayed nothing (capture: "
                                                    f"{row.get('graphs_off') or 'not reached'})")
            row = None
        out["host_us_per_layer" + suffix] = None if row is None else 1e3 * row["host_ms"]
        out["overhead_pct_8K_2participants" + suffix] = None if row is None else 100 * row["overhead"]
        if row is None:
            missing.setdefault("host_us_per_layer" + suffix,
                               f"kernels.json absent or without the 2-participant {exchange} 8K row")
            missing["overhead_pct_8K_2participants" + suffix] = missing["host_us_per_layer" + suffix]
    host = {r["path"]: r for r in (_load(folder, "host_path_cuda.json") or {}).get("rows", [])}
    out["host_us_per_layer_graphed_8layers"] = (host.get("distca attend") or {}).get("us_per_layer")
    if out["host_us_per_layer_graphed_8layers"] is None:
        missing["host_us_per_layer_graphed_8layers"] = "host_path_cuda.json absent"
    train = _load(folder, "train.json") or {}
    for key in ("train_loss_max_rel_diff_10_steps", "train_tokens_per_s_distca", "train_tokens_per_s_local"):
        out[key] = train.get(key)
        if out[key] is None:
            missing[key] = "train.json absent or without it"
    out["pingpong_vs_signal_only"] = ((_load(folder, "pingpong.json") or {}).get("summary") or {}).get(
        "pingpong_vs_signal_only")
    if out["pingpong_vs_signal_only"] is None:
        missing["pingpong_vs_signal_only"] = "pingpong.json absent"
    out["dead_pe_error_s"] = ((_load(folder, "dead_peer_nvshmem.json") or {}).get("summary") or {}).get(
        "dead_pe_error_s")
    if out["dead_pe_error_s"] is None:
        missing["dead_pe_error_s"] = "dead_peer_nvshmem.json absent"
    rows = [r for r in (_load(folder, "tagged_rounds.json") or {}).get("rows", []) if r.get("clients") == 2]
    row = min(rows, key=lambda r: r["tokens_per_rank"]) if rows else {}
    for key, field in (("tagged_step_ratio_2clients", "step_ratio"),
                       ("tagged_attend_host_ratio_2clients", "attend_host_ratio")):
        out[key] = row.get(field)
        if out[key] is None:
            missing[key] = "tagged_rounds.json absent or without a 2-client row"
    backends = _load(folder, "backends.json") or {}
    speed = {r["backend"]: [r["fwd_tflops"], r["bwd_tflops"]] for r in backends.get("speed") or []
             if r.get("shape") == "32/8/128" and r.get("doc_len") == 32768}
    out["kernel_tflops_32K"] = speed or None
    if not speed:
        missing["kernel_tflops_32K"] = "backends.json absent or without 32/8/128 rows at 32K"
    planners = (backends.get("plan") or {}).get("planners") or {}
    for name in ("flop", "time"):
        out[f"plan_max_mean_{name}"] = (planners.get(name) or {}).get("measured_max_mean")
        if out[f"plan_max_mean_{name}"] is None:
            missing[f"plan_max_mean_{name}"] = "backends.json absent or without its plan section"
    out["stages"] = stage_outcomes(folder / "session.log")
    out["missing"] = {k: v for k, v in missing.items() if out.get(k) is None}
    return out


def stage_outcomes(log: Path) -> dict:
    """``{stage: "ok" | "exit status N" | "skipped"}`` from a ``gpu_session.sh`` log (the last
    outcome of a stage that ran twice); {} without a log."""
    out: dict = {}
    if not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"== (\w+): (skipped|exit status (\d+))", line)
        if m:
            out[m.group(1)] = "skipped" if m.group(2) == "skipped" else (
                "ok" if m.group(3) == "0" else f"exit status {m.group(3)}")
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(__doc__.split("\n\n")[0] + "\nusage: python bench/gpu_summary.py FOLDER", file=sys.stderr)
        return 2
    folder = Path(args[0])
    summary = collect(folder)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for key, value in summary.items():
        if key != "missing":
            print(f"{key}: {value if value is not None else 'null (' + summary['missing'].get(key, '') + ')'}")
    print(f"wrote {folder / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
