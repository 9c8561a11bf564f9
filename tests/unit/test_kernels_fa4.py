"""The ``fa4`` backend (distca_server/kernels_fa4.py): FlashAttention-4 through its private
``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``.

On the CPU: a stand-in ``flash_attn.cute.interface`` (put in ``sys.modules``) checks each argument
the way FA4 4.0.0b36 asserts it, records it, and computes real attention in float64 with
:mod:`distca_server.refs`; the mapping (cu_seqlens, max_seqlen, scale, causal, window, GQA, LSE
layout, outputs) and the results against the float64 oracle are checked through it. Also: the
pure helpers, availability, ``auto``'s order, and that importing distca_server imports no
flash_attn. On a GPU with the package (marked ``gpu``): the real kernels against the oracle.
"""

from __future__ import annotations

import importlib.machinery
import random
import subprocess
import sys
import types

import pytest
import torch
from test_kernels import CASES, NAMES, ROWS_WITHOUT_KEYS, make_inputs, max_error
from test_kernels_window import EXPRESSIBLE, _diagonal_oracle

from distca_server import kernels, kernels_fa4
from distca_server.kernels import BACKENDS, available_backends, get_backend
from distca_server.kernels_fa4 import lse_from_fa4, lse_to_fa4, window_kwargs
from distca_server.refs import attention_ref, plain_attention

INF = float("inf")

# ---------------------------------------------------------------- the stand-in for FA4 (CPU)


