"""Input checks for ``DistCAClient.attend``: every problem is a ValueError naming the values,
raised before any byte moves."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from scheduler.checks import bad_lengths, is_number
from scheduler.cost import window_arg

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_attend_inputs(q, k, v, doc_lens, softmax_scale, window=None) -> tuple[list[int], float, int | None]:
    """Validate ``attend``'s arguments.

    Returns:
        ``(doc_lens as a list of ints, softmax_scale as a float, window as an int or None)``;
        ``None`` scale becomes ``head_dim ** -0.5``.

    Raises:
        ValueError: non-tensors, sparse tensors, wrong ranks or shapes, heads not divisible
            (GQA), mixed dtypes or devices, a non-float dtype, bad ``doc_lens`` (not an ordered sequence such as a set
            or dict, non-integers, zero or negative lengths, a sum other than ``total_tokens``),
            a ``softmax_scale`` that is not a finite int or float (bool and str refused), or a
            ``window`` that is neither None nor a positive int.
    """
    window = window_arg(window)
    check_qkv(q, k, v)
    lens = _doc_lens(doc_lens)
    if sum(lens) != q.shape[0]:
        raise ValueError(f"sum(doc_lens)={sum(lens)} != total_tokens={q.shape[0]}")

    scale = check_softmax_scale(softmax_scale)
    return lens, q.shape[2] ** -0.5 if scale is None else scale, window


def check_qkv(q, k, v) -> None:
    """The tensor part of :func:`check_attend_inputs` (what a compiled graph checks while it is
    traced, from shapes alone): q [T, Hq, D], k and v [T, Hkv, D], Hq a multiple of Hkv, one
    float dtype, one device, dense (strided) tensors.

    Raises:
        ValueError: naming the offending shapes, dtypes, devices or layouts.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [total_tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        value_head = (f" (a value head_dim other than the key's, as in DeepSeek-V3's attention, is not "
                      f"supported)" if k.shape[:2] == v.shape[:2] else "")
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}{value_head}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree in total_tokens or head_dim")
    hq, hkv = q.shape[1], k.shape[1]
    if q.shape[2] == 0:
        raise ValueError(f"head_dim must be positive, got head_dim=0 (q {tuple(q.shape)})")
    if hq == 0 or hkv == 0 or hq % hkv:
        raise ValueError(f"num_heads_q={hq} must be a positive multiple of num_heads_kv={hkv} "
                         f"(head_dim={q.shape[2]})")
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"q, k, v have mixed dtypes: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {q.dtype} not supported; use one of {FLOAT_DTYPES}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def check_softmax_scale(softmax_scale) -> float | None:
    """``softmax_scale`` as a float (None stays None: the caller's default ``head_dim ** -0.5``).

    Raises:
        ValueError: not a finite int or float.
    """
    if softmax_scale is None:
        return None
    # A number only: float("0.5") or float(True) would turn a caller's slip into a result.
    try:
        scale = float(softmax_scale) if is_number(softmax_scale) else math.nan
    except OverflowError:  # an int beyond float range
        scale = math.inf
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite number (int or float, not bool or str), "
                         f"got {softmax_scale!r}")
    return scale


def check_lens_array(doc_lens):
    """``doc_lens`` (a numpy array or tensor) as it is, if it is 1-D of an integer dtype.

    Raises:
        ValueError: another rank or dtype (float, complex, bool), or a tensor whose values cannot
            be read (sparse, meta).
    """
    if isinstance(doc_lens, torch.Tensor) and (doc_lens.layout != torch.strided or doc_lens.is_meta):
        raise ValueError(f"doc_lens must be a dense tensor with values, got a "
                         f"{'meta' if doc_lens.is_meta else doc_lens.layout} tensor")
    is_integer = (not doc_lens.dtype.is_floating_point and not doc_lens.dtype.is_complex
                  and doc_lens.dtype != torch.bool) if isinstance(doc_lens, torch.Tensor) \
        else doc_lens.dtype.kind in "iu"
    if doc_lens.ndim != 1 or not is_integer:
        raise ValueError(f"doc_lens must be a 1-D integer array or tensor, got {doc_lens.dtype} "
                         f"{tuple(doc_lens.shape)}")
    return doc_lens


def _doc_lens(doc_lens) -> list[int]:
    """``doc_lens`` as a list of Python ints, each a token count (:func:`scheduler.checks.bad_lengths`).

    Packing order is the meaning of the list, so only ordered containers are taken: a list,
    tuple or range, a 1-D integer numpy array or tensor. A set or dict is refused, not sorted.
    """
    if isinstance(doc_lens, (torch.Tensor, np.ndarray)):
        items = check_lens_array(doc_lens).tolist()
    elif isinstance(doc_lens, Sequence) and not isinstance(doc_lens, (str, bytes)):
        items = list(doc_lens)
    else:
        raise ValueError(f"doc_lens must be an ordered sequence of ints (list, tuple, 1-D integer "
                         f"numpy array or tensor), got {type(doc_lens).__name__}")
    bad = bad_lengths(items)
    if bad:
        raise ValueError(f"doc_lens must hold positive ints (token counts), got {bad[:5]}")
    return [int(x) for x in items]
