"""plan_batch(..., partial_kv=True): key blocks split off query shards where bands cannot
balance, or to keep a server's KV within max_kv_rows_per_server; valid plans, exact results."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_attend import make_inputs, run
from test_attend_partial import _check, _traffic_is_comm_bytes

from distca_client import DistCAClient
from distca_server.refs import varlen_attention_ref as attention_ref
from distca_server.runtime.local import split_documents
from distca_server.wire import RowFormat
from scheduler import CostModel, JobConfig, Plan, PlanConfig, plan_batch

COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)


def test_off_gives_todays_shapes():
    lens = [[65536, 100], [3000] * 4, [7]]
    assert np.array_equal(plan_batch(lens, 3, cost=COST).task_array,
                          plan_batch(lens, 3, cost=COST, partial_kv=False).task_array)


def test_key_blocks_beat_the_band_bound():
    """One 131,072-token document over 256 servers with min_shard 512: bands of >= 512 positions
    give at most 128 pieces (max/mean >= 2); key blocks reach (1 + eps) x mean."""
    lens = [[131072]] + [[] for _ in range(255)]
    bands = plan_batch(lens, 256, cost=COST, min_shard=512)
    split = plan_batch(lens, 256, cost=COST, min_shard=512, partial_kv=True, keep_activations=False)
    assert bands.imbalance()[1] >= 2.0
    assert split.imbalance()[1] <= 1.05 + 1e-9
    assert Plan.from_msgpack(split.to_msgpack()) == split  # a valid plan: every pair once
    key_split = np.unique(split.task_array[:, [1, 2, 3]], axis=0, return_counts=True)[1]
    assert key_split.max() > 1  # some shard's keys really are on several servers


@pytest.mark.parametrize("seed", range(30))
def test_partial_plans_are_valid_and_never_less_balanced(seed):
    rng = random.Random(seed)
    mode = rng.choice(["inplace", "dedicated"])
    ranks = rng.randint(1, 8)
    servers = ranks if mode == "inplace" else rng.randint(1, 8)
    lens = [[rng.choice([1, rng.randint(1, 300), rng.randint(100, 5000), rng.randint(5000, 40000)])
             for _ in range(rng.randint(0, 4))] for _ in range(ranks)]
    lens[0] = lens[0] or [5]
    ms = rng.choice([1, 16, 128, 1024])
    full = plan_batch(lens, servers, cost=COST, mode=mode, min_shard=ms)
    part = plan_batch(lens, servers, cost=COST, mode=mode, min_shard=ms, partial_kv=True, keep_activations=False)
    Plan(lens, servers, mode, COST, part.server_tasks, 0.05, ms)  # every check of the constructor
    assert max(part.server_loads()) <= max(full.server_loads()) * (1 + 1e-12)
    assert sum(part.server_loads()) == pytest.approx(sum(full.server_loads()), rel=1e-12)


def test_kv_budget_moves_past_blocks_off_a_server():
    """Dedicated servers, one 40,000-token document: the server with the outermost band needs
    its whole prefix; a 37,000-row budget moves key blocks of its tail shard elsewhere."""
    lens = [[40000], [300]]
    plain = plan_batch(lens, 4, cost=COST, mode="dedicated", min_shard=128)
    budget = 37000
    assert plain.row_matrix[1].sum(axis=0).max() > budget
    part = plan_batch(lens, 4, cost=COST, mode="dedicated", min_shard=128, partial_kv=True,
                      keep_activations=False,
                      max_kv_rows_per_server=budget)
    assert part.row_matrix[1].sum(axis=0).max() <= budget
    assert Plan.from_msgpack(part.to_msgpack()) == part


@pytest.mark.parametrize("mode,servers", [("inplace", 4), ("dedicated", 3)])
def test_planned_partial_plans_through_attend(mode, servers):
    """A plan the planner split on the key axis (min_shard larger than bands allow) equals the
    float64 reference through DistCAClient.local."""
    lens = [1500, 20, 7]
    q, k, v, dout = make_inputs(lens, 4, 2, 16, torch.float64, 0)
    want = run(lambda a, b, c: attention_ref(a, b, c, lens, 0.25), q, k, v, dout)
    ranks = servers if mode == "inplace" else 1
    config = JobConfig(plan=PlanConfig(mode=mode, min_shard=300), servers=servers, timeout_s=60)
    client = DistCAClient.local(config=config, num_ranks=ranks)
    fmt = RowFormat.of(q, k)
    plan = plan_batch(split_documents(lens, ranks), servers, cost=fmt.cost, mode=mode, min_shard=300,
                      partial_kv=True, keep_activations=False)
    assert len(np.unique(plan.task_array[:, [1, 2, 3]], axis=0)) < len(plan.task_array)  # split keys
    client._runtime._plans[(tuple(lens), fmt, "cpu", None)] = plan
    with client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens, softmax_scale=0.25), q, k, v, dout)
        assert client.last_plan is plan
        _traffic_is_comm_bytes(client, plan)
    _check(got, want, torch.float64)


def test_bad_partial_arguments():
    with pytest.raises(ValueError, match="partial_kv"):
        plan_batch([[5]], 1, cost=COST, partial_kv=1)
    with pytest.raises(ValueError, match="max_kv_rows_per_server"):
        plan_batch([[5]], 1, cost=COST, partial_kv=True, max_kv_rows_per_server=0)


def test_partial_kv_with_kept_activations():
    """The planner and a hand-built Plan accept a kept plan with split query shards; the kept
    backward then moves the split rows' merged O and LSE, no more."""
    lens = [1500, 20, 7]
    split = plan_batch([lens], 4, cost=COST, mode="dedicated", min_shard=300, partial_kv=True)
    assert split.keep_activations
    assert len(np.unique(split.task_array[:, [1, 2, 3]], axis=0)) < len(split.task_array)
    again = Plan([lens], 4, "dedicated", COST, split.server_tasks, 0.05, 300, keep_activations=True)
    assert again == split and Plan.from_msgpack(split.to_msgpack()) == split
    assert split.comm_bytes()["backward"]["out"] > 0 and max(split.owner_held_bytes()) > 0
