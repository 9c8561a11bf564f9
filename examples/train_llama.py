"""Train a small Hugging Face Llama on real documents with Ray Train, distca serving its core attention.

A ``TorchTrainer`` runs W data-parallel workers on a local Ray instance (or on the Ray cluster the
command runs in: ``ray job submit``, a node of ``ray start``); each holds a DDP replica
of a random-init transformers ``LlamaForCausalLM`` (bytes as tokens) and trains on its own chunk of
packed documents (``llama_worker.train_loop``). The model runs with ``attn_implementation="distca"``
(``distca_client.integrations.hf``): each layer's core attention goes to the distca job's attention
servers through ``DistCAClient.connect()`` (dedicated servers, or in-place on the workers
themselves); everything else stays in the worker. ``--attention local`` trains the same model on
the same data with local attention (``distca_client.varlen_attention`` behind the same adapter),
for comparison: the losses agree step for step, which the demo checks.

    python examples/train_llama.py                          # the demo: distca, then local
    python examples/train_llama.py --mode dedicated --servers 3 --steps 300 --name long
    python examples/train_llama.py --data corpus.jsonl --context 4096 --layers 6 --hidden 256
    python examples/train_llama.py --device cuda --dtype bfloat16 --transport nvshmem ...  # one GPU
                                                            # (make demo-gpu; see llama_device.py)

Writes ``runs/<name>/``: ``metrics.json``, ``loss.png``, ``balance.png`` and ``train/``, the run's
Ray Train storage (its checkpoints: model and optimizer state, metrics so far; ``--resume``
continues from the latest).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import ray
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
# Run from a plain checkout too: this folder for the example's modules, the repository root for
# distca itself when it is not pip-installed.
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
import llama_data  # noqa: E402
import llama_device  # noqa: E402
import llama_report  # noqa: E402
import llama_worker  # noqa: E402
from distca_cli.connect import explicit_address, worker_pythonpath  # noqa: E402
from llama_data import VOCAB_SIZE, PackedStream, load_corpus  # noqa: E402
from llama_report import (agree_rtol, format_step, loss_agreement, plot_balance, plot_loss,  # noqa: E402
                          runs_to_compare, summary_table, train_summary)
from llama_worker import MODEL_FILE, TrainConfig, read_state  # noqa: E402

# Ray Train's storage inside a run folder; a fresh run empties it (Ray Train would restore from it).
TRAIN_DIR = "train"


def _cluster_running() -> bool:
    """Whether this command joins a running Ray cluster rather than start a local instance: one is
    named by ``RAY_ADDRESS`` (``ray job submit`` sets it for its driver), or ``ray start`` recorded
    one on this machine (``ray stop`` removes the record) and a raylet here still names it. A record
    that a crashed cluster left behind is passed over (``ray.init`` would retry it for minutes);
    the look is at this machine's processes, so it waits on nothing."""
    if explicit_address(None) is not None:
        return True
    try:  # Ray's own lookups (what a plain ray.init() reads), not public API
        from ray._private.services import find_bootstrap_address, find_gcs_addresses
    except ImportError:  # a Ray without them: only RAY_ADDRESS names a cluster to join
        return False
    recorded = find_bootstrap_address(None)
    return recorded is not None and recorded in find_gcs_addresses()


