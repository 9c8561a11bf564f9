"""The FlashAttention-2 backends on CUDA: torch's own varlen kernels (``torch_varlen``) and the
``flash-attn`` package (``flash_attn``), with the LSE layouts they use (the contract is the
module doc of :mod:`distca_server.kernels`)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os

import torch

from .kernel_base import _NEG_INF, AttentionBackend, _BandedKernel


def flash_attn2_installed() -> bool:
    """Whether flash-attn 2's ``flash_attn`` package is installed, judged without importing it (its
    import loads the CUDA extension): a regular package (``flash_attn/__init__.py``, which exports
    ``flash_attn_varlen_func``) with ``flash_attn_interface.py`` beside it. flash-attn-4's wheel
    (4.0.0b36) ships ``flash_attn/cute/...`` and no ``flash_attn/__init__.py``: alone it makes
    ``flash_attn`` a namespace package (spec origin None) that ``find_spec`` still finds but from
    which ``from flash_attn import flash_attn_varlen_func`` fails."""
    try:
        spec = importlib.util.find_spec("flash_attn")  # a top-level name: found, not imported
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a __spec__
        return False
    if spec is None or spec.origin is None:
        return False
    return os.path.isfile(os.path.join(os.path.dirname(spec.origin), "flash_attn_interface.py"))


def fa2_max_seqlen_k(max_seqlen_q: int, max_seqlen_k: int, left: int, right: int) -> int:
    """``max_seqlen_k`` for FlashAttention-2's varlen kernels such that they mask exactly the window
    ``(left, right)`` (-1: unbounded side).

    Args: max_seqlen_q, max_seqlen_k: ints, bounds on the call's query / key sequence lengths;
    left, right: the window. Returns: ``max(max_seqlen_q, max_seqlen_k)`` where FA2 would rewrite
    the right side wrongly (``right > 0``, or ``left >= 0`` with ``right = -1``), else
    ``max_seqlen_k``.

    FA2 rewrites the window against this argument M (torch's
    ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``, as flash-attn's
    ``csrc/flash_attn/flash_api.cpp``): ``mha_varlen_fwd`` / ``mha_varlen_bwd`` make a side ``>= M``
    unbounded, then ``set_params_fprop`` gives an unbounded side M when the other one is bounded;
    the kernel keeps keys ``r + Lk - Lq - left <= j <= r + Lk - Lq + right``. A left side
    ``>= Lk - 1`` and a right side ``>= Lq - 1`` hide no key, so the rewrites are exact once M bounds
    every Lk (always) and, for the right side, every Lq. With M = max_seqlen_k and Lq > Lk, a right
    bound ``e >= max_seqlen_k`` (a diagonal above the bottom-right one) became full attention, and
    ``(left >= 0, -1)`` got the right side ``max_seqlen_k < Lq - 1``, which dropped keys. M is only a
    bound: the kernels mask with each sequence's lengths from cu_seqlens (``block_info.h``);
    ``mha_varlen_bwd`` sizes ``softmax_d`` and ``dq_accum`` by total_q and the batch, not by M, and
    its key blocks past a sequence's Lk exit at once (``compute_dq_dk_dv_1colblock``).
    tests/unit/test_kernel_masks.py emulates the rewrites.
    """
    return max(max_seqlen_q, max_seqlen_k) if right > 0 or (right < 0 <= left) else max_seqlen_k


def _flash_kernel_handles(q) -> bool:
    # FlashAttention-2 kernels: fp16/bf16 only, head_dim a multiple of 8 up to 256.
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] % 8 == 0 and q.shape[2] <= 256


def _lse_from_kernel(lse, cu_seqlens_q, total_q, num_heads):
    """FlashAttention LSE -> (ours: [T_q, H] float32 with -inf on rows without keys, its layout).

    Kernels return [H, T_q] ("heads_first"; assumed when H == T_q makes the shape ambiguous) or, in
    older flash-attn, [B, H, max_seqlen_q] ("padded"); they mark rows without keys with +inf.
    """
    layout = "padded" if lse.dim() == 3 else "heads_first" if lse.shape == (num_heads, total_q) else (
        "tokens_first" if lse.shape == (total_q, num_heads) else None)
    if layout is None:
        raise RuntimeError(f"unexpected kernel LSE shape {tuple(lse.shape)} for T_q={total_q}, H={num_heads}")
    if layout == "padded":
        b, r = _token_positions(cu_seqlens_q)
        lse = lse[b, :, r]
    lse = (lse.t() if layout == "heads_first" else lse).float()
    return lse.masked_fill(lse == float("inf"), _NEG_INF).contiguous(), layout


def _lse_to_kernel(lse, layout, cu_seqlens_q, max_seqlen_q):
    """Inverse of `_lse_from_kernel` for `layout` in {"heads_first", "tokens_first", "padded"}."""
    lse = lse.float().masked_fill(lse == _NEG_INF, float("inf"))
    if layout == "tokens_first":
        return lse.contiguous()
    if layout == "heads_first":
        return lse.t().contiguous()
    b, r = _token_positions(cu_seqlens_q)
    padded = lse.new_full((cu_seqlens_q.numel() - 1, lse.shape[1], max_seqlen_q), float("inf"))
    padded[b, :, r] = lse
    return padded


def _token_positions(cu_seqlens_q):
    """(sequence, row within it) of every query row, [T_q] int64 each; cu_seqlens_q[0] must be 0."""
    cu = cu_seqlens_q.long()
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu.diff())
    return seq, torch.arange(seq.numel(), device=cu.device) - cu[seq]


class TorchVarlenBackend(_BandedKernel, AttentionBackend):
    """torch's built-in FlashAttention-2 varlen kernels (CUDA): the aten ops
    ``_flash_attention_forward`` / ``_flash_attention_backward`` that
    ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) wraps. Causal via window (-1, 0),
    which the kernel aligns bottom-right; a sliding window W is (W - 1, 0); GQA native.

    The aten ops are called by keyword rather than through the private ``torch_attn::_varlen_attn``
    custom op: that op's positional parameters changed between torch releases (2.11 and 2.13 differ),
    while the aten schemas have kept theirs. LSE layout: ``[H, T_q]`` float32 on recent torch,
    ``[B, H, max_seqlen_q]`` on older builds; :func:`_lse_from_kernel` reads either.
    """

    name = "torch_varlen"
    device_types = ("cuda",)

    def __init__(self):
        self._lse_layout = "heads_first"  # what torch's fake kernel declares; refined at first call

    def is_available(self):
        return torch.cuda.is_available() and importlib.util.find_spec("torch.nn.attention.varlen") is not None

    def _kernel_handles(self, q):
        return _flash_kernel_handles(q)

    def _banded_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        left, right):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k, left, right), 0.0, right == 0, False,
            scale=scale, window_size_left=left, window_size_right=right)[:2]
        lse, self._lse_layout = _lse_from_kernel(lse, cu_seqlens_q, q.shape[0], q.shape[1])
        return out, lse

    def _banded_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, scale, left, right):
        # Dropout is off, so the Philox state is never read, but the op wants its two tensors.
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
            _lse_to_kernel(lse, self._lse_layout, cu_seqlens_q, max_seqlen_q),
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k, left, right),
            0.0, right == 0, rng_state, unused,
            scale=scale, window_size_left=left, window_size_right=right)
        return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _parameter_names(fn) -> tuple[tuple[str, bool], ...]:
    # torch.library custom ops wrap the Python function; its signature is on `_init_fn`.
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values()
    return tuple((p.name, p.default is inspect.Parameter.empty) for p in params)


def _call_by_name(fn, values: dict):
    """Call `fn` with the entries of `values` it accepts: flash-attn's private backward changed its
    positional order across versions (window_size -> window_size_left/right, softcap added)."""
    names = _parameter_names(fn)
    missing = [n for n, required in names if required and n not in values]
    if missing:
        raise RuntimeError(f"unsupported flash-attn version: {fn} needs unknown arguments {missing}")
    return fn(**{n: values[n] for n, _ in names if n in values})


class FlashAttnBackend(_BandedKernel, AttentionBackend):
    """The `flash-attn` package (Dao 2023), `flash_attn_varlen_func(..., causal=True)`: bottom-right
    causal since flash-attn 2.1; a sliding window W is `window_size=(W - 1, 0)` (flash-attn >= 2.3);
    GQA native; LSE from `return_attn_probs=True`."""

    name = "flash_attn"
    device_types = ("cuda",)

    def __init__(self):
        self._lse_layout = "heads_first"  # recent flash-attn's unpadded varlen LSE; refined at first call

    def is_available(self):
        return torch.cuda.is_available() and flash_attn2_installed()

    def _kernel_handles(self, q):
        return _flash_kernel_handles(q)

    def _banded_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        left, right):
        from flash_attn import flash_attn_varlen_func

        out, lse, _ = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k, left, right), dropout_p=0.0,
            softmax_scale=scale, causal=right == 0, window_size=(left, right), return_attn_probs=True)
        lse, self._lse_layout = _lse_from_kernel(lse, cu_seqlens_q, q.shape[0], q.shape[1])
        return out, lse

    def _banded_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, scale, left, right):
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # Same arguments as flash-attn's own autograd backward: the window (its forward turns
        # causal into right = 0; -1 is unbounded).
        _call_by_name(_flash_attn_varlen_backward, dict(
            dout=dout.contiguous(), q=q, k=k, v=v, out=out.contiguous(),
            softmax_lse=_lse_to_kernel(lse, self._lse_layout, cu_seqlens_q, max_seqlen_q),
            dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k, left, right),
            dropout_p=0.0, softmax_scale=scale,
            causal=right == 0, window_size=(left, right), window_size_left=left, window_size_right=right,
            softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None))
        return dq, dk, dv
