"""Sliding-window masks in the kernel backends: every backend against the windowed float64
oracle, the CPU backend's pieces against brute force, and the GPU kernels' window argument."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_kernels import CASES, NAMES, ROWS_WITHOUT_KEYS, make_inputs, max_error

from distca_server import kernels
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
        for r0, r1, c0, c1, kind in kernels._mask_pieces(lq, lk, window, chunk_elems):
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


def test_gpu_kernels_window_argument():
    """FlashAttention's (left, right) for a causal window W: W - 1 keys before the diagonal."""
    assert kernels._window_size(None) == [-1, 0]
    assert kernels._window_size(1) == [0, 0]
    assert kernels._window_size(4096) == [4095, 0]


@pytest.mark.parametrize("window", [0, -1, 1.5, True, "3"])
def test_bad_window_raises_value_error(window):
    x = make_inputs(CASES["one_doc_mha"], torch.float64)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    for b in ("reference", "torch_cpu"):
        with pytest.raises(ValueError, match="window must be a positive int"):
            BACKENDS[b].forward(x["q"], x["k"], x["v"], *args, window=window)


def test_windowed_cpu_memory_is_per_chunk():
    """A long sequence with a short window: pieces span rows x (rows + W) keys, never Lq x Lk."""
    pieces = kernels._mask_pieces(20000, 20000, 16)
    assert max((r1 - r0) * (c1 - c0) for r0, r1, c0, c1, _ in pieces) <= 64 * (64 + 16)
    assert sum(r1 - r0 for r0, r1, *_ in pieces) == 20000
    assert list(itertools.chain.from_iterable(range(r0, r1) for r0, r1, *_ in pieces)) == list(range(20000))
