"""Edge cases of ``attend`` and ``varlen_attention`` (issue 9, items 1, 2, 3, 5 and 8), against the
float64 references of :mod:`distca_server.refs`: any finite ``softmax_scale``, inputs in any
layout, double backward refused, half precision within 2x plain torch, and argument checks.
``attend`` is used only through ``DistCAClient.local(...)``'s public API."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from distca_client import DistCAClient, varlen_attention
from distca_server.kernels import BACKENDS
from distca_server.refs import attend_with_grads_ref, cu_seqlens, plain_attention, varlen_attention_ref
from scheduler.config import JobConfig, PlanConfig

LENS = [1, 37, 2, 130, 5, 64]  # single-token documents, odd and power-of-two lengths


def make_inputs(lens, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k, v, dout = (torch.randn(total, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    return [t.to(dtype) for t in (q, k, v, dout)]


def grads(fn, q, k, v, dout):
    """``[out, dq, dk, dv]`` of ``fn(q, k, v)`` for upstream ``dout``; q, k, v may be views."""
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def assert_close(got, want, rtol):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and not torch.isnan(g).any(), name
        err = (g.double() - w).abs().max().item()
        assert err <= rtol * max(1.0, w.abs().max().item()), (name, err)


def local_client(mode="inplace", backend="auto"):
    config = JobConfig(plan=PlanConfig(mode=mode, min_shard=16), servers=3, backend=backend, timeout_s=30)
    return DistCAClient.local(config=config, num_ranks=3 if mode == "inplace" else 2)


# ---------------------------------------------------------------- 1. any finite softmax_scale

SCALES = [0.0, -0.0, -0.5, -2.5, 1e-4, 3.0]


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_varlen_attention_any_finite_scale(backend, scale):
    q, k, v, dout = make_inputs(LENS, 4, 2, 16, torch.float64, seed=1)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    got = grads(lambda a, b, c: varlen_attention(a, b, c, LENS, softmax_scale=scale, backend=backend),
                *leaves, dout)
    assert_close(got, attend_with_grads_ref(q, k, v, LENS, dout, scale), rtol=1e-10)


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_attend_any_finite_scale(mode):
    lens = [300, 1, 77, 3, 129]  # split across servers: the LSE merge sees the scale too
    q, k, v, dout = make_inputs(lens, 8, 2, 16, torch.float64, seed=2)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with local_client(mode) as client:
        for scale in (0.0, -0.5, -2.5):
            got = grads(lambda a, b, c: client.attend(a, b, c, lens, softmax_scale=scale), *leaves, dout)
            assert_close(got, attend_with_grads_ref(q, k, v, lens, dout, scale), rtol=1e-10)


def test_scale_zero_is_the_mean_of_the_causal_prefix():
    q, k, v, _ = make_inputs([9, 4], 2, 1, 8, torch.float32, seed=3)
    out = varlen_attention(q, k, v, [9, 4], softmax_scale=0)
    prefix_mean = v.cumsum(0) / torch.arange(1, 14, dtype=torch.float32)[:, None, None]
    assert torch.allclose(out[:9], prefix_mean[:9].expand(9, 2, 8), atol=1e-6)


# ---------------------------------------------------------------- 2. any strides

LAYOUTS = ["head_dim_step2", "head_dim_major", "expanded_head_dim", "qkv_fused_head_dim_last"]


def in_layout(t, layout):
    """A tensor holding ``t``'s values in ``layout`` (a differentiable function of a fresh leaf),
    and that leaf. The expanded layout holds one value per row broadcast over head_dim."""
    if layout == "head_dim_step2":  # x[..., ::2] of a twice-as-wide tensor
        leaf = torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2).requires_grad_()
        return leaf[..., ::2], leaf
    if layout == "head_dim_major":  # storage [head_dim, tokens, heads]
        leaf = t.permute(2, 0, 1).contiguous().requires_grad_()
        return leaf.permute(1, 2, 0), leaf
    if layout == "expanded_head_dim":  # stride 0 along head_dim
        leaf = (t[..., :1] * t.shape[-1] ** -0.5).contiguous().requires_grad_()
        return leaf.expand(t.shape), leaf
    if layout == "qkv_fused_head_dim_last":  # [T, H, D, 3] from one projection, unbound
        leaf = torch.stack([t, t, t], dim=-1).requires_grad_()
        return leaf[..., 1], leaf
    raise KeyError(layout)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_varlen_attention_any_strides(backend, layout, dtype, rtol):
    q, k, v, dout = make_inputs(LENS, 8, 2, 32, dtype, seed=4)
    (qs, _), (ks, _), (vs, _), (douts, _) = (in_layout(t, layout) for t in (q, k, v, dout))
    assert qs.stride(-1) != 1
    got = grads(lambda a, b, c: varlen_attention(a, b, c, LENS, backend=backend), qs, ks, vs, douts.detach())
    assert_close(got, attend_with_grads_ref(qs, ks, vs, LENS, douts, 32 ** -0.5), rtol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attend_any_strides(layout):
    lens = [300, 1, 77, 3, 129]
    q, k, v, dout = make_inputs(lens, 4, 1, 16, torch.float64, seed=5)
    (qs, _), (ks, _), (vs, _), (douts, _) = (in_layout(t, layout) for t in (q, k, v, dout))
    with local_client("dedicated") as client:
        got = grads(lambda a, b, c: client.attend(a, b, c, lens), qs, ks, vs, douts.detach())
    assert_close(got, attend_with_grads_ref(qs, ks, vs, lens, douts, 0.25), rtol=1e-10)


# ---------------------------------------------------------------- 3. double backward

@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_varlen_attention_refuses_double_backward(backend):
    q, k, v, dout = make_inputs(LENS, 4, 2, 16, torch.float64, seed=6)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, LENS, backend=backend)
    with pytest.raises(RuntimeError, match="double backward through varlen_attention"):
        torch.autograd.grad(out, leaves, dout, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):  # a gradient penalty's way in
        varlen_attention(*leaves, LENS, backend=backend).backward(dout, create_graph=True)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_varlen_attention_first_order_under_checkpointing(use_reentrant):
    # Activation checkpointing runs the backward inside another backward: still first order.
    q, k, v, dout = make_inputs(LENS, 4, 2, 16, torch.float64, seed=7)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = checkpoint(lambda *t: varlen_attention(*t, LENS), *leaves, use_reentrant=use_reentrant)
    out.backward(dout)  # reentrant checkpointing refuses torch.autograd.grad
    got = [out.detach(), *(t.grad for t in leaves)]
    assert_close(got, attend_with_grads_ref(q, k, v, LENS, dout, 0.25), rtol=1e-10)


def test_attend_refuses_double_backward():
    q, k, v, dout = make_inputs(LENS, 4, 2, 16, torch.float64, seed=8)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with local_client() as client:
        out = client.attend(*leaves, LENS)
        with pytest.raises(RuntimeError, match="double backward through DistCAClient.attend"):
            torch.autograd.grad(out, leaves, dout, create_graph=True)


# ---------------------------------------------------------------- 5. half precision

def _within_2x_plain_torch(fn, lens, dtype, seed):
    q, k, v, dout = make_inputs(lens, 8, 2, 64, dtype, seed)
    q = q * 4  # sharper softmax, larger LSE: where half-precision statistics show (x4 is exact)
    exact = attend_with_grads_ref(q, k, v, lens, dout, 0.125)
    cu = cu_seqlens(lens)
    plain = grads(lambda a, b, c: plain_attention(a, b, c, cu, cu, 0.125)[0],
                  *(t.clone().requires_grad_() for t in (q, k, v)), dout)
    ours = grads(fn, *(t.clone().requires_grad_() for t in (q, k, v)), dout)
    for name, o, p, w in zip(("out", "dq", "dk", "dv"), ours, plain, exact):
        assert o.dtype == dtype
        e_ours, e_plain = (o.double() - w).abs().max().item(), (p.double() - w).abs().max().item()
        assert e_ours <= 2 * e_plain, (name, e_ours, e_plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_varlen_attention_half_precision_within_2x_plain_torch(backend, dtype):
    lens = [200, 1, 33, 90]
    _within_2x_plain_torch(lambda a, b, c: varlen_attention(a, b, c, lens, backend=backend), lens, dtype, 9)


def test_attend_reference_backend_bf16_within_2x_plain_torch():
    lens = [200, 1, 33, 90]
    with local_client("dedicated", backend="reference") as client:
        _within_2x_plain_torch(lambda a, b, c: client.attend(a, b, c, lens), lens, torch.bfloat16, 10)


# ---------------------------------------------------------------- 8. arguments

ORDERED_DOC_LENS = [
    np.array([5, 9, 3]), np.array([5, 9, 3], dtype=np.int32), np.array([5, 9, 3], dtype=np.uint16),
    [np.int64(5), np.int64(9), np.int64(3)], [np.int32(5), 9, np.uint8(3)], (5, 9, 3),
    torch.tensor([5, 9, 3]), torch.tensor([5, 9, 3], dtype=torch.int32),
]
UNORDERED_OR_BAD_DOC_LENS = [
    ({5, 9, 3}, "ordered"), (frozenset({5, 9, 3}), "ordered"), ({5: 0, 9: 0, 3: 0}, "ordered"),
    ({5: 0, 9: 0, 3: 0}.keys(), "ordered"), (iter([5, 9, 3]), "ordered"), ("593", "ordered"),
    (np.array([5.0, 9.0, 3.0]), "1-D integer"), (np.array([[5, 9, 3]]), "1-D integer"),
    (np.array([True, True]), "1-D integer"), ([5, np.float64(9), 3], "positive ints"),
    ([5, True, 11], "positive ints"), ([np.int64(-1), 18], "positive ints"),
    # tensors whose values cannot be read: torch's own error escaped (found by a review)
    (torch.tensor([5, 9, 3], device="meta"), "dense tensor with values, got a meta tensor"),
    (torch.tensor([5, 9, 3]).to_sparse(), "dense tensor with values, got a torch.sparse_coo tensor"),
]
BAD_SCALES = ["0.5", True, False, np.bool_(True), b"0.5", [0.5], torch.tensor(0.5), 10**400,
              float("nan"), np.float32("inf")]
BAD_BACKENDS = [["auto"], {"auto"}, ("auto",), None, 3, "nope"]


def case_id(x) -> str:
    text = repr(x)
    return text if len(text) <= 24 else f"{type(x).__name__}({text[:12]}...)"


@pytest.mark.parametrize("doc_lens", ORDERED_DOC_LENS, ids=case_id)
def test_ordered_doc_lens_are_accepted(doc_lens):
    q, k, v, _ = make_inputs([5, 9, 3], 2, 1, 8, torch.float64, seed=11)
    want = varlen_attention(q, k, v, [5, 9, 3])
    assert torch.equal(varlen_attention(q, k, v, doc_lens), want)
    with local_client() as client:
        assert (client.attend(q, k, v, doc_lens) - want).abs().max().item() <= 1e-12


@pytest.mark.parametrize("doc_lens,fragment", UNORDERED_OR_BAD_DOC_LENS, ids=case_id)
def test_unordered_or_bad_doc_lens_are_refused(doc_lens, fragment):
    q, k, v, _ = make_inputs([5, 9, 3], 2, 1, 8, torch.float64, seed=12)
    with pytest.raises(ValueError, match=fragment):
        varlen_attention(q, k, v, doc_lens)
    with local_client() as client:
        with pytest.raises(ValueError, match=fragment):
            client.attend(q, k, v, doc_lens)
        assert client.last_step is None  # nothing was planned or sent


@pytest.mark.parametrize("scale", BAD_SCALES, ids=case_id)
def test_softmax_scale_must_be_a_finite_number(scale):
    q, k, v, _ = make_inputs([5, 9], 2, 1, 8, torch.float32, seed=13)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        varlen_attention(q, k, v, [5, 9], softmax_scale=scale)
    with local_client() as client:
        with pytest.raises(ValueError, match="softmax_scale"):
            client.attend(q, k, v, [5, 9], softmax_scale=scale)
        assert client.last_step is None


@pytest.mark.parametrize("scale", [np.float32(0.5), np.float64(0.5), np.int64(2), 2], ids=case_id)
def test_numpy_and_int_scales_are_numbers(scale):
    q, k, v, _ = make_inputs([5, 9], 2, 1, 8, torch.float64, seed=14)
    assert torch.equal(varlen_attention(q, k, v, [5, 9], softmax_scale=scale),
                       varlen_attention(q, k, v, [5, 9], softmax_scale=float(scale)))


@pytest.mark.parametrize("backend", BAD_BACKENDS, ids=case_id)
def test_varlen_attention_refuses_unknown_backends(backend):
    q, k, v, _ = make_inputs([5, 9], 2, 1, 8, torch.float32, seed=15)
    with pytest.raises(ValueError, match="unknown attention backend"):
        varlen_attention(q, k, v, [5, 9], backend=backend)


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("tokens", [0, 14])
def test_varlen_attention_refuses_backends_that_cannot_run_on_the_inputs(backend, tokens):
    # CPU tensors: refused at call time even when there is nothing to compute.
    q, k, v, _ = make_inputs([tokens] if tokens else [], 2, 1, 8, torch.float32, seed=16)
    fragment = "not available on cpu" if BACKENDS[backend].is_available() else "cannot run on this install"
    with pytest.raises(ValueError, match=f"{backend}.*{fragment}"):
        varlen_attention(q, k, v, [tokens] if tokens else [], backend=backend)


def test_head_dim_zero_is_named_as_such():
    q, k, v, _ = make_inputs([5, 9, 3], 4, 2, 8, torch.float64, seed=13)
    with local_client() as client:
        with pytest.raises(ValueError, match=r"head_dim must be positive, got head_dim=0"):
            client.attend(q[..., :0], k[..., :0], v[..., :0], [5, 9, 3])  # was blamed on the head counts


@pytest.mark.parametrize("servers", [1, 2])
def test_the_output_is_never_a_view_and_takes_in_place_ops_like_local_attention(servers):
    """With one server its own rows came back as a slice of the kernel's output: autograd refused
    ``out.mul_(2)`` at once (a view), which local attention's output takes (found by a review).
    A backward through an output changed in place is refused where the plan keeps that very
    tensor for it (one server), as a kernel that saves its output refuses it."""
    lens = [5, 9, 3]
    q, k, v, dout = make_inputs(lens, 4, 2, 8, torch.float64, seed=14)
    q.requires_grad_()
    with DistCAClient.local(servers) as client:
        out = client.attend(q, k, v, lens)
        assert not out._is_view()
        out.mul_(2)
        want = varlen_attention_ref(q.detach(), k, v, lens, 8 ** -0.5)
        assert torch.allclose(out.detach(), 2 * want, atol=1e-12)
        if servers == 1:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                (out * dout).sum().backward()
        else:
            (out * dout).sum().backward()
        scaled = client.attend(q.detach(), k, v, lens)
        w = torch.ones(8, dtype=torch.float64, requires_grad=True)
        scaled.mul_(w)  # a forward-only output combined in place with a tensor that needs grad
        assert torch.allclose(scaled.detach(), want, atol=1e-12)