def _band_attention(q, k, v, cq, ck, scale, left, right):
    """(out [T, H, D], lse [T, H]) where row r sees key j iff ``d - left <= j <= d + right``,
    ``d = r + Lk - Lq`` (None: unbounded side): FlashAttention's (left, right) window."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [q[:0]], [q.new_zeros(0, q.shape[1])]
    for qa, qb, ka, kb in zip(cq, cq[1:], ck, ck[1:]):
        d = torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)
        j = torch.arange(kb - ka)[None, :]
        seen = torch.ones(d.shape[0], j.shape[1], dtype=torch.bool)
        if right is not None:
            seen &= j <= d + right
        if left is not None:
            seen &= j >= d - left
        ks, vs = (t[ka:kb].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        s = (q[qa:qb].transpose(0, 1) @ ks.transpose(1, 2) * scale).masked_fill(~seen, -INF)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[..., None])
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _attention(q, k, v, kw):
    """float64 (out, lse [T_q, H]) of the rows inside cu_seqlens_q, as the kernel would compute it."""
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    left, right = kw["window_size_left"], 0 if kw["causal"] else kw["window_size_right"]
    if right == 0:  # bottom-right causal, maybe a window: the refs' own definition
        return attention_ref(q, k, v, cq, ck, kw["softmax_scale"], None if left is None else left + 1)
    return _band_attention(q, k, v, cq, ck, kw["softmax_scale"], left, right)


def _check_varlen(q, k, kw):
    # What FA4 4.0.0b36 asserts (interface.py) about the varlen arguments.
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        t = kw[name]
        assert t.dtype == torch.int32 and t.stride(0) == 1 and t.shape == (kw["cu_seqlens_q"].numel(),), name
    assert type(kw["max_seqlen_q"]) is int and type(kw["max_seqlen_k"]) is int
    assert type(kw["softmax_scale"]) is float and kw["softmax_scale"] > 0
    assert type(kw["causal"]) is bool
    for side in ("window_size_left", "window_size_right"):
        assert kw[side] is None or (type(kw[side]) is int and kw[side] >= 0), side  # -1 would be a bound
    assert q.is_contiguous() and k.is_contiguous() and q.shape[1] % k.shape[1] == 0
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype


# The parameter names of 4.0.0b36's interface._flash_attn_fwd / _flash_attn_bwd (in signature order;
# distca passes everything by keyword), so a misspelled keyword fails here as it would there.
_FWD_PARAMS = frozenset(
    "q k v qv cu_seqlens_q cu_seqlens_k seqused_q seqused_k max_seqlen_q max_seqlen_k min_seqlen_k page_table "
    "softmax_scale causal softcap window_size_left window_size_right learnable_sink tile_mn mma_pv_is_rs "
    "intra_wg_overlap num_threads num_splits pack_gqa _arch score_mod mask_mod block_sparse_tensors return_lse "
    "out lse aux_tensors aux_scalars q_descale k_descale v_descale gather_kv_indices scheduler_metadata "
    "seqlen_k_per_split disable_scheduler_metadata gather_bwd_recompute_p".split())
_BWD_PARAMS = frozenset(
    "q k v out dout lse softmax_scale causal softcap window_size_left window_size_right m_block_size "
    "n_block_size num_threads pack_gqa num_stages_Q num_stages_dO SdP_swapAB dKV_swapAB dQ_swapAB "
    "AtomLayoutMSdP AtomLayoutNdKV AtomLayoutMdQ V_in_regs cu_seqlens_q cu_seqlens_k seqused_q seqused_k "
    "max_seqlen_q max_seqlen_k deterministic dq dk dv score_mod score_mod_bwd mask_mod aux_tensors aux_scalars "
    "block_sparse_tensors dlse learnable_sink".split())


class FakeFA4:
    """``flash_attn.cute.interface`` as far as distca uses it; ``arity``: values the forward returns."""

    def __init__(self, arity=5):
        self.arity, self.fwd, self.bwd = arity, [], []

    def _flash_attn_fwd(self, q, k, v, **kw):
        assert not set(kw) - _FWD_PARAMS, set(kw) - _FWD_PARAMS
        _check_varlen(q, k, kw)
        assert kw["return_lse"] is True and "seqused_q" not in kw and "seqused_k" not in kw
        out, lse = kw["out"], kw["lse"]
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
        self.fwd.append(dict(kw, q=q, k=k, v=v))
        o, l = _attention(q.double(), k.double(), v.double(), kw)
        a, b = int(kw["cu_seqlens_q"][0]), int(kw["cu_seqlens_q"][-1])
        out[a:b], lse[:, a:b] = o.to(out.dtype), l.t().float()
        return (out, lse, None, None, None)[:self.arity]

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, **kw):
        assert not set(kw) - _BWD_PARAMS, set(kw) - _BWD_PARAMS
        _check_varlen(q, k, kw)
        assert out.shape == dout.shape == q.shape and out.dtype == dout.dtype == q.dtype
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert kw["deterministic"] is False
        self.bwd.append(dict(kw, q=q, k=k, v=v, out=out, dout=dout, lse=lse))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        o, _ = _attention(q64, k64, v64, kw)
        a, b = int(kw["cu_seqlens_q"][0]), int(kw["cu_seqlens_q"][-1])
        o.backward(dout[a:b].double())
        for name, grad in (("dq", q64.grad), ("dk", k64.grad), ("dv", v64.grad)):
            assert kw[name].shape == grad.shape and kw[name].dtype == q.dtype
            kw[name].copy_(grad)
        return kw["dq"], kw["dk"], kw["dv"]


def _inject(monkeypatch, fake):
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec("flash_attn") reads it
        monkeypatch.setitem(sys.modules, name, mod)
    iface = sys.modules["flash_attn.cute.interface"]
    iface._flash_attn_fwd, iface._flash_attn_bwd = fake._flash_attn_fwd, fake._flash_attn_bwd


@pytest.fixture
def fake(monkeypatch):
    f = FakeFA4()
    _inject(monkeypatch, f)
    return f


def _backend(monkeypatch):
    """A fresh FA4Backend that runs its kernel path on CPU tensors (through the stand-in)."""
    b = kernels.FA4Backend()
    monkeypatch.setattr(b, "device_types", None)
    monkeypatch.setattr(b, "is_available", lambda: True)
    return b


def _args(x):
    return x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"]


def _run(b, x, window=None, diagonals=None, scale=None):
    args = (*_args(x)[:4], x["softmax_scale"] if scale is None else scale)
    out, lse = b.forward(x["q"], x["k"], x["v"], *args, window=window, diagonals=diagonals)
    return (out, lse, *b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args, window=window,
                                  diagonals=diagonals))


def _expected(x, window, fn, scale=None):
    q, k, v = (x[n].detach().cpu() for n in "qkv")
    if fn is attention_ref:
        q, k, v = q.double(), k.double(), v.double()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, x["cu_seqlens_q"].cpu(), x["cu_seqlens_k"].cpu(),
                  x["softmax_scale"] if scale is None else scale, window)
    out.backward(x["dout"].cpu().to(out.dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _assert_within_2x_plain(ours, x, window, scale=None, atol=1e-3):
    exact, plain = _expected(x, window, attention_ref, scale), _expected(x, window, plain_attention, scale)
    assert ours[1].dtype == torch.float32 and ours[1].shape == x["q"].shape[:2]
    for name, a, p, e in zip(NAMES, ours, plain, exact):
        assert max_error(a, e) <= 2 * max_error(p, e) + atol, (name, max_error(a, e), max_error(p, e))


# ---------------------------------------------------------------- pure parts (CPU)


@pytest.mark.parametrize("lr,expected", [
    ((-1, 0), (True, None, 0)), ((6, 0), (True, 6, 0)), ((0, 0), (True, 0, 0)), ((-1, -1), (False, None, None)),
    ((3, 2), (False, 3, 2)), ((2, -1), (False, 2, None)), ((-1, 4), (False, None, 4))])
def test_window_kwargs_spell_unbounded_as_none(lr, expected):
    assert window_kwargs(*lr) == dict(zip(("causal", "window_size_left", "window_size_right"), expected))


@pytest.mark.parametrize("major", [None, 9, 10, 11, 12])
def test_head_dims_fa4_accepts_per_architecture(major):
    # flash-attn-4 4.0.0b36 interface._validate_head_dims (asserted by _flash_attn_fwd and
    # _flash_attn_bwd): sm90 8..256 in steps of 8; sm100/sm110 8..128 or exactly 256.
    for d in range(0, 272, 4):
        want = d % 8 == 0 and 8 <= d <= 256
        if major in (10, 11):
            want = want and (d <= 128 or d == 256)
        assert kernels_fa4.fa4_head_dim_ok(d, major) is want, (d, major)


def test_lse_layout_conversions():
    ours = torch.tensor([[-INF, 0.5], [1.0, 2.0], [3.0, -INF]])
    fa4 = lse_to_fa4(ours)
    assert fa4.shape == (2, 3) and fa4.is_contiguous() and fa4.dtype == torch.float32
    assert fa4[0, 0] == INF and fa4[1, 2] == INF and fa4[1, 0] == 0.5
    back = lse_from_fa4(fa4, 3, 2)
    assert torch.equal(back, ours) and back.is_contiguous()
    assert torch.equal(lse_from_fa4(ours.t().contiguous(), 3, 2), ours)  # FA4's own -inf kept
    assert lse_to_fa4(ours.double()).dtype == torch.float32
    for bad in (ours, torch.zeros(2, 3, 1), None):
        with pytest.raises(RuntimeError, match="FlashAttention-4 LSE"):
            lse_from_fa4(bad, 3, 2)


# ---------------------------------------------------------------- argument mapping through the stand-in (CPU)


@pytest.mark.parametrize("window", [None, 1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_backward_arguments_and_results(monkeypatch, fake, window, dtype):
    b = _backend(monkeypatch)
    q_lens, k_lens, hq, hkv, d = CASES["odd_gqa4_d128"]  # [1, 3, 97] queries on [1, 50, 101] keys, GQA 4
    x = make_inputs((q_lens, k_lens, hq, hkv, d), dtype, seed=3)
    x["cu_seqlens_q"], x["cu_seqlens_k"] = x["cu_seqlens_q"].long(), x["cu_seqlens_k"].long()  # made int32
    x["max_seqlen_q"], x["max_seqlen_k"] = torch.tensor(97), torch.tensor(101)  # made host ints
    ours = _run(b, x, window)
    (f,), (g,) = fake.fwd, fake.bwd
    for kw in (f, g):
        assert kw["cu_seqlens_q"].tolist() == [0, 1, 4, 101] and kw["cu_seqlens_k"].tolist() == [0, 1, 51, 152]
        assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (97, 101) and kw["softmax_scale"] == d ** -0.5
        assert (kw["causal"], kw["window_size_left"], kw["window_size_right"]) == (
            True, None if window is None else window - 1, 0)
        assert kw["q"].shape == (101, hq, d) and kw["k"].shape == kw["v"].shape == (152, hkv, d)
    assert f["out"] is ours[0] and ours[0].dtype == dtype
    assert torch.equal(g["lse"], lse_to_fa4(ours[1])) and torch.equal(g["dout"], x["dout"])
    assert g["dq"] is ours[2] and g["dk"] is ours[3] and g["dv"] is ours[4]
    _assert_within_2x_plain(ours, x, window, atol=1e-5)


@pytest.mark.parametrize("arity", [2, 4, 5])
def test_forward_reads_only_out_and_lse_whatever_the_arity(monkeypatch, arity):
    fake = FakeFA4(arity)
    _inject(monkeypatch, fake)
    x = make_inputs(CASES["bottom_right_gqa8"], torch.bfloat16, seed=1)
    _assert_within_2x_plain(_run(_backend(monkeypatch), x), x, None, atol=1e-5)


def test_rows_without_keys_and_rows_outside_every_sequence(monkeypatch, fake):
    b = _backend(monkeypatch)
    x = make_inputs(ROWS_WITHOUT_KEYS, torch.bfloat16, seed=2)  # Lq > Lk: 4 rows see nothing
    ours = _run(b, x)
    assert torch.isneginf(ours[1][:4]).all() and (ours[0][:4] == 0).all() and (ours[2][:4] == 0).all()
    assert torch.isposinf(fake.bwd[0]["lse"][:, :4]).all()  # the backward gets FlashAttention's +inf
    _assert_within_2x_plain(ours, x, None, atol=1e-5)
    # Rows past cu_seqlens_q[-1]: no kernel writes them; out 0, lse -inf, dq 0.
    x = make_inputs(([3, 2], [3, 4], 4, 2, 64), torch.bfloat16, seed=3)
    q, dout = torch.cat([x["q"], x["q"][:2]]), torch.cat([x["dout"], x["dout"][:2]])
    out, lse = b.forward(q, x["k"], x["v"], *_args(x))
    dq, _, _ = b.backward(dout, q, x["k"], x["v"], out, lse, *_args(x))
    assert (out[5:] == 0).all() and torch.isneginf(lse[5:]).all() and (dq[5:] == 0).all()


def test_negative_scale_reaches_the_kernel_positive(monkeypatch, fake):
    x = make_inputs(CASES["square_gqa4_d128"], torch.bfloat16, seed=4)
    ours = _run(_backend(monkeypatch), x, window=16, scale=-0.5)
    assert fake.fwd[0]["softmax_scale"] == 0.5 and torch.equal(fake.fwd[0]["q"], -x["q"])
    _assert_within_2x_plain(ours, x, 16, scale=-0.5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 64, 100])
def test_partial_kv_diagonals_run_one_call_per_mask_class(monkeypatch, fake, window):
    q_lens, k_lens, diagonals, hq, hkv, d = EXPRESSIBLE
    x = make_inputs((q_lens, k_lens, hq, hkv, d), torch.bfloat16, seed=9)
    b = _backend(monkeypatch)
    with pytest.raises(ValueError, match="cannot express"):  # a window too short for the first task
        b.forward(x["q"], x["k"], x["v"], *_args(x), window=16, diagonals=diagonals)
    ours = _run(b, x, window, diagonals)
    classes = kernels.mask_classes(q_lens, k_lens, diagonals, window)
    want = [window_kwargs(*lr) for lr, _ in classes]
    for calls in (fake.fwd, fake.bwd):
        assert [{n: kw[n] for n in want[0]} for kw in calls] == want
        for kw, (_, idx) in zip(calls, classes):
            assert kw["max_seqlen_q"] == max(q_lens[i] for i in idx)
    assert len(classes) > 1 and any(w["window_size_right"] is None for w in want)
    for name, a, e in zip(NAMES, ours, _diagonal_oracle(x, window, diagonals)):
        assert max_error(a, e) <= 2e-2 * max(1.0, e[torch.isfinite(e)].abs().max().item()), name


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float64, 64), (torch.bfloat16, 36)])
def test_other_inputs_go_to_the_reference_math(monkeypatch, fake, dtype, d):
    x = make_inputs(([5, 9], [7, 9], 4, 2, d), dtype, seed=5)
    ours = _run(_backend(monkeypatch), x, window=4)
    assert not fake.fwd and not fake.bwd
    exact = _expected(x, 4, attention_ref)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for name, a, e in zip(NAMES, ours, exact):
        assert max_error(a, e) <= tol * max(1.0, e[torch.isfinite(e)].abs().max().item()), name


# ---------------------------------------------------------------- availability, `auto`, lazy import (CPU)


@pytest.fixture
def fresh_cache():
    kernels_fa4.fa4_available.cache_clear()
    yield
    kernels_fa4.fa4_available.cache_clear()


def _fake_cuda(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


def test_unavailable_without_cuda(monkeypatch, fake, fresh_cache):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not kernels_fa4.fa4_available() and not BACKENDS["fa4"].is_available()
    assert "fa4" not in available_backends("cuda") and "fa4" not in available_backends("cpu")
    with pytest.raises(ValueError, match="fa4.*cannot run on this install"):
        kernels.check_backend_name("fa4")
    with pytest.raises(ValueError, match="'fa4' is not available on cpu"):
        get_backend("fa4", "cpu")


@pytest.mark.parametrize("capability,expected", [((9, 0), True), ((10, 0), True), ((8, 9), False)])
def test_available_on_sm90_and_newer_with_the_package(monkeypatch, fake, fresh_cache, capability, expected):
    _fake_cuda(monkeypatch, capability)
    assert kernels_fa4.fa4_available() is expected
    assert BACKENDS["fa4"].supports("cuda") is expected and not BACKENDS["fa4"].supports("cpu")


def test_unavailable_without_the_package_or_when_it_cannot_import(monkeypatch, tmp_path, fresh_cache):
    _fake_cuda(monkeypatch, (9, 0))
    saved = {n: m for n, m in sys.modules.items() if n == "flash_attn" or n.startswith("flash_attn.")}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    real = kernels_fa4.importlib.util.find_spec
    monkeypatch.setattr(kernels_fa4.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real(name, *a))
    assert not kernels_fa4.fa4_installed() and not kernels_fa4.fa4_available()
    monkeypatch.setattr(kernels_fa4.importlib.util, "find_spec", real)
    # A namespace package flash_attn/cute (as the flash-attn-4 wheel installs it) whose import fails.
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    iface = tmp_path / "flash_attn" / "cute" / "interface.py"
    iface.write_text("raise ImportError('no CUTLASS DSL here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert kernels_fa4.fa4_installed() and "flash_attn" not in sys.modules  # found, not imported
        assert not kernels_fa4.fa4_available()
        kernels_fa4.fa4_available.cache_clear()
        iface.write_text("def _flash_attn_fwd(**kw): pass\ndef _flash_attn_bwd(**kw): pass\n")
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]
        kernels_fa4.importlib.invalidate_caches()
        assert kernels_fa4.fa4_available()
    finally:
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.parametrize("installed,expected", [
    ({"cudnn", "fa4", "flash_attn", "torch_varlen"}, "cudnn"), ({"fa4", "flash_attn", "torch_varlen"}, "fa4"),
    ({"fa4", "torch_varlen"}, "fa4"), ({"flash_attn", "torch_varlen"}, "flash_attn"),
    ({"torch_varlen"}, "torch_varlen")])
def test_auto_order_cudnn_fa4_flash_attn_torch_varlen(monkeypatch, installed, expected):
    for name in ("cudnn", "fa4", "flash_attn", "torch_varlen"):
        monkeypatch.setattr(BACKENDS[name], "is_available", lambda n=name: n in installed)
    assert get_backend("auto", "cuda").name == expected
    assert isinstance(BACKENDS["fa4"], kernels.FA4Backend) and get_backend("auto", "cpu").name == "torch_cpu"


def test_importing_distca_server_imports_no_flash_attn():
    code = ("import sys, distca_server, distca_server.kernels as k, distca_server.kernels_fa4\n"
            "assert k.get_backend('auto', 'cpu').name == 'torch_cpu' and 'fa4' in k.BACKENDS\n"
            "loaded = [m for m in sys.modules if m == 'flash_attn' or m.startswith('flash_attn.')]\n"
            "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- GPU (marked `gpu`: tests/conftest.py skips them without CUDA)


def _fa4_or_skip():
    if not BACKENDS["fa4"].is_available():
        pytest.skip("fa4 backend not available (flash-attn-4 or an sm90+ GPU missing)")
    return BACKENDS["fa4"]


def _random_case(rng, hq, hkv, d):
    n = rng.randint(1, 6)
    k_lens = [rng.choice([1, 2, 3, rng.randint(4, 300)]) for _ in range(n)]
    q_lens = [rng.choice([lk, rng.randint(1, lk)]) for lk in k_lens]  # partial queries: Lq <= Lk
    return q_lens, k_lens, hq, hkv, d


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [None, 1, 7, 64])
@pytest.mark.parametrize("heads", [(8, 2, 128), (8, 1, 64), (4, 4, 128)],
                         ids=["gqa4_d128", "gqa8_d64", "mha_d128"])
def test_gpu_matches_the_float64_oracle_over_random_lengths(seed, window, heads):
    b = _fa4_or_skip()
    x = make_inputs(_random_case(random.Random(seed), *heads), torch.bfloat16, device="cuda", seed=seed)
    _assert_within_2x_plain([t.cpu() for t in _run(b, x, window)], x, window)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 2])
def test_gpu_rows_without_keys_and_empty_sequences(window):
    b = _fa4_or_skip()
    x = make_inputs(([9, 0, 4, 1], [5, 3, 4, 1], 4, 2, 64), torch.float16, device="cuda", seed=1)
    _assert_within_2x_plain([t.cpu() for t in _run(b, x, window)], x, window)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 64, 100])
def test_gpu_partial_kv_diagonals_match_the_definition(window):
    b = _fa4_or_skip()
    q_lens, k_lens, diagonals, hq, hkv, d = EXPRESSIBLE
    x = make_inputs((q_lens, k_lens, hq, hkv, d), torch.bfloat16, device="cuda", seed=9)
    ours = _run(b, x, window, diagonals)
    expected = _diagonal_oracle({n: (t.cpu() if torch.is_tensor(t) else t) for n, t in x.items()}, window,
                                diagonals)
    for name, a, e in zip(NAMES, ours, expected):
        assert max_error(a.cpu(), e) <= 2e-2 * max(1.0, e[torch.isfinite(e)].abs().max().item()), name
