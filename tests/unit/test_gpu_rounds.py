"""Rounds on a CUDA device (skipped without one): ``DistCAClient.local`` with several participants
in lock step on one GPU equals the reference, and rounds are ordered against the caller's streams
(q, k, v made on a side stream behind a long kernel; a queued round's result read on another
stream), as ``distca_server.runtime.order`` promises."""

from __future__ import annotations

import pytest
import torch

from distca_client import DistCAClient
from distca_server.refs import varlen_attention_ref
from scheduler.config import JobConfig, PlanConfig

LENS = [301, 1, 77, 640, 129, 2, 900]


def _inputs(dtype, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(LENS)
    q = torch.randn(T, 8, 64, generator=g)
    k, v, dout = torch.randn(T, 2, 64, generator=g), torch.randn(T, 2, 64, generator=g), torch.randn(T, 8, 64, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _reference(q, k, v, dout):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = varlen_attention_ref(*leaves, LENS, 64 ** -0.5)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dout.double())
    return [out.detach()] + [t.grad for t in leaves]


def _close(got, want, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for g, w in zip(got, want):
        err = (g.double() - w).abs().max().item()
        assert err <= tol * max(1.0, w.abs().max().item()), err


def _client(servers, mode, backend="auto"):
    return DistCAClient.local(config=JobConfig(servers=servers, backend=backend,
                                               plan=PlanConfig(mode=mode, min_shard=64)))


@pytest.mark.gpu
@pytest.mark.parametrize("servers,mode", [(1, "inplace"), (4, "inplace"), (2, "dedicated")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_local_participants_in_lock_step_on_one_gpu_equal_the_reference(servers, mode, dtype):
    q, k, v, dout = _inputs(dtype)
    with _client(servers, mode) as client:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = client.attend(*leaves, LENS)
        out.backward(dout)
        assert client._runtime._rounds._pool is None  # every round on this thread
    _close([out.detach()] + [t.grad for t in leaves], _reference(q, k, v, dout), dtype)


def _busy(stream, n=40):
    """Queue a few ms of work on ``stream`` (so a missing wait shows as a race)."""
    with torch.cuda.stream(stream):
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(n):
            a = a @ a
            a = a / a.norm()
    return a


@pytest.mark.gpu
@pytest.mark.parametrize("synchronous", [True, False])
def test_rounds_wait_for_inputs_made_on_a_side_stream_and_results_are_ready_on_the_reading_stream(synchronous):
    q0, k0, v0, dout = _inputs(torch.float32, seed=1)
    want = _reference(q0, k0, v0, dout)
    side, reader = torch.cuda.Stream(), torch.cuda.Stream()
    with _client(3, "inplace") as client:
        for attempt in range(3):
            with torch.cuda.stream(side):
                _busy(side)
                # q, k, v come out of work queued behind the busy kernels on the side stream
                q, k, v = (t * 1.0 for t in (q0, k0, v0))
                leaves = [t.requires_grad_() for t in (q, k, v)]
                if synchronous:
                    out = client.attend(*leaves, LENS)
                else:
                    handle = client.attend_async(*leaves, LENS)
            if not synchronous:
                with torch.cuda.stream(reader):  # the result is taken, and read, on another stream
                    _busy(reader, n=10)
                    out = handle.wait()
                    got = out.detach().clone()
                reader.synchronize()
            else:
                with torch.cuda.stream(side):
                    got = out.detach().clone()
            with torch.cuda.stream(side):
                out.backward(dout)
            torch.cuda.synchronize()
            _close([got] + [t.grad for t in leaves], want, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("servers,mode", [(2, "inplace"), (4, "inplace"), (2, "dedicated")])
def test_local_participants_over_the_in_process_heap_on_one_gpu_equal_the_reference(servers, mode):
    """Issue 22 item 2(a): the one-sided protocol between in-process participants over plain device
    buffers, device-driven (stream memory operations) from the plan's second round on."""
    dtype = torch.bfloat16
    q, k, v, dout = _inputs(dtype)
    job = JobConfig(servers=servers, transport="nvshmem", heap_bytes=256 << 20,
                    plan=PlanConfig(mode=mode, min_shard=64), timeout_s=60)
    with DistCAClient.local(config=job) as client:
        for _ in range(4):  # install the routes, then run device-driven
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = client.attend(*leaves, LENS)
            out.backward(dout)
            client.new_step()
            _close([out.detach()] + [t.grad for t in leaves], _reference(q, k, v, dout), dtype)
        counts = [t.device_exchanges for t in client._runtime._group._endpoints.values()]
        assert min(counts) >= 4, counts


@pytest.mark.gpu
def test_device_driven_rounds_make_no_synchronizing_cuda_call():
    """Issue 22 item 1: once a plan's routes are installed, a forward and a backward round of
    in-process participants over the device heap queue their work without a synchronizing CUDA
    call (torch's sync debug mode names any: a device-to-host copy, an ``.item()``, a stream or
    event synchronize), so the host can run ahead of the device."""
    import warnings
    q, k, v, dout = _inputs(torch.bfloat16)
    job = JobConfig(servers=2, transport="nvshmem", heap_bytes=256 << 20,
                    plan=PlanConfig(mode="inplace", min_shard=64), timeout_s=60)
    with DistCAClient.local(config=job) as client:
        for _ in range(3):  # the buffers grow, the routes install
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            client.attend(*leaves, LENS).backward(dout)
            client.new_step()
        torch.cuda.synchronize()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = client.attend(*leaves, LENS)
                out.backward(dout)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
        assert not syncs, "\n".join(syncs)
        torch.cuda.synchronize()
        _close([out.detach()] + [t.grad for t in leaves], _reference(q, k, v, dout), torch.bfloat16)
