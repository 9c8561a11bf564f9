"""Attention backends against an independent dense float64 oracle.

The oracle is `distca_server.refs.attention_ref` in float64 (per-sequence bottom-right causal
masks, differentiated with autograd), which shares no code with `distca_server.kernels`.
Low-precision backends may be at most 2x worse than plain torch (`distca_server.refs.plain_attention`,
torch.softmax) run in the same precision (the rule of flash-attention's tests/test_flash_attn.py).
"""

from __future__ import annotations

import inspect
import math
import sys

import pytest
import torch

from distca_server import kernels_flash
from distca_server.kernels import (BACKENDS, TorchVarlenBackend, available_backends, check_backend_name,
                                   get_backend)
from distca_server.refs import attention_ref, plain_attention

# name: (q_lens, k_lens, num_heads_q, num_heads_kv, head_dim)
CASES = {
    "bottom_right_gqa8": ([7, 30, 1], [20, 45, 9], 8, 1, 64),
    "square_gqa4_d128": ([33, 64, 1, 17], [33, 64, 1, 17], 4, 1, 128),
    "empty_seqs_mha": ([0, 13, 5, 0], [11, 13, 40, 0], 2, 2, 64),
    "odd_gqa4_d128": ([1, 3, 97], [1, 50, 101], 8, 2, 128),
    "one_doc_mha": ([150], [150], 3, 3, 64),
}
# Lq > Lk: the first Lq - Lk rows of a sequence see no key at all.
ROWS_WITHOUT_KEYS = ([9, 4], [5, 4], 4, 2, 64)


def _cu(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def make_inputs(case, dtype, device="cpu", seed=0):
    q_lens, k_lens, hq, hkv, d = case
    g = torch.Generator().manual_seed(seed)
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    q, k, v = randn(sum(q_lens), hq, d), randn(sum(k_lens), hkv, d), randn(sum(k_lens), hkv, d)
    dout = randn(sum(q_lens), hq, d)
    return dict(q=q, k=k, v=v, dout=dout, cu_seqlens_q=_cu(q_lens, device),
                cu_seqlens_k=_cu(k_lens, device), max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
                softmax_scale=d ** -0.5)


def oracle(x):
    """Float64 attention and its autograd gradients: (out, lse, dq, dk, dv)."""
    q, k, v = (x[n].detach().double().cpu().requires_grad_() for n in "qkv")
    out, lse = attention_ref(q, k, v, x["cu_seqlens_q"].cpu(), x["cu_seqlens_k"].cpu(), x["softmax_scale"])
    out.backward(x["dout"].double().cpu())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def plain(x):
    """(out, lse, dq, dk, dv) of plain torch in x's dtype, on the CPU: the low-precision yardstick."""
    q, k, v = (x[n].detach().cpu().requires_grad_() for n in "qkv")
    out, lse = plain_attention(q, k, v, x["cu_seqlens_q"].cpu(), x["cu_seqlens_k"].cpu(), x["softmax_scale"])
    out.backward(x["dout"].cpu())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run(backend, x):
    """(out, lse, dq, dk, dv) from one backend; backward consumes that backend's own out/lse."""
    b = BACKENDS[backend] if isinstance(backend, str) else backend
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    out, lse = b.forward(x["q"], x["k"], x["v"], *args)
    return (out, lse, *b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args))


NAMES = ("out", "lse", "dq", "dk", "dv")


def max_error(actual, expected):
    """Max |actual - expected| over finite entries; -inf entries must match exactly."""
    actual, expected = actual.detach().double().cpu(), expected.double()
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = torch.isfinite(expected)
    return (actual - expected)[finite].abs().max().item() if finite.any() else 0.0


def assert_matches(results, expected, rtol):
    for name, a, e in zip(NAMES, results, expected):
        magnitude = max(1.0, e[torch.isfinite(e)].abs().max().item())
        err = max_error(a, e)
        assert err <= rtol * magnitude, f"{name}: {err:.3g} > {rtol} * {magnitude:.3g}"


