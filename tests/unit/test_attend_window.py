"""Sliding-window attention: ``attend(..., window=W)`` and ``varlen_attention(..., window=W)``
against the windowed float64 reference, forward and backward, over servers, modes and windows."""

from __future__ import annotations

import functools

import pytest
import torch
from test_attend import make_inputs, run

from distca_client import DistCAClient, varlen_attention
from distca_server.refs import cu_seqlens, plain_attention
from distca_server.refs import varlen_attention_ref as attention_ref
from scheduler.config import JobConfig, PlanConfig

WINDOWS = [1, 7, 128, 4096, 10**6]  # 10**6: longer than every document
DOCS = {  # odd lengths, 1-token documents, one document longer than the 4096 window
    "odd": [17, 3, 257, 1, 301, 129, 1, 511, 2],
    "long": [4211, 1, 40],
}
SETUPS = [  # (docs, hq, hkv, d, servers, mode)
    ("odd", 4, 2, 16, 1, "inplace"),
    ("odd", 4, 1, 16, 4, "inplace"),
    ("odd", 4, 2, 16, 3, "dedicated"),
    ("odd", 4, 2, 16, 8, "inplace"),
    ("long", 2, 1, 8, 5, "dedicated"),
    ("long", 2, 1, 8, 2, "inplace"),
]


def _client(servers, mode, epsilon=0.05):
    ranks = servers if mode == "inplace" else max(1, servers // 2)
    plan = PlanConfig(epsilon=epsilon, mode=mode, min_shard=16)
    return DistCAClient.local(config=JobConfig(plan=plan, servers=servers, timeout_s=60), num_ranks=ranks)


@functools.lru_cache(maxsize=None)
def _case(docs, hq, hkv, d, window):
    """float64 inputs and the windowed float64 reference's (out, dq, dk, dv), computed once."""
    lens = DOCS[docs]
    q, k, v, dout = make_inputs(lens, hq, hkv, d, torch.float64, seed=hq + window % 97)
    want = run(lambda a, b, c: attention_ref(a, b, c, lens, d ** -0.5, window), q, k, v, dout)
    return (q, k, v, dout), want


def _check(got, want, dtype):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and g.shape == w.shape
        err = (g.to(torch.float64) - w).abs().max().item()
        if dtype == torch.float64:
            assert err <= 1e-10, (name, err)
        else:  # relative to the tensor, or to the unit inputs where it vanishes (W = 1: dq == 0)
            assert err <= 1e-5 * max(w.abs().max().item(), 1.0), (name, err)


@pytest.mark.parametrize("docs,hq,hkv,d,servers,mode", SETUPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_windowed_attend_matches_windowed_reference(docs, hq, hkv, d, servers, mode, window, dtype):
    lens = DOCS[docs]
    inputs, want = _case(docs, hq, hkv, d, window)
    q, k, v, dout = (t.to(dtype) for t in inputs)  # float32: the reference is of the unrounded inputs
    with _client(servers, mode) as client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens, window=window), q, k, v, dout)
        plan = client.last_plan
        moved = client.traffic()
    _check(got, want, dtype)
    assert plan.window == window and plan.num_servers == servers
    if servers > 1:
        assert sum(1 for tasks in plan.server_tasks if tasks) > 1  # the work really was spread
    # every task takes exactly its window's keys
    for tasks in plan.server_tasks:
        for t in tasks:
            assert t.kv_start == max(0, t.q_start - window + 1) and t.kv_end == t.q_end
    comm = plan.comm_bytes()
    for kind in ("forward", "backward"):
        for name, n in comm[kind].items():
            if name != "total":
                assert moved.get(kind, {}).get(name, 0) == n, (kind, name)


def test_a_window_differs_from_full_attention():
    """Not vacuous: the reference with a short window is far from full causal attention."""
    lens = DOCS["odd"]
    q, k, v, _ = make_inputs(lens, 4, 2, 16, torch.float64, 0)
    full = attention_ref(q, k, v, lens, 0.25)
    assert (attention_ref(q, k, v, lens, 0.25, 7) - full).abs().max() > 0.1
    assert torch.equal(attention_ref(q, k, v, lens, 0.25, max(lens)), full)


