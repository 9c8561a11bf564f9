"""The dtype rules of the data plane, defined once.

Half-precision activations keep their softmax statistics and their gradient sums in float32;
float64 runs keep float64 end to end (the exactness tests need it). The byte-count side of the same
rule is :attr:`scheduler.cost.CostModel.lse_bytes`.
"""

from __future__ import annotations

import torch

# Wire codes of the activation dtypes (round header).
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name without ``torch.`` (e.g. ``"bfloat16"``): how reports and messages name it."""
    return str(dtype).removeprefix("torch.")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the LSE and of summed gradients for activations of ``dtype``: float64 for
    float64, else float32 (FlashAttention-2 keeps its row statistics in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
