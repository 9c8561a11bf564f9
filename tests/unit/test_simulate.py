"""Step-time simulator: hand-computed cases, schedules, ping-pong, memory, presets, bad input."""

import re
from pathlib import Path

import numpy as np
import pytest

from distca_sim.hardware import attention_tables
from distca_sim.network import alltoall_seconds, plan_round_bytes, rank_nodes, ring_seconds
from distca_sim.pipeline import Round, pipeline_1f1b, run_rounds, tick_schedule
from distca_sim.simulate import (GPUS, MODELS, SYSTEMS, GPUConfig, ModelConfig, ParallelConfig,
                                 Workload, get_gpu, get_model, simulate)
from distca_sim.systems import Context, cp_server_seconds
from scheduler import CostModel, plan_batch
from scheduler.cost import RoundKind
from scheduler.baselines import capped_lpt, per_doc_cp

# A model and a GPU with round numbers, so step times can be written down by hand.
# Linear weights per layer: 256·(256 + 2·128) + 256² + 3·256·512 = 589,824.
TINY = ModelConfig("tiny", hidden_size=256, num_heads=2, num_kv_heads=1, num_layers=4,
                   ffn_hidden_size=512, vocab_size=1)
UNIT = GPUConfig("unit", peak_flops=1e12, hbm_bytes=1e15, nvlink_bw=1e18, ib_bw=1e18,
                 linear_efficiency=1.0, attn_fwd_efficiency=1.0, attn_bwd_efficiency=1.0,
                 link_efficiency=1.0, collective_latency_s=0.0, kernel_launch_s=0.0)
LIN_F = 2 * 589_824 / 1e12        # seconds per token per layer, forward
LIN_B = 2 * LIN_F                  # backward: input and weight gradients
HEAD = 3 * 2 * 256 * 1 / 1e12      # LM head forward + backward per token (vocab 1)


def attn_f(l):
    """Forward seconds of a causal document: 4·head_dim·heads FLOPs per pair, l(l+1)/2 pairs."""
    return 4 * 128 * 2 * l * (l + 1) / 2 / 1e12


def attn_b(l):
    return 2.5 * attn_f(l)


def run(batch, *, dp, pp=1, m=1, systems=("packing", "distca", "wlb_ideal", "per_doc_cp"),
        **kw):
    par = ParallelConfig(tp=1, dp=dp, pp=pp, microbatches=m)
    return simulate(TINY, UNIT, par, Workload("pretrain", 1024), systems=systems,
                    epsilons=(0.0,), batch=batch, **kw)


# ---- hand-computed cases ----------------------------------------------------------------------
def test_one_rank_every_system_is_the_sum_of_its_parts():
    cmp = run([[[1024]]], dp=1)
    expected = 4 * (1024 * (LIN_F + LIN_B) + attn_f(1024) + attn_b(1024)) + 1024 * HEAD
    for r in cmp.results:
        assert r.step_time_s == pytest.approx(expected, rel=1e-9), r.system
        assert r.throughput_tokens_s == pytest.approx(1024 / expected, rel=1e-9)
        assert r.comm_exposed_s == pytest.approx(0.0, abs=1e-12)
    assert cmp.recompute is False


def test_two_equal_ranks_take_as_long_as_one_and_double_throughput():
    one = run([[[1024]]], dp=1).get("packing")
    two = run([[[1024], [1024]]], dp=2)
    for r in two.results:
        assert r.step_time_s == pytest.approx(one.step_time_s, rel=1e-6), r.system
        assert r.throughput_tokens_s == pytest.approx(2 * one.throughput_tokens_s, rel=1e-6)
        assert r.idle_fraction == pytest.approx(0.0, abs=1e-6)


