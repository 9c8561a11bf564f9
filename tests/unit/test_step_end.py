"""When a step ends follows autograd (issue 23, defects 4 and 5): activation checkpointing
(reentrant, non-reentrant, Hugging Face's) makes one plan per training step and leaves nothing
kept; a forward that is never backpropagated frees its kept rows when autograd drops it; many
micro-batches stay in one step; ``retain_graph`` is refused clearly under kept activations and
exact without them. Every result is float64 against the float64 reference (1e-10)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from distca_client import DistCAClient
from distca_server.refs import attend_with_grads_ref, varlen_attention_ref
from scheduler.config import JobConfig, PlanConfig

LENS = [100, 1, 37, 118]
HQ, HKV, D = 4, 2, 8
SCALE = D ** -0.5
LAYERS = 3


def _client(keep=True, servers=2, min_shard=16, **kw):
    plan = PlanConfig(min_shard=min_shard, keep_activations=keep)
    return DistCAClient.local(config=JobConfig(plan=plan, servers=servers, backend="reference", timeout_s=30),
                              **kw)


def _tensors(lens, seed, layers=1):
    """Per layer (q, k, v) as float64 leaves, and one upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    per_layer = [[torch.randn(T, h, D, generator=g, dtype=torch.float64).requires_grad_() for h in (HQ, HKV, HKV)]
                 for _ in range(layers)]
    return per_layer, torch.randn(T, HQ, D, generator=g, dtype=torch.float64)


def _clone(layers):
    return [[t.detach().clone().requires_grad_() for t in layer] for layer in layers]


def _close(got, want):
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-10


def _held(client) -> int:
    """Bytes kept now by every batch bound in the current step."""
    return sum(b.held_bytes() for b in client._runtime._state.batches.values())


def _stack(attend, layers, dout, wrap=None):
    """LAYERS chained layers ``tanh(attend(q_i + h, k_i, v_i))`` (``wrap``: checkpoint each); the
    loss ``<h, dout>`` backpropagated. Returns the output and every leaf's gradient."""
    def layer(h, q, k, v):
        return attend(q if h is None else q + h, k, v).tanh()
    h = None
    for q, k, v in layers:
        h = layer(h, q, k, v) if wrap is None else wrap(lambda q, k, v, h=h: layer(h, q, k, v), q, k, v)
    (h * dout).sum().backward()
    return [h.detach()] + [t.grad for leaves in layers for t in leaves]


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_makes_one_plan_per_step_and_keeps_nothing(reentrant, keep):
    wrap = (lambda fn, *args: checkpoint(fn, *args, use_reentrant=reentrant))
    with _client(keep) as client:
        for step in range(3):
            layers, dout = _tensors(LENS, step, LAYERS)
            got = _stack(lambda q, k, v: client.attend(q, k, v, LENS), layers, dout, wrap)
            want = _stack(lambda q, k, v: varlen_attention_ref(q, k, v, LENS, SCALE), _clone(layers), dout)
            for g, w in zip(got, want):
                _close(g, w)
            assert client._runtime.step == step  # one step per training step, not one per layer
            assert len(client._step_traffic.batches()) == 1 and client.last_step.step == step
            assert _held(client) == 0  # recomputed forwards left nothing on the servers


@pytest.mark.parametrize("reentrant", [None, True])  # None: transformers' default (non-reentrant in 5.x)
def test_hf_gradient_checkpointing_makes_one_plan_per_step(reentrant):
    transformers = pytest.importorskip("transformers")
    from distca_client.integrations import hf
    lens = [7, 1, 13, 1, 5, 2, 11]
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    ids = torch.randint(0, 61, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lens])[None]

    def model(attn):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn,
                                                             dtype=torch.float64).train()
    hf.register_local("distca_step_end_ref", backend="reference")
    ref = model("distca_step_end_ref")  # the same model, unchecked, on single-device float64 attention
    want = ref(input_ids=ids, position_ids=positions).logits
    want.pow(2).sum().backward()
    with _client(servers=3, min_shard=4) as client:
        hf.register(client, name="distca_step_end")
        ours = model("distca_step_end")
        ours.gradient_checkpointing_enable(**({} if reentrant is None else
                                              {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}))
        for step in range(3):
            ours.zero_grad()
            logits = ours(input_ids=ids, position_ids=positions).logits
            logits.pow(2).sum().backward()
            assert client._runtime.step == step
            assert len(client._step_traffic.batches()) == 1 and _held(client) == 0
            _close(logits.detach(), want.detach())
            for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
                assert (p.grad - q.grad).abs().max().item() <= 1e-10, name


