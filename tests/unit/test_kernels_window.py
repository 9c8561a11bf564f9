"""Sliding-window masks in the kernel backends: every backend against the windowed float64
oracle, the CPU backend's pieces against brute force, and the GPU kernels' window argument."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_kernels import CASES, NAMES, ROWS_WITHOUT_KEYS, make_inputs, max_error

from distca_server import kernel_base, kernels
from distca_server.kernels import BACKENDS
from distca_server.refs import attention_ref, plain_attention

WINDOWS = [1, 2, 7, 64, 10**6]


def oracle(x, window):
    q, k, v = (x[n].detach().double().requires_grad_() for n in "qkv")
    out, lse = attention_ref(q, k, v, x["cu_seqlens_q"], x["cu_seqlens_k"], x["softmax_scale"], window)
    out.backward(x["dout"].double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def plain(x, window):
    q, k, v = (x[n].detach().requires_grad_() for n in "qkv")
    out, lse = plain_attention(q, k, v, x["cu_seqlens_q"], x["cu_seqlens_k"], x["softmax_scale"], window)
    out.backward(x["dout"])
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run(backend, x, window):
    b = BACKENDS[backend]
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    out, lse = b.forward(x["q"], x["k"], x["v"], *args, window=window)
    return (out, lse, *b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args, window=window))


ALL_CASES = {**CASES, "rows_without_keys": ROWS_WITHOUT_KEYS}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_windowed_backends_match_the_windowed_oracle(case, dtype, rtol, backend, window):
    x = make_inputs(ALL_CASES[case], dtype, seed=4)
    expected = oracle(x, window)
    for name, a, e in zip(NAMES, run(backend, x, window), expected):
        magnitude = max(1.0, e[torch.isfinite(e)].abs().max().item()) if torch.isfinite(e).any() else 1.0
        assert max_error(a, e) <= rtol * magnitude, (name, max_error(a, e))


@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
@pytest.mark.parametrize("window", [2, 7, 64])
def test_windowed_bf16_within_2x_of_plain_torch(backend, window):
    x = make_inputs(CASES["odd_gqa4_d128"], torch.bfloat16, seed=2)
    expected = oracle(x, window)
    for name, a, p, e in zip(NAMES, run(backend, x, window), plain(x, window), expected):
        assert max_error(a, e) <= 2 * max_error(p, e) + 1e-5, name


@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 5), (9, 4), (4, 9), (300, 300), (130, 1000), (1000, 130)])
@pytest.mark.parametrize("window", [1, 3, 64, 129, 2000])
def test_cpu_mask_pieces_cover_each_visible_pair_once(lq, lk, window):
    """Small chunks (chunk_elems) force many pieces; each visible pair in exactly one, no piece
    has a row that sees nothing there, causal pieces are squares."""
    for chunk_elems in (1, 1 << 22):
        count = torch.zeros(lq, lk, dtype=torch.int64)
        for r0, r1, c0, c1, kind in kernel_base._mask_pieces(lq, lk, window, chunk_elems):
            r = torch.arange(r0, r1)[:, None]
            c = torch.arange(c0, c1)[None, :]
            if kind == "full":
                seen = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool)
            elif kind == "causal":
                assert r1 - r0 == c1 - c0
                seen = (c - c0) <= (r - r0)
            else:
                seen = (c <= r + lk - lq) & (c > r + lk - lq - window)
            assert seen.any(dim=1).all()
            count[r0:r1, c0:c1] += seen
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        want = (j <= i + lk - lq) & (j > i + lk - lq - window)
        assert torch.equal(count, want.long())


def _diagonal_oracle(x, window, diagonals):
    """float64 (out, lse, dq, dk, dv) with sequence b's row r seeing key c iff
    r + d_b - W < c <= r + d_b, straight from the definition (autograd for the gradients)."""
    q, k, v = (x[n].detach().double().requires_grad_() for n in "qkv")
    cq, ck = x["cu_seqlens_q"].tolist(), x["cu_seqlens_k"].tolist()
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b, (qa, qb, ka, kb) in enumerate(zip(cq, cq[1:], ck, ck[1:])):
        r = torch.arange(qb - qa)[:, None] + diagonals[b]
        c = torch.arange(kb - ka)[None, :]
        seen = (c <= r) & ((c > r - window) if window is not None else True)
        s = (q[qa:qb].transpose(0, 1) @ k[ka:kb].repeat_interleave(group, 1).transpose(0, 1).transpose(1, 2))
        s = (s * x["softmax_scale"]).masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[..., None])
        outs.append((p @ v[ka:kb].repeat_interleave(group, 1).transpose(0, 1)).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    out = torch.cat(outs)
    out.backward(x["dout"].double())
    return out.detach(), torch.cat(lses).detach(), q.grad, k.grad, v.grad


# Partial-KV tasks as sequences: (Lq, Lk, diagonal = q_start - kv_start): keys ending before the
# queries (past blocks, every row sees all or some), the diagonal block, rows that see nothing.
PARTIAL = ([30, 30, 30, 7, 1, 12], [10, 25, 30, 40, 5, 12], [40, 5, 0, 3, 9, 20], 4, 2, 16)
# The shapes a valid plan makes (keys never past the queries): FlashAttention-expressible.
EXPRESSIBLE = ([30, 30, 30, 1, 12], [10, 25, 30, 5, 12], [40, 5, 0, 9, 20], 4, 2, 16)
# (q_lens, k_lens, diagonals, window) whose windows FlashAttention-2 rewrites against max_seqlen_k
# (tests/unit/test_kernel_masks.py): Lq > Lk with a diagonal above the bottom-right one, class
# (-1, 10), which max_seqlen_k = 4 made full attention; class (0, -1), whose right side became
# max_seqlen_k = 512 (130,816 pairs lost); both among other classes; and an empty sequence, which
# mask_classes puts in the first class.
CLAMPED = {
    "right_bound_past_max_k": ([12], [4], [2], None),
    "left_bound_lq_gt_max_k": ([1024], [512], [511], 1024),
    "mixed_classes": ([12, 8, 30, 40], [4, 8, 10, 8], [2, 0, 40, 30], None),
    "mixed_windowed": ([1024, 12, 8], [512, 4, 8], [511, 2, 0], 1024),
    "empty_sequence": ([4, 0, 12], [4, 5, 4], [0, 0, 2], None),
}


@pytest.mark.parametrize("window", [None, 3, 16, 100])
@pytest.mark.parametrize("case", ["partial", "expressible"])
@pytest.mark.parametrize("backend", ["reference", "torch_cpu", "banded"])
def test_per_sequence_diagonals_match_the_definition(backend, window, case):
    q_lens, k_lens, diagonals, hq, hkv, d = PARTIAL if case == "partial" else EXPRESSIBLE
    x = make_inputs((q_lens, k_lens, hq, hkv, d), torch.float64, seed=9)
    expected = _diagonal_oracle(x, window, diagonals)
    b = FakeBanded() if backend == "banded" else BACKENDS[backend]
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    if backend == "banded":
        # A (left, right) window cannot hide keys on both sides of what a row sees beyond its
        # band: keys after the last row's diagonal, or (windowed) keys before the first row's.
        inexpressible = [(lq, lk, dd) for lq, lk, dd in zip(q_lens, k_lens, diagonals)
                         if (dd - (lk - lq) < 0 and lk - 1 > dd)
                         or (window is not None and dd - (lk - lq) > window - 1 and window < lq + dd)]
        if inexpressible:
            with pytest.raises(ValueError, match="window_size cannot express"):
                b.forward(x["q"], x["k"], x["v"], *args, window=window, diagonals=diagonals)
            return
    out, lse = b.forward(x["q"], x["k"], x["v"], *args, window=window, diagonals=diagonals)
    grads = b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args, window=window, diagonals=diagonals)
    for name, a, e in zip(NAMES, (out, lse, *grads), expected):
        assert max_error(a, e) <= 1e-10, name


@pytest.mark.parametrize("backend", ["reference", "torch_cpu", "banded"])
@pytest.mark.parametrize("case", CLAMPED)
def test_clamped_shapes_match_the_definition(backend, case):
    # The GPU test's shapes on the CPU: mask classes and per-class calls (banded) are exact there.
    q_lens, k_lens, diagonals, window = CLAMPED[case]
    x = make_inputs((q_lens, k_lens, 4, 2, 64), torch.float64, seed=11)
    b = FakeBanded() if backend == "banded" else BACKENDS[backend]
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    out, lse = b.forward(x["q"], x["k"], x["v"], *args, window=window, diagonals=diagonals)
    grads = b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args, window=window, diagonals=diagonals)
    for name, a, e in zip(NAMES, (out, lse, *grads), _diagonal_oracle(x, window, diagonals)):
        assert max_error(a, e) <= 1e-10, name


class FakeBanded(kernel_base._BandedKernel, kernels.ReferenceBackend):
    """A FlashAttention-style backend on the CPU: one (left, right) window per call, computed by
    the reference math one sequence at a time; records its calls."""

    name = "fake_banded"

    def __init__(self):
        self.calls = []

    def _banded(self, cu_q, cu_k, left, right):
        """(window, diagonals) of the reference that equal FlashAttention's (left, right)."""
        cq, ck = cu_q.tolist(), cu_k.tolist()
        diags, windows = [], set()
        for qa, qb, ka, kb in zip(cq, cq[1:], ck, ck[1:]):
            base = (kb - ka) - (qb - qa)
            dd = base + right if right >= 0 else (kb - ka) - 1 + 0
            diags.append(dd)
            windows.add(None if left < 0 else dd - base + left + 1)
        assert len(windows) <= 1 or right >= 0
        return (windows.pop() if len(windows) == 1 else None), diags

    def _banded_forward(self, q, k, v, cu_q, cu_k, mq, mk, scale, left, right):
        self.calls.append((left, right))
        window, diags = self._banded(cu_q, cu_k, left, right)
        return kernels.ReferenceBackend._forward(self, q, k, v, cu_q, cu_k, mq, mk, scale,
                                                 kernel_base._Mask(window, diags))

    def _banded_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, left, right):
        window, diags = self._banded(cu_q, cu_k, left, right)
        return kernels.ReferenceBackend._backward(self, dout, q, k, v, out, lse, cu_q, cu_k, mq, mk,
                                                  scale, kernel_base._Mask(window, diags))