def check_contract(results, x):
    out, lse, dq, dk, dv = results
    assert out.shape == x["q"].shape and out.dtype == x["q"].dtype
    assert lse.shape == x["q"].shape[:2]
    assert lse.dtype == (torch.float64 if x["q"].dtype == torch.float64 else torch.float32)
    for grad, like in ((dq, x["q"]), (dk, x["k"]), (dv, x["v"])):
        assert grad.shape == like.shape and grad.dtype == like.dtype


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_float64_matches_oracle(case):
    x = make_inputs(CASES[case], torch.float64)
    results = run("reference", x)
    check_contract(results, x)
    assert_matches(results, oracle(x), rtol=1e-10)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_cpu_matches_oracle(case, dtype, rtol):
    x = make_inputs(CASES[case], dtype, seed=1)
    results = run("torch_cpu", x)
    check_contract(results, x)
    assert_matches(results, oracle(x), rtol=rtol)


def _errors(backend, x, expected):
    return [max_error(a, e) for a, e in zip(run(backend, x), expected)]


def assert_within_2x_plain_torch(backend, x, atol=0.0):
    expected = oracle(x)  # the oracle sees the same rounded inputs, upcast to float64
    ours, theirs = _errors(backend, x, expected), [max_error(a, e) for a, e in zip(plain(x), expected)]
    for name, e_ours, e_plain in zip(NAMES, ours, theirs):
        assert e_ours <= 2 * e_plain + atol, f"{name}: {backend} {e_ours:.3g} vs plain torch {e_plain:.3g}"


def sharpen(x, factor=4.0):
    """Scores `factor` times larger (a power of two: exact in every dtype): a peaked softmax and a
    larger LSE, where rounding the softmax statistics to half precision shows."""
    return dict(x, q=x["q"] * factor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
@pytest.mark.parametrize("case,sharp,scale", [
    ("bottom_right_gqa8", False, None), ("square_gqa4_d128", True, None), ("odd_gqa4_d128", True, None),
    ("one_doc_mha", True, None), ("bottom_right_gqa8", True, -0.25), ("one_doc_mha", False, 0.0)])
def test_half_precision_within_2x_of_plain_torch(backend, dtype, case, sharp, scale):
    # The CUDA backends fall back to `reference` for head dims they lack, so it must hold too.
    x = make_inputs(CASES[case], dtype, seed=2)
    x = sharpen(x) if sharp else x
    if scale is not None:
        x["softmax_scale"] = scale
    assert_within_2x_plain_torch(backend, x)


@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
def test_rows_without_keys_give_zero_out_and_minus_inf_lse(backend):
    x = make_inputs(ROWS_WITHOUT_KEYS, torch.float64, seed=3)
    results = run(backend, x)
    out, lse, dq = results[:3]
    dead = slice(0, 4)  # sequence 0 has Lq = 9, Lk = 5
    assert torch.all(out[dead] == 0) and torch.all(lse[dead] == float("-inf")) and torch.all(dq[dead] == 0)
    assert all(torch.isfinite(t).all() for t in results[2:])
    assert_matches(results, oracle(x), rtol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
def test_strided_inputs_from_packed_qkv(backend):
    q_lens, k_lens, hq, hkv, d = CASES["bottom_right_gqa8"]
    x = make_inputs((q_lens, q_lens, hq, hkv, d), torch.float64, seed=4)
    qkv = torch.cat([x["q"], x["k"], x["v"]], dim=1)  # [T, H_q + 2 H_kv, D], as a fused projection gives
    x.update(q=qkv[:, :hq], k=qkv[:, hq:hq + hkv], v=qkv[:, hq + hkv:])
    assert not x["q"].is_contiguous()
    assert_matches(run(backend, x), oracle(x), rtol=1e-10)


def test_backends_share_out_and_lse():
    # A backward round may run on a different backend than its forward (e.g. after a fallback).
    x = make_inputs(CASES["odd_gqa4_d128"], torch.float64, seed=5)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    out, lse = BACKENDS["reference"].forward(x["q"], x["k"], x["v"], *args)
    grads = BACKENDS["torch_cpu"].backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args)
    assert_matches(grads, oracle(x)[2:], rtol=1e-10)


def test_get_backend_and_errors():
    assert set(BACKENDS) == {"reference", "torch_cpu", "torch_varlen", "flash_attn", "cudnn", "fa4"}
    assert get_backend("auto", "cpu") is BACKENDS["torch_cpu"]
    assert get_backend("reference", torch.device("cpu")).name == "reference"
    assert available_backends("cpu") == ["torch_cpu", "reference"]
    with pytest.raises(ValueError, match="nope.*torch_cpu"):
        get_backend("nope", "cpu")
    with pytest.raises(ValueError, match="torch_varlen.*not available"):
        get_backend("torch_varlen", "cpu")
    with pytest.raises(ValueError, match="reference"):
        get_backend("auto", "meta")


def test_bad_inputs_raise_value_error():
    x = make_inputs(CASES["empty_seqs_mha"], torch.float32)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], 0.1)
    cpu = BACKENDS["torch_cpu"]
    with pytest.raises(ValueError, match="multiple"):
        cpu.forward(x["q"][:, :1].repeat(1, 3, 1), x["k"], x["v"], *args)
    with pytest.raises(ValueError, match="cu_seqlens"):
        cpu.forward(x["q"][:5], x["k"], x["v"], *args)
    with pytest.raises(ValueError, match="dtype"):
        cpu.forward(x["q"].double(), x["k"], x["v"], *args)


