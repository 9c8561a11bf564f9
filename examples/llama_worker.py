"""The Ray Train side of the training demo: what every ``TorchTrainer`` worker runs.

:func:`train_loop` is one data-parallel rank of a random-init transformers ``LlamaForCausalLM``
(bytes as tokens). It reads like any transformers + Ray Train script; distca adds these lines::

    from distca_client import DistCAClient
    from distca_client.integrations import hf
    hf.register(DistCAClient.connect(job))   # rank and world size: the Train context
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="distca")

after which every layer's core attention goes to the job's attention servers and everything else
stays in the worker. Gradients are averaged by DDP (``ray.train.torch.prepare_model``) over the
gloo group Ray Train sets up; checkpoints are Ray Train checkpoints (``model.pt`` and
``state.json``), reported with ``ray.train.report`` and found again with
``ray.train.get_checkpoint()`` when Ray Train restores the run.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from scheduler.checks import finite_nonnegative, finite_positive, nonnegative_int
from scheduler.config import ConfigError, JobConfig, PlanConfig

import llama_device
from llama_data import VOCAB_SIZE, PackedStream, collate, load_corpus, source_problem
from llama_report import imbalance, rank_flops

# The attn_implementation names each run registers in its workers' transformers.
ATTENTION = {"distca": "distca", "local": "distca_local"}
# A Ray Train checkpoint of this job is a folder of these two files.
MODEL_FILE, STATE_FILE = "model.pt", "state.json"


@dataclass
class TrainConfig:
    """Everything a run depends on; stored in metrics.json and every checkpoint."""

    name: str = "demo"
    steps: int = 100
    attention: str = "distca"          # "distca" or "local"
    mode: str = "inplace"              # distca servers: "inplace" or "dedicated"
    servers: int = 2                   # dedicated servers (in-place: one per worker)
    workers: int = 2                   # data-parallel ranks (Ray Train workers)
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
    epsilon: float = PlanConfig.epsilon
    min_shard: int = PlanConfig.min_shard
    threads: int = 1                   # torch threads per worker (workers share the machine)
    runs_dir: str = "runs"
    resume: bool = False
    save_every: int = 0                # also save a checkpoint every N steps (0: only at the end)
    log_every: int = 1
    # Where and how the workers compute (llama_device): the defaults are the CPU demo's.
    device: str = "cpu"                # "cpu", or "cuda" (the workers share the GPU: gpus_per_worker)
    dtype: str = "float32"             # "float32", or "bfloat16" (autocast; float32 weights and AdamW)
    transport: str = "torch_dist"      # the distca job's transport (JobConfig.transport)
    gpus_per_worker: float | None = None  # cuda: each worker's num_gpus (None: an equal share of one)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def job_config(self) -> JobConfig:
        """The distca job's settings (``distca_server.launch(config=...)``).

        Raises:
            ConfigError: every bad one at once (plan and job fields together).
        """
        return JobConfig.from_fields(servers=self.servers, transport=self.transport, mode=self.mode,
                                     epsilon=self.epsilon, min_shard=self.min_shard)

    @property
    def num_servers(self) -> int:
        """Attention servers of a distca run: dedicated ones, or one per worker in place."""
        return self.servers if self.mode == "dedicated" else self.workers

    def model_config(self):
        """The transformers ``LlamaConfig``: SwiGLU width about 8/3·hidden (a multiple of 32)."""
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=self.hidden, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           intermediate_size=32 * round(8 / 3 * self.hidden / 32),
                           max_position_embeddings=self.context, tie_word_embeddings=False)

    def validate(self) -> None:
        """Refuse a bad setting, every one at once, before anything starts (Ray, the run folder).

        Raises:
            ValueError: ``"train config: ..."`` naming each bad value, the distca job's settings
                (:meth:`job_config`: mode, servers, epsilon, min_shard) in JobConfig's words.
        """
        problems = []
        if self.attention not in ("distca", "local"):
            problems.append(f"attention={self.attention!r} (distca or local)")
        for name in ("steps", "workers", "context", "threads", "log_every", "layers",
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
        # The optimizer's and the data's numbers: AdamW and the shuffle would refuse a bad one only
        # inside the Train workers, and a grad_clip <= 0 would not be refused at all (0 zeroes every
        # gradient, a negative one turns the step around).
        for name, check in (("lr", finite_positive), ("grad_clip", finite_positive),
                            ("weight_decay", finite_nonnegative), ("warmup", nonnegative_int),
                            ("seed", nonnegative_int)):
            try:
                check(name, getattr(self, name))
            except ValueError as exc:
                problems.append(str(exc))
        if (problem := source_problem(self.data)) is not None:
            problems.append(f"data={self.data!r}: {problem}")
        problems += llama_device.config_problems(self)
        try:
            self.job_config()  # as launch will check it, but before Ray starts
        except ConfigError as exc:  # the transport is named above, with the device it must carry
            problems += [p for p in exc.problems if not p.startswith("transport ")]
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


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on the norms' gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then constant: a function of the step alone, so a
    resumed run continues on exactly the schedule it left."""
    return cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup))


