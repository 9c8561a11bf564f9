"""Captured rounds (distca_server/runtime/graphed.py, JobConfig.cuda_graphs).

On the CPU: a client with ``cuda_graphs`` on the CPU runs its rounds eagerly and exactly;
``RoundGraphs``' bookkeeping (warm-up rounds, the capture, retrying a capture whose routes are not
installed yet, turning graphs off when a capture fails, the least recently used capture going
when the graph words run out, a capture that can no longer replay being made again) with a
recording stand-in for the CUDA capture. The ``gpu`` test runs forward and backward rounds of
several layers and two steps from CUDA graphs against the eager client and the float64
reference.
"""

from __future__ import annotations


import pytest
import torch

import distca_server.runtime.graphed as graphed
from distca_client import DistCAClient
from distca_server.refs import attend_with_grads_ref
from distca_server.runtime.graphed import WARMUP_ROUNDS, RoundGraphs
from distca_server.transport.symmetric_words import GRAPH_BLOCKS
from scheduler.config import JobConfig, PlanConfig
from scheduler.cost import RoundKind
from gpu_subprocess import run_fresh



def stateless_job(servers: int, **kw) -> JobConfig:
    return JobConfig(servers=servers, transport="shm", cuda_graphs=True,
                     plan=PlanConfig(mode="inplace", keep_activations=False, min_shard=32), **kw)


def layers(client, lens, steps: int, n_layers: int, device, dtype=torch.float32, seed: int = 0):
    """Forward and backward of ``n_layers`` attention layers per step; every output and gradient."""
    g = torch.Generator().manual_seed(seed)
    T, got = sum(lens), []
    for step in range(steps):
        for _ in range(n_layers):
            q, k, v = (torch.randn(T, h, 16, generator=g).to(device, dtype).requires_grad_() for h in (4, 2, 2))
            dout = torch.randn(T, 4, 16, generator=g).to(device, dtype)
            out = client.attend(q, k, v, lens)
            out.backward(dout)
            got.append((q, k, v, dout, out.detach(), q.grad, k.grad, v.grad))
        client.new_step()
    return got


def test_cuda_graphs_on_the_cpu_run_the_rounds_eagerly_and_exactly():
    lens = [37, 1, 90, 128, 5]
    client = DistCAClient.local(config=stateless_job(2))
    try:
        got = layers(client, lens, steps=2, n_layers=3, device="cpu", dtype=torch.float64)
        assert client._runtime.graphs.replays == 0
    finally:
        client.close()
    for q, k, v, dout, out, dq, dk, dv in got:
        ref = attend_with_grads_ref(q, k, v, lens, dout, 16 ** -0.5)
        for a, b in zip((out, dq, dk, dv), ref):
            torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-9)


class FakeCapture:
    """Stands in for CapturedRound: records what it was made with and each replay."""
    made: list = []
    fail: BaseException | None = None

    def __init__(self, participants, transports, kind, scale, inputs, outputs):
        if FakeCapture.fail is not None:
            raise FakeCapture.fail
        self.args, self.replays, self.ok = (participants, transports, kind, scale), [], True
        FakeCapture.made.append(self)

    def usable(self):
        return self.ok

    def release(self):
        self.released = True

    def replay(self, inputs, outputs, streams):
        self.replays.append((inputs, outputs, len(streams)))


@pytest.fixture
def fake(monkeypatch):
    FakeCapture.made, FakeCapture.fail = [], None
    monkeypatch.setattr(graphed, "CapturedRound", FakeCapture)
    return FakeCapture


def run(graphs, key, kind=RoundKind.FORWARD, scale=0.25, n=2):
    return graphs.run(key, ["p"] * n, ["t"] * n, kind, scale, [("in",)] * n, [("out",)] * n, ["s"] * n)


def test_a_round_is_captured_after_its_warm_up_and_replayed_from_then_on(fake):
    g = RoundGraphs()
    assert [run(g, "shape") for _ in range(WARMUP_ROUNDS)] == [False] * WARMUP_ROUNDS and not fake.made
    assert run(g, "shape") and run(g, "shape")
    (cap,) = fake.made
    assert cap.args == (["p", "p"], ["t", "t"], RoundKind.FORWARD, 0.25) and len(cap.replays) == 2
    assert cap.replays[0] == ([("in",)] * 2, [("out",)] * 2, 2)  # each participant's rows and stream
    assert g.replays == 2
    # another kind or scale is another round: its own warm-up
    assert not run(g, "shape", kind=RoundKind.BACKWARD) and not run(g, "shape", scale=0.5)
    g.clear()  # the group went: everything starts over
    assert not run(g, "shape")