def test_imbalanced_pair_packing_waits_distca_balances():
    # Equal tokens, but rank 0's single 2048-token document has twice the attention work.
    cmp = run([[[2048], [1024, 1024]]], dp=2)
    lin = 2048 * (LIN_F + LIN_B)
    packing = 4 * (lin + attn_f(2048) + attn_b(2048)) + 2048 * HEAD
    half = (attn_f(2048) + 2 * attn_f(1024)) / 2  # each server's share when balanced
    balanced = 4 * (lin + 3.5 * half) + 2048 * HEAD
    assert cmp.get("packing").step_time_s == pytest.approx(packing, rel=1e-9)
    assert cmp.get("packing").idle_fraction > 0.05
    assert cmp.get("distca").step_time_s == pytest.approx(balanced, rel=1e-2)
    # WLB-ideal: CP over both ranks splits every document evenly (free links): also balanced.
    assert cmp.get("wlb_ideal").step_time_s == pytest.approx(balanced, rel=1e-2)
    assert cmp.get("wlb_ideal").details["cp"] == 2
    assert cmp.speedup("distca", "packing") > 1.1


def test_pipeline_bubbles_and_distca_serving_in_bubbles():
    """pp 2, 4 microbatches of one document each. Stateless servers: every tick is planned
    afresh, so bubbles serve half of a lone stage's CA-tasks. Kept activations pin each backward
    to the servers of its forward tick (0.5/0.5 when its stage ran alone there, else its own
    rank), so by hand the backward ticks' busiest servers run 1, 1.5, 1, 1.5, 1 documents' backward
    (B0: (1,0) from F1, own rank; B1: (1,1) own + (0,0) split; B2: own, own; B3: (1,3) split +
    (0,2) own; B4: (0,3) own) where stateless servers run 0.5, 1, 1, 1, 0.5."""
    p, m, L = 2, 4, 2048
    batch = [[[L]] for _ in range(m)]
    lin = L * (LIN_F + LIN_B) * 4 / p     # one microbatch on one stage (2 layers)
    caf, cab = attn_f(L) * 4 / p, attn_b(L) * 4 / p
    one_f_one_b = (m + p - 1) * (lin + caf + cab)   # bubble (p-1)/(m+p-1) of equal stages
    pooled = (m + p - 1) * lin + m * (caf + cab)    # bubbles serve CA-tasks of both passes
    pinned = (m + p - 1) * lin + m * caf + 6 * cab  # ... of the forward only, in effect
    cmp = run(batch, dp=1, pp=p, m=m, systems=("packing", "distca"), keep_activations=False)
    assert cmp.get("packing").step_time_s == pytest.approx(one_f_one_b, rel=1e-3)
    assert cmp.get("distca").step_time_s == pytest.approx(pooled, rel=1e-2)
    kept = run(batch, dp=1, pp=p, m=m, systems=("distca",)).get("distca")
    assert kept.details["keep_activations"] is True
    assert kept.step_time_s == pytest.approx(pinned, rel=1e-2)
    for keep in (False, True):
        plain = run(batch, dp=1, pp=p, m=m, systems=("distca",), bubble_serving=False,
                    keep_activations=keep)
        assert plain.get("distca").step_time_s == pytest.approx(one_f_one_b, rel=1e-3)
    assert cmp.get("distca").step_time_s < kept.step_time_s - 1.5 * cab
    # Here pinning costs more than bubbles give: a lone stage's forward split over both servers
    # brings its backward to a server busy with its own stage's (1.5 caf worse than no serving).
    assert kept.step_time_s == pytest.approx(plain.get("distca").step_time_s + cab - caf, rel=1e-2)


# ---- schedules -----------------------------------------------------------------------------------
def test_1f1b_equal_stages_bubble_fraction():
    p, m, f, b = 4, 8, 1.0, 2.0
    makespan, busy = pipeline_1f1b(np.full((p, m), f), np.full((p, m), b))
    assert makespan == pytest.approx((m + p - 1) * (f + b))
    assert 1 - busy[0] / makespan == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_stage_imbalance_by_hand():
    # Stage 1 twice as slow. By hand: S0 F0[0,1] F1[1,2] B0[7,9] B1[13,15];
    #                                S1 F0[1,3] B0[3,7] F1[7,9] B1[9,13].
    makespan, _ = pipeline_1f1b([[1, 1], [2, 2]], [[2, 2], [4, 4]])
    assert makespan == pytest.approx(15.0)
    # A point-to-point hop of 0.5 s delays every stage crossing.
    assert pipeline_1f1b([[1, 1], [1, 1]], [[1, 1], [1, 1]], p2p_s=0.5)[0] > 6.0