def _ensure_ray(num_gpus: int | None = None, env: dict[str, str] | None = None) -> bool:
    """Join the running Ray cluster (:func:`_cluster_running`), or start a local Ray instance,
    unless Ray is up in this process (a test's, or the caller's); True if this call did either
    (the caller then shuts it down: a cluster's driver disconnects, the cluster stays).
    ``num_gpus``: the GPUs a local instance offers (None: Ray's own count); ``env``: more
    environment variables for every worker (:func:`llama_device.worker_env`)."""
    if ray.is_initialized():
        return False
    # log_to_driver=False: Train's controller and workers log to Ray's session files, so the
    # terminal shows the progress bar and the step lines only.
    env_vars = {**(env or {}), "PYTHONPATH": worker_pythonpath(ROOT)}  # workers import distca from here
    common = dict(namespace="distca", log_to_driver=False, logging_level=logging.WARNING,
                  runtime_env={"env_vars": env_vars})
    if _cluster_running():
        # "auto": RAY_ADDRESS, else the recorded cluster; unlike that address given explicitly, it
        # sends the token Ray keeps for a cluster started here. No resources: the cluster has its
        # own, and Ray refuses num_cpus, num_gpus, object_store_memory when joining one.
        ray.init(address="auto", **common)
    else:  # "local" explicitly: never joined by accident, with resources it would refuse
        ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False,
                 object_store_memory=200 * 2**20, **({} if num_gpus is None else {"num_gpus": num_gpus}), **common)
    return True


def _ship_code_to_workers() -> None:
    """Send this example's modules to Ray workers by value, so workers of a Ray instance someone
    else started need no PYTHONPATH entry for ``examples/``."""
    for module in (llama_data, llama_device, llama_report, llama_worker):
        ray.cloudpickle.register_pickle_by_value(module)


def latest_checkpoint(cfg: TrainConfig) -> Path:
    """The run's latest Ray Train checkpoint folder, checked against ``cfg`` for ``--resume``.

    Raises:
        ValueError: no checkpoint, one of a different setup, or one already at ``cfg.steps``.
    """
    from ray.train import Result
    train_dir = cfg.run_dir / TRAIN_DIR
    try:
        checkpoint = Result.from_path(train_dir.resolve()).checkpoint
    except RuntimeError:  # Ray Train's "no such run folder"
        checkpoint = None
    if checkpoint is None:
        raise ValueError(f"--resume: no Ray Train checkpoint under {train_dir}")
    state = read_state(checkpoint.path)
    # The data as paths resolved here: a checkpoint of an older version may hold a relative one.
    saved = dict(state["config"], data=data_path(state["config"]["data"]))
    now = replace(cfg, data=data_path(cfg.data))
    must_match = ("layers", "hidden", "heads", "kv_heads", "workers", "context", "seed", "data", "attention")
    diff = [f"{k}: saved {saved[k]!r}, now {getattr(now, k)!r}" for k in must_match if saved[k] != getattr(now, k)]
    if diff:
        raise ValueError("--resume with a different setup: " + "; ".join(diff))
    if state["step"] >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint is at step {state['step']}, nothing to do for "
                         f"--steps {cfg.steps}")
    return Path(checkpoint.path)


def data_path(data: str | None) -> str | None:
    """``--data`` as an absolute path (None, the standard library, stays None): each Train worker
    reads it again, from its own working directory."""
    return None if data is None else str(Path(data).resolve())


def check_start(cfg: TrainConfig) -> None:
    """Refuse a run that cannot start, before anything starts (Ray, the run folder).

    Raises:
        ValueError: a bad setting (:meth:`TrainConfig.validate`, the data's path included), or a
            ``--resume`` that cannot continue (:func:`latest_checkpoint`).
    """
    cfg.validate()
    if cfg.resume:
        latest_checkpoint(cfg)


