"""Train a small Hugging Face Llama on real documents with distca serving its core attention.

W data-parallel workers (Ray actors) each hold a full replica of a random-init transformers
``LlamaForCausalLM`` (bytes as tokens) and train on their own chunk of packed documents; gradients
are averaged with a gloo all-reduce and every replica takes the same AdamW step. The model runs
with ``attn_implementation="distca"`` (``distca_client.integrations.hf``): each layer's core
attention goes to the distca job's attention servers through ``DistCAClient.attend`` (dedicated
servers, or in-place on the workers themselves); everything else stays in the worker.
``--attention local`` trains the same model on the same data with local attention
(``distca_client.varlen_attention`` behind the same adapter), for comparison: the losses agree
step for step.

    python examples/train_llama.py                          # the demo: distca, then local
    python examples/train_llama.py --mode dedicated --servers 3 --steps 300 --name long
    python examples/train_llama.py --data corpus.jsonl --context 4096 --layers 6 --hidden 256

Writes ``runs/<name>/``: ``metrics.json``, ``loss.png``, ``balance.png`` and ``checkpoint.pt``
(model and optimizer state; ``--resume`` continues from it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import ray
import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
# Run from a plain checkout too: this folder for the data module, the repository root for distca
# itself when it is not pip-installed.
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
import llama_data  # noqa: E402
from llama_data import VOCAB_SIZE, PackedStream, load_corpus, positions, target_mask  # noqa: E402

# The attn_implementation names each run registers in its workers' transformers.
ATTENTION = {"distca": "distca", "local": "distca_local"}


@dataclass
class TrainConfig:
    """Everything a run depends on; stored in metrics.json and the checkpoint."""

    name: str = "demo"
    steps: int = 100
    attention: str = "distca"          # "distca" or "local"
    mode: str = "inplace"              # distca servers: "inplace" or "dedicated"
    servers: int = 2                   # dedicated servers (in-place: one per worker)
    workers: int = 2                   # data-parallel ranks
    context: int = 2048                # tokens per rank per step
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    data: str | None = None            # None: the standard library's source files
    epsilon: float = 0.05
    min_shard: int = 128
    threads: int = 1                   # torch threads per worker (workers share the machine)
    runs_dir: str = "runs"
    resume: bool = False
    save_every: int = 0                # also save a checkpoint every N steps (0: only at the end)
    log_every: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def model_config(self):
        """The transformers ``LlamaConfig``: SwiGLU width about 8/3·hidden (a multiple of 32)."""
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=self.hidden, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           intermediate_size=32 * round(8 / 3 * self.hidden / 32),
                           max_position_embeddings=self.context, tie_word_embeddings=False)

    def validate(self) -> None:
        problems = []
        if self.attention not in ("distca", "local"):
            problems.append(f"attention={self.attention!r} (distca or local)")
        if self.mode not in ("dedicated", "inplace"):
            problems.append(f"mode={self.mode!r} (dedicated or inplace)")
        for name in ("steps", "workers", "context", "servers", "threads", "log_every", "layers",
                     "hidden", "heads", "kv_heads"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} (must be >= 1)")
        if self.heads >= 1 and self.hidden % self.heads:
            problems.append(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        elif self.heads >= 1 and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even (rotary pairs)")
        if self.kv_heads >= 1 and self.heads % self.kv_heads:
            problems.append(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.save_every < 0:
            problems.append(f"save_every={self.save_every} (must be >= 0)")
        if problems:
            raise ValueError("train config: " + "; ".join(problems))

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name


def build_model(cfg: TrainConfig, attn_implementation: str):
    """The random-init ``LlamaForCausalLM`` every rank starts from (seeded: all replicas equal)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(cfg.model_config(), attn_implementation=attn_implementation,
                                            dtype=torch.float32)