def test_retain_graph_refused_with_kept_activations_exact_without():
    layers, dout = _tensors(LENS, 7)
    want = attend_with_grads_ref(*layers[0], LENS, dout, SCALE)
    for keep in (True, False):
        leaves = _clone(layers)
        with _client(keep) as client:
            loss = (client.attend(*leaves[0], LENS) * dout).sum()
            loss.backward(retain_graph=True)
            for g, w in zip((t.grad for t in leaves[0]), want[1:]):
                _close(g, w)
            state = client._runtime._state
            rounds = state.seq
            if keep:
                with pytest.raises(RuntimeError, match=r"retain_graph.*keep_activations=False"):
                    loss.backward()
                assert state.seq == rounds  # refused before any round: no peer waits for one
                _stack(lambda q, k, v: client.attend(q, k, v, LENS), _clone(layers), dout)  # still works
            else:
                loss.backward()
                assert state.seq == rounds + 1
                for g, w in zip((t.grad for t in leaves[0]), want[1:]):
                    _close(g, 2 * w)


def _shapes(n):
    return [[40 + 9 * i, 3, i + 1] for i in range(n)]  # n distinct batch shapes


def test_twenty_micro_batches_in_flight_are_one_step():
    shapes = _shapes(20)
    with _client() as client:
        runs = [(lens, *_tensors(lens, i)) for i, lens in enumerate(shapes)]
        outs = [client.attend(*layers[0], lens) for lens, layers, _ in runs]  # forward all ...
        assert _held(client) > 0 and len(client._runtime._state.batches) == 20  # none evicted
        for out, (lens, layers, dout) in zip(outs, runs):  # ... then backward one by one
            (out * dout).sum().backward()
            want = attend_with_grads_ref(*layers[0], lens, dout, SCALE)
            for g, w in zip([out.detach()] + [t.grad for t in layers[0]], want):
                _close(g, w)
        assert client._runtime.step == 0 and _held(client) == 0
        assert {b.step for b in client._step_traffic.batches()} == {0} and len(client._step_traffic.batches()) == 20
        # 1F1B: a forward after a backward, with a micro-batch still awaiting its own, is the same step
        a, b = (_tensors(lens, 30 + i) for i, lens in enumerate(shapes[:2]))
        out_a = client.attend(*a[0][0], shapes[0])
        assert client._runtime.step == 1  # the step before had ended: a new one
        out_b = client.attend(*b[0][0], shapes[1])
        (out_a * a[1]).sum().backward()
        out_c = client.attend(*_tensors(shapes[0], 40)[0][0], shapes[0])
        assert client._runtime.step == 1
        (out_b * b[1]).sum().backward()
        out_c.sum().backward()
        assert client._runtime.step == 1 and _held(client) == 0


def test_max_batches_is_a_validated_setting_and_spares_busy_batches():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_batches"):
            DistCAClient.local(2, max_batches=bad)
    with _client(max_batches=2) as client:
        assert client._runtime.max_batches == 2
        shapes = _shapes(5)
        with torch.no_grad():  # idle batches: only the 2 most recent stay bound
            for lens in shapes:
                client.attend(*_tensors(lens, 0)[0][0], lens)
        assert [b.key[0] for b in client._runtime._state.batches.values()] == [tuple(s) for s in shapes[3:]]
        runs = [(lens, *_tensors(lens, i)) for i, lens in enumerate(shapes)]
        outs = [client.attend(*layers[0], lens) for lens, layers, _ in runs]  # 5 busy batches kept
        for out, (lens, layers, dout) in zip(outs, runs):
            (out * dout).sum().backward()
            want = varlen_attention_ref(*_clone(layers)[0], lens, SCALE)
            _close(out.detach(), want.detach())
        assert _held(client) == 0


def test_forward_with_grad_and_no_backward_frees_its_rows_when_dropped():
    layers, _ = _tensors(LENS, 3, LAYERS)
    with _client() as client:
        for _ in range(3):  # evaluation without no_grad
            outs = [client.attend(*leaves, LENS) for leaves in layers]
            assert _held(client) > 0
            del outs
            assert _held(client) == 0
        assert client._runtime.step == 0  # no backward: the step does not end by itself
        handle = client.attend_async(*layers[0], LENS)  # a handle dropped before wait()
        while not handle.done():
            time.sleep(0.01)
        assert _held(client) > 0
        del handle
        assert _held(client) == 0
