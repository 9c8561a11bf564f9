"""Partial-KV CA-tasks through ``DistCAClient.local``: query shards whose keys are split over
servers, partial outputs merged by their LSEs, forward and backward against the float64 reference.

Plans here are built by hand (a planned batch whose shards are then split on the key axis at
random points, or laid out explicitly) and installed in the local runtime's plan cache, so the
data path is tested on task shapes the planner does not make as well as on those it does.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_attend import make_inputs, run

from distca_client import DistCAClient
from distca_server.refs import cu_seqlens, plain_attention
from distca_server.refs import varlen_attention_ref as attention_ref
from distca_server.runtime.local import split_documents
from distca_server.wire import RowFormat
from scheduler import CATask, JobConfig, Plan, PlanConfig, plan_batch
from scheduler.cost import window_kv_start


def split_keys(plan: Plan, rng: random.Random, pieces_max: int = 4) -> Plan:
    """``plan`` with some shards' keys cut at random points, each piece on a random server."""
    tasks = [[] for _ in range(plan.num_servers)]
    for s, own in enumerate(plan.server_tasks):
        for t in own:
            n = t.kv_end - t.kv_start
            k = min(rng.randint(1, pieces_max), n)
            if k == 1 or rng.random() < 0.3:
                tasks[s].append(t)
                continue
            cuts = sorted(rng.sample(range(t.kv_start + 1, t.kv_end), k - 1))
            for a, b in zip([t.kv_start, *cuts], [*cuts, t.kv_end]):
                tasks[rng.randrange(plan.num_servers)].append(t._replace(kv_start=a, kv_end=b))
    return Plan(plan.doc_lens_per_rank, plan.num_servers, plan.mode, plan.cost, tasks,
                plan.epsilon, 1, window=plan.window)


def _client_with_plan(lens, q, k, servers, mode, window, make_plan):
    ranks = servers if mode == "inplace" else max(1, servers // 2)
    config = JobConfig(plan=PlanConfig(mode=mode, min_shard=16), servers=servers, timeout_s=60)
    client = DistCAClient.local(config=config, num_ranks=ranks)
    fmt = RowFormat.of(q, k)
    base = plan_batch(split_documents(lens, ranks), servers, cost=fmt.cost, mode=mode, min_shard=16,
                      window=window)
    plan = make_plan(base)
    client._runtime._plans[(tuple(lens), fmt, str(q.device), window)] = plan
    return client, plan


def _check(got, want, dtype):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype
        err = (g.to(torch.float64) - w).abs().max().item()
        tol = 1e-10 if dtype == torch.float64 else 1e-5 * max(w.abs().max().item(), 1.0)
        assert err <= tol, (name, err)


def _traffic_is_comm_bytes(client, plan):
    moved, comm = client.traffic(), plan.comm_bytes()
    for kind in ("forward", "backward"):
        for name, n in comm[kind].items():
            if name != "total":
                assert moved.get(kind, {}).get(name, 0) == n, (kind, name)


DOCS = [17, 3, 257, 1, 301, 129, 1, 511, 2]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_random_key_splits_match_reference(seed, dtype):
    rng = random.Random(seed)
    mode = rng.choice(["inplace", "dedicated"])
    servers = rng.randint(1, 8)
    window = rng.choice([None, None, 7, 128])
    lens = rng.sample(DOCS, rng.randint(2, len(DOCS)))
    q, k, v, dout = make_inputs(lens, 4, 2, 16, torch.float64, seed)
    want = run(lambda a, b, c: attention_ref(a, b, c, lens, 0.25, window), q, k, v, dout)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    client, plan = _client_with_plan(lens, q, k, servers, mode, window, lambda p: split_keys(p, rng))
    with client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens, softmax_scale=0.25, window=window),
                  q, k, v, dout)
        assert client.last_plan is plan
        _traffic_is_comm_bytes(client, plan)
    _check(got, want, dtype)


@pytest.mark.parametrize("servers", [2, 3, 5, 8])
@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_one_shard_split_over_servers(servers, mode):
    """One document, one query shard [0, l), its keys cut into ``servers`` pieces, one per server;
    in-place, its own rank's server gets none: the document's whole work sits elsewhere."""
    lens, length = [900], 900
    q, k, v, dout = make_inputs(lens, 4, 1, 16, torch.float64, servers)
    want = run(lambda a, b, c: attention_ref(a, b, c, lens, 0.25), q, k, v, dout)

    def make(base):
        owner = next(r for r, docs in enumerate(base.doc_lens_per_rank) if docs)
        others = [s for s in range(servers) if not (mode == "inplace" and s == owner)]
        cuts = np.linspace(0, length, len(others) + 1).astype(int).tolist()
        tasks = [[] for _ in range(servers)]
        for s, a, b in zip(others, cuts, cuts[1:]):
            tasks[s].append(CATask(owner, 0, 0, length, a, b))
        return Plan(base.doc_lens_per_rank, servers, mode, base.cost, tasks, 0.0, 1)
    client, plan = _client_with_plan(lens, q, k, servers, mode, None, make)
    busy = [s for s, t in enumerate(plan.server_tasks) if t]
    assert len(busy) == (servers - 1 if mode == "inplace" else servers) and len(busy) >= 1
    with client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens, softmax_scale=0.25), q, k, v, dout)
        _traffic_is_comm_bytes(client, plan)
    _check(got, want, torch.float64)


@pytest.mark.parametrize("window", [None, 64])
def test_partial_bf16_within_twice_plain_torch(window):
    lens = [301, 129, 511, 2]
    q, k, v, dout = make_inputs(lens, 4, 2, 32, torch.bfloat16, 3)
    cu = cu_seqlens(lens)
    rng = random.Random(5)
    client, _ = _client_with_plan(lens, q, k, 4, "inplace", window, lambda p: split_keys(p, rng, 6))
    with client:
        got = run(lambda a, b, c: client.attend(a, b, c, lens, window=window), q, k, v, dout)
    plain = run(lambda a, b, c: plain_attention(a, b, c, cu, cu, 32 ** -0.5, window)[0], q, k, v, dout)
    exact = run(lambda a, b, c: attention_ref(a, b, c, lens, 32 ** -0.5, window),
                *(t.to(torch.float64) for t in (q, k, v, dout)))
    for name, g, p, w in zip(("out", "dq", "dk", "dv"), got, plain, exact):
        ours, theirs = (g.double() - w).abs().max().item(), (p.double() - w).abs().max().item()
        assert ours <= 2 * theirs + 1e-5, (name, ours, theirs)


def test_split_plans_round_trip_and_count_each_pair_once():
    rng = random.Random(0)
    base = plan_batch([[300, 7], [129, 1]], 2, cost=RowFormat.of(torch.zeros(1, 4, 8), torch.zeros(1, 2, 8)).cost,
                      min_shard=16)
    plan = split_keys(base, rng, 5)
    assert len(plan.task_array) > len(base.task_array)
    assert Plan.from_msgpack(plan.to_msgpack()) == plan
    assert sum(plan.server_loads()) == pytest.approx(sum(base.server_loads()))
    for tasks in plan.server_tasks:
        for t in tasks:
            assert window_kv_start(t.q_start, None) <= t.kv_start < t.kv_end <= t.q_end
