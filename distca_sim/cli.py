"""``distca simulate``: the step-time simulator from the command line.

Registered into the ``distca`` command (:mod:`distca_cli`) through :func:`register`. One
configuration prints one comparison table (distca per ε, WLB-ideal, per-document CP, plain
packing); ``--sweep`` runs every context × ε of the lists given, with a progress bar, and prints
one summary table.

Examples::

    distca simulate --model llama3-8b --gpu h100 --gpus 64 --tp 8 --pp 1 \\
        --context 131072 --dataset pretrain --epsilon 0.05
    distca simulate --gpus 128 --pp 4 --sweep --contexts 128K 256K --epsilon 0 0.05 0.1
    distca simulate --gpus 64 --no-keep-activations   # stateless servers: backward resends Q, K, V, O, LSE
    distca simulate --gpu h100 --attn-profile bench/results/gpu/nvidia-h100-80gb-hbm3/kernels_profile/llama3-8b-tp8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from scheduler.checks import INT64_MAX
from scheduler.time_cost import TimeModel

from .hardware import load_attention_profile, measured_attention_profile
from .simulate import (GPUS, MODELS, SYSTEMS, ParallelConfig, Workload, format_table, get_gpu,
                       get_model, simulate)

_MODEL_FIELDS = ("hidden_size", "num_heads", "num_kv_heads", "num_layers", "ffn_hidden_size",
                 "vocab_size")


def _folder(text: str) -> Path:
    """A non-empty path (``Path("")`` would name the current folder); argparse type."""
    if not text:
        raise argparse.ArgumentTypeError("must be a folder path, got ''")
    return Path(text)


def tokens(text: str) -> int:
    """``131072``, ``128K`` or ``1M`` (K = 1024) as an int; argparse type."""
    s = str(text).strip().upper()
    mult = {"K": 1024, "M": 1024 ** 2}.get(s[-1:], 1)
    try:
        value = int(s[:-1] if mult > 1 else s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"token count must be positive: {text!r}")
    if value > INT64_MAX:  # every run of a sweep is checked before the first starts
        raise argparse.ArgumentTypeError(f"token count must be at most 2**63 - 1: {text!r}")
    return value


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "simulate", help="simulate training step time: distca vs WLB-ideal, per-doc CP, packing",
        description="Cluster-scale step-time simulator (distca_sim.simulate).")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="llama3-8b", help=f"preset: {', '.join(MODELS)}")
    for f in _MODEL_FIELDS:
        g.add_argument("--" + f.replace("_", "-"), type=int, default=None,
                       help=f"override the preset's {f}")
    g = p.add_argument_group("cluster")
    g.add_argument("--gpu", default="h100", help=f"preset: {', '.join(GPUS)}")
    g.add_argument("--gpus", type=int, default=64, help="total GPUs (= tp * dp * pp)")
    g.add_argument("--tp", type=int, default=8, help="tensor-parallel GPUs per rank")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default 2*pp with a pipeline, else 1)")
    g.add_argument("--attn-profile", type=_folder, default=None, metavar="DIR",
                   help="measured attention latency: DIR/forward.json and DIR/backward.json "
                        "(ProfileTable JSON, bench/gpu_kernels.py), for this model's per-GPU shape "
                        "at --tp; default: the tables measured on that GPU shipped with distca "
                        "(distca_sim/data/profiles) when there are some for this shape, else the "
                        "GPU preset's assumed rates")
    g.add_argument("--assumed-rates", action="store_true",
                   help="price attention by the GPU preset's assumed FLOP rates even where distca "
                        "ships measured tables for this shape; an explicit --attn-profile takes "
                        "precedence over it")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="pretrain", choices=("pretrain", "prolong"))
    g.add_argument("--context", type=tokens, default=131072, help="tokens per rank (e.g. 128K)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--step", type=int, default=0)
    g = p.add_argument_group("systems")
    g.add_argument("--epsilon", type=float, nargs="+", default=[0.05], help="distca ε values")
    g.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    g.add_argument("--recompute", default="auto", choices=("auto", "none", "full"))
    g.add_argument("--planner", default="flops", choices=("flops", "time", "both"),
                   help="distca's planner: balance FLOPs, the seconds the attention tables predict "
                        "(DistCA §4.2; rows 'distca-time eps=...'), or both in one run")
    g.add_argument("--no-ping-pong", action="store_true", help="distca without nano-batch overlap")
    g.add_argument("--no-bubble-serving", action="store_true",
                   help="distca balances each pipeline stage on its own")
    g.add_argument("--keep-activations", action=argparse.BooleanOptionalAction, default=True,
                   help="distca's servers keep each layer's activations until its backward round, "
                        "which then sends dO only (default); --no-keep-activations: stateless "
                        "servers, the backward round resends Q, K, V, O and LSE (with --pp > 1 and "
                        "no recomputation often faster: kept activations pin each backward to the "
                        "servers of its forward tick)")
    g = p.add_argument_group("sweep and output")
    g.add_argument("--sweep", action="store_true", help="run every --contexts x --epsilon value")
    g.add_argument("--contexts", type=tokens, nargs="+", default=[65536, 131072, 262144, 524288])
    g.add_argument("--json", type=Path, default=None,
                   help="write the results as JSON here (checked to be writable before the run)")
    p.set_defaults(func=main)
    return p


def _model(args):
    model = get_model(args.model)
    over = {f: getattr(args, f) for f in _MODEL_FIELDS if getattr(args, f) is not None}
    if over:
        model = dataclasses.replace(model, name=f"{model.name}-custom", **over)
    return model


def _run(args, model, gpu, par, context, eps):
    return simulate(model, gpu, par, Workload(args.dataset, context, args.seed, args.step),
                    systems=args.systems, epsilons=eps, ping_pong=not args.no_ping_pong,
                    bubble_serving=not args.no_bubble_serving, recompute=args.recompute,
                    keep_activations=args.keep_activations, planner=args.planner)


def _check_json_path(path: Path) -> None:
    """Refuse a ``--json`` path that cannot be written, before a run that may take minutes: a
    folder, a missing folder under a file, or a place this process may not write.

    Raises:
        ValueError: naming the path (and the OS's reason where looking at it failed).
    """
    try:
        if path.is_dir():
            raise ValueError(f"--json {path}: is a folder (give a file path)")
        folder = path.parent
        while not folder.exists():  # the folders that do not exist yet are made when writing
            folder = folder.parent
        if not folder.is_dir():
            raise ValueError(f"--json {path}: {folder} is not a folder")
    except OSError as exc:  # is_dir/exists raise for a folder this process may not search, a too long name
        raise ValueError(f"--json {path}: {exc.strerror or exc}") from None
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK):
        raise ValueError(f"--json {path}: {target} is not writable")


def main(args) -> int:
    """Entry point of ``distca simulate``; returns the exit status (1 after a one-line error on
    stderr, as the other ``distca`` commands)."""
    try:
        if args.json is not None:
            _check_json_path(args.json)
        model, gpu = _model(args), get_gpu(args.gpu)
        par = ParallelConfig.from_gpus(args.gpus, tp=args.tp, pp=args.pp,
                                       microbatches=args.microbatches)
        # simulate() checks the layout too, but the attention tables below are chosen by
        # model.cost_model(tp) first, whose own error would hide what is wrong (e.g. tp > heads).
        par.check(model, gpu)
        profile = args.attn_profile
        if profile is not None:  # the folder check of `distca up --attn-profile` (PlanConfig), one message
            TimeModel.from_dir(str(profile))
        if profile is None and not args.assumed_rates:
            profile = measured_attention_profile(args.gpu, model.cost_model(par.tp))
        if profile is not None:
            gpu = gpu.with_tables(*load_attention_profile(profile, model.cost_model(par.tp)))
            where = profile if args.attn_profile is not None else f"{Path(profile).parent.name}/{Path(profile).name}"
            print(f"attention latency: measured tables from {where}")
        else:
            print("attention latency: the GPU preset's assumed rates")
        if not args.sweep:
            cmp = _run(args, model, gpu, par, args.context, args.epsilon)
            print(cmp.table())
            if "wlb_ideal" in args.systems and "distca" in args.systems:
                for which in (("distca-flops", "distca-time") if args.planner == "both" else ("distca",)):
                    best = cmp.get(which)
                    print(f"\nbest {which} ({best.system}) vs WLB-ideal: "
                          f"{cmp.speedup(which):.3f}x throughput")
                if par.pp > 1 and args.keep_activations and not cmp.recompute:
                    print("note: kept activations pin each backward to the servers of its forward tick; "
                          "in a pipeline without recomputation stateless servers (--no-keep-activations) "
                          "may be faster")
            rows = [dict(context=args.context, **r.to_dict()) for r in cmp.results]
        else:
            rows = _sweep(args, model, gpu, par)
    except ValueError as exc:
        print(f"distca simulate: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        except OSError as exc:  # refused after all (a full disk, a race with the check): one line
            print(f"distca simulate: error: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0


def _sweep(args, model, gpu, par) -> list[dict]:
    """Every context × ε; one summary table, one row per (context, system)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety; the sweep runs without it
        def tqdm(it, **_):
            return it
    jobs = [(c, e) for c in args.contexts for e in args.epsilon]
    rows, table = [], []
    done_baselines = set()
    for context, eps in tqdm(jobs, desc="simulate", unit="config", file=sys.stderr):
        cmp = _run(args, model, gpu, par, context, [eps])
        wlb = next((r for r in cmp.results if r.system == "wlb_ideal"), None)
        for r in cmp.results:
            base = not r.system.startswith("distca")
            if base and context in done_baselines:
                continue  # baselines do not depend on ε
            vs = r.throughput_tokens_s / wlb.throughput_tokens_s if wlb else None
            rows.append(dict(context=context, speedup_vs_wlb=vs, **r.to_dict()))
            table.append([f"{context // 1024}K", r.system, f"{r.step_time_s:.3f}",
                          f"{r.throughput_tokens_s:,.0f}", f"{vs:.3f}" if vs else "-",
                          f"{r.comm_exposed_s:.3f}", f"{100 * r.idle_fraction:.1f}",
                          f"{r.memory_bytes / 2 ** 30:.1f}"])
        done_baselines.add(context)
    print(f"{model.name} on {par.gpus}x {gpu.name} (tp={par.tp} dp={par.dp} pp={par.pp} "
          f"microbatches={par.microbatches}), {args.dataset}")
    print(format_table(["context", "system", "step s", "tokens/s", "vs WLB", "exposed s",
                        "idle %", "mem GiB"], table))
    return rows
