"""Kept activations: servers hold each layer's Q, K, V, O and LSE rows from its forward round until
its backward round, which sends dO only. Exactness over several layers per step (forward all, then
backward in reverse order, as autograd runs it), byte counts against the transport, held memory,
release and the planner's cap."""

from __future__ import annotations

import random

import pytest
import torch

from distca_client import DistCAClient
from distca_server.errors import DistCAError
from distca_server.refs import varlen_attention_ref as attention_ref
from scheduler import CostModel, JobConfig, Plan, PlanConfig, plan_batch
from scheduler.cost import KEPT_TENSORS, MERGED_TENSORS, RoundKind

LAYERS = 3


def _lens(seed: int) -> list[int]:
    rng = random.Random(seed)
    lens = [rng.choice([1, 1, 2, rng.randint(3, 90), rng.randint(100, 700)]) for _ in range(rng.randint(1, 12))]
    return lens + [1]  # always a 1-token document


def layer_inputs(lens, hq, hkv, d, dtype, seed, layers=LAYERS):
    """``layers`` (q, k, v) triples and one dout, drawn in float64 then cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    per_layer = [[torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv)]
                 for _ in range(layers)]
    dout = torch.randn(T, hq, d, generator=g, dtype=torch.float64)
    return [[t.to(dtype) for t in layer] for layer in per_layer], dout.to(dtype)


def _stack(attend, layers, dout):
    """LAYERS chained layers: layer i+1's queries add layer i's output, so autograd runs the
    backward rounds in reverse layer order. Returns the last output and every leaf's gradient."""
    leaves = [[t.detach().clone().requires_grad_() for t in layer] for layer in layers]
    h = None
    for q, k, v in leaves:
        out = attend(q if h is None else q + 0.5 * h, k, v)
        h = out
    h.backward(dout)
    return [h.detach()] + [t.grad for layer in leaves for t in layer]