@pytest.mark.parametrize("window", [1, 7, 128])
def test_windowed_bf16_error_within_twice_plain_torch(window):
    lens = DOCS["odd"]
    hq, hkv, d = 4, 2, 32
    q, k, v, dout = make_inputs(lens, hq, hkv, d, torch.bfloat16, seed=7)
    scale = d ** -0.5
    cu = cu_seqlens(lens)
    with _client(4, "inplace") as client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens, window=window), q, k, v, dout)
    plain = run(lambda a, b, c: plain_attention(a, b, c, cu, cu, scale, window)[0], q, k, v, dout)
    exact = run(lambda a, b, c: attention_ref(a, b, c, lens, scale, window),
                *(t.to(torch.float64) for t in (q, k, v, dout)))
    for name, g, p, w in zip(("out", "dq", "dk", "dv"), got, plain, exact):
        ours = (g.double() - w).abs().max().item()
        theirs = (p.double() - w).abs().max().item()
        # + 1e-5: far below bf16's rounding at unit scale (4e-3), for tensors that vanish exactly
        # (W = 1: dq == 0, which plain torch hits exactly and a float32 kernel to ~1e-6)
        assert ours <= 2 * theirs + 1e-5, (name, ours, theirs)


def test_windowed_plans_move_fewer_kv_bytes_and_are_keyed_by_window():
    lens = [1531, 40, 3, 700]
    q, k, v, dout = make_inputs(lens, 4, 2, 16, torch.float32, 1)
    with _client(4, "dedicated") as client:
        client.attend(q, k, v, lens, window=64)
        windowed = client.last_step
        client.attend(q, k, v, lens)  # another layer of the step without a window: its own plan
        full = client.last_step
        assert full is not windowed and full.plan.window is None and windowed.plan.window == 64
        client.attend(q, k, v, lens, window=64)  # a later windowed layer reuses the windowed batch
        assert client.last_step is windowed
        wb, fb = windowed.plan.comm_bytes(), full.plan.comm_bytes()
    assert wb["forward"]["k"] < fb["forward"]["k"]
    assert wb["forward"]["total"] + wb["backward"]["total"] < fb["forward"]["total"] + fb["backward"]["total"]


@pytest.mark.parametrize("window", [1, 7, 4096])
def test_varlen_attention_window(window):
    lens = DOCS["odd"]
    q, k, v, dout = make_inputs(lens, 4, 2, 16, torch.float64, 5)
    got = run(lambda a, b, c: varlen_attention(a, b, c, lens, window=window), q, k, v, dout)
    want = run(lambda a, b, c: attention_ref(a, b, c, lens, 16 ** -0.5, window), q, k, v, dout)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-10


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "7", [7]])
def test_bad_window_is_refused_before_anything_moves(window):
    lens = [3, 4]
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    with DistCAClient.local(2) as client:
        with pytest.raises(ValueError, match="window must be a positive int"):
            client.attend(q, k, v, lens, window=window)
        assert client.last_step is None
    with pytest.raises(ValueError, match="window must be a positive int"):
        varlen_attention(q, k, v, lens, window=window)


@pytest.mark.parametrize("mode,servers", [("inplace", 4), ("dedicated", 3)])
@pytest.mark.parametrize("keep", [True, False])
def test_windowed_attend_with_kept_activations(mode, servers, keep):
    """A windowed plan (no shard split on the key axis) with kept activations: the backward round
    sends only dO and runs from the server's kept rows, and still equals the float64 reference."""
    lens = DOCS["odd"]
    inputs, want = _case("odd", 4, 2, 16, 7)
    ranks = servers if mode == "inplace" else 1
    config = JobConfig(plan=PlanConfig(mode=mode, min_shard=16, keep_activations=keep), servers=servers,
                       timeout_s=60)
    with DistCAClient.local(config=config, num_ranks=ranks) as client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens, window=7), *inputs)
        plan = client.last_plan
        moved = client.traffic()
    _check(got, want, torch.float64)
    assert plan.window == 7 and plan.keep_activations is keep
    assert ("q" in moved.get("backward", {})) is not keep  # kept: no Q rows in the backward round
