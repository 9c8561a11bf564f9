"""RowScatter: copies rows into place and sums the repeated ones in float32, like index_add_ would
in float64."""

import numpy as np
import pytest
import torch

from distca_server.rowsum import RowScatter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("seed", range(6))
def test_matches_index_add_in_float64(dtype, seed):
    rng = np.random.default_rng(seed)
    num_rows = int(rng.integers(1, 40))
    # Every row at least once, some rows several times, spread over 1-3 pieces in random order.
    flat = np.concatenate([np.arange(num_rows), rng.integers(0, num_rows, int(rng.integers(0, 30)))])
    rng.shuffle(flat)
    cuts = np.sort(rng.integers(0, len(flat) + 1, int(rng.integers(0, 3))))
    indices = np.split(flat, cuts)
    pieces = [torch.randn(len(i), 2, 3, dtype=torch.float64).to(dtype) for i in indices]
    want = torch.zeros(num_rows, 2, 3, dtype=torch.float64)
    for i, p in zip(indices, pieces):
        want.index_add_(0, torch.as_tensor(i), p.double())
    scatter = RowScatter(indices, num_rows, "cpu")
    got = scatter(pieces, torch.full((num_rows, 2, 3), float("nan"), dtype=dtype))
    assert scatter.has_sums == (len(flat) > num_rows)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_rows_without_contribution_and_out_of_range_are_value_errors():
    with pytest.raises(ValueError, match=r"rows \[2\] receive no contribution"):
        RowScatter([np.array([0, 1])], 3, "cpu")
    with pytest.raises(ValueError, match="out of range"):
        RowScatter([np.array([0, 5])], 3, "cpu")
