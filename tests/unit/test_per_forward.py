"""distca_client.integrations.per_forward.LastLengths: a batch's document lengths computed once
while the same tensors at the same versions come again (each layer of a forward), and computed
again for anything else."""

from __future__ import annotations

import threading

import pytest
import torch

from distca_client.integrations.per_forward import LastLengths


def _counting(lens):
    calls = []

    def compute():
        calls.append(1)
        return list(lens)
    return calls, compute


def test_same_tensors_same_versions_reuse_the_last_lengths():
    memo, cu = LastLengths(), torch.tensor([0, 3, 5])
    calls, compute = _counting([3, 2])
    first = memo.get((cu, None), "k", compute)
    second = memo.get((cu, None), "k", compute)
    assert first == second == [3, 2] and len(calls) == 1
    second.append(9)  # a caller changing its list does not change the kept one
    assert memo.get((cu, None), "k", compute) == [3, 2] and len(calls) == 1


@pytest.mark.parametrize("change", ["in_place", "new_tensor", "key", "none_position"])
def test_anything_else_computes_again(change):
    memo, cu = LastLengths(), torch.tensor([0, 3, 5])
    calls, compute = _counting([3, 2])
    memo.get((cu, None), "k", compute)
    tensors, key = (cu, None), "k"
    if change == "in_place":
        cu.add_(0)  # bumps the version though the values are equal
    elif change == "new_tensor":
        tensors = (cu.clone(), None)
    elif change == "key":
        key = "other"
    else:
        tensors = (None, cu)
    memo.get(tensors, key, compute)
    assert len(calls) == 2


def test_lists_inference_tensors_and_errors_are_never_kept():
    memo = LastLengths()
    calls, compute = _counting([2])
    memo.get(([0, 2],), "k", compute)
    memo.get(([0, 2],), "k", compute)
    with torch.inference_mode():
        frozen = torch.tensor([0, 2])
    memo.get((frozen,), "k", compute)
    memo.get((frozen,), "k", compute)
    assert len(calls) == 4
    cu = torch.tensor([0, 2])

    def bad():
        calls.append(1)
        raise ValueError("refused")
    for _ in range(2):
        with pytest.raises(ValueError, match="refused"):
            memo.get((cu,), "k", bad)
    assert len(calls) == 6


def test_a_freed_tensor_never_matches_its_successor():
    memo = LastLengths()
    calls, compute = _counting([4])
    memo.get((torch.tensor([0, 4]),), "k", compute)  # freed at once
    memo.get((torch.tensor([0, 4]),), "k", compute)  # may reuse the address and the version 0
    assert len(calls) == 2


def test_each_thread_keeps_its_own():
    memo, cu = LastLengths(), torch.tensor([0, 1])
    calls, compute = _counting([1])
    memo.get((cu,), "k", compute)
    t = threading.Thread(target=memo.get, args=((cu,), "k", compute))
    t.start()
    t.join()
    assert len(calls) == 2
