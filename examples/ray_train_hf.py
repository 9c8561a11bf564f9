"""Train a Hugging Face Llama with Ray Train, its core attention served by a distca job.

Each ``TorchTrainer`` worker joins the job with ``DistCAClient.connect(job)`` (rank and world size
come from the Train context), registers it as transformers' ``"distca"`` attention, and trains a
DDP replica of a small random-init ``LlamaForCausalLM`` on its own packed chunk of real documents
(bytes as tokens), packed by transformers' ``DataCollatorWithFlattening``.

    python examples/ray_train_hf.py --workers 2 --steps 20
    python examples/ray_train_hf.py --mode inplace --context 1024
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import ray
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]  # a plain checkout works too
from llama_data import PackedStream, load_corpus  # noqa: E402

JOB = "ray-train-hf"


def model_config(args: dict):
    """A small Llama config over byte tokens (vocabulary 256)."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=256, hidden_size=args["hidden"], intermediate_size=2 * args["hidden"],
                       num_hidden_layers=args["layers"], num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=args["context"])


def build_model(args: dict, attn_implementation: str):
    """The random-init model every rank starts from (seeded, so all replicas are equal)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(args["seed"])
    return AutoModelForCausalLM.from_config(model_config(args), attn_implementation=attn_implementation,
                                            dtype=torch.float32)


def packed_stream(args: dict) -> PackedStream:
    """The run's documents, shuffled and packed into ``context``-token chunks."""
    return PackedStream(load_corpus(args["data"]), args["context"], args["seed"])


def rank_batch(stream: PackedStream, step: int, rank: int, world_size: int) -> tuple[dict, list[int]]:
    """Rank ``rank``'s packed batch of step ``step`` as ``DataCollatorWithFlattening`` makes it
    (``input_ids``/``labels``/``position_ids`` [1, context], ``cu_seq_lens_q/k``), and the document
    lengths. The ``cu_seq_lens`` say "one document" when a chunk is a single document, which
    ``position_ids`` alone cannot (distca refuses such a training row)."""
    from transformers import DataCollatorWithFlattening
    tokens, doc_lens = stream.batch(step, world_size)[rank]
    docs = np.split(tokens.astype(np.int64), np.cumsum(doc_lens)[:-1])
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs]), list(doc_lens)


def train_loop(args: dict) -> None:
    """One Ray Train worker: join the distca job, train, report every step's losses."""
    from ray import train
    from ray.train.torch import prepare_model

    from distca_client import DistCAClient
    from distca_client.integrations import hf

    torch.set_num_threads(1)  # the workers share a small machine
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    client = hf.register(DistCAClient.connect(args["job"]))  # rank, world size: the Train context
    model = prepare_model(build_model(args, "distca"))  # DDP over the Train workers' gloo group
    opt = torch.optim.AdamW(model.parameters(), lr=args["lr"])
    stream, history = packed_stream(args), []
    for step in range(args["steps"]):
        batch, doc_lens = rank_batch(stream, step, rank, world)
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        # The plan the scheduler made holds every rank's documents: this rank's are at its index.
        plan_ok = client.last_plan.doc_lens_per_rank[rank] == doc_lens
        gathered = [torch.zeros(2) for _ in range(world)]
        torch.distributed.all_gather(gathered, torch.tensor([loss.item(), float(plan_ok)]))
        history.append({"step": step, "rank_losses": [g[0].item() for g in gathered],
                        "plans_match_ranks": all(bool(g[1]) for g in gathered)})
    # The run's result: the metrics of its last checkpoint (rank 0's model weights).
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            torch.save(model.module.state_dict(), Path(tmp) / "model.pt")
            checkpoint = train.Checkpoint.from_directory(tmp)
        train.report({"world_size": world, "history": history}, checkpoint=checkpoint)
    client.close()


def run(args: dict) -> dict:
    """Launch the distca job, train with a ``TorchTrainer``, shut the job down; returns the
    final report (``world_size``; ``history``: per step, every rank's loss and whether the plans
    put each rank's documents at its Train rank; ``checkpoint``: the Ray Train checkpoint path)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from distca_server import launch, shutdown

    started = not ray.is_initialized()
    if started:
        path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "examples"),
                                           os.environ.get("PYTHONPATH")) if p)
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, namespace="distca",
                 log_to_driver=False, logging_level=logging.WARNING,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    # detached=False: the job lives as long as ``job`` holds its handles.
    # num_cpus=0: servers and Train workers share a small machine (torch threads are set per worker).
    job = launch(args["job"], servers=args["servers"], mode=args["mode"], min_shard=args["min_shard"],
           detached=False, server_options={"num_cpus": 0})
    try:
        trainer = TorchTrainer(
            train_loop, train_loop_config=args,
            scaling_config=ScalingConfig(num_workers=args["workers"], use_gpu=False,
                                         resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(name=args["job"], storage_path=args["storage"]))
        result = trainer.fit()
    finally:
        shutdown(args["job"])
        del job
        if started:
            ray.shutdown()
    return {**result.metrics, "checkpoint": result.checkpoint.path}


def parse_args(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=JOB, help="distca job name")
    ap.add_argument("--mode", choices=["dedicated", "inplace"], default="dedicated")
    ap.add_argument("--servers", type=int, default=1, help="dedicated attention servers")
    ap.add_argument("--workers", type=int, default=2, help="Ray Train workers (data-parallel ranks)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--context", type=int, default=512, help="tokens per worker per step")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-shard", type=int, default=64, help="smallest shard of a split document")
    ap.add_argument("--data", default=None, help="folder or JSONL (default: the standard library)")
    ap.add_argument("--storage", default=str(Path(tempfile.gettempdir()) / "distca_ray_train"),
                    help="Ray Train's storage_path")
    return vars(ap.parse_args(argv))


def main(argv=None) -> dict:
    args = parse_args(argv)
    metrics = run(args)
    for h in metrics["history"]:
        losses = ", ".join(f"{x:.4f}" for x in h["rank_losses"])
        print(f"step {h['step']:3d}  loss per rank [{losses}]  mean {np.mean(h['rank_losses']):.4f}")
    first, last = (np.mean(metrics["history"][i]["rank_losses"]) for i in (0, -1))
    print(f"{metrics['world_size']} workers: loss {first:.4f} -> {last:.4f} "
          f"(ln 256 = {math.log(256):.4f})")
    return metrics


if __name__ == "__main__":
    main()
