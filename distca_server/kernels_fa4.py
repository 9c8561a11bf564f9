"""The ``fa4`` attention backend: FlashAttention-4, the CuTe-DSL kernels of ``flash-attn-4``.

Install: ``pip install 'flash-attn-4==4.0.0b36'`` (the ``fa4`` extra; with a CUDA 13 torch add its
``cu13`` extra, ``flash-attn-4[cu13]``, which brings ``nvidia-cutlass-dsl-libs-cu13``). The GPU
machine reaches no package index: carry the wheels (flash-attn-4, nvidia-cutlass-dsl and its
``-libs-cu13``, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, einops) in the device call
(issue 21: about 97.5 MiB as wheels, 55 MiB xz-compressed). The package (import path
``flash_attn.cute``; it brings CUTLASS and compiles kernels on first use) is imported on first use
only, never when this module or :mod:`distca_server` is imported.

Read against (pinned): PyPI ``flash-attn-4`` 4.0.0b36 (wheel sha256 ``b6f0e2a2...95d2``), file
``flash_attn/cute/interface.py`` (sha256 ``7665cf3a...6e1d``; repository Dao-AILab/flash-attention,
whose ``e89594094a37`` of 2026-08-21 has the same parameter names). Its private entry points are
called directly, by keyword: torch 2.11's FA4 hook expects a 2-tuple, and the forward's arity
changes between releases (4 values at ``e89594094a37``, 5 in 4.0.0b36), so only ``[0]`` and ``[1]``
are read::

    _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
        seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, ..., softmax_scale=None, causal=False,
        softcap=None, window_size_left=None, window_size_right=None, ..., return_lse=False,
        out=None, lse=None, ...) -> (out, lse, p, row_max, o_lo)
    _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
        window_size_left=None, window_size_right=None, ..., cu_seqlens_q=None, cu_seqlens_k=None,
        seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False,
        dq=None, dk=None, dv=None, ...) -> (dq, dk, dv)

Varlen (packed THD): q, out, dout, dq ``[T_q, H_q, D]``; k, v, dk, dv ``[T_k, H_kv, D]``;
fp16/bf16 (the backward asserts it); ``H_q % H_kv == 0`` (GQA, native); head_dim 8..256 and a
multiple of 8 on sm90, but on sm100/sm110 only 8..128 or exactly 256 (``_validate_head_dims``; other
head dims go to the reference math there); cu_seqlens int32, contiguous, ``[B + 1]``;
max_seqlen_* host ints. LSE: ``[H_q, T_q]`` float32, natural log (``softmax.finalize`` multiplies
its log2 sum by ln 2), -inf on rows that see no key (the forward writes out 0 there). The
backward's preprocess reads a -inf LSE as 0; we pass +inf there instead (FlashAttention's
convention, as :func:`distca_server.kernels_flash._lse_to_kernel`), so P = exp(S - lse) is 0 whatever
the mask.

Masks (module doc of :mod:`distca_server.kernels`): FA4 aligns causal and windows bottom-right
(``block_info``: key bound ``m + seqlen_k - seqlen_q``) and spells "unbounded" as ``None``: a -1
would be read as a bound (``_resolve_causal_local_window`` drops -1 only when both sides are).
A FlashAttention window ``(left, right)`` (-1 unbounded) is therefore ``window_size_left = left``
or None, ``window_size_right = right`` or None, ``causal = right == 0``; distca's sliding window W
is ``(W - 1, 0)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys

import torch

__all__ = ["FA4Kernels", "fa4_available", "fa4_installed", "window_kwargs", "lse_from_fa4", "lse_to_fa4",
           "fa4_head_dim_ok"]

_MODULE = "flash_attn.cute.interface"
_MIN_MAJOR = 9  # sm90 (Hopper) and newer


def fa4_installed() -> bool:
    """Whether ``flash_attn.cute.interface`` can be imported, judged without importing anything
    (the ``flash_attn`` package's folders are searched for ``cute/interface.py``)."""
    if _MODULE in sys.modules:
        return True
    try:
        spec = importlib.util.find_spec("flash_attn")  # a top-level name: found, not imported
    except (ImportError, ValueError):
        return False
    paths = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(p, "cute", "interface.py")) for p in paths)


def _interface():
    """The ``flash_attn.cute.interface`` module (imported here, on first use)."""
    return importlib.import_module(_MODULE)


@functools.lru_cache(maxsize=None)
def fa4_available() -> bool:
    """True when CUDA is available, the current GPU is sm90 or newer, and ``flash_attn.cute.interface``
    imports with ``_flash_attn_fwd`` / ``_flash_attn_bwd``. Asked on first use (cached), never at
    import; a broken install (CUTLASS DSL missing, ABI mismatch) counts as not available."""
    if not torch.cuda.is_available() or not fa4_installed():
        return False
    if torch.cuda.get_device_capability()[0] < _MIN_MAJOR:
        return False
    try:
        iface = _interface()
    except Exception:  # noqa: BLE001 - any failure to import means "not available"
        return False
    return callable(getattr(iface, "_flash_attn_fwd", None)) and callable(getattr(iface, "_flash_attn_bwd", None))


