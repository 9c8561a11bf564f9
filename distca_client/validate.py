"""Input checks for ``DistCAClient.attend``: every problem is a ValueError naming the values,
raised before any byte moves."""

from __future__ import annotations

import math

import torch

from scheduler.checks import is_int

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_attend_inputs(q, k, v, doc_lens, softmax_scale) -> tuple[list[int], float]:
    """Validate ``attend``'s arguments.

    Returns:
        ``(doc_lens as a list of ints, softmax_scale as a float)``; ``None`` scale becomes
        ``head_dim ** -0.5``.

    Raises:
        ValueError: non-tensors, wrong ranks or shapes, heads not divisible (GQA), mixed dtypes
            or devices, a non-float dtype, bad ``doc_lens`` (non-integers, zero or negative
            lengths, a sum other than ``total_tokens``), or a non-finite ``softmax_scale``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [total_tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree in total_tokens or head_dim")
    hq, hkv = q.shape[1], k.shape[1]
    if hq == 0 or hkv == 0 or q.shape[2] == 0 or hq % hkv:
        raise ValueError(f"num_heads_q={hq} must be a positive multiple of num_heads_kv={hkv} "
                         f"(head_dim={q.shape[2]})")
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"q, k, v have mixed dtypes: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {q.dtype} not supported; use one of {FLOAT_DTYPES}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")

    if isinstance(doc_lens, torch.Tensor):
        if doc_lens.dim() != 1 or doc_lens.dtype.is_floating_point or doc_lens.dtype == torch.bool \
                or doc_lens.is_complex():
            raise ValueError(f"doc_lens tensor must be 1-D integer, got {doc_lens.dtype} {tuple(doc_lens.shape)}")
        lens = [int(x) for x in doc_lens.tolist()]
    else:
        try:
            items = list(doc_lens)
        except TypeError:
            raise ValueError(f"doc_lens must be a list of ints or a 1-D integer tensor, got "
                             f"{type(doc_lens).__name__}") from None
        bad = [x for x in items if not is_int(x)]
        if bad:
            raise ValueError(f"doc_lens must hold ints, got {bad[:5]}")
        lens = [int(x) for x in items]
    nonpos = [(i, x) for i, x in enumerate(lens) if x <= 0]
    if nonpos:
        raise ValueError(f"doc_lens must be positive; (index, length) {nonpos[:5]}")
    if sum(lens) != q.shape[0]:
        raise ValueError(f"sum(doc_lens)={sum(lens)} != total_tokens={q.shape[0]}")

    if softmax_scale is None:
        scale = q.shape[2] ** -0.5
    else:
        try:
            scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise ValueError(f"softmax_scale must be a number, got {softmax_scale!r}") from None
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return lens, scale
