"""The FlashAttention mask geometry shared by the banded GPU backends (distca_server/kernel_base.py
``mask_classes`` / ``_class_calls``, distca_server/kernels_flash.py ``fa2_max_seqlen_k``), on the
CPU: each kernel call's ``(left, right)`` window, as FlashAttention-2 rewrites it against its
``max_seqlen_k`` argument, must keep exactly distca's mask; empty sequences classify.
"""

from __future__ import annotations

import random

import pytest
import torch

from distca_server import kernel_base
from distca_server.kernel_base import mask_classes
from distca_server.kernels_flash import fa2_max_seqlen_k


def distca_mask(lq, lk, d, window):
    """bool [lq, lk]: row r sees key j iff ``r + d - W < j <= r + d`` (no lower bound without a
    window): the definition in the module doc of distca_server.kernels."""
    r, j = torch.arange(lq)[:, None] + d, torch.arange(lk)[None, :]
    return (j <= r) & ((j > r - window) if window is not None else True)


def fa2_mask(lq, lk, left, right, max_seqlen_k):
    """bool [lq, lk]: the keys FlashAttention-2's varlen kernels let each row of a sequence see for
    ``window_size = (left, right)`` and the ``max_seqlen_k`` argument, emulating torch's
    aten/src/ATen/native/transformers/cuda/flash_attn (flash-attn's csrc/flash_attn has the same
    code). Both FA2 backends pass causal = ``right == 0``, so mha_varlen_fwd's
    ``if (is_causal) window_size_right = 0;`` changes nothing and is left out."""
    # flash_api.cpp mha_varlen_fwd / mha_varlen_bwd: a side at or past max_seqlen_k is unbounded.
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_k:
        right = -1
    # set_params_fprop: causal is (-1, 0); a bounded side gives the other side max_seqlen_k.
    causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = max_seqlen_k
    if left >= 0 and right < 0:
        right = max_seqlen_k
    # mask.h: causal keeps j <= r + Lk - Lq; local keeps r + Lk - Lq - left <= j <= r + Lk - Lq + right,
    # Lq, Lk the sequence's own lengths (block_info.h, from cu_seqlens).
    r, j = torch.arange(lq)[:, None] + lk - lq, torch.arange(lk)[None, :]
    if causal:
        return j <= r
    if left < 0 and right < 0:
        return torch.ones(lq, lk, dtype=torch.bool)
    return (j >= r - left) & (j <= r + right)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def fa2_errors(q_lens, k_lens, diagonals, window, max_q=None, max_k=None, inflate=True):
    """Pairs (over all sequences) where the FA2 kernel calls distca makes for this batch
    (``_class_calls``: one per mask class, or one for everything) see other keys than distca's
    mask. ``max_q`` / ``max_k``: the caller's bounds (default: exact); ``inflate=False`` passes
    each call's own max_seqlen_k, as the backends did before ``fa2_max_seqlen_k``."""
    max_q = max(q_lens) if max_q is None else max_q
    max_k = max(k_lens) if max_k is None else max_k
    mask = kernel_base._Mask(window, diagonals)
    calls = kernel_base._class_calls(_cu(q_lens), _cu(k_lens), max_q, max_k, mask)
    if calls[0][1] is None:
        members, bounds = [list(range(len(q_lens)))], [(max_q, max_k)]
    else:  # one call per class, in mask_classes' order
        members = [idx for _, idx in mask_classes(q_lens, k_lens, diagonals, window)]
        bounds = [rows[4:] for _, rows in calls]
        for (_, rows), idx in zip(calls, members, strict=True):
            assert rows[2].diff().tolist() == [q_lens[b] for b in idx]
    wrong = 0
    for ((left, right), _), idx, (mq, mk) in zip(calls, members, bounds, strict=True):
        m = fa2_max_seqlen_k(mq, mk, left, right) if inflate else mk
        for b in idx:
            want = distca_mask(q_lens[b], k_lens[b], mask.diagonal(b, q_lens[b], k_lens[b]), window)
            wrong += int((fa2_mask(q_lens[b], k_lens[b], left, right, m) != want).sum())
    return wrong


# The reviewer's cases (Lq > Lk, per-task diagonals): (Lq=12, Lk=4, diagonal 2) is class (-1, 10),
# which max_seqlen_k = 4 turned into full attention (row 0 saw key 3); (1024, 512, 511, W=1024) is
# class (0, -1), whose right side became max_seqlen_k = 512 and dropped 130,816 pairs.
REVIEWED = [(([12], [4], [2], None), (-1, 10), 1), (([1024], [512], [511], 1024), (0, -1), 130816)]


@pytest.mark.parametrize("case,window_size,wrong_pairs_before", REVIEWED)
def test_the_reviewed_windows_kept_exactly(case, window_size, wrong_pairs_before):
    q_lens, k_lens, diagonals, window = case
    assert mask_classes(q_lens, k_lens, diagonals, window) == [(window_size, [0])]
    # The emulation reproduces the defect with the call's own max_seqlen_k ...
    assert fa2_errors(q_lens, k_lens, diagonals, window, inflate=False) == wrong_pairs_before
    if window is None:
        assert fa2_mask(12, 4, -1, 10, 4)[0, 3] and not distca_mask(12, 4, 2, None)[0, 3]
    # ... and fa2_max_seqlen_k removes it.
    assert fa2_max_seqlen_k(max(q_lens), max(k_lens), *window_size) == max(q_lens)
    assert fa2_errors(q_lens, k_lens, diagonals, window) == 0