def test_tick_schedule_order():
    ticks = tick_schedule(2, 2)
    assert ticks == [("F", [(0, 0)]), ("F", [(0, 1), (1, 0)]), ("B", [(1, 0)]),
                     ("F", [(1, 1)]), ("B", [(0, 0), (1, 1)]), ("B", [(0, 1)])]
    for p, m in ((1, 3), (3, 5), (4, 2)):
        t = tick_schedule(p, m)
        assert len(t) == 2 * (m + p - 1)
        assert sum(len(a) for _, a in t) == 2 * p * m


# ---- ping-pong -----------------------------------------------------------------------------------
def test_ping_pong_hides_communication_shorter_than_compute():
    # Per nano-batch: linear 1, attention 1, dispatch and return 0.5 each (shorter than compute).
    rd = Round(lin=np.array([2.0]), ca=np.array([2.0]), dispatch_bw_s=1.0, return_bw_s=1.0)
    t, busy = run_rounds([rd] * 3, np.zeros(1), ping_pong=True)
    assert t == pytest.approx(3 * 4.0 + 0.5)  # only the very last return shows
    assert busy[0] == pytest.approx(12.0)
    seq, _ = run_rounds([rd] * 3, np.zeros(1), ping_pong=False)
    assert seq == pytest.approx(3 * (4.0 + 2.0))  # sequential: every byte exposed


def test_ping_pong_exposes_the_remainder_of_long_communication():
    # Per nano-batch: linear 1, attention 1, dispatch and return 3 each. By hand: lin0 [0,1],
    # D0 [1,4], lin1 [1,2], D1 [4,7], CA0 [4,5], R0 [7,10], CA1 [7,8], R1 [10,13].
    rd = Round(lin=np.array([2.0]), ca=np.array([2.0]), dispatch_bw_s=6.0, return_bw_s=6.0)
    assert run_rounds([rd], np.zeros(1), ping_pong=True)[0] == pytest.approx(13.0)
    assert run_rounds([rd], np.zeros(1), ping_pong=False)[0] == pytest.approx(16.0)
    # Latency is paid per call: two calls per direction with ping-pong.
    rd = Round(lin=np.array([2.0]), ca=np.array([2.0]), dispatch_bw_s=0.2, return_bw_s=0.2,
               latency_s=0.1)
    assert run_rounds([rd], np.zeros(1), ping_pong=True)[0] == pytest.approx(4.0 + 0.2)


def test_distca_ping_pong_beats_sequential_on_a_real_batch():
    par = ParallelConfig.from_gpus(64, tp=8)
    w = Workload("pretrain", 65536)
    pp = simulate("llama3-8b", "h100", par, w, systems=("distca",), epsilons=(0.0,))
    seq = simulate("llama3-8b", "h100", par, w, systems=("distca",), epsilons=(0.0,),
                   ping_pong=False)
    a, b = pp.get("distca"), seq.get("distca")
    assert a.comm_s == pytest.approx(b.comm_s)
    assert a.comm_exposed_s < 0.2 * b.comm_exposed_s
    assert a.step_time_s < b.step_time_s


# ---- network -------------------------------------------------------------------------------------
def test_alltoall_busiest_port_and_nodes():
    gpu = get_gpu("h100")
    nodes = rank_nodes(4, 4, 8)                     # two ranks of 4 GPUs per node
    assert nodes.tolist() == [0, 0, 1, 1]
    send = np.zeros((4, 4))
    send[0, 1] = 9e9                                # inside node 0: NVLink
    send[0, 2] = send[1, 2] = 1e9                   # into node 1: rank 2 receives 2 GB over IB
    t, per = alltoall_seconds(send, nodes, gpu)
    assert t == pytest.approx(max(9e9 / gpu.nvlink_eff, 2e9 / gpu.ib_eff))
    assert per[3] == 0.0
    assert ring_seconds(8e9, 8, False, gpu) == pytest.approx(7 / 8 * 8e9 / gpu.nvlink_eff)