def _client(servers, mode, keep=True, **kw):
    ranks = servers if mode == "inplace" else max(1, servers // 2 + 1)
    plan = PlanConfig(mode=mode, min_shard=16, keep_activations=keep, **kw)
    return DistCAClient.local(config=JobConfig(plan=plan, servers=servers, timeout_s=30), num_ranks=ranks)


CASES = [  # (seed, hq, hkv, d, servers, mode)
    (0, 4, 1, 32, 1, "inplace"),
    (1, 8, 2, 64, 3, "inplace"),
    (2, 4, 4, 32, 8, "inplace"),
    (3, 8, 1, 32, 1, "dedicated"),
    (4, 4, 2, 64, 4, "dedicated"),
    (5, 8, 2, 32, 6, "dedicated"),
]


@pytest.mark.parametrize("seed,hq,hkv,d,servers,mode", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layers_match_float64_reference(seed, hq, hkv, d, servers, mode, dtype):
    lens = _lens(seed)
    layers, dout = layer_inputs(lens, hq, hkv, d, dtype, seed)
    scale = d ** -0.5
    with _client(servers, mode) as client:
        got = _stack(lambda q, k, v: client.attend(q, k, v, lens), layers, dout)
        assert client.last_plan.keep_activations
        assert client.last_step.held_bytes() == 0  # every layer's backward round freed its rows
    want = _stack(lambda q, k, v: attention_ref(q, k, v, lens, scale),
                  [[t.double() for t in layer] for layer in layers], dout.double())
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and g.shape == w.shape
        err = (g.double() - w).abs().max().item()
        assert err <= (1e-10 if dtype == torch.float64 else 1e-5 * max(1.0, w.abs().max().item())), (i, err)


@pytest.mark.parametrize("servers,mode", [(4, "inplace"), (3, "dedicated")])
def test_bf16_error_within_twice_plain_torch(servers, mode):
    lens = _lens(11) + [777]
    layers, dout = layer_inputs(lens, 8, 2, 64, torch.bfloat16, 11)
    scale = 64 ** -0.5
    with _client(servers, mode) as client:
        got = _stack(lambda q, k, v: client.attend(q, k, v, lens), layers, dout)
    plain = _stack(lambda q, k, v: attention_ref(q, k, v, lens, scale), layers, dout)
    exact = _stack(lambda q, k, v: attention_ref(q, k, v, lens, scale),
                   [[t.double() for t in layer] for layer in layers], dout.double())
    for i, (g, p, w) in enumerate(zip(got, plain, exact)):
        ours, theirs = (g.double() - w).abs().max().item(), (p.double() - w).abs().max().item()
        assert ours <= 2 * theirs + 1e-6, (i, ours, theirs)


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
@pytest.mark.parametrize("seed", range(3))
def test_counted_bytes_equal_bytes_moved(mode, seed):
    lens = _lens(20 + seed)
    servers = random.Random(seed).randint(2, 6)
    layers, dout = layer_inputs(lens, 4, 2, 16, torch.float32, seed)
    with _client(servers, mode) as client:
        _stack(lambda q, k, v: client.attend(q, k, v, lens), layers, dout)
        moved, plan = client.traffic(), client.last_plan
    expected = plan.comm_bytes()
    assert set(expected["backward"]) == {"dout", "out", "lse", "dq", "dk", "dv", "total"}
    assert expected["backward"]["out"] == expected["backward"]["lse"] == 0  # no split tasks
    for kind in ("forward", "backward"):
        for name, n in expected[kind].items():
            if name != "total":
                assert moved.get(kind, {}).get(name, 0) == LAYERS * n, (kind, name)
        assert sum(moved.get(kind, {}).values()) == LAYERS * expected[kind]["total"]


def test_kept_backward_moves_fewer_bytes_and_same_gradients():
    lens = [600, 3, 250, 1, 90]
    layers, dout = layer_inputs(lens, 4, 1, 32, torch.float64, 3)
    results = {}
    for keep in (True, False):
        with _client(4, "dedicated", keep=keep) as client:
            results[keep] = (_stack(lambda q, k, v: client.attend(q, k, v, lens), layers, dout),
                             client.traffic())
    for a, b in zip(results[True][0], results[False][0]):
        assert (a - b).abs().max().item() <= 1e-12
    kept, stateless = (sum(r[1]["backward"].values()) for r in (results[True], results[False]))
    assert set(results[True][1]["backward"]) == {"dout", "dq", "dk", "dv"}
    assert kept < stateless


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves while ``fn`` runs."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_client_saves_nothing_and_servers_hold_plan_bytes(mode):
    lens = [700, 5, 300, 1, 41]
    layers, _ = layer_inputs(lens, 4, 2, 32, torch.float32, 9)
    held = {}
    for keep in (True, False):
        with _client(3, mode, keep=keep) as client:
            leaves = [[t.clone().requires_grad_() for t in layer] for layer in layers]
            outs = []
            saved = _saved_bytes(lambda: outs.extend(client.attend(*layer, lens) for layer in leaves))
            held[keep] = (saved, client.last_step.held_bytes(), client.last_plan)
            sum(o.sum() for o in outs).backward()
            assert client.last_step.held_bytes() == 0
    saved_kept, server_kept, plan = held[True]
    saved_stateless, server_stateless, _ = held[False]
    ROUND = 8  # the int64 tensor that owns a round's state (distca_client.autograd.Round), one per layer
    assert saved_kept == LAYERS * ROUND and server_stateless == 0
    T = sum(lens)
    assert saved_stateless == LAYERS * (ROUND + T * (2 * 4 * 32 * 4 + 4 * 4 + 2 * 2 * 32 * 4))  # q, out, lse, k, v
    assert server_kept == LAYERS * sum(plan.held_bytes())


def test_forward_without_grad_keeps_nothing():
    lens = [300, 20]
    layers, _ = layer_inputs(lens, 4, 1, 16, torch.float32, 2)
    with _client(2, "inplace") as client:
        with torch.no_grad():
            client.attend(*layers[0], lens)
        assert client.last_step.held_bytes() == 0
        client.attend(*layers[1], lens)  # no input requires grad: nothing will come back
        assert client.last_step.held_bytes() == 0


def test_new_step_releases_kept_activations():
    lens = [300, 20, 1]
    layers, _ = layer_inputs(lens, 4, 1, 16, torch.float32, 4)
    with _client(3, "dedicated") as client:
        leaves = [t.clone().requires_grad_() for t in layers[0]]
        out = client.attend(*leaves, lens)
        batch = client.last_step
        assert batch.held_bytes() == sum(client.last_plan.held_bytes()) > 0
        client.new_step()
        assert batch.held_bytes() == 0
        with pytest.raises(DistCAError, match="step"):
            out.sum().backward()


def test_inplace_change_of_a_kept_tensor_is_refused():
    lens = [200]
    layers, _ = layer_inputs(lens, 2, 1, 16, torch.float32, 5)
    with _client(1, "inplace") as client:  # one server: it keeps the client's own tensors
        q, k, v = (t.clone().requires_grad_() for t in layers[0])
        out = client.attend(q * 1, k * 1, v * 1, lens)
        out.sum().backward()  # fine
        qq = q * 1
        out = client.attend(qq, k * 1, v * 1, lens)
        with torch.no_grad():
            qq.add_(1.0)
        with pytest.raises(RuntimeError, match="inplace"):
            out.sum().backward()


# ---- cost model and plan --------------------------------------------------------------------------
COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)


def test_round_tensors_with_kept_activations():
    assert RoundKind.BACKWARD.dispatch_with(True) == ("dout",)
    assert RoundKind.BACKWARD.dispatch_with(False) == RoundKind.BACKWARD.dispatch
    assert RoundKind.FORWARD.dispatch_with(True) == RoundKind.FORWARD.dispatch == ("q", "k", "v")
    assert RoundKind.BACKWARD.split_dispatch_with(True) == MERGED_TENSORS == ("out", "lse")
    assert RoundKind.BACKWARD.split_dispatch_with(False) == RoundKind.FORWARD.split_dispatch_with(True) == ()
    assert RoundKind.BACKWARD.tensors_with(True) == ("dout", "out", "lse", "dq", "dk", "dv")
    assert COST.merged_row_bytes() == COST.bytes_per_token("out") + COST.bytes_per_token("lse")
    q, kv = COST.step_row_bytes(False)
    qk, kvk = COST.step_row_bytes(True)
    hq, hkv = COST.held_row_bytes()
    assert (q - qk, kv - kvk) == (hq, hkv)  # what stays on the server is what no longer travels
    assert hq == sum(COST.bytes_per_token(n) for n in KEPT_TENSORS if n not in ("k", "v"))
    assert hkv == 2 * COST.bytes_per_token("k")


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_plan_flag_bytes_summary_and_round_trip(mode):
    lens = [[4096, 100, 7], [9000], [300] * 9, [1]]
    kept = plan_batch(lens, 4, cost=COST, mode=mode)
    stateless = plan_batch(lens, 4, cost=COST, mode=mode, keep_activations=False)
    assert kept.keep_activations and not stateless.keep_activations
    a, b = kept.comm_bytes()["backward"], stateless.comm_bytes()["backward"]
    assert set(a) == {"dout", "out", "lse", "dq", "dk", "dv", "total"} and "q" in b
    assert a["out"] == a["lse"] == 0 and kept.owner_held_bytes() == [0] * 4  # no split tasks
    assert kept.comm_bytes()["forward"]["total"] + a["total"] < (
        stateless.comm_bytes()["forward"]["total"] + b["total"])
    held = kept.held_bytes()
    assert stateless.held_bytes() == [0] * 4 and min(held) >= 0
    hq, hkv = COST.held_row_bytes()
    assert sum(held) >= sum(map(sum, lens)) * (hq + hkv)  # every token held once, KV maybe more
    assert "held per layer" in kept.summary() and "held per layer" not in stateless.summary()
    assert Plan.from_msgpack(kept.to_msgpack()) == kept
    assert Plan.from_msgpack(kept.to_msgpack()) != Plan.from_msgpack(stateless.to_msgpack()) or \
        kept.task_array.shape != stateless.task_array.shape


def test_held_bytes_cap():
    rng = random.Random(3)
    lens = [[rng.choice([64, 300, 2000, 9000]) for _ in range(rng.randint(2, 9))] for _ in range(6)]
    free = plan_batch(lens, 5, cost=COST, mode="dedicated")
    cap = int(0.97 * max(free.held_bytes()))
    capped = plan_batch(lens, 5, cost=COST, mode="dedicated", max_held_bytes_per_server=cap)
    assert max(capped.held_bytes()) <= cap
    with pytest.raises(ValueError, match="infeasible"):
        plan_batch(lens, 5, cost=COST, mode="dedicated", max_held_bytes_per_server=1000)
    with pytest.raises(ValueError, match="keep_activations"):
        plan_batch(lens, 5, cost=COST, mode="dedicated", keep_activations=False, max_held_bytes_per_server=cap)
    with pytest.raises(ValueError, match="max_held_bytes_per_server"):
        plan_batch(lens, 5, cost=COST, mode="dedicated", max_held_bytes_per_server=0)
    with pytest.raises(ValueError, match="keep_activations"):
        plan_batch(lens, 5, cost=COST, mode="dedicated", keep_activations=1)


@pytest.mark.parametrize("servers,tokens", [(16, 16384), (32, 32768)])
def test_capped_plans_stay_balanced(servers, tokens):
    """Under a cap of 1.5x the mean held bytes the plan still reaches 1 + eps (dedicated, Pretrain
    trace: a few long documents, many short ones). Plain LPT filled the servers the long documents
    left idle with short ones up to the cap, and the long ones' bands then found no server with
    both FLOP and memory room (max/mean 1.9-2.1)."""
    from distca_sim.workloads import sample_batch
    cost = CostModel(32, 8, 128, dtype_bytes=2)
    batch = sample_batch("pretrain", servers, tokens, seed=0, step=0)
    free = plan_batch(batch, servers, cost=cost, mode="dedicated")
    mean = sum(free.held_bytes()) / servers
    assert max(free.held_bytes()) > 2 * mean  # the batch needs the cap
    capped = plan_batch(batch, servers, cost=cost, mode="dedicated", max_held_bytes_per_server=int(1.5 * mean))
    assert max(capped.held_bytes()) <= 1.5 * mean
    assert capped.imbalance()[1] <= 1.05 + 1e-9


def test_local_client_passes_the_cap():
    lens = [700, 5, 300, 1, 41]
    layers, _ = layer_inputs(lens, 4, 2, 32, torch.float32, 9)
    with pytest.raises(ValueError, match="max_held_bytes_per_server"):
        DistCAClient.local(2, config=PlanConfig(keep_activations=False, max_held_bytes_per_server=10))
    with _client(3, "dedicated", max_held_bytes_per_server=10) as client:
        with pytest.raises(ValueError, match="infeasible"):
            client.attend(*layers[0], lens)
