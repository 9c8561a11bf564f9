"""``torch.compile`` traces ``DistCAClient.attend`` (the ``distca::attend_fwd``/``attend_bwd``
operators, their fakes and their one autograd formula): ``fullgraph=True`` functions and a tiny
Hugging Face Llama on ``attn_implementation="distca"`` equal eager and the float64 reference to
1e-10, forward and backward, over random documents with 1-token ones and GQA; a new batch is data to
the compiled graph, not a recompile; the step, ticket and ``retain_graph`` rules hold in compiled
code; ``return_lse`` equals the reference's log-sum-exp in flash-attention's layout."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from distca_client import DistCAClient, op
from distca_server.dtypes import accumulation_dtype
from distca_server.refs import attention_ref, cu_seqlens, varlen_attention_ref
from scheduler.config import JobConfig, PlanConfig

HQ, HKV, D = 6, 2, 8  # GQA: 3 query heads per KV head
SCALE = D ** -0.5
T = 64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # compiled code of one test never serves another's client
    yield
    torch._dynamo.reset()


def _client(keep=True, servers=2, mode="inplace", ranks=None):
    plan = PlanConfig(mode=mode, min_shard=4, keep_activations=keep)
    return DistCAClient.local(config=JobConfig(plan=plan, servers=servers, backend="reference", timeout_s=30),
                              num_ranks=ranks)


def _lens(seed: int, total: int = T) -> list[int]:
    """Random document lengths summing to ``total``, with 1-token documents and at least two."""
    rng = random.Random(seed)
    lens = [1, 1]
    while sum(lens) < total:
        lens.append(min(rng.choice([1, 2, rng.randint(3, 30)]), total - sum(lens)))
    rng.shuffle(lens)
    return lens


def _leaves(seed: int, dtype=torch.float64, layers=2, total=T):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(total, h, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
             for h in (HQ, HKV, HKV)] for _ in range(layers)]


def _clone(layers):
    return [[t.detach().clone().requires_grad_() for t in layer] for layer in layers]


def _two_layers(attend):
    """Two chained layers: layer 2's queries add layer 1's output, so the backward rounds run in
    reverse order."""
    def fn(layers, doc_lens):
        (q1, k1, v1), (q2, k2, v2) = layers
        h = attend(q1, k1, v1, doc_lens).tanh()
        return attend(q2 + h, k2, v2, doc_lens)
    return fn


def _run(fn, layers, doc_lens, dout):
    out = fn(layers, doc_lens)
    out.backward(dout)
    return [out.detach()] + [t.grad for layer in layers for t in layer]


def _close(got, want, tol=1e-10):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert (g - w).abs().max().item() <= tol


def _held(client) -> int:
    return sum(b.held_bytes() for b in client._runtime._state.batches.values())


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("mode,servers,ranks", [("inplace", 2, None), ("dedicated", 3, 2)])
def test_compiled_attend_equals_eager_and_reference(keep, mode, servers, ranks):
    counter = CompileCounterWithBackend("aot_eager")
    with _client(keep, servers, mode, ranks) as client:
        eager = _two_layers(client.attend)
        compiled = torch.compile(_two_layers(client.attend), backend=counter, fullgraph=True)
        reference = _two_layers(lambda q, k, v, lens: varlen_attention_ref(q, k, v, lens.tolist(), SCALE))
        for batch in range(4):
            lens = _lens(batch)
            layers = _leaves(batch)
            dout = torch.randn(T, HQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(99 + batch))
            doc_lens = torch.tensor(lens)
            got = _run(compiled, layers, doc_lens, dout)
            _close(got, _run(eager, _clone(layers), doc_lens, dout))
            _close(got, _run(reference, _clone(layers), doc_lens, dout))
            assert _held(client) == 0  # every backward round freed what its forward kept
    # the first batch, then its document count made dynamic: no recompile per batch
    assert counter.frame_count <= 2


def test_a_compiled_function_recompiles_for_another_client_and_uses_it():
    def fn(client, q, k, v, doc_lens):
        return client.attend(q, k, v, doc_lens) * 2
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    (q, k, v), = _leaves(0, layers=1)
    lens = torch.tensor(_lens(0))
    with _client(servers=2) as a, _client(servers=3) as b:
        for client in (a, b):
            out = compiled(client, q, k, v, lens)
            assert client.last_step is not None and client.last_plan.num_servers == client._runtime.num_servers
            _close([out.detach()], [2 * varlen_attention_ref(q, k, v, lens.tolist(), SCALE).detach()])
            out.sum().backward()


def test_compiled_rounds_keep_the_step_and_retain_graph_rules():
    (q, k, v), = _leaves(1, layers=1)
    lens = _lens(1)
    for keep in (True, False):
        with _client(keep) as client:
            compiled = torch.compile(lambda q, k, v, d: client.attend(q, k, v, d), backend="aot_eager",
                                     fullgraph=True)
            doc_lens = torch.tensor(lens)
            out = compiled(q, k, v, doc_lens)  # never backpropagated: dropping it frees its rows
            assert (_held(client) > 0) == keep
            del out
            assert _held(client) == 0 and client._runtime.step == 0
            with torch.no_grad():  # forward only: nothing kept
                compiled(q, k, v, doc_lens)
            assert _held(client) == 0
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            loss = compiled(*leaves, doc_lens).sum()
            loss.backward(retain_graph=True)
            first = [t.grad.clone() for t in leaves]
            rounds = client._runtime._state.seq
            if keep:
                with pytest.raises(RuntimeError, match=r"retain_graph.*keep_activations=False"):
                    loss.backward()
                assert client._runtime._state.seq == rounds  # refused before any round
            else:
                loss.backward()
                _close([t.grad for t in leaves], [2 * g for g in first])
            assert _held(client) == 0


def test_saved_tensor_hooks_that_copy_keep_the_round_in_eager_only():
    (q, k, v), = _leaves(8, layers=1)
    lens = _lens(8)
    want = varlen_attention_ref(*_clone([[q, k, v]])[0], lens, SCALE)
    copying = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)  # offloading's shape
    with _client() as client:
        with copying:
            out = client.attend(q, k, v, lens)
        assert _held(client) > 0  # the node holds the round, not only the saved tensor's storage
        out.sum().backward()
        _close([out.detach()], [want.detach()])
        assert _held(client) == 0
        compiled = torch.compile(lambda q, k, v, d: client.attend(q, k, v, d), backend="aot_eager",
                                 fullgraph=True)
        with copying:
            out = compiled(q, k, v, torch.tensor(lens))
        with pytest.raises(RuntimeError, match="names no live forward round"):  # documented limit
            out.sum().backward()


def test_compiled_attend_checks_doc_lens_when_it_runs():
    (q, k, v), = _leaves(2, layers=1)
    with _client() as client:
        compiled = torch.compile(lambda q, k, v, d: client.attend(q, k, v, d), backend="aot_eager",
                                 fullgraph=True)
        compiled(q, k, v, torch.tensor(_lens(2))).sum().backward()
        with pytest.raises(ValueError, match=r"sum\(doc_lens\)=63 != total_tokens=64"):
            compiled(q, k, v, torch.tensor([32, 31]))
        with pytest.raises(ValueError, match="positive ints"):
            compiled(q, k, v, torch.tensor([0, 64]))


@pytest.mark.parametrize("bad, match", [
    ("v", r"k and v shapes differ: \(64, 2, 8\) vs \(63, 2, 8\)"),
    ("head_dim", r"k and v shapes differ: \(64, 2, 8\) vs \(64, 2, 4\)"),
    ("q", r"q \(63, 4, 8\) and k/v \(64, 2, 8\) disagree in total_tokens or head_dim")])
def test_compiled_attend_checks_shapes_while_tracing(bad, match):
    """q/k/v that disagree get eager's ValueError under torch.compile too, with gradients on:
    the backward's fake used to build dk and dv from dout and fail while compiling, with a
    BackendCompilerFailed about an invalid gradient (found by a review). Dynamo reports it as
    Unsupported naming the ValueError (as every tracing-time argument error)."""
    q = torch.randn(63 if bad == "q" else 64, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(64, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(63 if bad == "v" else 64, 2, 4 if bad == "head_dim" else 8, dtype=torch.float64,
                    requires_grad=True)
    lens = torch.tensor([40, 1, 23])
    with _client() as client:
        torch._dynamo.reset()
        loose = torch.compile(lambda q, k, v, d: client.attend(q, k, v, d), backend="aot_eager")
        with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match=match):
            loose(q, k, v, lens)  # dynamo may report it as Unsupported without fullgraph too
        torch._dynamo.reset()
        strict = torch.compile(lambda q, k, v, d: client.attend(q, k, v, d), backend="aot_eager", fullgraph=True)
        with pytest.raises(torch._dynamo.exc.Unsupported, match=match):
            strict(q, k, v, lens)
        good = [torch.randn(64, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
        strict(*good, lens).sum().backward()  # and the next call works
        assert all(t.grad is not None for t in good)


def test_lists_and_numpy_doc_lens_compile_too():
    (q, k, v), = _leaves(7, layers=1)
    counter = CompileCounterWithBackend("aot_eager")
    with _client() as client:
        compiled = torch.compile(lambda q, k, v, d: client.attend(q, k, v, d, softmax_scale=0.3, window=4),
                                 backend=counter, fullgraph=True)
        for doc_lens in ([30, 1, 33], [10, 1, 53], np.array([1, 62, 1]), (1, 1, 62)):
            out = compiled(q, k, v, doc_lens)
            _close([out.detach()], [client.attend(q, k, v, list(doc_lens), softmax_scale=0.3, window=4).detach()])
            out.sum().backward()
    assert counter.frame_count <= 4  # list, list (its ints now dynamic), array, tuple: no more


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [None, 5])
def test_return_lse_equals_reference(dtype, window):
    lens = _lens(3)
    cu = cu_seqlens(lens)
    (q, k, v), = _leaves(3, dtype, layers=1)
    want_out, want_lse = attention_ref(*(t.detach().double() for t in (q, k, v)), cu, cu, SCALE, window)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    with _client() as client:
        compiled = torch.compile(lambda q, k, v, d: client.attend(q, k, v, d, window=window, return_lse=True),
                                 backend="aot_eager", fullgraph=True)
        dout = torch.randn(T, HQ, D, dtype=dtype, generator=torch.Generator().manual_seed(5))
        grads = []
        for run in ("eager", "async", "compiled"):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            if run == "eager":
                out, lse = client.attend(*leaves, lens, window=window, return_lse=True)
            elif run == "async":
                out, lse = client.attend_async(*leaves, lens, window=window, return_lse=True).wait()
            else:
                out, lse = compiled(*leaves, torch.tensor(lens))
            assert lse.shape == (HQ, T) and lse.dtype == accumulation_dtype(dtype) and lse.is_contiguous()
            assert not lse.requires_grad  # a constant to autograd
            assert (lse.double() - want_lse.t()).abs().max().item() <= tol
            assert (out.double() - want_out).abs().max().item() <= tol
            ((out * dout).sum() + lse.sum()).backward()  # the LSE term adds no gradient
            grads.append([t.grad for t in leaves])
        plain = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        client.attend(*plain, lens, window=window).backward(dout)
        for g in grads:
            _close(g, [t.grad for t in plain], tol=0)
        with pytest.raises(ValueError, match="return_lse"):
            client.attend(q, k, v, lens, return_lse=1)


def test_operators_pass_opcheck():
    (q, k, v), = _leaves(4, layers=1)
    lens = torch.tensor(_lens(4))
    # the round tensor names a new round on every call, so eager and AOT outputs differ by design:
    # the AOT-dispatch comparison is left out
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    with _client(keep=False) as client:
        key = op.client_key(client)
        plain = tuple(t.detach() for t in (q, k, v))
        torch.library.opcheck(torch.ops.distca.attend_fwd.default,
                              (*plain, lens, key, None, None, False, 0, False), test_utils=utils)
        torch.library.opcheck(torch.ops.distca.attend_fwd.default,
                              (q, k, v, lens, key, 0.5, 7, True, 0, False), test_utils=utils)
        out, lse, rnd = torch.ops.distca.attend_fwd(*plain, lens, key, None, None, True, 0, False)
        dout = torch.randn_like(out)
        torch.library.opcheck(torch.ops.distca.attend_bwd.default, (dout, rnd, *plain, out, lse, HKV),
                              test_utils=utils)
        dq, dk, dv = torch.ops.distca.attend_bwd(dout, rnd, *plain, out, lse, HKV)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        varlen_attention_ref(*leaves, lens.tolist(), SCALE).backward(dout)
        _close([dq, dk, dv], [t.grad for t in leaves])


# ---- Hugging Face: attn_implementation="distca" under torch.compile ------------------------------

def test_compiled_hf_llama_equals_eager_forward_and_backward():
    transformers = pytest.importorskip("transformers")
    from distca_client.integrations import hf
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=128)
    total = 40
    ids = torch.randint(0, 61, (1, total), generator=torch.Generator().manual_seed(1))
    counter = CompileCounterWithBackend("aot_eager")
    with _client(servers=3, mode="dedicated", ranks=2) as client:
        hf.register(client)  # attn_implementation="distca"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="distca",
                                                              dtype=torch.float64).train()
        compiled = torch.compile(model, backend=counter, fullgraph=True)

        def run(m, positions):
            model.zero_grad()
            logits = m(input_ids=ids, position_ids=positions).logits
            logits.pow(2).sum().backward()
            return [logits.detach()] + [p.grad.clone() for p in model.parameters()]
        for batch in range(3):
            lens = _lens(10 + batch, total)
            positions = torch.cat([torch.arange(n) for n in lens])[None]
            got = run(compiled, positions)
            assert [n for r in client.last_plan.doc_lens_per_rank for n in r] == lens  # this batch's plan
            _close(got, run(model, positions))
            assert _held(client) == 0
    assert counter.frame_count == 1  # the documents are data: one graph for every batch
    assert any("distca.attend_fwd" in str(n.target) for g in counter.graphs for n in g.graph.nodes)


@pytest.mark.slow
def test_inductor_compiled_attend_equals_eager():
    with _client(keep=True) as client:
        eager = _two_layers(client.attend)
        compiled = torch.compile(_two_layers(client.attend), backend="inductor", fullgraph=True)
        lens = torch.tensor(_lens(6))
        layers = _leaves(6)
        dout = torch.randn(T, HQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
        _close(_run(compiled, layers, lens, dout), _run(eager, _clone(layers), lens, dout))
        assert _held(client) == 0