def test_per_doc_cp_analytic_matches_the_plan_baseline():
    batch = [[1000, 37, 5000], [129, 4096], [3]]
    cost = CostModel(4, 1, 128, 2)
    fwd, _ = attention_tables(get_gpu("h100"), cost)
    plan = per_doc_cp(batch, 3, cost=cost)
    arr = plan.task_array
    want = np.bincount(arr[:, 0], fwd.latencies(arr[:, 4] - arr[:, 3], arr[:, 6]), minlength=3)
    got = cp_server_seconds([x for r in batch for x in r], 3, fwd)
    np.testing.assert_allclose(got, want, rtol=1e-12)


# ---- kept activations ----------------------------------------------------------------------------
# Four ranks, one heavy: the plan moves shards of the 6,000-token documents to the light ranks.
KEEP_RANKS = [[6000, 6000, 300], [500, 700], [128, 900], [40, 1000, 2]]


@pytest.mark.parametrize("keep", [False, True])
def test_round_bytes_are_the_plans_comm_bytes(keep):
    cost = CostModel(4, 1, 128, 2)
    plan = plan_batch(KEEP_RANKS, 4, cost=cost, epsilon=0.0, min_shard=128, keep_activations=keep)
    mats = plan_round_bytes(*plan.row_matrix, cost, keep_activations=keep)
    comm = plan.comm_bytes()
    for kind in RoundKind:
        off = {d: float(m.sum() - np.trace(m)) for (k, d), m in mats.items() if k is kind}
        assert off["dispatch"] == sum(comm[kind.value][n] for n in kind.dispatch_with(keep))
        assert off["dispatch"] + off["return"] == comm[kind.value]["total"] > 0
    if keep:  # the backward round sends dO only: one Q-sized row per query row
        assert mats[(RoundKind.BACKWARD, "dispatch")].sum() == plan.row_matrix[0].sum() * cost.bytes_per_token("dout")


def test_kept_activations_move_fewer_bytes_and_hold_what_the_plan_holds():
    """Same batch, same ε: with kept activations distca's ports are busy for less time, its CA
    bytes are the plan's comm_bytes (forward + backward, every layer), and each server holds
    Plan.held_bytes per layer from the forward tick to the backward tick."""
    res = {keep: run([KEEP_RANKS], dp=4, systems=("distca",), keep_activations=keep,
                     recompute="none").get("distca") for keep in (False, True)}
    stateless, kept = res[False], res[True]
    assert kept.comm_s < stateless.comm_s
    assert kept.details["ca_bytes_per_step"] < 0.7 * stateless.details["ca_bytes_per_step"]
    for keep, r in res.items():
        plan = plan_batch(KEEP_RANKS, 4, cost=TINY.cost_model(1), epsilon=0.0, min_shard=128,
                          keep_activations=keep)
        comm = plan.comm_bytes()
        assert r.details["ca_bytes_per_step"] == TINY.num_layers * (comm["forward"]["total"]
                                                                    + comm["backward"]["total"])
        np.testing.assert_array_equal(r.per_rank["held_bytes"], TINY.num_layers * np.array(plan.held_bytes()))
        assert r.details["keep_activations"] is keep
    assert stateless.details["held_bytes_max"] == 0 < kept.details["held_bytes_max"]
    assert "kept, held" in run([KEEP_RANKS], dp=4, systems=("distca",)).table()  # the default


def test_kept_activations_client_memory_and_recompute():
    kw = dict(model=get_model("llama3-8b"), gpu=get_gpu("h200"), tp=8, pp=4, dp=2, microbatches=8,
              min_shard=128)
    ctx = Context(**kw, recompute=False)
    saved = ctx.cost.bytes_per_token("q") + 2 * ctx.cost.bytes_per_token("k") + ctx.cost.bytes_per_token("lse")
    assert saved == 2 * (4096 + 2 * 8 * 128 + 2 * 32) / 8  # Q, K, V and the fp32 LSE per GPU
    # stage 0 keeps 4 microbatches of 8 layers alive; each drops Q, K, V, LSE per layer
    assert ctx.act_bytes_per_token(0) - ctx.act_bytes_per_token(0, True) == pytest.approx(4 * 8 * saved)
    full = Context(**kw, recompute=True)  # one recomputed layer in flight
    assert full.act_bytes_per_token(0) - full.act_bytes_per_token(0, True) == pytest.approx(saved)
    # with full recompute a server holds one layer's rows, during the backward tick only
    rec = run([KEEP_RANKS], dp=4, systems=("distca",), recompute="full").get("distca")
    plan = plan_batch(KEEP_RANKS, 4, cost=TINY.cost_model(1), epsilon=0.0, min_shard=128)
    np.testing.assert_array_equal(rec.per_rank["held_bytes"], plan.held_bytes())


