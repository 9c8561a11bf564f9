"""DistCAClient.local(...).attend against single-device causal varlen attention, forward and backward."""

from __future__ import annotations

import random

import pytest
import torch

from distca_client import DistCAClient
from distca_server.refs import varlen_attention_ref as attention_ref
from scheduler.config import JobConfig, PlanConfig


def make_inputs(doc_lens, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(doc_lens)
    q, k, v = (torch.randn(total, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def run(fn, q, k, v, dout):
    """out, dq, dk, dv of ``fn(q, k, v)`` with upstream gradient ``dout``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def doc_case(name, seed=0):
    rng = random.Random(seed)
    if name == "odd":
        return [rng.choice([1, 3, 17, 129, 257, 301, 511, 777]) for _ in range(7)]
    if name == "ones":
        return [1] * 9 + [300, 1, 1]
    if name == "one_doc":
        return [1531]
    if name == "tiny_many":
        return [rng.randint(1, 5) for _ in range(230)]
    if name == "mixed":
        return [1200, 1, 64, 3, 700, 255, 2, 9]
    raise KeyError(name)


CASES = [
    # (docs, hq, hkv, d, servers, epsilon, mode)
    ("odd", 8, 1, 64, 4, 0.05, "inplace"),
    ("odd", 8, 2, 128, 3, 0.0, "dedicated"),
    ("ones", 4, 1, 64, 2, 0.2, "inplace"),
    ("one_doc", 8, 1, 64, 8, 0.05, "inplace"),
    ("one_doc", 4, 4, 64, 5, 0.0, "dedicated"),
    ("tiny_many", 4, 1, 64, 6, 0.05, "inplace"),
    ("tiny_many", 8, 2, 64, 3, 0.2, "dedicated"),
    ("mixed", 8, 1, 128, 1, 0.05, "inplace"),
    ("mixed", 8, 2, 64, 7, 0.0, "inplace"),
    ("mixed", 4, 1, 128, 8, 0.2, "dedicated"),
]


def _client(servers, epsilon, mode, backend="auto"):
    ranks = servers if mode == "inplace" else max(1, servers // 2)
    plan = PlanConfig(epsilon=epsilon, mode=mode, min_shard=16)
    return DistCAClient.local(config=JobConfig(plan=plan, servers=servers, backend=backend, timeout_s=30),
                              num_ranks=ranks)


@pytest.mark.parametrize("docs,hq,hkv,d,servers,epsilon,mode", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attend_matches_reference(docs, hq, hkv, d, servers, epsilon, mode, dtype):
    lens = doc_case(docs, seed=servers)
    q, k, v, dout = make_inputs(lens, hq, hkv, d, dtype, seed=len(lens) + servers)
    scale = d ** -0.5
    with _client(servers, epsilon, mode) as client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens), q, k, v, dout)
        plan = client.last_plan
    want = run(lambda a, b, c: attention_ref(a, b, c, lens, scale),
               *(t.to(torch.float64) for t in (q, k, v, dout)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and g.shape == w.shape
        err = (g.to(torch.float64) - w).abs().max().item()
        if dtype == torch.float64:
            assert err <= 1e-10, (name, err)
        else:
            assert err <= 1e-5 * w.abs().max().item(), (name, err)
    assert plan.num_servers == servers and plan.mode == mode


@pytest.mark.parametrize("docs,servers,mode", [("odd", 4, "inplace"), ("mixed", 3, "dedicated"),
                                               ("tiny_many", 5, "inplace")])
def test_attend_bf16_error_within_twice_plain_torch(docs, servers, mode):
    lens = doc_case(docs, seed=1)
    hq, hkv, d = 8, 2, 64
    q, k, v, dout = make_inputs(lens, hq, hkv, d, torch.bfloat16, seed=7)
    scale = d ** -0.5
    with _client(servers, 0.05, mode) as client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens), q, k, v, dout)
    plain = run(lambda a, b, c: attention_ref(a, b, c, lens, scale), q, k, v, dout)
    exact = run(lambda a, b, c: attention_ref(a, b, c, lens, scale),
                *(t.to(torch.float64) for t in (q, k, v, dout)))
    for name, g, p, w in zip(("out", "dq", "dk", "dv"), got, plain, exact):
        assert g.dtype == torch.bfloat16
        ours = (g.double() - w).abs().max().item()
        theirs = (p.double() - w).abs().max().item()
        assert ours <= 2 * theirs + 1e-6, (name, ours, theirs)


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
@pytest.mark.parametrize("seed", range(4))
def test_bytes_moved_equal_plan_comm_bytes(mode, seed):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, rng.randint(3, 60), rng.randint(100, 900)]) for _ in range(rng.randint(1, 25))]
    servers = rng.randint(1, 6)
    q, k, v, dout = make_inputs(lens, 4, 2, 16, torch.float32, seed)
    with _client(servers, rng.choice([0.0, 0.05, 0.2]), mode) as client:
        run(lambda a, b, c: client.attend(a, b, c, lens), q, k, v, dout)
        moved = client.traffic()
        expected = client.last_plan.comm_bytes()
    for kind in ("forward", "backward"):
        for name, n in expected[kind].items():
            if name != "total":
                assert moved.get(kind, {}).get(name, 0) == n, (kind, name)
        assert sum(moved.get(kind, {}).values()) == expected[kind]["total"]


def test_plan_cached_per_doc_lens_and_reused_across_layers():
    lens = [100, 3, 250]
    q, k, v, _ = make_inputs(lens, 4, 1, 32, torch.float32, 0)
    with DistCAClient.local(3, config=PlanConfig(min_shard=16)) as client:
        client.attend(q, k, v, lens)
        first = client.last_step
        client.attend(q * 2, k, v, torch.tensor(lens))  # next layer, same batch
        assert client.last_step is first
        client.attend(q, k, v, [100, 253])
        assert client.last_step is not first


def test_softmax_scale_and_empty_servers():
    lens = [5, 2]  # fewer documents than servers: some virtual ranks and servers are empty
    q, k, v, dout = make_inputs(lens, 2, 1, 8, torch.float64, 3)
    with DistCAClient.local(6, config=PlanConfig(epsilon=0.0)) as client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens, softmax_scale=0.3), q, k, v, dout)
    want = run(lambda a, b, c: attention_ref(a, b, c, lens, 0.3), q, k, v, dout)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-12


def _bad_inputs():
    lens = [3, 4]
    q = torch.randn(7, 4, 8)
    k = torch.randn(7, 2, 8)
    v = torch.randn(7, 2, 8)
    yield "total_tokens", (q, k, v, [3, 3]), {}
    yield "positive", (q, k, v, [0, 7]), {}
    yield "positive", (q, k, v, [-1, 8]), {}
    yield "ints", (q, k, v, [3.0, 4]), {}
    yield "k and v shapes differ", (q, k, torch.randn(7, 1, 8), lens), {}
    yield r"value head_dim other than the key's.*not supported", (q, k, torch.randn(7, 2, 4), lens), {}
    yield "disagree", (q, torch.randn(6, 2, 8), torch.randn(6, 2, 8), lens), {}
    yield "multiple of num_heads_kv", (q, torch.randn(7, 3, 8), torch.randn(7, 3, 8), lens), {}
    yield "mixed dtypes", (q, k.double(), v, lens), {}
    yield "head_dim", (torch.randn(7, 4), k, v, lens), {}
    yield "finite", (q, k, v, lens), {"softmax_scale": float("nan")}
    yield "finite", (q, k, v, lens), {"softmax_scale": float("inf")}
    yield "1-D integer", (q, k, v, torch.tensor([3.0, 4.0])), {}
    yield "not supported", (q.int(), k.int(), v.int(), lens), {}
    yield r"q must be a dense \(strided\) tensor, got layout torch.sparse_coo", (q.to_sparse(), k, v, lens), {}
    yield r"q, k, v are on meta, where the job's attention backend 'auto' cannot run", \
        tuple(t.to("meta") for t in (q, k, v)) + (lens,), {}


@pytest.mark.parametrize("fragment,args,kwargs", list(_bad_inputs()))
def test_attend_rejects_bad_input(fragment, args, kwargs):
    with DistCAClient.local(2) as client:
        with pytest.raises(ValueError, match=fragment):
            client.attend(*args, **kwargs)
        assert client.last_step is None  # nothing was planned or sent


@pytest.mark.parametrize("make,fragment", [
    (lambda: DistCAClient.local(0), "num_servers"),
    (lambda: DistCAClient.local(2, config=PlanConfig(mode="sideways")), "mode"),
    (lambda: DistCAClient.local(2, num_ranks=3), "num_ranks"),
    (lambda: DistCAClient.local(config=JobConfig(plan=PlanConfig(), servers=2, backend="cuda_magic")),
     "backend"),
    (lambda: DistCAClient.local(2, config=PlanConfig(epsilon=-0.1)), "epsilon"),
    (lambda: DistCAClient.local(config=JobConfig(plan=PlanConfig(), servers=2, timeout_s=0)), "timeout_s"),
])
def test_local_rejects_bad_arguments(make, fragment):
    with pytest.raises(ValueError, match=fragment):
        make()


def test_varlen_attention_matches_reference_and_attend():
    from distca_client import varlen_attention
    lens = doc_case("mixed")
    q, k, v, dout = make_inputs(lens, 8, 2, 32, torch.float64, 5)
    got = run(lambda a, b, c: varlen_attention(a, b, c, lens), q, k, v, dout)
    want = run(lambda a, b, c: attention_ref(a, b, c, lens, 32 ** -0.5), q, k, v, dout)
    with DistCAClient.local(3, config=PlanConfig(min_shard=16)) as client:
        served = run(lambda a, b, c: client.attend(a, b, c, lens), q, k, v, dout)
    for g, w, s in zip(got, want, served):
        assert (g - w).abs().max().item() <= 1e-10 and (s - g).abs().max().item() <= 1e-10
    with pytest.raises(ValueError, match="total_tokens"):
        varlen_attention(q, k, v, [1, 2])


def test_attend_async_handles_wait_in_any_order():
    lens_a, lens_b = [300, 7], [5, 250, 1]
    qa, ka, va, da = make_inputs(lens_a, 4, 1, 16, torch.float64, 1)
    qb, kb, vb, db = make_inputs(lens_b, 4, 1, 16, torch.float64, 2)
    with DistCAClient.local(2, config=PlanConfig(min_shard=16)) as client:
        leaves_a = [t.clone().requires_grad_() for t in (qa, ka, va)]
        leaves_b = [t.clone().requires_grad_() for t in (qb, kb, vb)]
        ha = client.attend_async(*leaves_a, lens_a)
        hb = client.attend_async(*leaves_b, lens_b)
        out_b, out_a = hb.wait(), ha.wait()
        assert ha.done() and hb.done()
        ((out_a * da).sum() + (out_b * db).sum()).backward()
    for leaves, (q, k, v, d), lens, out in ((leaves_a, (qa, ka, va, da), lens_a, out_a),
                                            (leaves_b, (qb, kb, vb, db), lens_b, out_b)):
        want = run(lambda a, b, c: attention_ref(a, b, c, lens, 16 ** -0.5), q, k, v, d)
        for g, w in zip([out.detach()] + [t.grad for t in leaves], want):
            assert (g - w).abs().max().item() <= 1e-10
