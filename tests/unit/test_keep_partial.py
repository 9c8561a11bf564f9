"""Kept activations with partial-KV tasks: a query shard's keys split over servers, each server
holding a partial O and LSE. The kept backward round sends dO for every query row plus the owner's
merged O and LSE for the query rows of split tasks; exact against the float64 reference over
several layers, bytes counted equal bytes moved, held bytes equal what the plan says.

Plans are built by hand (planned batches whose shards are cut on the key axis at random points,
or one shard spread over every server) and installed in the local runtime's plan cache, as in
test_attend_partial.py; one case uses the planner's own key splits.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_attend_partial import split_keys
from test_keep_activations import layer_inputs

from distca_client import DistCAClient
from distca_server.errors import DistCAError
from distca_server.refs import cu_seqlens, plain_attention
from distca_server.refs import varlen_attention_ref as attention_ref
from distca_server.runtime.local import split_documents
from distca_server.wire import RowFormat
from scheduler import CATask, CostModel, JobConfig, Plan, PlanConfig, plan_batch
from scheduler.cost import is_split

LAYERS = 2
SCALE = 0.25


def _stack(attend, layers, dout, during=None):
    """LAYERS chained layers (layer i+1's queries add layer i's output, so autograd runs the
    backward rounds in reverse order); ``during()`` runs between the forward and the backward.
    Returns the last output and every leaf's gradient."""
    leaves = [[t.detach().clone().requires_grad_() for t in layer] for layer in layers]
    h = None
    for q, k, v in leaves:
        h = attend(q if h is None else q + 0.5 * h, k, v)
    if during is not None:
        during()
    h.backward(dout)
    return [h.detach()] + [t.grad for layer in leaves for t in layer]


def _kept(plan: Plan) -> Plan:
    """``plan`` (any tasks) as a kept-activation plan: the constructor runs every check."""
    return Plan(plan.doc_lens_per_rank, plan.num_servers, plan.mode, plan.cost, plan.server_tasks,
                plan.epsilon, plan.min_shard, keep_activations=True, window=plan.window)


def _client(lens, servers, mode, ranks, fmt, window, make_plan):
    """A local client whose plan for ``lens`` is ``make_plan(planned batch)``."""
    config = JobConfig(plan=PlanConfig(mode=mode, min_shard=16, keep_activations=True), servers=servers,
                       timeout_s=60)
    client = DistCAClient.local(config=config, num_ranks=ranks)
    base = plan_batch(split_documents(lens, ranks), servers, cost=fmt.cost, mode=mode, min_shard=16,
                      window=window)
    plan = make_plan(base)
    assert plan.keep_activations
    client._runtime._plans[(tuple(lens), fmt, "cpu", window)] = plan
    return client, plan


def _run_checked(client, plan, lens, layers, dout, window=None):
    """Run the layers; check held bytes between forward and backward, and afterwards the bytes
    moved against ``plan.comm_bytes()``. Returns the results."""
    held = {}

    def during():
        held["now"] = client.last_step.held_bytes()
    got = _stack(lambda q, k, v: client.attend(q, k, v, lens, softmax_scale=SCALE, window=window),
                 layers, dout, during)
    assert client.last_plan is plan
    assert held["now"] == LAYERS * (sum(plan.held_bytes()) + sum(plan.owner_held_bytes()))
    assert client.last_step.held_bytes() == 0  # every backward round freed what it used
    moved, comm = client.traffic(), plan.comm_bytes()
    assert set(comm["backward"]) == {"dout", "out", "lse", "dq", "dk", "dv", "total"}
    for kind in ("forward", "backward"):
        for name, n in comm[kind].items():
            if name != "total":
                assert moved.get(kind, {}).get(name, 0) == LAYERS * n, (kind, name)
        assert sum(moved.get(kind, {}).values()) == LAYERS * comm[kind]["total"]
    return got


def _want(lens, layers, dout, window=None):
    return _stack(lambda q, k, v: attention_ref(q, k, v, lens, SCALE, window),
                  [[t.double() for t in layer] for layer in layers], dout.double())


def _check(got, want, dtype):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and g.shape == w.shape
        err = (g.double() - w).abs().max().item()
        assert err <= (1e-10 if dtype == torch.float64 else 1e-5 * max(1.0, w.abs().max().item())), (i, err)


DOCS = [17, 3, 257, 1, 301, 129, 1, 511, 2, 64]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_random_key_splits_match_reference(seed, dtype):
    rng = random.Random(seed)
    mode = rng.choice(["inplace", "dedicated"])
    servers = rng.randint(1, 8)
    ranks = servers if mode == "inplace" else rng.randint(1, 5)  # ranks without documents too
    window = rng.choice([None, None, None, 7, 128])
    hq, hkv = rng.choice([(4, 1), (4, 2), (8, 2), (2, 2)])
    lens = rng.sample(DOCS, rng.randint(1, 5)) + [rng.choice([257, 301, 511])] + [1]
    layers, dout = layer_inputs(lens, hq, hkv, 16, dtype, seed, layers=LAYERS)
    client, plan = _client(lens, servers, mode, ranks, RowFormat.of(*layers[0][:2]), window,
                           lambda p: _kept(split_keys(p, rng, 5)))
    arr = plan.task_array
    assert is_split(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6], window).any()
    with client:
        got = _run_checked(client, plan, lens, layers, dout, window)
    _check(got, _want(lens, layers, dout, window), dtype)