def test_pipeline_holds_each_microbatch_until_its_backward_tick():
    """pp 2, 2 microbatches: stage 0 keeps microbatch 0's rows from tick 0 to tick 4 while
    microbatch 1 arrives, so some server holds more than one microbatch's layers at once; with
    one microbatch per step the peak is one microbatch's."""
    batch = [[[3000, 200], [50, 60]], [[100], [2500, 20]]]
    two = run(batch, dp=2, pp=2, m=2, systems=("distca",), recompute="none").get("distca")
    one = run(batch[:1], dp=2, pp=2, m=1, systems=("distca",), recompute="none").get("distca")
    assert two.per_rank["held_bytes"].max() > one.per_rank["held_bytes"].max() > 0
    assert two.memory_bytes > one.memory_bytes


# ---- memory --------------------------------------------------------------------------------------
def test_capped_lpt_by_hand():
    # WLB-ideal's packing (scheduler.baselines.capped_lpt, shared with wlb_packing): costliest
    # first to the least-loaded bin with room; ties go to the lower index / lower bin.
    sizes, costs = [4, 3, 3, 2, 1], [16.0, 9.0, 9.0, 4.0, 1.0]
    assert capped_lpt(sizes, costs, 2, float("inf")) == [[0, 3], [1, 2, 4]]
    # cap 6: item 3 (size 2) fits only bin 0 (4 + 2); item 4 fits nowhere (6, 6) -> smaller bin 0
    assert capped_lpt(sizes, costs, 2, 6) == [[0, 3, 4], [1, 2]]
    assert capped_lpt([], [], 3, 10) == [[], [], []]
    with pytest.raises(ValueError, match="num_bins"):
        capped_lpt(sizes, costs, 0, 10)
    with pytest.raises(ValueError, match="5 != 4"):
        capped_lpt(sizes, costs[:4], 2, 10)


def test_memory_by_hand_llama3_8b():
    m = get_model("llama3-8b")
    assert m.num_params == 8_030_261_248          # Llama-3-8B: 8.03 B weights
    # Per token per layer: 4h + h + 2·kv·d + h + 2·heads + 3·ffn = 69,696 bf16 elements.
    assert m.activation_bytes_per_token_layer() == 2 * 69_696
    kw = dict(model=m, gpu=get_gpu("h200"), tp=8, pp=1, dp=8, microbatches=1, min_shard=128)
    ctx = Context(**kw, recompute=False)
    assert ctx.act_bytes_per_token(0) == pytest.approx(32 * 2 * 69_696 / 8 + 4 * 128_256 / 8)
    shard = 8_030_261_248 / 8
    assert ctx.states_bytes() == pytest.approx(6 * shard + 12 * shard / 8)
    full = Context(**kw, recompute=True)  # keeps each layer's input, plus one layer in flight
    assert full.act_bytes_per_token(0) == pytest.approx(
        32 * 2 * 4096 / 8 + 2 * 69_696 / 8 + 4 * 128_256 / 8)
    pp = Context(**{**kw, "pp": 4, "microbatches": 8}, recompute=False)
    assert pp.act_bytes_per_token(0) == pytest.approx(4 * 8 * 2 * 69_696 / 8)  # 4 alive, 8 layers


def test_memory_fits_and_auto_recompute():
    par = ParallelConfig.from_gpus(16, tp=8)
    w = Workload("pretrain", 131072)
    none = simulate("llama3-8b", "h100", par, w, systems=("packing",), recompute="none")
    assert not none.get("packing").fits               # ~81 GB of activations on an H100 (81,559 MiB)
    auto = simulate("llama3-8b", "h100", par, w, systems=("packing",))
    assert auto.recompute and auto.get("packing").fits
    assert auto.get("packing").step_time_s > none.get("packing").step_time_s
    h200 = simulate("llama3-8b", "h200", par, w, systems=("packing", "wlb_ideal"))
    assert not h200.recompute
    # Variable-length packing buys balance with memory: its fullest GPU holds more.
    assert h200.get("wlb_ideal").memory_divergence >= h200.get("packing").memory_divergence