def fa4_head_dim_ok(head_dim: int, major: int | None) -> bool:
    """Whether FA4's kernels take ``head_dim`` (= head_dim_v) on a GPU of compute capability ``major``
    (None: not a CUDA device, judged as sm90). Mirrors 4.0.0b36 ``interface._validate_head_dims``,
    which both ``_flash_attn_fwd`` and ``_flash_attn_bwd`` assert: sm90 takes 8..256, a multiple of
    8 (fp16/bf16 alignment); sm100/sm110 take 8..128 or exactly 256 (its (192, 128) and (64 or d, 512) MLA
    shapes need head_dim_v != head_dim); sm80/sm120 are not checked there."""
    if head_dim % 8 != 0 or not 8 <= head_dim <= 256:
        return False
    if major in (10, 11):
        return head_dim <= 128 or head_dim == 256
    return True


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def window_kwargs(left: int, right: int) -> dict:
    """FA4's mask arguments for a FlashAttention window ``(left, right)`` (-1: unbounded side).

    Returns ``dict(causal=right == 0, window_size_left=..., window_size_right=...)`` with each side
    as given, or None where it is negative. E.g. distca's causal ``(-1, 0)`` -> ``(True, None, 0)``,
    window W ``(W - 1, 0)`` -> ``(True, W - 1, 0)``, the keys every row sees ``(-1, -1)`` ->
    ``(False, None, None)``.
    """
    return dict(causal=right == 0, window_size_left=None if left < 0 else int(left),
                window_size_right=None if right < 0 else int(right))


def lse_from_fa4(lse: torch.Tensor, total_q: int, num_heads: int) -> torch.Tensor:
    """FA4's varlen LSE ``[H, T_q]`` float32 -> distca's ``[T_q, H]`` float32, contiguous, -inf on
    rows without keys (a +inf, FlashAttention-2's mark for them, becomes -inf too).

    Raises: RuntimeError if ``lse`` is None or not ``[num_heads, total_q]`` (an FA4 whose layout
    changed: the ``(total_q, num_heads)`` layout is FA4's MLA one, not used here).
    """
    if lse is None or tuple(lse.shape) != (num_heads, total_q):
        raise RuntimeError(f"unexpected FlashAttention-4 LSE {None if lse is None else tuple(lse.shape)}; "
                           f"expected [H={num_heads}, T_q={total_q}]")
    lse = lse.t().float()
    return lse.masked_fill(lse == float("inf"), float("-inf")).contiguous()


def lse_to_fa4(lse: torch.Tensor) -> torch.Tensor:
    """distca's LSE ``[T_q, H]`` (any float dtype) -> FA4's ``[H, T_q]`` float32, contiguous, +inf
    where distca has -inf (so the backward's P is 0 on those rows)."""
    lse = lse.float()
    return lse.masked_fill(lse == float("-inf"), float("inf")).t().contiguous()


def _varlen_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right) -> dict:
    return dict(cu_seqlens_q=cu_seqlens_q.to(torch.int32).contiguous(),
                cu_seqlens_k=cu_seqlens_k.to(torch.int32).contiguous(),
                max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), softmax_scale=float(scale),
                **window_kwargs(left, right))


def _on(device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class FA4Kernels:
    """The ``fa4`` backend's kernels, mixed into :class:`distca_server.kernels.FA4Backend` with the
    FlashAttention-style one-call-per-(left, right) driver (``_BandedKernel``), which gives every
    kernel call one window ``(left, right)``.

    Handles fp16/bf16 with a head_dim FA4 accepts on the device (:func:`fa4_head_dim_ok`); other inputs
    (float32, float64, odd head dims) go to the reference math, as in every backend
    (``AttentionBackend._kernel_handles``).
    Errors raised by FA4 itself (AssertionError, CUTLASS compile errors) propagate unchanged.
    """

    name = "fa4"
    device_types = ("cuda",)

    def is_available(self):
        return fa4_available()

    def _kernel_handles(self, q):
        if q.dtype not in (torch.float16, torch.bfloat16):
            return False
        major = None
        if q.device.type == "cuda":
            major = _major(q.device.index if q.device.index is not None else torch.cuda.current_device())
        return fa4_head_dim_ok(q.shape[2], major)

    def _banded_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        left, right):
        """One kernel call. Returns out ``[T_q, H_q, D]`` in q's dtype and lse ``[T_q, H_q]``
        float32, natural log; out 0 and lse -inf on rows that see no key or lie outside every
        sequence (out and lse are pre-filled: FA4 writes only the rows of its sequences)."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        with _on(q.device):
            res = _interface()._flash_attn_fwd(
                q=q, k=k, v=v, return_lse=True, out=out, lse=lse,
                **_varlen_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right))
        return res[0], lse_from_fa4(res[1], q.shape[0], q.shape[1])

    def _banded_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, scale, left, right):
        """One kernel call. Returns dq ``[T_q, H_q, D]``, dk, dv ``[T_k, H_kv, D]`` in q's dtype,
        dk/dv summed over each GQA group (FA4 does it); zero outside every sequence."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        with _on(q.device):
            res = _interface()._flash_attn_bwd(
                q=q, k=k, v=v, out=out.to(q.dtype).contiguous(), dout=dout.to(q.dtype).contiguous(),
                lse=lse_to_fa4(lse), dq=dq, dk=dk, dv=dv, deterministic=False,
                **_varlen_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right))
        return res[0], res[1], res[2]