@pytest.mark.parametrize("servers", [2, 3, 5, 8])
@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_one_shard_split_over_servers(servers, mode):
    """One long document's one query shard [0, l), its keys cut into one piece per server, next
    to unsplit documents; in-place, its own rank's server gets no piece (the shard's whole work
    sits elsewhere) and that rank keeps the merged O and LSE of every row of it. With one other
    server, both pieces sit on it (its merged rows arrive once per task)."""
    lens = [900, 33, 1]
    layers, dout = layer_inputs(lens, 4, 2, 16, torch.float64, servers, layers=LAYERS)
    ranks = servers if mode == "inplace" else 2

    def make(base):
        owner, doc = next((r, i) for r, docs in enumerate(base.doc_lens_per_rank)
                          for i, n in enumerate(docs) if n == 900)
        others = [s for s in range(servers) if not (mode == "inplace" and s == owner)]
        pieces = max(2, len(others))  # one other server: two pieces of the shard on it
        cuts = np.linspace(0, 900, pieces + 1).astype(int).tolist()
        tasks = [[t for t in own if (t.src_rank, t.doc_index) != (owner, doc)] for own in base.server_tasks]
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            tasks[others[i % len(others)]].append(CATask(owner, doc, 0, 900, a, b))
        return Plan(base.doc_lens_per_rank, servers, mode, base.cost, tasks, 0.0, 1, keep_activations=True)
    client, plan = _client(lens, servers, mode, ranks, RowFormat.of(*layers[0][:2]), None, make)
    owners = plan.owner_held_bytes()
    assert sum(owners) == 900 * plan.cost.merged_row_bytes() and max(owners) == sum(owners)
    with client:
        got = _run_checked(client, plan, lens, layers, dout)
    _check(got, _want(lens, layers, dout), torch.float64)


@pytest.mark.parametrize("mode,servers", [("inplace", 4), ("dedicated", 3)])
def test_planned_partial_kept_plans_through_attend(mode, servers):
    """plan_batch(partial_kv=True, keep_activations=True) splits a shard on the key axis (min_shard
    larger than bands allow); its plan equals the float64 reference through DistCAClient.local."""
    lens = [1500, 20, 7]
    layers, dout = layer_inputs(lens, 4, 2, 16, torch.float64, 1, layers=LAYERS)
    ranks = servers if mode == "inplace" else 1
    fmt = RowFormat.of(*layers[0][:2])
    config = JobConfig(plan=PlanConfig(mode=mode, min_shard=300), servers=servers, timeout_s=60)
    client = DistCAClient.local(config=config, num_ranks=ranks)
    plan = plan_batch(split_documents(lens, ranks), servers, cost=fmt.cost, mode=mode, min_shard=300,
                      partial_kv=True)
    assert plan.keep_activations and plan.split_row_matrix.sum() > 0
    client._runtime._plans[(tuple(lens), fmt, "cpu", None)] = plan
    with client:
        got = _run_checked(client, plan, lens, layers, dout)
    _check(got, _want(lens, layers, dout), torch.float64)


def test_bf16_error_within_twice_plain_torch():
    lens = [301, 129, 511, 2]
    layers, dout = layer_inputs(lens, 4, 2, 32, torch.bfloat16, 3, layers=LAYERS)
    rng = random.Random(5)
    client, _ = _client(lens, 4, "inplace", 4, RowFormat.of(*layers[0][:2]), None,
                        lambda p: _kept(split_keys(p, rng, 6)))
    with client:
        got = _stack(lambda q, k, v: client.attend(q, k, v, lens, softmax_scale=SCALE), layers, dout)
    cu = cu_seqlens(lens)
    plain = _stack(lambda q, k, v: plain_attention(q, k, v, cu, cu, SCALE, None)[0], layers, dout)
    exact = _want(lens, layers, dout)
    for i, (g, p, w) in enumerate(zip(got, plain, exact)):
        ours, theirs = (g.double() - w).abs().max().item(), (p.double() - w).abs().max().item()
        assert ours <= 2 * theirs + 1e-5, (i, ours, theirs)


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_new_step_releases_merged_rows_too(mode):
    """A new step drops what servers keep and what owners keep of split shards; the old
    backward round then raises DistCAError."""
    lens = [600, 20, 1]
    layers, _ = layer_inputs(lens, 4, 1, 16, torch.float32, 4, layers=LAYERS)
    rng = random.Random(2)
    client, plan = _client(lens, 3, mode, 3 if mode == "inplace" else 2, RowFormat.of(*layers[0][:2]),
                           None, lambda p: _kept(split_keys(p, rng, 4)))
    assert sum(plan.owner_held_bytes()) > 0
    with client:
        leaves = [t.clone().requires_grad_() for t in layers[0]]
        out = client.attend(*leaves, lens, softmax_scale=SCALE)
        batch = client.last_step
        assert batch.held_bytes() == sum(plan.held_bytes()) + sum(plan.owner_held_bytes())
        client.new_step()
        assert batch.held_bytes() == 0
        with pytest.raises(DistCAError, match="step"):
            out.sum().backward()