def _fit(trainer, progress, cfg: TrainConfig, show: bool):
    """Run ``trainer.fit()`` on a thread while the progress bar follows rank 0's step records
    (``progress``: the ``ray.util.queue.Queue`` rank 0 feeds); returns fit's Result."""
    if show:  # workers import torch and transformers first: say why nothing moves yet
        tqdm.write(f"{cfg.name} ({cfg.attention}): starting {cfg.workers} Ray Train workers ...")
    bar, pool = None, ThreadPoolExecutor(1)
    fitting = pool.submit(trainer.fit)
    try:
        while True:
            done = fitting.done()  # before the get: then every record was put before it
            try:
                record = progress.get(timeout=0.5)
            except queue.Empty:
                if done:  # nothing more will come (a failure is raised below)
                    break
                continue
            if "start" in record:
                bar = tqdm(initial=record["start"], total=cfg.steps, unit="step", disable=not show,
                           desc=f"{cfg.name} ({cfg.attention})", dynamic_ncols=True)
                continue
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}",
                            tok_s=f"{cfg.workers * cfg.context / record['step_time_s']:,.0f}")
            if show and (record["step"] % cfg.log_every == 0 or record["step"] == cfg.steps - 1):
                tqdm.write(format_step(record))
    finally:
        if bar is not None:
            bar.close()
        # No waiting for fit on Ctrl-C: stopping Ray (the caller's finally) ends it.
        pool.shutdown(wait=False)
    return fitting.result()


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Run one training job (distca or local attention) with a ``TorchTrainer`` and write its run
    folder.

    Starts a local Ray instance only if none is running (and stops only that one). Returns the
    metrics written to metrics.json, plus ``model_state`` (the final checkpoint's parameters)
    and ``checkpoint`` (its folder).

    Raises:
        ValueError: a bad config, or a ``--resume`` that cannot continue (see latest_checkpoint).
    """
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    from distca_server import launch, shutdown
    from scheduler import CostModel

    check_start(cfg)
    run_dir = cfg.run_dir
    if not cfg.resume:
        shutil.rmtree(run_dir / TRAIN_DIR, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(cfg.data)
    job = f"llama-{cfg.name}" if cfg.attention == "distca" else None

    started_ray = _ensure_ray(_gpus_here(cfg), llama_device.worker_env(cfg))
    _ship_code_to_workers()
    launched, steps = None, None
    wall0 = time.perf_counter()
    try:
        llama_device.check_gpus(cfg, ray.cluster_resources().get("GPU", 0.0))
        if job is not None:
            # Handles must stay referenced: with detached=False the actors live as long as they do.
            # num_cpus=0: servers and Train workers share a small machine (on a GPU, a share of it).
            launched = launch(name=job, config=cfg.job_config(), detached=False,
                              server_options=llama_device.server_options(cfg))
        steps = Queue(actor_options={"num_cpus": 0})
        # Ray Train gives its workers 60 s to start (import torch and transformers, join the gloo
        # group); a busy 2-core machine can take longer. The controller reads it from here.
        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600")
        cpus = ray.cluster_resources().get("CPU", 1.0)
        # A share of a CPU each, so W workers fit beside the servers (torch threads: --threads);
        # with --device cuda also a share of the GPU.
        use_gpu, resources = llama_device.worker_resources(cfg, cpus)
        torch_config = llama_device.torch_config(cfg)
        trainer = TorchTrainer(
            llama_worker.train_loop,
            train_loop_config={"cfg": asdict(cfg), "job": job, "progress": steps},
            **({} if torch_config is None else {"torch_config": torch_config}),
            scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=use_gpu, resources_per_worker=resources),
            run_config=RunConfig(name=TRAIN_DIR, storage_path=str(run_dir.resolve()),
                                 checkpoint_config=CheckpointConfig(num_to_keep=1)))
        result = _fit(trainer, steps, cfg, progress)
    finally:
        if steps is not None:
            steps.shutdown()
        if launched is not None:
            shutdown(job)
        if started_ray:
            ray.shutdown()
    wall = time.perf_counter() - wall0

    final = torch.load(Path(result.checkpoint.path) / MODEL_FILE, weights_only=True, map_location="cpu")["model"]
    state = read_state(result.checkpoint.path)
    history = state["steps"]
    metrics = {
        "name": cfg.name, "attention": cfg.attention,
        "mode": cfg.mode if job else None, "servers": cfg.num_servers if job else 0,
        "workers": cfg.workers, "config": asdict(cfg),
        "model": {"class": "LlamaForCausalLM", "layers": cfg.layers, "hidden": cfg.hidden,
                  "heads": cfg.heads, "kv_heads": cfg.kv_heads, "vocab": VOCAB_SIZE,
                  "parameters": sum(v.numel() for v in final.values())},
        "data": {"source": corpus.source, "documents": len(corpus.documents), "tokens": corpus.num_tokens},
        "tokens_per_step": cfg.workers * cfg.context,
        "wall_s": wall,  # this session's: after a --resume, earlier sessions' walls are not kept
        "session_starts": state["session_starts"],  # llama_report.warm_steps
        "steps": history,
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot_loss(run_dir / "loss.png", runs_to_compare(cfg))
    if job is not None:
        sample = max(history, key=lambda r: r["imbalance_before"])
        cost = CostModel(cfg.heads, cfg.kv_heads, cfg.head_dim, dtype_bytes=4)
        plot_balance(run_dir / "balance.png", PackedStream(corpus, cfg.context, cfg.seed), cfg, cost, sample)
    return dict(metrics, model_state=final, checkpoint=result.checkpoint.path)


def _gpus_here(cfg: TrainConfig) -> int | None:
    """The GPUs a Ray instance this command starts should offer: torch's count for a GPU run (Ray
    then needs no detection of its own), None (Ray's default) on the CPU."""
    return torch.cuda.device_count() if cfg.device == "cuda" else None


# ---- command line --------------------------------------------------------------------------------
def parse_args(argv=None) -> tuple[TrainConfig, bool]:
    """The run's config, and whether a local-attention run follows it (``--compare-local``).

    Raises:
        ValueError: a bad setting, naming its value (SystemExit for argparse's own errors).
    """
    return parse_command_line(argv)[:2]


def parse_command_line(argv=None) -> tuple[TrainConfig, bool, str | None]:
    """:func:`parse_args`, plus ``--summary-json`` (None when not given)."""
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--name", default=d.name, help="run folder: <runs-dir>/<name>")
    ap.add_argument("--steps", type=int, default=d.steps, help="train until this step")
    ap.add_argument("--attention", choices=["distca", "local"], default=d.attention)
    ap.add_argument("--compare-local", action=argparse.BooleanOptionalAction, default=True,
                    help="after a distca run, train <name>-local with local attention on the same data")
    ap.add_argument("--mode", choices=["inplace", "dedicated"], default=d.mode,
                    help="in-place: each worker also serves attention; dedicated: --servers separate actors")
    ap.add_argument("--servers", type=int, default=None,
                    help=f"attention servers, dedicated mode only (default {d.servers})")
    ap.add_argument("--workers", type=int, default=d.workers, help="data-parallel ranks (Ray Train workers)")
    ap.add_argument("--context", type=int, default=d.context, help="tokens per rank per step")
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--grad-clip", type=float, default=d.grad_clip)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--data", default=d.data,
                    help="folder of text files or JSONL with a 'text' field (default: this Python's stdlib)")
    ap.add_argument("--epsilon", type=float, default=d.epsilon, help="planner imbalance tolerance")
    ap.add_argument("--min-shard", type=int, default=d.min_shard, help="smallest shard of a split document")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker")
    ap.add_argument("--runs-dir", default=d.runs_dir)
    ap.add_argument("--resume", action="store_true", help="continue from the run's latest Ray Train checkpoint")
    ap.add_argument("--save-every", type=int, default=d.save_every,
                    help="also checkpoint every N steps (0: only at the end)")
    ap.add_argument("--log-every", type=int, default=d.log_every, help="print a step line every N steps")
    ap.add_argument("--device", default=d.device, help="cpu, or cuda: the workers share the GPU "
                    "(--gpus-per-worker each)")
    ap.add_argument("--dtype", default=d.dtype, help="float32, or bfloat16: autocast forward, float32 "
                    "weights and AdamW; the distca-vs-local tolerance follows it")
    ap.add_argument("--transport", default=d.transport, help="the distca job's transport: torch_dist, "
                    "shm (CPU tensors, one node) or nvshmem (CUDA tensors)")
    ap.add_argument("--gpus-per-worker", type=float, default=d.gpus_per_worker,
                    help="with --device cuda: each worker's num_gpus (default: an equal share of one GPU)")
    ap.add_argument("--summary-json", default=None, help="also write the distca-vs-local summary here "
                    "(loss agreement, step time, tokens/s)")
    a = ap.parse_args(argv)
    if a.mode == "inplace" and a.servers is not None:  # distca up's refusal, in its words
        raise ValueError(f"--servers {a.servers} is for dedicated mode: in in-place mode every client "
                         f"rank serves its share of attention (the job has as many servers as clients); "
                         f"drop --servers, or use --mode dedicated")
    fields = {k: getattr(a, k) for k in asdict(d)}
    fields.update(servers=d.servers if a.servers is None else a.servers, data=data_path(a.data))
    cfg = TrainConfig(**fields)
    cfg.validate()  # a bad value is named before Ray starts
    return cfg, a.compare_local and cfg.attention == "distca", a.summary_json


