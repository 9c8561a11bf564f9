"""Host reads of a batch's document boundaries, once per forward instead of once per layer.

A framework hands every attention layer of a forward the same boundary tensors (transformers'
``position_ids`` / ``cu_seq_lens``, Megatron's ``packed_seq_params`` and masks). Reading their values
on the host waits for the device; on a GPU that wait queues behind the previous layer's exchange,
so a host that should only enqueue work would stall at every layer. :class:`LastLengths` keeps the
last answer and gives it again while the same tensor objects at the same in-place versions come.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Hashable, Sequence

import torch


class LastLengths:
    """The last document lengths computed from some tensors, per thread (each training thread runs
    its own forwards), reused while the same tensors come again.

    Tensors are held by weak reference (a freed tensor never matches a new one at its address) and
    keyed on their version counter (an in-place change recomputes). Lists, other objects and
    inference tensors (which keep no version) are never matched: those calls always compute.
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, tensors: Sequence[object], key: Hashable, compute: Callable[[], list[int]]) -> list[int]:
        """``compute()``'s lengths, or the last call's when ``tensors`` (None entries allowed) are the
        same objects at the same versions and ``key`` (the grid, the mode: whatever else the
        lengths depend on) is equal. A call whose ``compute`` raises keeps nothing (its error is
        raised again next time). Returns a new list each call."""
        if any(t is not None and (not isinstance(t, torch.Tensor) or t.is_inference()) for t in tensors):
            return compute()
        full = (key,) + tuple(None if t is None else t._version for t in tensors)
        last = getattr(self._local, "entry", None)
        if last is not None and last[0] == full and all(
                (t is None and r is None) or (r is not None and r() is t) for t, r in zip(tensors, last[1])):
            return list(last[2])
        lens = compute()
        self._local.entry = (full, tuple(None if t is None else weakref.ref(t) for t in tensors), tuple(lens))
        return list(lens)