# ---- plan bytes -----------------------------------------------------------------------------------
COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_split_rows_cost_merged_bytes_and_hold_less(mode):
    """Against the same tasks with kept activations off the key axis (hand count): the kept
    backward adds out + lse per off-rank query row of a split task; a server holds no O and LSE
    for those rows; owners hold them once per row."""
    lens = [[4000, 70], [9000], [300, 1], [2500]]
    plan = plan_batch(lens, 4, cost=COST, mode=mode, min_shard=2048, partial_kv=True)
    arr = plan.task_array
    split = is_split(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6])
    assert split.any()
    off = (arr[:, 0] != arr[:, 1]) if mode == "inplace" else np.ones(len(arr), bool)
    split_off = int((arr[:, 4] - arr[:, 3])[split & off].sum())
    back = plan.comm_bytes()["backward"]
    assert back["out"] == split_off * COST.bytes_per_token("out")
    assert back["lse"] == split_off * COST.bytes_per_token("lse")
    whole = Plan(plan.doc_lens_per_rank, 4, mode, COST, plan.server_tasks, plan.epsilon, plan.min_shard,
                 keep_activations=False)
    assert back["dout"] == whole.comm_bytes()["backward"]["dout"]
    hq, hkv = COST.held_row_bytes()
    for s, held in enumerate(plan.held_bytes()):
        mine = arr[arr[:, 0] == s]
        q = int((mine[:, 4] - mine[:, 3]).sum())
        q_split = int((mine[:, 4] - mine[:, 3])[split[arr[:, 0] == s]].sum())
        assert held == q * hq + int(plan.row_matrix[1][:, s].sum()) * hkv - q_split * COST.merged_row_bytes()
    shards = {(r, d, a, b) for _, r, d, a, b, _, _ in arr[split].tolist()}
    assert sum(plan.owner_held_bytes()) == sum(b - a for _, _, a, b in shards) * COST.merged_row_bytes()
    assert "merged O and LSE" in plan.summary()


def test_held_cap_keeps_unsplit_plan_when_splits_break_it():
    """With max_held_bytes_per_server, key splits that would push a server past the cap are
    dropped (the greedy's plan is returned); splits that fit stay."""
    lens = [[113, 129, 11857], [], [294], [189, 32986], []]
    kw = dict(cost=COST, mode="dedicated", min_shard=2048)
    kw["max_held_bytes_per_server"] = 1 << 62  # a cap that binds nothing: the planner skips its LPT fallback
    split = plan_batch(lens, 6, partial_kv=True, **kw)
    bands = plan_batch(lens, 6, **kw)
    del kw["max_held_bytes_per_server"]
    assert split.split_row_matrix.sum() > 0 and max(split.held_bytes()) > max(bands.held_bytes())
    capped = plan_batch(lens, 6, partial_kv=True, max_held_bytes_per_server=max(bands.held_bytes()), **kw)
    assert capped == bands
    roomy = plan_batch(lens, 6, partial_kv=True, max_held_bytes_per_server=max(split.held_bytes()), **kw)
    assert roomy == split


@pytest.mark.parametrize("keep", [True, False])
def test_local_client_plans_partial_kv(keep):
    """``DistCAClient.local`` with ``PlanConfig(partial_kv=True)``: a document the head-tail bands
    cannot balance (2,048 tokens over 4 dedicated servers at min_shard 512: two bands, max/mean 2)
    gets key blocks split onto the idle servers, and attend stays exact, kept or stateless."""
    lens = [2048, 5]
    layers, dout = layer_inputs(lens, 4, 2, 16, torch.float64, 4, layers=LAYERS)
    balance = {}
    for partial_kv in (False, True):
        config = JobConfig(plan=PlanConfig(mode="dedicated", min_shard=512, keep_activations=keep,
                                           partial_kv=partial_kv), servers=4, timeout_s=60)
        with DistCAClient.local(config=config, num_ranks=1) as client:
            got = _stack(lambda q, k, v: client.attend(q, k, v, lens, softmax_scale=SCALE), layers, dout)
            plan = client.last_plan
            arr = plan.task_array
            assert bool(is_split(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6], None).any()) is partial_kv
            balance[partial_kv] = plan.imbalance()[1]
            _check(got, _want(lens, layers, dout), torch.float64)
    assert balance[False] >= 1.9 and balance[True] <= 1.05 + 1e-9
    with pytest.raises(ValueError, match="partial_kv must be a bool, got 1"):
        DistCAClient.local(2, config=PlanConfig(partial_kv=1))
