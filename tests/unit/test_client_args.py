"""DistCAClient.local refuses bad settings with one ValueError naming every offending value."""

import re

import numpy as np
import pytest

from distca_client import DistCAClient


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(epsilon=True), "epsilon=True"),
    (dict(epsilon=float("nan")), "epsilon=nan"),
    (dict(backend=["auto"]), "backend=['auto']"),
    (dict(backend="nope"), "backend='nope'"),
    (dict(num_servers=True), "num_servers=True"),
    (dict(min_shard=0), "min_shard=0"),
    (dict(timeout_s=False), "timeout_s=False"),
    (dict(mode="both"), "mode='both'"),
    (dict(num_ranks=3), "num_ranks=3 != num_servers=2"),
])
def test_bad_settings_are_value_errors(kwargs, fragment):
    args = {"num_servers": 2, **kwargs}
    with pytest.raises(ValueError, match=r"DistCAClient\.local: .*" + re.escape(fragment)):
        DistCAClient.local(**args)


def test_every_problem_is_named_at_once():
    with pytest.raises(ValueError) as info:
        DistCAClient.local(num_servers=0, epsilon=-1.0, mode="x")
    assert all(s in str(info.value) for s in ("num_servers=0", "epsilon=-1.0", "mode='x'"))


def test_numpy_integers_are_counts():
    with DistCAClient.local(num_servers=np.int64(2), min_shard=np.int32(16), epsilon=np.float32(0.1)) as c:
        assert c is not None


def test_a_backend_this_install_cannot_run_is_refused_when_the_client_is_built():
    import torch
    if torch.cuda.is_available():
        pytest.skip("flash_attn / torch_varlen may run here")
    with pytest.raises(ValueError, match="backend='torch_varlen'.*cannot run on this install"):
        DistCAClient.local(num_servers=2, backend="torch_varlen")