def read_state(checkpoint_dir: str | Path) -> dict:
    """A checkpoint's ``state.json``: ``step`` (the next step to run), ``config``, ``steps`` (the
    metrics of every step so far), ``session_starts`` (the first step of each session that ran
    them: 0, then where each ``--resume`` continued; absent from checkpoints of older versions)."""
    return json.loads((Path(checkpoint_dir) / STATE_FILE).read_text())


def _report(step: int, cfg: TrainConfig, history: list[dict], session_starts: list[int], model, opt, *,
            rank: int) -> None:
    """``ray.train.report`` with a checkpoint of rank 0's replica (every replica holds the same);
    every rank calls it, as Ray Train requires."""
    from ray import train
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, Path(tmp) / MODEL_FILE)
            (Path(tmp) / STATE_FILE).write_text(json.dumps({"step": step, "config": asdict(cfg), "steps": history,
                                                            "session_starts": session_starts}))
            checkpoint = train.Checkpoint.from_directory(tmp)
        train.report({"step": step}, checkpoint=checkpoint)


def train_loop(config: dict) -> None:
    """One Ray Train worker. ``config``: ``cfg`` (a TrainConfig as a dict), ``job`` (the distca
    job's name, None for local attention) and ``progress`` (a ``ray.util.queue.Queue`` that rank 0
    feeds with ``{"start": step}`` and then one metrics record per step, or None)."""
    from ray import train
    from ray.train.torch import prepare_model
    from distca_client import DistCAClient
    from distca_client.integrations import hf

    cfg, job, progress = TrainConfig(**config["cfg"]), config["job"], config["progress"]
    torch.set_num_threads(cfg.threads)  # the workers share a small machine
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if job is not None:
        client = hf.register(DistCAClient.connect(job), ATTENTION["distca"])
    else:
        client = None
        hf.register_local(ATTENTION["local"])
    model = build_model(cfg, ATTENTION[cfg.attention]).train()
    opt = build_optimizer(model, cfg)
    start, history, session_starts = 0, [], []
    checkpoint = train.get_checkpoint()  # the run's latest, when Ray Train restores a run
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = torch.load(Path(d) / MODEL_FILE, weights_only=True, map_location="cpu")
            state = read_state(d)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        # An older checkpoint does not say where its sessions began: its steps count as one session.
        start, history, session_starts = state["step"], state["steps"], state.get("session_starts", [0])
    # Each session's first step warms up again (kernels, the transport's heap): the summary's step
    # time leaves it out (llama_report.warm_steps).
    session_starts = session_starts + [start]
    device = llama_device.worker_device(cfg)
    ddp = prepare_model(model)  # on the worker's device; DDP averages gradients during backward

    stream = PackedStream(load_corpus(cfg.data), cfg.context, cfg.seed)
    if rank == 0 and progress is not None:
        progress.put({"start": start})
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        counts0 = llama_device.round_counts(client)
        chunks = stream.batch(step, world)
        tokens, doc_lens = chunks[rank]
        batch = llama_device.to_device(collate(tokens, doc_lens), device)
        with llama_device.autocast(cfg, device):
            loss = ddp(**batch).loss  # mean over this rank's predicted bytes (float32)
        llama_device.synchronize(device)  # a GPU's phases: timed when done, not when queued
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        llama_device.synchronize(device)
        t2 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        opt.step()
        llama_device.synchronize(device)
        t3 = time.perf_counter()
        # The scheduler's plan holds every rank's documents: this rank's are at its Train rank.
        plan_ok = client is None or client.last_plan.doc_lens_per_rank[rank] == doc_lens
        counts1 = llama_device.round_counts(client)
        mine = torch.tensor([loss.item(), t1 - t0, t2 - t1, t3 - t2, float(plan_ok)], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        torch.distributed.all_gather(gathered, mine)
        if rank == 0:
            ranks = torch.stack(gathered).tolist()
            record = step_record(cfg, step, job, [c[1] for c in chunks], ranks, grad_norm.item(),
                                 time.perf_counter() - t0)
            record["transport_used"] = llama_device.transport_used(client)  # rank 0's
            record.update(llama_device.run_facts(device))  # rank 0's kernel and NVSHMEM status
            record["rounds"], record["header_rounds"] = _round_deltas(counts0, counts1)  # rank 0's
            history.append(record)
            if progress is not None:
                progress.put(record)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            _report(step + 1, cfg, history, session_starts, model, opt, rank=rank)
    _report(cfg.steps, cfg, history, session_starts, model, opt, rank=rank)
    if client is not None:
        client.close()


def _round_deltas(before, after) -> tuple[int | None, int | None]:
    """This step's ``(rounds, header rounds)`` from :func:`llama_device.round_counts` before and
    after it (a group formed during the step counts from zero); None without distca."""
    if after is None:
        return None, None
    if before is None or after[0] < before[0]:  # a new group epoch counts again from zero
        before = (0, 0)
    return after[0] - before[0], after[1] - before[1]


def step_record(cfg: TrainConfig, step: int, job: str | None, lens: list[list[int]],
                ranks: list[list[float]], grad_norm: float, step_time: float) -> dict:
    """One step's metrics. ``lens``: every rank's document lengths; ``ranks``: per rank
    ``[loss, forward_s, backward_s, optimizer_s, plan_ok]``; with distca the scheduler's record
    of the step's plan (``status(job)["last"]``: the next step cannot be planned before this
    rank asks for it, so it is this step's)."""
    from scheduler import CostModel
    cost = CostModel(cfg.heads, cfg.kv_heads, cfg.head_dim, dtype_bytes=4)
    before = rank_flops(cost, lens)
    losses = [r[0] for r in ranks]
    record = {"step": step, "loss": float(np.mean(losses)), "rank_losses": losses,
              "plans_match_ranks": all(r[4] == 1.0 for r in ranks),
              "step_time_s": step_time, "lr": learning_rate(cfg, step), "grad_norm": grad_norm,
              "documents": sum(len(x) for x in lens), "longest": max(max(x) for x in lens),
              "rank_flops": before, "imbalance_before": imbalance(before)}
    for i, phase in enumerate(("forward_s", "backward_s", "optimizer_s"), 1):
        record[phase] = max(r[i] for r in ranks)  # the slowest rank sets the pace
    if job is not None:
        from distca_server import status
        last = status(job)["last"]
        record.update(imbalance_before=last["imbalance_before"], imbalance_after=last["imbalance_after"],
                      bytes=int((last["bytes"]["forward"] + last["bytes"]["backward"]) * cfg.layers),
                      server_flops=[last["server_flops"][k] for k in sorted(last["server_flops"])],
                      plan_ms=last["plan_ms"], num_tasks=last["num_tasks"])
    else:  # each rank runs its own attention: nothing is balanced, nothing moves
        record.update(imbalance_after=record["imbalance_before"], bytes=0, server_flops=before)
    return record