def packed_forward(model, tokens: torch.Tensor, doc_lens: list[int]) -> torch.Tensor:
    """logits [T, vocab] of one packed chunk: tokens [T] int64, documents of ``doc_lens`` tokens,
    passed as transformers' packed format (``position_ids`` restarting per document and
    ``cu_seq_lens_q/k``)."""
    cu = torch.tensor([0, *np.cumsum(doc_lens).tolist()], dtype=torch.int32)
    pos = torch.from_numpy(positions(doc_lens))
    return model(input_ids=tokens[None], position_ids=pos[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                 max_length_q=max(doc_lens), max_length_k=max(doc_lens)).logits[0]


def next_byte_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``tokens[t+1]`` at every ``t`` where ``mask[t]``.

    logits [T, vocab], tokens [T] int64, mask [T] bool (False at each document's last token, so no
    prediction crosses a document boundary). Returns a scalar; 0 (still in the graph) when no
    position has a target.
    """
    idx = mask[:-1].nonzero().squeeze(1)
    if idx.numel() == 0:
        return logits.sum() * 0
    return F.cross_entropy(logits[idx], tokens[idx + 1])


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then constant: a function of the step alone, so a
    resumed run continues on exactly the schedule it left."""
    return cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup))


# ---- workers -------------------------------------------------------------------------------------
# num_cpus=0: workers, servers and the scheduler share a small machine; Ray's CPU accounting would
# otherwise refuse to place them all (torch's own threads are set by --threads).
@ray.remote(num_cpus=0)
class Worker:
    """One data-parallel rank: a model replica, its AdamW, and a client of the distca job."""

    def __init__(self, cfg: TrainConfig, rank: int, job: str | None):
        from distca_client.integrations import hf
        torch.set_num_threads(cfg.threads)
        self.cfg, self.rank = cfg, rank
        if job is not None:
            from distca_client import DistCAClient
            self.client = hf.register(DistCAClient.connect(job, rank=rank, world_size=cfg.workers),
                                      ATTENTION["distca"])
        else:
            self.client = None
            hf.register_local(ATTENTION["local"])
        self.model = build_model(cfg, ATTENTION[cfg.attention]).train()
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]  # norm gains
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(0.9, 0.95))

    @staticmethod
    def free_address() -> tuple[str, int]:
        """An address for the gradient group's rendezvous on this worker's node."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def join(self, host: str, port: int) -> None:
        """Join the W-rank gloo group used for the gradient all-reduce (the default group: distca's
        own all-to-all groups are standalone, so it is free)."""
        torch.distributed.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                                             rank=self.rank, world_size=self.cfg.workers)

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def step(self, tokens: np.ndarray, doc_lens: list[int], lr: float) -> dict:
        """One training step on this rank's chunk: tokens uint8 [context], doc_lens sum to context.

        Returns this rank's loss (mean over its predicted bytes) and phase timings in seconds.
        """
        t0 = time.perf_counter()
        x = torch.from_numpy(tokens.astype(np.int64))
        mask = torch.from_numpy(target_mask(doc_lens))
        loss = next_byte_loss(packed_forward(self.model, x, doc_lens), x, mask)
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        t2 = time.perf_counter()
        # One flat all-reduce: each rank's loss is a mean over its own bytes, so the average of
        # the ranks' gradients is the gradient of the average loss.
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= self.cfg.workers
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        t3 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        t4 = time.perf_counter()
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), "forward_s": t1 - t0,
                "backward_s": t2 - t1, "allreduce_s": t3 - t2, "optimizer_s": t4 - t3}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# ---- the driver ----------------------------------------------------------------------------------
def _ensure_ray() -> bool:
    """Start a local Ray instance unless one is up (a test's, or the caller's); True if started."""
    if ray.is_initialized():
        return False
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, namespace="distca",
             object_store_memory=200 * 2**20, log_to_driver=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": path}})  # workers import distca from here
    return True


def _ship_code_to_workers() -> None:
    """Send this example's modules to Ray workers by value, so workers of a Ray instance someone
    else started need no PYTHONPATH entry for ``examples/``."""
    for module in (llama_data, sys.modules[__name__]):
        if module.__name__ != "__main__":  # __main__ always travels by value
            ray.cloudpickle.register_pickle_by_value(module)


def rank_flops(cost, doc_lens_per_rank: list[list[int]]) -> list[float]:
    """Forward attention FLOPs (one layer) of each rank's own documents: the load with no balancing."""
    return [sum(cost.doc_flops(n) for n in lens) for lens in doc_lens_per_rank]