def test_flash_attn_backward_called_by_keyword_across_versions():
    seen = {}
    def v2_5(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
             max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
             rng_state=None):
        seen.update(window_size=window_size, causal=causal)
    def v2_7(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
             max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
             softcap, alibi_slopes, deterministic, rng_state=None):
        seen.update(left=window_size_left, right=window_size_right, softcap=softcap)
    class CustomOp:  # torch.library custom ops keep the Python function on `_init_fn`
        _init_fn = staticmethod(v2_7)
        def __call__(self, **kw):
            return v2_7(**kw)
    values = {n: n for n in inspect.signature(v2_7).parameters} | dict(
        window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0, causal=True)
    kernels_flash._call_by_name(v2_5, values)
    kernels_flash._call_by_name(CustomOp(), values)
    assert seen == dict(window_size=(-1, -1), causal=True, left=-1, right=-1, softcap=0.0)
    with pytest.raises(RuntimeError, match="sink"):
        kernels_flash._call_by_name(lambda q, sink: None, values)


def _package(root, files):
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


@pytest.mark.parametrize("files,fa2", [
    # flash-attn-4 (4.0.0b36) alone: flash_attn/cute/..., no flash_attn/__init__.py, so flash_attn is
    # a namespace package that find_spec finds but `from flash_attn import flash_attn_varlen_func`
    # cannot import from.
    (["flash_attn/cute/__init__.py", "flash_attn/cute/interface.py"], False),
    # flash-attn 2 (with or without flash-attn-4 installed beside it).
    (["flash_attn/__init__.py", "flash_attn/flash_attn_interface.py"], True),
    (["flash_attn/__init__.py", "flash_attn/flash_attn_interface.py", "flash_attn/cute/interface.py"], True),
    (["flash_attn/__init__.py"], False),  # some other package named flash_attn
], ids=["fa4_only", "fa2", "fa2_and_fa4", "no_interface"])
def test_flash_attn_backend_needs_flash_attn_2_not_a_namespace_package(tmp_path, monkeypatch, files, fa2):
    from distca_server import kernels_fa4

    _package(tmp_path, files)
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates the import caches
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the package alone decides
    for other in ("cudnn", "fa4"):  # their checks would query the (absent) GPU
        monkeypatch.setattr(BACKENDS[other], "is_available", lambda: False)
    assert kernels_flash.flash_attn2_installed() is fa2
    assert BACKENDS["flash_attn"].is_available() is fa2
    assert ("flash_attn" in available_backends("cuda")) is fa2  # what bench/gpu_session.sh prints
    # flash-attn-4's own check still sees its files either way.
    assert kernels_fa4.fa4_installed() is any(f.endswith("cute/interface.py") for f in files)
    assert "flash_attn" not in sys.modules  # judged without importing the package