def test_banded_backends_make_one_call_per_mask_class():
    """A partial-KV server without a window: diagonal blocks (-1, 0) and fully visible past
    blocks (-1, -1), two kernel calls; bottom-right everywhere: one."""
    classes = kernels.mask_classes([4, 4, 4, 1], [4, 8, 3, 2], [0, 4, 7, 5], None)
    assert classes == [((-1, 0), [0, 1]), ((-1, -1), [2, 3])]
    assert kernels.mask_classes([4], [8], [4], 5) == [((4, 0), [0])]  # W - 1 keys before the diagonal
    b = FakeBanded()
    x = make_inputs(([4, 4, 4, 1], [4, 8, 3, 2], 2, 1, 8), torch.float64)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    b.forward(x["q"], x["k"], x["v"], *args, diagonals=[0, 4, 7, 5])
    assert b.calls == [(-1, 0), (-1, -1)]
    b.calls.clear()
    b.forward(x["q"], x["k"], x["v"], *args)
    assert b.calls == [(-1, 0)]
    with pytest.raises(ValueError, match="diagonals must be 4 ints"):
        b.forward(x["q"], x["k"], x["v"], *args, diagonals=[0, 1])


@pytest.mark.parametrize("window", [0, -1, 1.5, True, "3"])
def test_bad_window_raises_value_error(window):
    x = make_inputs(CASES["one_doc_mha"], torch.float64)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    for b in ("reference", "torch_cpu"):
        with pytest.raises(ValueError, match="window must be a positive int"):
            BACKENDS[b].forward(x["q"], x["k"], x["v"], *args, window=window)