def test_the_gpu_tests_clamped_shapes_are_kept_exactly():
    from test_kernels_window import CLAMPED

    for name, (q_lens, k_lens, diagonals, window) in CLAMPED.items():
        assert fa2_errors(q_lens, k_lens, diagonals, window) == 0, name
        assert fa2_errors(q_lens, k_lens, diagonals, window, inflate=False) > 0, name  # the GPU test bites


def test_keys_after_the_last_diagonal_are_refused_even_one():
    # (Lq=2, Lk=3, diagonal 0): key 2 is after row 1's diagonal. Its offset e = -1 once read as
    # right = -1, "unbounded": class (-1, -1), full attention on the FA-style backends.
    for case in (([2], [3], [0], None), ([2], [3], [0], 2), ([4, 2], [4, 3], [0, 0], None)):
        with pytest.raises(ValueError, match="window_size cannot express"):
            mask_classes(*case)
    assert mask_classes([2], [3], [1], None) == [((-1, 0), [0])]  # the bottom-right diagonal


def test_only_the_windows_fa2_rewrites_wrongly_get_a_larger_bound():
    for left, right in ((-1, 0), (6, 0), (-1, -1)):  # causal, sliding window, every key
        assert fa2_max_seqlen_k(12, 4, left, right) == 4
    for left, right in ((-1, 3), (2, 5), (0, -1), (9, -1)):
        assert fa2_max_seqlen_k(12, 4, left, right) == 12
    assert fa2_max_seqlen_k(4, 12, 0, -1) == 12  # Lq <= Lk: the call's own bound already suffices


@pytest.mark.parametrize("seed", range(8))
def test_fa2_kernel_calls_keep_distca_s_mask_over_random_batches(seed):
    """Random per-task diagonals (Lq below, equal to and above Lk; diagonals at, above and below
    the bottom-right one) and windows: every expressible batch's FA2 calls see exactly distca's
    mask, with exact and with looser max_seqlen bounds; the old argument was wrong on some."""
    rng = random.Random(seed)
    checked = before = 0
    for _ in range(150):
        n = rng.randint(1, 4)
        q_lens = [rng.choice([0, 1, 2, rng.randint(1, 40)]) for _ in range(n)]
        k_lens = [rng.choice([0, 1, 3, rng.randint(1, 40)]) for _ in range(n)]
        diagonals = [lk - lq + rng.randint(-3, 45) for lq, lk in zip(q_lens, k_lens)]
        window = rng.choice([None, None, 1, 3, rng.randint(1, 60)])
        try:
            mask_classes(q_lens, k_lens, diagonals, window)
        except ValueError:  # no (left, right) window expresses it; the backends refuse it too
            continue
        checked += 1
        slack_q, slack_k = rng.choice([(0, 0), (0, 5), (7, 0), (64, 64)])
        assert fa2_errors(q_lens, k_lens, diagonals, window) == 0, (q_lens, k_lens, diagonals, window)
        assert fa2_errors(q_lens, k_lens, diagonals, window, max_q=max(q_lens) + slack_q,
                           max_k=max(k_lens) + slack_k) == 0, (q_lens, k_lens, diagonals, window, slack_q)
        before += fa2_errors(q_lens, k_lens, diagonals, window, inflate=False) > 0
        # Bottom-right everywhere (no diagonals): one causal or sliding-window call.
        assert fa2_errors(q_lens, k_lens, None, window) == 0
    assert checked >= 40 and before >= 1, (checked, before)


# ---------------------------------------------------------------- empty sequences


def test_empty_sequences_go_with_the_first_class():
    # No query rows (sequence 1) or no keys: nothing to mask, so no class of their own and no error
    # (before: "has keys no query may see" for [4, 0], [4, 5], [0, 0]).
    assert mask_classes([4, 0], [4, 5], [0, 0], None) == [((-1, 0), [0, 1])]
    assert mask_classes([0, 4, 3], [5, 8, 0], [-7, 4, -9], 3) == [((2, 0), [0, 1, 2])]
    assert mask_classes([4, 0, 4, 2], [8, 5, 3, 0], [4, 0, 7, 0], None) == [((-1, 0), [0, 1, 3]),
                                                                            ((-1, -1), [2])]
    # Every sequence empty: the bottom-right class, as a call without diagonals.
    assert mask_classes([0, 0], [3, 0], [0, 5], None) == [((-1, 0), [0, 1])]
    assert mask_classes([0], [0], [0], 7) == [((6, 0), [0])]
    assert mask_classes([], [], [], None) == []


def test_empty_sequences_through_the_banded_driver_match_the_reference():
    from test_kernels import NAMES, make_inputs, max_error
    from test_kernels_window import FakeBanded, _diagonal_oracle

    q_lens, k_lens, diagonals = [4, 0, 3], [4, 5, 6], [0, 0, 3]
    x = make_inputs((q_lens, k_lens, 2, 1, 8), torch.float64, seed=3)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    b = FakeBanded()
    out, lse = b.forward(x["q"], x["k"], x["v"], *args, diagonals=diagonals)
    grads = b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args, diagonals=diagonals)
    assert b.calls == [(-1, 0)]  # one kernel call: the empty sequence joined the diagonal blocks
    for name, a, e in zip(NAMES, (out, lse, *grads), _diagonal_oracle(x, None, diagonals)):
        assert max_error(a, e) <= 1e-10, name
