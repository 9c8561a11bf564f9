"""A plan's rounds between processes over a real transport, against the float64 reference.

Each participant of a plan (in-place: one per rank; dedicated: clients and servers) is its own
process (``torch.multiprocessing``, spawn), joins the group with :func:`join_epoch` (the epoch's
bootstrap value handed over through a queue, as the scheduler hands it over in a job) and runs
forward + backward rounds through :class:`~distca_server.participant.Participant`, the code the
runtimes call. ``shm`` runs here (CPU tensors); ``nvshmem`` on the GPU machine (CUDA tensors, PEs
sharing the GPU; ``pytest -m nvshmem``).

Checks: float64 rounds with the reference backend equal the float64 reference to 1e-10 (outputs
and all three gradients); low-precision rounds with the device's fast backend (bf16 on CUDA, float32
on CPU) stay within 2x the error plain torch makes in that precision (plus a small floor).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.multiprocessing as mp

from distca_server.refs import attend_with_grads_ref, cu_seqlens, plain_attention, relative_error

TIMEOUT_S = 60.0
# (mode, servers, clients, seed): in-place plans have one participant per rank; dedicated plans
# add the servers as participants of their own.
PLANS = {2: ("inplace", 2, 2, 1), 3: ("dedicated", 1, 2, 2), 4: ("inplace", 4, 4, 3)}


def _batch(seed: int, ranks: int) -> list[list[int]]:
    """Odd lengths, 1-token documents, one rank without documents when there are several."""
    rng = random.Random(seed)
    batch = [[rng.choice([1, 3, rng.randint(5, 90), rng.randint(90, 400)]) for _ in range(rng.randint(1, 4))]
             for _ in range(ranks)]
    if ranks > 2:
        batch[rng.randrange(ranks)] = []
    return batch


def _plan(P: int, keep: bool):
    from scheduler import CostModel, plan_batch
    mode, servers, clients, seed = PLANS[P]
    cost = CostModel(8, 2, 64, 8)
    batch = _batch(seed, clients)
    return plan_batch(batch, servers, cost=cost, epsilon=0.0, mode=mode, min_shard=16,
                      keep_activations=keep), batch, cost


def _inputs(batch, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(sum(lens), h, 64, generator=g, dtype=torch.float64) for h in (8, 2, 2, 8)]
            for lens in batch]


def _rounds(participant, transport, inputs, device, dtype, scale, keep):
    """Forward then backward; returns (out, dq, dk, dv) on the CPU (None for a pure server)."""
    p = participant
    if p.rank is None:
        p.forward(transport, None, None, None, scale, keep=0 if keep else None)
        if keep:
            p.backward_kept(transport, None, scale, kept=0)
        else:
            p.backward(transport, None, None, None, None, None, None, scale)
        return None
    q, k, v, dout = (t.to(device=device, dtype=dtype) for t in inputs[p.rank])
    out, lse = p.forward(transport, q, k, v, scale, keep=0 if keep else None)
    if keep:
        grads = p.backward_kept(transport, dout, scale, kept=0)
    else:
        grads = p.backward(transport, q, k, v, out, lse, dout, scale)
    return [t.detach().cpu() for t in (out, *grads)]


def _worker(rank: int, P: int, kind: str, keep: bool, boot, results, done) -> None:
    try:
        from distca_server.kernels import get_backend
        from distca_server.participant import Participant
        from distca_server.runtime.groups import join_epoch
        from distca_server.wire import RowFormat
        from scheduler import CostModel
        from scheduler.parts import plan_parts

        cuda = kind == "nvshmem"
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        plan, batch, cost = _plan(P, keep)
        part = plan_parts(plan)[rank]
        group = join_epoch(kind, job=f"attend-test-{os.getppid()}", epoch=0, rank=rank, world_size=P,
                           host="127.0.0.1", timeout_s=TIMEOUT_S, device=device,
                           publish=lambda value: [boot.put(value) for _ in range(P - 1)],
                           lookup=lambda: boot.get(timeout=TIMEOUT_S))
        inputs = _inputs(batch, seed=P)
        scale = 64 ** -0.5
        got = {}
        # float64 with the reference math, then the device's fast backend in low precision.
        low = (torch.bfloat16, "auto") if cuda else (torch.float32, "torch_cpu")
        for dtype, backend in ((torch.float64, "reference"), low):
            fmt = RowFormat(CostModel(cost.num_heads_q, cost.num_heads_kv, cost.head_dim, dtype.itemsize), dtype)
            participant = Participant(part, fmt, get_backend(backend, device), device)
            got[str(dtype)] = _rounds(participant, group.transport, inputs, device, dtype, scale, keep)
            group.settled()
        results.put((rank, part.rank, got))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put((rank, None, {"error": f"{type(exc).__name__}: {exc}"}))
    done.wait(TIMEOUT_S)
    # NVSHMEM's teardown is collective; every PE leaves at once instead, like a job's shutdown.
    os._exit(0)


def run_plan(P: int, kind: str, keep: bool) -> tuple[dict, list, list]:
    ctx = mp.get_context("spawn")  # CUDA does not survive fork
    boot, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(r, P, kind, keep, boot, results, done)) for r in range(P)]
    try:
        for p in procs:
            p.start()
        got = {}
        for _ in range(P):
            rank, client_rank, value = results.get(timeout=TIMEOUT_S * 3)
            assert "error" not in value, f"participant {rank}: {value['error']}"
            if client_rank is not None:
                got[client_rank] = value
        done.set()
        for p in procs:
            p.join(timeout=30)
        plan, batch, _ = _plan(P, keep)
        assert plan.comm_bytes()["forward"]["total"] > 0, "the plan moves no row: nothing was tested"
        return got, batch, _inputs(batch, seed=P)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _plain_errors(q, k, v, lens, dout, scale) -> list[float]:
    """Relative error of plain torch in q's dtype against the float64 reference on the same
    (rounded) inputs, per tensor (out, dq, dk, dv): the low-precision yardstick."""
    want = attend_with_grads_ref(q, k, v, lens, dout, scale)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    cu = cu_seqlens(lens)
    out, _ = plain_attention(*leaves, cu, cu, scale)
    out.backward(dout)
    return [relative_error(a, b) for a, b in zip((out.detach(), *(t.grad for t in leaves)), want)]


def check(got, batch, inputs, low_dtype) -> None:
    scale = 64 ** -0.5
    for r, lens in enumerate(batch):
        if not lens:
            assert all(t.shape[0] == 0 for t in got[r]["torch.float64"] + got[r][str(low_dtype)])
            continue
        want = attend_with_grads_ref(*inputs[r][:3], lens, inputs[r][3], scale)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got[r]["torch.float64"], want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"rank {r} {name} (float64)")
        # Low precision: against the reference on the same rounded inputs, within 2x plain torch.
        q, k, v, dout = (t.to(low_dtype) for t in inputs[r])
        want = attend_with_grads_ref(q, k, v, lens, dout, scale)
        plain = _plain_errors(q, k, v, lens, dout, scale)
        for name, a, b, e in zip(("out", "dq", "dk", "dv"), got[r][str(low_dtype)], want, plain):
            err = relative_error(a, b)
            assert err <= 2 * e + 1e-6, f"rank {r} {name} ({low_dtype}): {err:.2e} vs plain torch {e:.2e}"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("P,keep", [(2, True), (3, False)])
def test_attend_over_shm_processes_equals_the_reference(P, keep):
    got, batch, inputs = run_plan(P, "shm", keep)
    check(got, batch, inputs, torch.float32)


@pytest.mark.nvshmem
@pytest.mark.parametrize("P,keep", [(2, True), (3, False), (4, True)])
def test_attend_over_nvshmem_equals_the_reference(P, keep):
    got, batch, inputs = run_plan(P, "nvshmem", keep)
    check(got, batch, inputs, torch.bfloat16)