# ---- presets, measured tables, bad input ---------------------------------------------------------
def test_presets():
    assert set(MODELS) == {"llama3-8b", "llama-34b"} and set(GPUS) == {"h100", "h200"}
    m34 = get_model("34b")
    assert (m34.hidden_size, m34.num_layers, m34.num_heads, m34.num_kv_heads,
            m34.ffn_hidden_size) == (8192, 48, 64, 8, 22016)
    assert get_model("Llama-8B") is MODELS["llama3-8b"]
    h100, h200 = get_gpu("h100"), get_gpu("H200")
    assert h100.peak_flops == h200.peak_flops == 989.4e12
    # nvidia-smi's memory.total on the benchmark machines (bench/results/gpu/*/session*.log),
    # not the product names' decimal 80 GB / 141 GB.
    assert (h100.hbm_bytes, h200.hbm_bytes) == (81559 * 2**20, 143771 * 2**20)
    assert h100.nvlink_bw == 450e9 and h100.ib_bw == 50e9
    par = ParallelConfig.from_gpus(64, tp=8, pp=2)
    assert (par.dp, par.microbatches, par.gpus) == (4, 4, 64)


def test_measured_tables_replace_the_analytic_ones():
    cost = TINY.cost_model(1)
    fwd, bwd = attention_tables(UNIT, cost)
    slow = UNIT.with_tables(
        type(fwd)(fwd.q_lens, fwd.kv_lens, [[2 * x for x in r] for r in fwd.latency_s]),
        type(bwd)(bwd.q_lens, bwd.kv_lens, [[2 * x for x in r] for r in bwd.latency_s]))
    a = simulate(TINY, UNIT, ParallelConfig(tp=1), Workload(), systems=("packing",),
                 batch=[[[1024]]]).get("packing")
    b = simulate(TINY, slow, ParallelConfig(tp=1), Workload(), systems=("packing",),
                 batch=[[[1024]]]).get("packing")
    assert b.attention_s == pytest.approx(2 * a.attention_s)


@pytest.mark.parametrize("call", [
    lambda: get_model("gpt-5"),
    lambda: get_gpu("a100"),
    lambda: ParallelConfig(tp=0),
    lambda: ParallelConfig.from_gpus(60, tp=8),
    lambda: Workload("c4"),
    lambda: Workload(context=8),
    lambda: ModelConfig("x", 100, 3, 1, 2, 8, 8),
    lambda: GPUConfig("x", 1e12, 1e9, 1e9, 1e9, linear_efficiency=1.5),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=3, dp=2), Workload()),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, pp=5, dp=1), Workload()),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, dp=2), Workload(), systems=("x",)),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, dp=2), Workload(), epsilons=(-1,)),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, dp=2), Workload(), epsilons=()),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, dp=4), Workload(), cp_degrees=(3,)),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, dp=2), Workload(), recompute="x"),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, dp=2), Workload(),
                     batch=[[[10]]]),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, dp=1), Workload(),
                     batch=[[[0]]]),
    lambda: simulate("llama3-8b", "h100", ParallelConfig(tp=8, dp=2), Workload(), keep_activations=1),
])
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("kw, words", [
    (dict(ping_pong="False"), "ping_pong must be a bool, got 'False'"),  # a str is truthy: ran ping-pong
    (dict(bubble_serving=0), "bubble_serving must be a bool, got 0"),
    (dict(systems="distca"), f"systems must be a sequence of names from {SYSTEMS}, got 'distca'"),
    (dict(epsilons="0.05"), "epsilons must be a sequence of numbers, got '0.05'"),
])
def test_flags_and_lists_of_the_wrong_type_are_refused_by_name(kw, words):
    # A str for a list would be taken letter by letter ("unknown systems ['d', 'i', ...]").
    with pytest.raises(ValueError, match=f"^{re.escape(words)}$"):
        simulate(TINY, UNIT, ParallelConfig(tp=1), Workload(), batch=[[[1024]]], **kw)


