"""Client and server memory of one real training step, with and without kept activations.

A Hugging Face ``LlamaForCausalLM`` (random init, ``--layers`` layers, hidden ``--hidden``, GQA
``--heads``/``--kv-heads``, float32) runs one packed batch of ``--tokens`` tokens (documents of
random lengths, ``position_ids`` restarting per document) through ``DistCAClient.local`` with
``attn_implementation="distca"``, forward then backward.

Measured after the forward, before the backward (the step's peak of activation memory):
- ``client saved``: bytes of the distinct tensor storages autograd saved for the backward, the
  whole model's (``torch.autograd.graph.saved_tensors_hooks``): what the training process keeps
  for its own layers plus, when stateless, each attention layer's Q, K, V, O and LSE;
- ``servers held``: bytes the attention servers keep (``PlannedBatch.held_bytes``), and what the
  plan says they hold (``layers x sum(Plan.held_bytes())``);
- ``bwd bytes``: bytes the backward rounds moved (``DistCAClient.traffic()``).
Both modes (in-place: the servers are the client ranks; dedicated: separate servers), checked
equal in loss and gradients: the kept step's loss and every gradient element within
:data:`FLOAT32_RTOL` of the stateless step's, relative to the stateless loss and to its largest
gradient element (the run fails otherwise, naming both differences).

Usage::

    python bench/kept_memory.py            # 4 servers, 16K tokens, 4 layers
Writes JSON to ``--json`` (default ``bench/results/kept_memory.json``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.report import finish  # noqa: E402
from distca_client import DistCAClient  # noqa: E402
from scheduler.config import PlanConfig  # noqa: E402

MIB = 2 ** 20
# Kept and stateless steps run the same kernels on the same rows, so they agree exactly (0.0 in
# practice); 1e-5 is the project's float32 agreement tolerance (examples/llama_report.AGREE_RTOL,
# bench/pingpong.py), the margin for one rounding of a different summation order.
FLOAT32_RTOL = 1e-5


def _model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      intermediate_size=(8 * args.hidden // 3 + 31) // 32 * 32,
                      max_position_embeddings=args.tokens)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="distca", dtype=torch.float32)


def _batch(tokens: int, seed: int):
    rng = random.Random(seed)
    lens = []
    while sum(lens) < tokens:
        lens.append(min(tokens - sum(lens), rng.choice([rng.randint(1, 300), rng.randint(300, 6000)])))
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    return ids, pos, lens


def one_step(args, mode: str, keep: bool) -> dict:
    from distca_client.integrations import hf
    client = DistCAClient.local(args.servers, num_ranks=args.servers,
                                config=PlanConfig(mode=mode, keep_activations=keep))
    hf.register(client)
    model = _model(args)
    ids, pos, lens = _batch(args.tokens, 1)
    storages: dict = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
    batch = client.last_step
    held, planned = batch.held_bytes(), args.layers * sum(batch.plan.held_bytes())
    loss.backward()
    seconds = time.perf_counter() - t0
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    row = {"mode": mode, "keep_activations": keep, "client_saved_bytes": sum(storages.values()),
           "servers_held_bytes": held, "plan_held_bytes": planned, "held_after_backward": batch.held_bytes(),
           "backward_bytes": sum(client.traffic().get("backward", {}).values()),
           "loss": loss.item(), "seconds": seconds, "docs": len(lens)}
    client.close()
    return row, grads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "kept_memory.json")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for mode in ("inplace", "dedicated"):
        (off, g_off), (on, g_on) = one_step(args, mode, False), one_step(args, mode, True)
        on["grad_max_diff"] = (g_on - g_off).abs().max().item()
        on["loss_diff"] = abs(on["loss"] - off["loss"])
        grad_tol, loss_tol = FLOAT32_RTOL * g_off.abs().max().item(), FLOAT32_RTOL * abs(off["loss"])
        on["grad_tol"], on["loss_tol"] = grad_tol, loss_tol
        if not (on["grad_max_diff"] <= grad_tol and on["loss_diff"] <= loss_tol):
            raise AssertionError(f"{mode}: kept and stateless steps differ: gradients by up to "
                                 f"{on['grad_max_diff']:.3e} (tolerance {grad_tol:.3e} = {FLOAT32_RTOL:g} x "
                                 f"the largest gradient), loss by {on['loss_diff']:.3e} (tolerance "
                                 f"{loss_tol:.3e} = {FLOAT32_RTOL:g} x {off['loss']:.6f})")
        if not (on["held_after_backward"] == 0 and on["servers_held_bytes"] == on["plan_held_bytes"]):
            raise AssertionError(f"{mode}: servers held {on['servers_held_bytes']} B, the plan says "
                                 f"{on['plan_held_bytes']} B; {on['held_after_backward']} B left after backward")
        rows += [off, on]

    def show():
        head = ("mode", "kept", "client saved MiB", "servers held MiB", "plan held MiB", "bwd MiB",
                "loss", "step s")
        print(" | ".join(head))
        print(" | ".join("---" for _ in head))
        for r in rows:
            print(" | ".join([r["mode"], "yes" if r["keep_activations"] else "no",
                              f"{r['client_saved_bytes'] / MIB:.1f}", f"{r['servers_held_bytes'] / MIB:.1f}",
                              f"{r['plan_held_bytes'] / MIB:.1f}", f"{r['backward_bytes'] / MIB:.1f}",
                              f"{r['loss']:.6f}", f"{r['seconds']:.2f}"]))
    saved = {(r["mode"], r["keep_activations"]): r["client_saved_bytes"] for r in rows}
    headline = [f"{m}: client saves {saved[(m, True)] / MIB:.1f} MiB with kept activations vs "
                f"{saved[(m, False)] / MIB:.1f} MiB stateless "
                f"({1 - saved[(m, True)] / saved[(m, False)]:.0%} less); gradients differ by "
                f"{next(r['grad_max_diff'] for r in rows if r['mode'] == m and r['keep_activations']):.1e}"
                for m in ("inplace", "dedicated")]
    finish(show, headline, time.perf_counter() - start, args.json, {"args": vars(args) | {"json": str(args.json)},
                                                                   "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
