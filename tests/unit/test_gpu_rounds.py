"""Rounds on a CUDA device (skipped without one): ``DistCAClient.local`` with several participants
in lock step on one GPU equals the reference, and rounds are ordered against the caller's streams
(q, k, v made on a side stream behind a long kernel; a queued round's result read on another
stream), as ``distca_server.runtime.order`` promises; over the device heap, a participant failing
mid-round leaves no wait held (its CPU run, over the host heap, runs everywhere)."""

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
    event synchronize), so the host can run ahead of the device. The participants' threads count
    (the caller waits for them), the watchdogs' do not: each reads its signal words on a thread
    and a stream of its own while exchanges are in flight, which holds up nothing the host queues."""
    import threading
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
        caught = []

        def record(message, category, filename, lineno, file=None, line=None):
            if not threading.current_thread().name.startswith("distca-watchdog"):
                caught.append((threading.current_thread().name, filename, lineno, message))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record  # restored on leaving
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = client.attend(*leaves, LENS)
                out.backward(dout)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{t}: {f}:{n}: {m}" for t, f, n, m in caught if "synchroniz" in str(m)]
        assert not syncs, "\n".join(syncs)
        torch.cuda.synchronize()
        _close([out.detach()] + [t.grad for t in leaves], _reference(q, k, v, dout), torch.bfloat16)


def _gpu_failing_participant(device: str = "cuda") -> None:
    """In-process participants over the device heap, called from the default stream: participant
    1's kernel raises in a device-driven round after its peers queued their waits for its rows and
    joined them on their streams. The round raises that error; the peers' watchdogs read their
    words on a stream of their own, see participant 1 leave and force the waits (a read or an
    abort signal queued behind the held stream would wait for itself); then the default stream
    drains and the next step, on a new group, equals the reference."""
    from unittest import mock
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, dout = _inputs(dtype, device=device)
    want = _reference(q, k, v, dout)
    job = JobConfig(servers=3, transport="nvshmem", heap_bytes=256 << 20,
                    plan=PlanConfig(mode="inplace", min_shard=64), timeout_s=20)

    def step(client):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = client.attend(*leaves, LENS)
        out.backward(dout)
        client.new_step()
        _close([out.detach()] + [t.grad for t in leaves], want, dtype)
    with DistCAClient.local(config=job) as client:
        for _ in range(3):  # the routes install: the next rounds are device-driven
            step(client)
        first = client._runtime._group
        executor = next(iter(client._runtime._bound.values()))[1].executor

        def broken(*args, **kwargs):
            raise RuntimeError("kernel failed on participant 1")
        with mock.patch.object(executor, "forward", broken):
            try:
                client.attend(*[t.clone().requires_grad_() for t in (q, k, v)], LENS)
            except RuntimeError as exc:
                assert "kernel failed on participant 1" in str(exc), exc
            else:
                raise AssertionError("the round with a failing participant did not fail")
        client.new_step()
        if device == "cuda":
            torch.cuda.current_stream().synchronize()  # returns: no wait is left held
        assert first.broken
        for _ in range(2):
            step(client)
        assert client._runtime._group is not first


def test_a_participant_failing_mid_round_over_the_in_process_heap_on_the_cpu():
    _gpu_failing_participant("cpu")  # what the gpu test below runs, on the CPU (HostStream)


@pytest.mark.gpu
def test_a_participant_failing_mid_round_on_the_gpu_ends_its_peers_waits_and_the_next_step_runs():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from gpu_subprocess import run_fresh
    run_fresh("test_gpu_rounds", "_gpu_failing_participant", 90, "the failing round and the next steps")