def test_cluster_comparison_has_every_system_and_a_table():
    cmp = simulate("llama3-8b", "h200", ParallelConfig.from_gpus(32, tp=8),
                   Workload("prolong", 65536), epsilons=(0.0, 0.1))
    names = [r.system for r in cmp.results]
    assert names == ["distca eps=0", "distca eps=0.1", "wlb_ideal", "per_doc_cp", "packing"]
    assert cmp.get("distca").throughput_tokens_s >= cmp.get("packing").throughput_tokens_s
    assert len({r.tokens_per_step for r in cmp.results}) == 1
    text = cmp.table()
    assert "wlb_ideal" in text and "vs WLB" in text
    d = cmp.get("wlb_ideal").to_dict()
    assert d["details"]["cp"] in (1, 2, 4) and "per_rank" not in d


# ---- command line --------------------------------------------------------------------------------
def test_cli_single_configuration_and_sweep(tmp_path, capsys):
    from distca_cli import main
    assert main(["simulate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "32", "--tp", "8",
                 "--pp", "1", "--context", "64K", "--dataset", "pretrain",
                 "--epsilon", "0.05"]) == 0
    out = capsys.readouterr().out
    for name in ("distca eps=0.05", "wlb_ideal", "per_doc_cp", "packing", "vs WLB-ideal", "kept, held"):
        assert name in out
    assert main(["simulate", "--gpus", "32", "--context", "64K", "--systems", "distca",
                 "--no-keep-activations"]) == 0
    assert "epsilon=0.05, stateless" in capsys.readouterr().out
    # a pipeline without recomputation: kept activations may lose to stateless servers, and it says so
    pipe = ["simulate", "--gpus", "32", "--pp", "2", "--context", "32K", "--recompute", "none",
            "--systems", "distca", "wlb_ideal"]
    assert main(pipe) == 0
    assert "--no-keep-activations) may be faster" in capsys.readouterr().out
    assert main(pipe + ["--no-keep-activations"]) == 0
    assert "may be faster" not in capsys.readouterr().out
    path = tmp_path / "sweep.json"
    assert main(["simulate", "--gpus", "32", "--pp", "2", "--sweep", "--contexts", "32K", "64K",
                 "--epsilon", "0", "0.1", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert "simulate" in captured.err and "4/4" in captured.err  # the progress bar
    import json
    rows = json.loads(path.read_text())
    assert {r["context"] for r in rows} == {32768, 65536}
    assert sum(r["system"] == "wlb_ideal" for r in rows) == 2  # baselines once per context
    assert main(["simulate", "--gpus", "60"]) == 1  # one line, exit status 1, as every distca command
    assert "not a multiple" in capsys.readouterr().err


def test_cli_json_path_is_checked_before_the_run(tmp_path, capsys):
    from distca_cli import main
    small = ["simulate", "--gpus", "8", "--context", "16K", "--systems", "packing"]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for target, words in ((tmp_path, f"--json {tmp_path}: is a folder (give a file path)"),
                          (a_file / "out.json", f"--json {a_file / 'out.json'}: {a_file} is not a folder")):
        assert main([*small, "--json", str(target)]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.splitlines() == [f"distca simulate: error: {words}"]
    deep = tmp_path / "new" / "folder" / "out.json"  # folders that do not exist yet are made
    assert main([*small, "--json", str(deep)]) == 0 and deep.is_file()


def test_cli_json_write_failure_is_one_line(tmp_path, capsys, monkeypatch):
    import errno
    from distca_cli import main

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full_disk)
    path = tmp_path / "out.json"
    assert main(["simulate", "--gpus", "8", "--context", "16K", "--systems", "packing", "--json", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"distca simulate: error: --json {path}: No space left on device"]


@pytest.mark.parametrize("case", ["unsearchable folder", "too long a name"])
def test_cli_json_path_the_os_cannot_look_at_is_one_line(tmp_path, capsys, monkeypatch, case):
    import errno
    import os
    from distca_cli import main
    # Tests may run as root, whom no permission stops: the PermissionError of a folder without
    # search permission is raised by a stand-in; a name over 255 bytes fails for real, for anyone.
    if case == "unsearchable folder":
        path, reason = tmp_path / "locked" / "out.json", os.strerror(errno.EACCES)
        real_is_dir = Path.is_dir

        def is_dir(self):
            if self == path:
                raise PermissionError(errno.EACCES, reason, str(self))
            return real_is_dir(self)
        monkeypatch.setattr(Path, "is_dir", is_dir)
    else:
        path, reason = tmp_path / ("x" * 300) / "out.json", os.strerror(errno.ENAMETOOLONG)
    assert main(["simulate", "--gpus", "8", "--context", "16K", "--systems", "packing", "--json", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [f"distca simulate: error: --json {path}: {reason}"]


def test_cli_tp_above_the_head_count_is_the_layout_error(capsys):
    from distca_cli import main
    words = ("bad parallel layout: tp=64 must divide the 8 GPUs of a node; "
             "tp=64 must divide num_heads=32")
    # Without --assumed-rates the shipped tables are looked up by the per-GPU shape at this tp.
    for extra in ([], ["--assumed-rates"]):
        assert main(["simulate", "--gpus", "64", "--tp", "64", *extra]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.splitlines() == [f"distca simulate: error: {words}"]


@pytest.mark.parametrize("args, words", [
    (["--hidden-size", str(10**30)], f"hidden_size must be a positive int at most 2**63 - 1, got {10**30}"),
    (["--vocab-size", str(10**30)], f"vocab_size must be a positive int at most 2**63 - 1, got {10**30}"),
    (["--num-layers", "10000000"], "num_layers must be at most 1024 (the simulator times each layer), got 10000000"),
    (["--sweep", "--contexts", "64K", str(10**30)], f"token count must be at most 2**63 - 1: '{10**30}'"),
    (["--attn-profile", ""], "must be a folder path, got ''")])
def test_cli_sizes_past_their_bounds_are_one_line_before_any_run(args, words, capsys):
    """A model size past int64 was a traceback (OverflowError) or a table of 1e25 s, 10 M layers
    ran for minutes (a loop per layer), a sweep's bad last context failed after the others ran,
    and an empty --attn-profile named the current folder (found by a review)."""
    from distca_cli import main
    try:
        code = main(["simulate", "--gpus", "8", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code not in (0, None)
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "1/2" not in err, err


def test_cli_attn_profile_folder_check_is_the_configs(tmp_path, capsys):
    from distca_cli import main
    from scheduler.config import ConfigError, PlanConfig
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    words = f"attention profile {str(a_file)!r}: not a folder"
    assert main(["simulate", "--gpus", "8", "--context", "16K", "--attn-profile", str(a_file)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"distca simulate: error: {words}"]
    with pytest.raises(ConfigError, match=re.escape(words)):  # what `distca up --attn-profile` says
        PlanConfig(attn_profile=str(a_file))


def test_cli_assumed_rates_help_says_an_attn_profile_wins():
    import argparse

    from distca_sim import cli
    parser = argparse.ArgumentParser()
    sim = cli.register(parser.add_subparsers())
    text = next(a.help for a in sim._actions if a.dest == "assumed_rates")
    assert "--attn-profile takes precedence" in text


def test_stage_hop_crosses_nodes_where_any_stage_boundary_does():
    """Rank ``s·R + d``'s node is that of its first GPU: with tp 2, dp 2 on 8-GPU nodes two
    stages share a node, so the stage 1 → 2 hop crosses nodes and paces every tick (InfiniBand);
    with tp 1 all 4 stages share one node (NVLink)."""
    from distca_sim.network import p2p_seconds
    from distca_sim.systems import _p2p
    gpu, model = get_gpu("h200"), get_model("llama3-8b")
    for tp, same in ((2, False), (1, True)):
        ctx = Context(model=model, gpu=gpu, tp=tp, pp=4, dp=2, microbatches=8, min_shard=128,
                      recompute=False)
        assert _p2p(ctx, 4096, 2) == p2p_seconds(4096, model.hidden_size, tp, same, gpu)
    assert p2p_seconds(4096, model.hidden_size, 2, False, gpu) > p2p_seconds(4096, model.hidden_size, 2, True, gpu)
