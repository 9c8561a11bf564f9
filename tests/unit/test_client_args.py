"""DistCAClient.local refuses bad settings with one ValueError naming every offending value."""

import re

import numpy as np
import pytest
import torch

from distca_client import DistCAClient
from distca_server.refs import varlen_attention_ref
from scheduler.config import JobConfig, PlanConfig


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(epsilon=True), "epsilon must be a finite number >= 0, got True"),
    (dict(epsilon=float("nan")), "epsilon must be a finite number >= 0, got nan"),
    (dict(backend=["auto"]), "backend must be a non-empty str, got ['auto']"),
    (dict(backend="nope"), "backend='nope'"),
    (dict(num_servers=True), "num_servers must be a positive int, got True"),
    (dict(min_shard=0), "min_shard must be a positive int, got 0"),
    (dict(timeout_s=False), "timeout_s must be a finite number > 0, got False"),
    (dict(mode="both"), "mode must be one of ('inplace', 'dedicated'), got 'both'"),
    (dict(num_ranks=3), "num_ranks=3 != num_servers=2"),
])
def test_bad_settings_are_value_errors(kwargs, fragment):
    args = {"num_servers": 2, **kwargs}
    with pytest.raises(ValueError, match=r"DistCAClient\.local: .*" + re.escape(fragment)):
        DistCAClient.local(**args)


def test_no_server_count_is_named_once():
    with pytest.raises(ValueError) as info:
        DistCAClient.local()
    assert str(info.value) == "DistCAClient.local: num_servers must be a positive int, got None"  # not num_ranks too


def test_every_problem_is_named_at_once():
    with pytest.raises(ValueError) as info:
        DistCAClient.local(num_servers=0, epsilon=-1.0, mode="x")
    assert all(s in str(info.value) for s in ("num_servers must be a positive int, got 0", "got -1.0", "got 'x'"))


def test_numpy_integers_are_counts():
    doc_lens = [200, 3, 61]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(doc_lens), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    config = PlanConfig(min_shard=np.int32(16), epsilon=np.float32(0.1))
    with DistCAClient.local(num_servers=np.int64(2), config=config) as c:
        out = c.attend(q, k, v, doc_lens)
        plan = c.last_plan
    # The numpy values became the plan's settings, as plain Python numbers ...
    assert (plan.num_servers, plan.min_shard, plan.mode) == (2, 16, "inplace")
    assert type(plan.num_servers) is int and type(plan.min_shard) is int
    assert plan.epsilon == pytest.approx(0.1) and type(plan.epsilon) is float
    # ... and the client computes causal attention per document with them.
    torch.testing.assert_close(out, varlen_attention_ref(q, k, v, doc_lens, 8 ** -0.5), rtol=1e-10, atol=1e-10)


def test_a_backend_this_install_cannot_run_is_refused_when_the_client_is_built():
    if torch.cuda.is_available():
        pytest.skip("flash_attn / torch_varlen may run here")
    with pytest.raises(ValueError, match="backend='torch_varlen'.*cannot run on this install"):
        DistCAClient.local(config=JobConfig(plan=PlanConfig(), servers=2, backend="torch_varlen"))


def test_old_keywords_name_a_bad_backend_beside_the_other_problems():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as info:
        DistCAClient.local(2, epsilon=-1, backend="nope")
    assert info.value.problems[0] == "epsilon must be a finite number >= 0, got -1"
    assert info.value.problems[1].startswith("backend='nope' (unknown attention backend 'nope'")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as info:  # a non-str backend: named once
        DistCAClient.local(2, epsilon=-1, backend=["auto"])
    assert [p.split(" ")[0] for p in info.value.problems] == ["epsilon", "backend"]