def test_kernel_lse_layouts_round_trip():
    cu, h = _cu([3, 0, 2], "cpu"), 2
    ours = torch.tensor([[float("-inf"), 0.5], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    for layout in ("heads_first", "tokens_first", "padded"):
        kernel_lse = kernels_flash._lse_to_kernel(ours, layout, cu, 3)
        assert torch.isposinf(kernel_lse).any()  # FlashAttention marks rows without keys with +inf
        back, detected = kernels_flash._lse_from_kernel(kernel_lse, cu, ours.shape[0], h)
        assert torch.equal(back, ours) and detected == layout


# ---------------------------------------------------------------- any finite scale, any strides

# Scale 0 is uniform attention over the causal prefix; negative scales favour the least similar keys.
SCALES = [0.0, -0.0, -0.5, -3.0, 2e-3, 4.0]


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
@pytest.mark.parametrize("case", [*CASES, "rows_without_keys"])
def test_any_finite_scale_matches_oracle(backend, case, scale):
    x = make_inputs(CASES.get(case, ROWS_WITHOUT_KEYS), torch.float64, seed=8)
    x["softmax_scale"] = scale
    results = run(backend, x)
    assert all(not torch.isnan(t).any() for t in results)
    assert_matches(results, oracle(x), rtol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
def test_scale_zero_is_uniform_over_the_causal_prefix(backend):
    x = make_inputs(CASES["bottom_right_gqa8"], torch.float32, seed=9)
    x["softmax_scale"] = 0.0
    out, lse, dq, dk, _ = run(backend, x)
    # Sequence 1: Lq = 30 rows over Lk = 45 keys; row r sees keys [0, r + 15] of k-offset 20.
    v, group = x["v"].double(), 8
    for r in (0, 17, 29):
        mean = v[20:20 + r + 16].mean(0).repeat_interleave(group, 0)
        assert torch.allclose(out[7 + r].double(), mean, atol=1e-6)
        assert torch.allclose(lse[7 + r].double(), torch.full((8,), math.log(r + 16.0), dtype=torch.float64))
    assert torch.all(dq == 0) and torch.all(dk == 0)  # scores 0 * q . k depend on neither


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scale_raises_value_error(scale):
    x = make_inputs(CASES["one_doc_mha"], torch.float32)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], scale)
    for backend in ("reference", "torch_cpu"):
        with pytest.raises(ValueError, match="softmax_scale must be finite"):
            BACKENDS[backend].forward(x["q"], x["k"], x["v"], *args)


def restride(t, layout):
    """``t``'s values (or, for the expanded layouts, values broadcast from a slice of it) in storage
    whose strides are not those of a contiguous tensor."""
    if layout == "head_dim_step2":  # x[..., ::2]
        return torch.stack([t, torch.full_like(t, float("nan"))], dim=-1).flatten(-2)[..., ::2]
    if layout == "head_dim_major":  # storage [D, T, H]
        return t.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    if layout == "heads_major":  # storage [H, T, D]
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "expanded_head_dim":  # stride 0 along head_dim; rows keep about their norm
        return (t[..., :1] * t.shape[-1] ** -0.5).expand(t.shape)
    if layout == "expanded_tokens":  # stride 0 along tokens (one row repeated)
        return t[:1].expand(t.shape)
    raise KeyError(layout)


LAYOUTS = ["head_dim_step2", "head_dim_major", "heads_major", "expanded_head_dim", "expanded_tokens"]


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
@pytest.mark.parametrize("case", ["bottom_right_gqa8", "odd_gqa4_d128", "rows_without_keys"])
def test_any_strides_match_oracle(backend, layout, case, dtype, rtol):
    x = make_inputs(CASES.get(case, ROWS_WITHOUT_KEYS), dtype, seed=10)
    for name in ("q", "k", "v", "dout"):
        x[name] = restride(x[name], layout)
    assert not x["q"].is_contiguous()
    expected = oracle(x)
    b = BACKENDS[backend]
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    out, lse = b.forward(x["q"], x["k"], x["v"], *args)
    # The backward also takes out and lse in any layout (they may come back from another rank).
    grads = b.backward(x["dout"], x["q"], x["k"], x["v"], restride(out, "head_dim_major"),
                       lse.t().contiguous().t(), *args)
    assert_matches((out, lse, *grads), expected, rtol=rtol)


def test_half_precision_strided_within_2x_of_plain_torch():
    x = sharpen(make_inputs(CASES["odd_gqa4_d128"], torch.bfloat16, seed=11))
    for name in ("q", "k", "v", "dout"):
        x[name] = restride(x[name], "head_dim_step2")
    assert_within_2x_plain_torch("torch_cpu", x)


def test_check_backend_name():
    assert check_backend_name("auto") == "auto"
    assert check_backend_name("torch_cpu", "cpu") == "torch_cpu"
    assert check_backend_name("reference", torch.device("cpu")) == "reference"
    for bad in (["auto"], {"auto"}, None, 3, "nope", "AUTO", b"auto"):
        with pytest.raises(ValueError, match="unknown attention backend"):
            check_backend_name(bad)
        with pytest.raises(ValueError, match="unknown attention backend"):
            get_backend(bad, "cpu")  # a list used to raise a bare TypeError here
    with pytest.raises(ValueError, match="flash_attn.*not available on cpu"):
        check_backend_name("flash_attn", "cpu")
    for name in ("flash_attn", "torch_varlen"):
        if not BACKENDS[name].is_available():  # e.g. a CPU-only install
            with pytest.raises(ValueError, match=f"{name}.*cannot run on this install"):
                check_backend_name(name)
        else:
            assert check_backend_name(name) == name


# ---------------------------------------------------------------- GPU (marked `gpu`: tests/conftest.py skips them without CUDA)

GPU_BACKENDS = ["torch_varlen", "flash_attn", "cudnn", "fa4"]


def _gpu_backend_or_skip(name):
    if not BACKENDS[name].is_available():
        pytest.skip(f"{name} not available")
    return BACKENDS[name]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("case", [*CASES, "rows_without_keys"])
def test_gpu_bfloat16_within_2x_of_plain_torch(backend, case):
    b = _gpu_backend_or_skip(backend)
    x = make_inputs(CASES.get(case, ROWS_WITHOUT_KEYS), torch.bfloat16, device="cuda", seed=6)
    assert_within_2x_plain_torch(b, x, atol=1e-3)  # the slack these tests always had on GPUs
    check_contract(run(b, x), x)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_float32_falls_back_exactly(backend):
    b = _gpu_backend_or_skip(backend)
    x = make_inputs(CASES["odd_gqa4_d128"], torch.float32, device="cuda", seed=7)
    results = run(b, x)
    check_contract(results, x)
    assert_matches(results, oracle(x), rtol=1e-5)


@pytest.mark.gpu
def test_gpu_auto_picks_a_fast_backend():
    if not any(BACKENDS[n].is_available() for n in GPU_BACKENDS):
        pytest.skip("no GPU attention backend installed")
    assert get_backend("auto", "cuda").name in GPU_BACKENDS


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("scale", [0.0, -0.5], ids=str)
@pytest.mark.parametrize("layout", [None, "head_dim_step2", "head_dim_major"])
def test_gpu_any_scale_and_strides(backend, scale, layout):
    b = _gpu_backend_or_skip(backend)
    x = make_inputs(CASES["bottom_right_gqa8"], torch.bfloat16, device="cuda", seed=12)
    x["softmax_scale"] = scale
    if layout is not None:
        for name in ("q", "k", "v", "dout"):
            x[name] = restride(x[name], layout)
    assert_within_2x_plain_torch(b, x, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_odd_head_dim_falls_back_within_2x_of_plain_torch(backend):
    # head_dim 100 is not a multiple of 8: the FlashAttention kernels refuse it, `reference` runs.
    b = _gpu_backend_or_skip(backend)
    x = sharpen(make_inputs(([7, 30, 1], [20, 45, 9], 8, 2, 100), torch.bfloat16, device="cuda", seed=13))
    assert_within_2x_plain_torch(b, x)


def test_torch_varlen_calls_match_the_installed_aten_schemas():
    # The GPU kernels cannot run here, but their aten ops have meta kernels: a call whose arguments
    # the installed torch's schemas refuse fails on CPU installs too, not first on a lent GPU.
    b = TorchVarlenBackend()
    q = torch.empty(10, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(12, 2, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    for left, right in ((-1, 0), (3, 0), (-1, -1)):
        out, lse = b._banded_forward(q, k, k, cu, cu, 5, 6, 0.125, left, right)
        assert out.shape == q.shape and lse.shape == (10, 8) and lse.dtype == torch.float32
        dq, dk, dv = b._banded_backward(q, q, k, k, out, lse, cu, cu, 5, 6, 0.125, left, right)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_half_precision_head_dims_within_2x_of_plain_torch(backend, dtype, head_dim):
    # Odd lengths, a 1-token document, GQA 4: the kernels' supported head dims in both half types.
    b = _gpu_backend_or_skip(backend)
    x = make_inputs(([1, 3, 97, 256], [1, 50, 101, 256], 8, 2, head_dim), dtype, device="cuda", seed=14)
    assert_within_2x_plain_torch(b, sharpen(x), atol=1e-3)