def test_a_capture_whose_routes_are_not_installed_waits_one_more_round(fake):
    g = RoundGraphs()
    for _ in range(WARMUP_ROUNDS):
        run(g, "s")
    fake.fail = ValueError("route not installed")
    assert not run(g, "s")
    fake.fail = None
    assert not run(g, "s") and run(g, "s") and len(fake.made) == 1


def test_a_failed_capture_turns_graphs_off_with_a_warning(fake):
    g = RoundGraphs()
    for _ in range(WARMUP_ROUNDS):
        run(g, "s")
    fake.fail = RuntimeError("operation not permitted when stream is capturing")
    with pytest.warns(RuntimeWarning, match="without CUDA graphs.*not permitted"):
        assert not run(g, "s")
    fake.fail = None
    assert not any(run(g, "s") for _ in range(3)) and "not permitted" in g.disabled


def test_captures_beyond_the_graph_words_go_least_recently_used_first_and_unusable_ones_are_made_again(fake):
    g = RoundGraphs()
    keys = [f"shape{i}" for i in range(GRAPH_BLOCKS + 1)]
    for key in keys:
        for _ in range(WARMUP_ROUNDS + 1):
            run(g, key)
    assert len(fake.made) == GRAPH_BLOCKS + 1
    first = fake.made[0]
    assert getattr(first, "released", False) and not any(getattr(c, "released", False) for c in fake.made[1:])
    assert run(g, keys[-1]) and len(fake.made) == GRAPH_BLOCKS + 1  # kept
    assert run(g, keys[1]) and len(fake.made) == GRAPH_BLOCKS + 1  # kept, now the most recently used
    assert run(g, keys[0]) and fake.made[-1] is not first  # its warm-up is done: captured again at once,
    assert fake.made[2].released  # taking the words of the least recently used (keys[2])
    fake.made[-1].ok = False  # e.g. the buffers grew: made again at once
    assert run(g, keys[0]) and len(fake.made) == GRAPH_BLOCKS + 3


def _gpu_layers() -> None:
    """2 and 3 in-place participants on CUDA, bf16 and float32: graphed rounds equal the eager ones
    bit for bit (the same kernels on the same rows) and the float64 reference to dtype rounding."""
    lens = [300, 1, 77, 512, 129, 31]
    for servers in (2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            outs = []
            for graphs in (False, True):
                job = JobConfig(servers=servers, transport="nvshmem", cuda_graphs=graphs, heap_bytes=64 << 20,
                                plan=PlanConfig(mode="inplace", keep_activations=False, min_shard=64))
                client = DistCAClient.local(config=job)
                try:
                    outs.append(layers(client, lens, steps=2, n_layers=4, device="cuda", dtype=dtype, seed=servers))
                    if graphs:
                        g = client._runtime.graphs
                        assert g.disabled is None, g.disabled
                        assert g.replays >= 2 * (2 * 4 - WARMUP_ROUNDS), g.replays
                finally:
                    client.close()
            for eager, replayed in zip(*outs):
                for a, b in zip(eager[4:], replayed[4:]):
                    assert torch.equal(a, b), (servers, dtype)
            q, k, v, dout, out, dq, dk, dv = outs[1][-1]
            ref = attend_with_grads_ref(q, k, v, lens, dout, 16 ** -0.5)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            for a, b in zip((out, dq, dk, dv), ref):
                torch.testing.assert_close(a.double().cpu(), b, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_graphed_rounds_on_the_gpu_equal_the_eager_ones():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run_fresh("test_graphed_rounds", "_gpu_layers", 300, "graphed rounds")


def test_cuda_graphs_with_a_kept_activation_plan_warn_that_rounds_run_eagerly():
    job = JobConfig(servers=2, transport="shm", cuda_graphs=True, plan=PlanConfig(mode="inplace"))
    with pytest.warns(RuntimeWarning, match="stateless plans only.*keep_activations=False"):
        client = DistCAClient.local(config=job)
    client.close()