def _imbalance(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _load_checkpoint(cfg: TrainConfig) -> dict:
    path = cfg.run_dir / "checkpoint.pt"
    if not path.exists():
        raise ValueError(f"--resume: no checkpoint at {path}")
    ckpt = torch.load(path, weights_only=True)
    saved = ckpt["config"]
    must_match = ("layers", "hidden", "heads", "kv_heads", "workers", "context", "seed", "data")
    diff = [f"{k}: saved {saved[k]!r}, now {getattr(cfg, k)!r}" for k in must_match if saved[k] != getattr(cfg, k)]
    if diff:
        raise ValueError("--resume with a different setup: " + "; ".join(diff))
    if ckpt["step"] >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint is at step {ckpt['step']}, nothing to do for "
                         f"--steps {cfg.steps}")
    return ckpt


def _save_checkpoint(cfg: TrainConfig, step: int, history: list[dict], state: dict) -> None:
    """``checkpoint.pt``: the next step to run, the config, the metrics so far, and rank 0's model
    and optimizer state (every replica holds the same). Written to a temporary name first, so a
    crash while saving leaves the previous checkpoint intact."""
    path = cfg.run_dir / "checkpoint.pt"
    torch.save({"step": step, "config": asdict(cfg), "steps": history, **state}, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Run one training job (distca or local attention) and write its run folder.

    Starts a local Ray instance only if none is running (and stops only that one). Returns the
    metrics written to metrics.json, plus ``model_state`` (rank 0's final parameters).
    """
    from distca_server import launch, shutdown, status
    from scheduler import CostModel

    cfg.validate()
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(cfg.data)
    stream = PackedStream(corpus, cfg.context, cfg.seed)
    cost = CostModel(cfg.heads, cfg.kv_heads, cfg.head_dim, dtype_bytes=4)
    ckpt = _load_checkpoint(cfg) if cfg.resume else None
    history: list[dict] = list(ckpt["steps"]) if ckpt else []
    start_step = ckpt["step"] if ckpt else 0
    num_servers = cfg.servers if cfg.mode == "dedicated" else cfg.workers

    started_ray = _ensure_ray()
    _ship_code_to_workers()
    job = f"llama-{cfg.name}" if cfg.attention == "distca" else None
    workers, launched = [], None
    wall0 = time.perf_counter()
    try:
        if job is not None:
            # Handles must stay referenced: with detached=False the actors live as long as they do.
            launched = launch(name=job, servers=cfg.servers, mode=cfg.mode, epsilon=cfg.epsilon,
                              min_shard=cfg.min_shard, detached=False, server_options={"num_cpus": 0})
        workers = [Worker.remote(cfg, r, job) for r in range(cfg.workers)]
        host, port = ray.get(workers[0].free_address.remote())
        ray.get([w.join.remote(host, port) for w in workers])
        if ckpt is not None:
            state = ray.put({"model": ckpt["model"], "optimizer": ckpt["optimizer"]})
            ray.get([w.load.remote(state) for w in workers])

        tokens_per_step = cfg.workers * cfg.context
        bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, unit="step",
                   desc=f"{cfg.name} ({cfg.attention})", disable=not progress, dynamic_ncols=True)
        for step in bar:
            chunks = stream.batch(step, cfg.workers)
            lens = [c[1] for c in chunks]
            t0 = time.perf_counter()
            results = ray.get([w.step.remote(tok, doc_lens, learning_rate(cfg, step))
                               for w, (tok, doc_lens) in zip(workers, chunks)])
            step_time = time.perf_counter() - t0
            before_loads = rank_flops(cost, lens)
            record = {"step": step, "loss": float(np.mean([r["loss"] for r in results])),
                      "step_time_s": step_time, "lr": learning_rate(cfg, step),
                      "grad_norm": results[0]["grad_norm"],
                      "documents": sum(len(x) for x in lens), "longest": max(max(x) for x in lens),
                      "rank_flops": before_loads, "imbalance_before": _imbalance(before_loads)}
            for phase in ("forward_s", "backward_s", "allreduce_s"):
                record[phase] = max(r[phase] for r in results)  # the slowest rank sets the pace
            if job is not None:
                last = status(job)["last"]  # the scheduler's record of this step's plan
                record.update(imbalance_before=last["imbalance_before"],
                              imbalance_after=last["imbalance_after"],
                              bytes=int((last["bytes"]["forward"] + last["bytes"]["backward"]) * cfg.layers),
                              server_flops=[last["server_flops"][k] for k in sorted(last["server_flops"])],
                              plan_ms=last["plan_ms"], num_tasks=last["num_tasks"])
            else:  # each rank runs its own attention: nothing is balanced, nothing moves
                record.update(imbalance_after=record["imbalance_before"], bytes=0,
                              server_flops=before_loads)
            history.append(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tokens_per_step / step_time:,.0f}")
            if progress and (step % cfg.log_every == 0 or step == cfg.steps - 1):
                tqdm.write(format_step(record))
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
                _save_checkpoint(cfg, step + 1, history, ray.get(workers[0].state.remote()))
        final = ray.get(workers[0].state.remote())
    finally:
        for w in workers:
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception:  # a broken worker is killed below anyway
                pass
            ray.kill(w)
        if launched is not None:
            shutdown(job)
        if started_ray:
            ray.shutdown()

    _save_checkpoint(cfg, cfg.steps, history, final)
    metrics = {
        "name": cfg.name, "attention": cfg.attention,
        "mode": cfg.mode if job else None, "servers": num_servers if job else 0,
        "workers": cfg.workers, "config": asdict(cfg),
        "model": {"class": "LlamaForCausalLM", "layers": cfg.layers, "hidden": cfg.hidden,
                  "heads": cfg.heads, "kv_heads": cfg.kv_heads, "vocab": VOCAB_SIZE,
                  "parameters": sum(v.numel() for v in final["model"].values())},
        "data": {"source": corpus.source, "documents": len(corpus.documents), "tokens": corpus.num_tokens},
        "tokens_per_step": cfg.workers * cfg.context,
        "wall_s": time.perf_counter() - wall0,
        "steps": history,
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot_loss(run_dir / "loss.png", _runs_to_compare(cfg))
    if job is not None:
        sample = max(history, key=lambda r: r["imbalance_before"])
        plot_balance(run_dir / "balance.png", stream, cfg, cost, sample)
    return dict(metrics, model_state=final["model"])


# ---- reporting -----------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_step(r: dict) -> str:
    return (f"step {r['step']:4d}  loss {r['loss']:.4f}  time {r['step_time_s']:.2f} s  "
            f"imbalance {r['imbalance_before']:.2f} -> {r['imbalance_after']:.2f}  "
            f"moved {_mib(r['bytes'])}  docs {r['documents']:3d} (longest {r['longest']})")


def summary_table(runs: list[dict]) -> str:
    """One row per run: loss first -> last, step time, tokens/s, imbalance, bytes moved."""
    head = ("run", "attention", "steps", "loss first", "loss last10", "step time", "tokens/s",
            "imbalance before", "after", "moved/step", "wall")
    rows = []
    for m in runs:
        s = m["steps"]
        how = m["attention"] + (f" ({m['mode']}, {m['servers']} servers)" if m["attention"] == "distca" else "")
        times = [r["step_time_s"] for r in s[1:]] or [s[0]["step_time_s"]]  # step 0 warms up
        rows.append((m["name"], how, str(len(s)), f"{s[0]['loss']:.3f}",
                     f"{np.mean([r['loss'] for r in s[-10:]]):.3f}", f"{np.mean(times):.2f} s",
                     f"{m['tokens_per_step'] / np.mean(times):,.0f}",
                     f"{np.mean([r['imbalance_before'] for r in s]):.2f}",
                     f"{np.mean([r['imbalance_after'] for r in s]):.2f}",
                     _mib(np.mean([r["bytes"] for r in s])), f"{m['wall_s']:.0f} s"))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _runs_to_compare(cfg: TrainConfig) -> list[dict]:
    """Metrics of this run and its counterpart (``<name>-local`` or ``<name>`` without it)."""
    names = [cfg.name, cfg.name.removesuffix("-local") if cfg.name.endswith("-local") else cfg.name + "-local"]
    found = []
    for n in dict.fromkeys(names):
        path = Path(cfg.runs_dir) / n / "metrics.json"
        if path.exists():
            found.append(json.loads(path.read_text()))
    return found


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
                 f"{m['workers']} ranks x {m['config']['context']} tokens\n"
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
    num_servers = cfg.servers if cfg.mode == "dedicated" else cfg.workers
    plan = plan_batch(lens, num_servers, cost=cost, epsilon=cfg.epsilon, mode=cfg.mode, min_shard=cfg.min_shard)
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
        ax.set_title(f"{title}; max/mean {_imbalance(loads):.2f}", fontsize=9)
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


# ---- command line --------------------------------------------------------------------------------
def parse_args(argv=None) -> tuple[TrainConfig, bool]:
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
    ap.add_argument("--servers", type=int, default=d.servers, help="attention servers (dedicated mode)")
    ap.add_argument("--workers", type=int, default=d.workers, help="data-parallel ranks")
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
    ap.add_argument("--resume", action="store_true", help="continue from <run>/checkpoint.pt")
    ap.add_argument("--save-every", type=int, default=d.save_every,
                    help="also checkpoint every N steps (0: only at the end)")
    ap.add_argument("--log-every", type=int, default=d.log_every, help="print a step line every N steps")
    a = ap.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(a, k) for k in asdict(d)})
    return cfg, a.compare_local and cfg.attention == "distca"


def main(argv=None, *, progress: bool = True) -> dict:
    """Train as the command line says; returns ``{run name: train()'s result}``."""
    cfg, compare = parse_args(argv)
    configs = [cfg] + ([replace(cfg, name=cfg.name + "-local", attention="local")] if compare else [])
    started_ray = _ensure_ray()  # one Ray instance for both runs
    try:
        results = {}
        for c in configs:
            results[c.name] = train(c, progress=progress)
    finally:
        if started_ray:
            ray.shutdown()
    for c in configs:  # again, now that every run of this command has finished
        plot_loss(c.run_dir / "loss.png", _runs_to_compare(c))
    runs = list(results.values())
    print()
    print(summary_table(runs))
    if len(runs) == 2:
        diff = [abs(a["loss"] - b["loss"]) for a, b in zip(runs[0]["steps"], runs[1]["steps"])]
        early = min(10, len(diff))
        print(f"\nloss difference distca vs local: at most {max(diff[:early]):.1e} in the first {early} steps, "
              f"{max(diff):.1e} over all {len(diff)}\n(attention agrees to float32 rounding; like any two "
              f"kernels' rounding, it grows slowly as training goes on)")
    print(f"\nwrote {', '.join(str(c.run_dir) for c in configs)}: metrics.json, loss.png, "
          + ("balance.png, " if cfg.attention == "distca" else "") + "checkpoint.pt")
    return results


if __name__ == "__main__":
    main()