def test_windowed_cpu_memory_is_per_chunk():
    """A long sequence with a short window: pieces span rows x (rows + W) keys, never Lq x Lk."""
    pieces = kernel_base._mask_pieces(20000, 20000, 16)
    assert max((r1 - r0) * (c1 - c0) for r0, r1, c0, c1, _ in pieces) <= 64 * (64 + 16)
    assert sum(r1 - r0 for r0, r1, *_ in pieces) == 20000
    assert list(itertools.chain.from_iterable(range(r0, r1) for r0, r1, *_ in pieces)) == list(range(20000))


# ---------------------------------------------------------------- GPU (marked `gpu`: tests/conftest.py skips them without CUDA)


def _on_cuda(x):
    return {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in x.items()}


def _check_gpu_diagonals(backend, x, window, diagonals):
    """``backend``'s forward and backward on CUDA inputs ``x`` against the float64 oracle of the
    same window and per-sequence diagonals, to bf16 rounding of O(1) values."""
    expected = _diagonal_oracle({n: (t.cpu() if torch.is_tensor(t) else t) for n, t in x.items()}, window,
                                diagonals)
    b = BACKENDS[backend]
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    out, lse = b.forward(x["q"], x["k"], x["v"], *args, window=window, diagonals=diagonals)
    grads = b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args, window=window, diagonals=diagonals)
    for name, a, e in zip(NAMES, (out, lse, *grads), expected):
        scale = max(1.0, e[torch.isfinite(e)].abs().max().item())
        assert max_error(a.cpu(), e) <= 2e-2 * scale, name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn", "cudnn", "fa4"])