def main(argv=None, *, progress: bool = True) -> dict:
    """Train as the command line says; returns ``{run name: train()'s result}``.

    Raises:
        ValueError: a bad setting (naming it), or a ``--resume`` that cannot continue, of either
            run, before anything starts (:func:`check_start`).
        SystemExit(1): the distca and local runs disagree beyond the rounding of ``--dtype``
            (:func:`llama_report.agree_rtol`).
    """
    cfg, compare, summary_json = parse_command_line(argv)
    configs = [cfg] + ([replace(cfg, name=cfg.name + "-local", attention="local")] if compare else [])
    for c in configs:  # every run's, before the first trains (each train() checks its own again)
        check_start(c)
    started_ray = _ensure_ray(_gpus_here(cfg), llama_device.worker_env(cfg))  # one Ray instance for both runs
    try:
        results = {}
        for c in configs:
            results[c.name] = train(c, progress=progress)
    finally:
        if started_ray:
            ray.shutdown()
    for c in configs:  # again, now that every run of this command has finished
        plot_loss(c.run_dir / "loss.png", runs_to_compare(c))
    runs = list(results.values())
    print()
    print(summary_table(runs))
    agreement = None
    if len(runs) == 2:
        agreement = loss_agreement(runs[0]["steps"], runs[1]["steps"], agree_rtol(cfg.dtype))
        verdict = (f"they agree to {cfg.dtype} rounding" if agreement["agree"] else
                   f"they DISAGREE beyond {cfg.dtype} rounding (tolerance {agreement['rtol']:.1e})")
        print(f"\nloss distca vs local: largest relative difference {agreement['max_rel_first']:.1e} over "
              f"the first {agreement['first']} steps: {verdict}\n(largest absolute difference over all "
              f"{agreement['steps']} steps {agreement['max_abs_all']:.1e}: like any two kernels' rounding, "
              f"it grows slowly as training goes on)")
    print(f"\nwrote {', '.join(str(c.run_dir) for c in configs)}: metrics.json, loss.png, "
          + ("balance.png, " if cfg.attention == "distca" else "") + f"{TRAIN_DIR}/ (Ray Train checkpoints)")
    if summary_json is not None:
        summary = train_summary(runs, agreement, device=llama_device.device_name())
        Path(summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_json).write_text(json.dumps(summary, indent=1))
        print(f"wrote {summary_json}")
    if agreement is not None and not agreement["agree"]:
        raise SystemExit(1)
    return results


def cli(argv=None) -> int:
    """The command: :func:`main`, with a bad setting (a ``ValueError``) as one line
    ``train_llama.py: error: ...`` on stderr and exit status 1 instead of a traceback."""
    try:
        main(argv)
    except ValueError as exc:
        print(f"{Path(__file__).name}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