@pytest.mark.parametrize("window", [1, 7, 64, 10**6])
@pytest.mark.parametrize("case", ["odd_gqa4_d128", "bottom_right_gqa8", "rows_without_keys"])
def test_gpu_windowed_bf16_within_2x_of_plain_torch(backend, window, case):
    if not BACKENDS[backend].is_available():
        pytest.skip(f"{backend} not available")
    x = _on_cuda(make_inputs(ALL_CASES[case], torch.bfloat16, seed=5))
    expected = oracle(x, window)
    for name, a, p, e in zip(NAMES, run(backend, x, window), plain(x, window), expected):
        a, p, e = a.cpu(), p.cpu(), e.cpu()
        assert max_error(a, e) <= 2 * max_error(p, e) + 1e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn", "cudnn", "fa4"])
@pytest.mark.parametrize("window", [None, 3, 16, 100])
def test_gpu_partial_kv_diagonals_match_the_definition(backend, window):
    # The shapes a valid partial-KV plan makes: one kernel call per (left, right) mask class.
    if not BACKENDS[backend].is_available():
        pytest.skip(f"{backend} not available")
    q_lens, k_lens, diagonals, hq, hkv, d = EXPRESSIBLE
    x = _on_cuda(make_inputs((q_lens, k_lens, hq, hkv, d), torch.bfloat16, seed=9))
    if window is not None and any(dd - (lk - lq) > window - 1 and window < lq + dd
                                  for lq, lk, dd in zip(q_lens, k_lens, diagonals)):
        pytest.skip("not expressible as one (left, right) window per class")
    _check_gpu_diagonals(backend, x, window, diagonals)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn", "cudnn", "fa4"])
@pytest.mark.parametrize("case", CLAMPED)
def test_gpu_windows_fa2_rewrites_keep_the_definition(backend, case):
    # FA2's flash_api.cpp drops a window side >= max_seqlen_k and gives an unbounded side
    # max_seqlen_k; distca_server.kernels_flash.fa2_max_seqlen_k passes a bound that keeps both exact.
    if not BACKENDS[backend].is_available():
        pytest.skip(f"{backend} not available")
    q_lens, k_lens, diagonals, window = CLAMPED[case]
    x = _on_cuda(make_inputs((q_lens, k_lens, 4, 2, 64), torch.bfloat16, seed=11))
    _check_gpu_diagonals(backend, x, window, diagonals)
