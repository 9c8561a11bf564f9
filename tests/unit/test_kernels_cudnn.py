"""The ``cudnn`` backend (distca_server/kernels_cudnn.py).

On the CPU: its pure parts (buckets, per-slot padding, rows without keys), its availability and
``auto``'s choice, the variant pack and graph cache through a stand-in for cuDNN, and, where the
``cudnn`` package is installed, the graph-building arguments (cudnn-frontend validates a graph
without a GPU). On a GPU (marked ``gpu``): forward, LSE and backward against the float64 oracle,
and one built graph per bucket across mixes of lengths.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import random
import sys
import threading
import time
import types

import pytest
import torch
from test_kernels import CASES, NAMES, make_inputs, max_error

from distca_server import kernels, kernels_cudnn
from distca_server.kernels import BACKENDS, available_backends, get_backend
from distca_server.kernels_cudnn import Bucket, bucket_shape, padded_offsets, rows_with_keys
from distca_server.refs import attention_ref, plain_attention

# ---------------------------------------------------------------- pure parts (CPU)


def test_bucket_shape_rounds_each_bound_up_to_a_power_of_two():
    assert bucket_shape(3, 97, 101, 101, 152) == Bucket(8, 128, 128, 128, 256)
    assert bucket_shape(1, 1, 1, 1, 1) == Bucket(8, 64, 64, 128, 128)
    assert bucket_shape(0, 0, 0, 0, 0) == Bucket(8, 64, 64, 128, 128)
    assert bucket_shape(9, 64, 64, 129, 128) == Bucket(16, 64, 64, 256, 128)
    assert bucket_shape(64, 65536, 65537, 65536, 70000) == Bucket(64, 65536, 131072, 65536, 131072)
    rng = random.Random(0)
    for _ in range(200):
        vals = [rng.randint(0, 5000) for _ in range(5)]
        b = bucket_shape(*vals)
        for v, bound in zip(vals, b):
            assert bound >= v and bound & (bound - 1) == 0
            assert bound < 2 * max(v, 1) or bound in (8, 64, 128)
        # every smaller call lands in the same or a smaller bucket
        assert all(x <= y for x, y in zip(bucket_shape(*[v // 2 for v in vals]), b))


@pytest.mark.parametrize("bad", [(-1, 1, 1, 1, 1), (1, 2.0, 1, 1, 1), (1, 1, True, 1, 1), (1, 1, 1, None, 1)])
def test_bucket_shape_refuses_bad_values_by_name(bad):
    with pytest.raises(ValueError, match="bucket_shape needs ints >= 0"):
        bucket_shape(*bad)


def test_padded_offsets_pad_with_zero_length_sequences():
    lens, offsets = padded_offsets(torch.tensor([0, 3, 3, 10], dtype=torch.int32), 8)
    assert lens.dtype == torch.int32 and offsets.dtype == torch.int64
    assert lens.tolist() == [3, 0, 7, 0, 0, 0, 0, 0]
    assert offsets.tolist() == [0, 3, 3, 10, 10, 10, 10, 10, 10]
    lens, offsets = padded_offsets(torch.tensor([5, 9]), 1)  # exact fit, non-zero start
    assert lens.tolist() == [4] and offsets.tolist() == [5, 9]
    for bad, slots in ((torch.zeros(4, dtype=torch.int32), 2), (torch.zeros(0, dtype=torch.int32), 2),
                       (torch.zeros(2, 2, dtype=torch.int32), 4)):
        with pytest.raises(ValueError, match="must be \\[B \\+ 1\\]"):
            padded_offsets(bad, slots)


def test_offsets_widen_to_int64_only_past_int32():
    assert not kernels_cudnn.wide_offsets(Bucket(8, 1 << 17, 1 << 17, 1 << 17, 1 << 17), 64, 8, 128)
    assert kernels_cudnn.wide_offsets(Bucket(8, 1 << 18, 1 << 18, 1 << 18, 1 << 18), 64, 8, 128)


def _brute_rows_with_keys(cq, ck, total_q, left, right):
    seen = [False] * total_q
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for r in range(lq):
            d = r + lk - lq
            seen[cq[b] + r] = any((left < 0 or j >= d - left) and (right < 0 or j <= d + right) for j in range(lk))
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_rows_with_keys_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    lq = [rng.choice([0, 1, 2, 5, 9]) for _ in range(n)]
    lk = [rng.choice([0, 1, 3, 5, 12]) for _ in range(n)]
    start = rng.choice([0, 2])
    cq = [start + sum(lq[:i]) for i in range(n + 1)]
    ck = [sum(lk[:i]) for i in range(n + 1)]
    total_q = cq[-1] + rng.choice([0, 3])  # rows past the last sequence see nothing
    for left, right in ((-1, 0), (0, 0), (2, 0), (-1, -1), (3, -1), (-1, 2), (1, 4)):
        got = rows_with_keys(torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32), total_q,
                             left, right).tolist()
        assert got == _brute_rows_with_keys(cq, ck, total_q, left, right), (lq, lk, left, right)


# ---------------------------------------------------------------- availability and `auto` (CPU)


def test_unavailable_without_the_package(monkeypatch):
    real = kernels_cudnn.importlib.util.find_spec
    monkeypatch.setattr(kernels_cudnn.importlib.util, "find_spec",
                        lambda name, *a: None if name == "cudnn" else real(name, *a))
    kernels_cudnn.cudnn_available.cache_clear()
    try:
        assert not kernels_cudnn.cudnn_available()
        assert not BACKENDS["cudnn"].is_available()
        assert "cudnn" not in available_backends("cuda")
        with pytest.raises(ValueError, match="cudnn.*cannot run on this install"):
            kernels.check_backend_name("cudnn")
    finally:
        kernels_cudnn.cudnn_available.cache_clear()


@pytest.mark.parametrize("capability,version,expected", [
    ((9, 0), 91900, True), ((10, 0), 91900, True), ((9, 0), 90600, True), ((8, 0), 91900, False),
    ((12, 0), 91900, False), ((9, 0), 90500, False), ((9, 0), 91000, False), ((9, 0), 91001, False),
    ((9, 0), 91002, True)])
def test_available_only_where_cudnn_builds_the_graphs(monkeypatch, capability, version, expected):
    # cudnn-frontend 1.32, node/scaled_dot_product_flash_attention.h (CompositeSDPABackwardNode::
    # pre_validate_node): ragged Stats refused for the backward on sm8x/sm12x; fp16/bf16 SDPA refused
    # on cuDNN 9.10.0/9.10.1. A stand-in `cudnn` module and CUDA: no GPU query here.
    fake = types.ModuleType("cudnn")
    fake.__spec__ = importlib.machinery.ModuleSpec("cudnn", None)
    fake.backend_version = lambda: version
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    kernels_cudnn.cudnn_available.cache_clear()
    try:
        assert kernels_cudnn.cudnn_available() is expected
    finally:
        kernels_cudnn.cudnn_available.cache_clear()


def test_auto_is_unchanged_on_the_cpu():
    assert "cudnn" in BACKENDS and "cudnn" not in available_backends("cpu")
    assert get_backend("auto", "cpu").name == "torch_cpu"
    with pytest.raises(ValueError, match="'cudnn' is not available on cpu"):
        get_backend("cudnn", "cpu")


@pytest.mark.parametrize("installed,expected", [
    ({"cudnn", "flash_attn", "torch_varlen"}, "cudnn"), ({"flash_attn", "torch_varlen"}, "flash_attn"),
    ({"torch_varlen"}, "torch_varlen"), ({"cudnn", "torch_varlen"}, "cudnn")])
def test_auto_prefers_cudnn_then_today_s_order(monkeypatch, installed, expected):
    # is_available stands in for CUDA, the packages and sm90+: no CUDA query here.
    for name in ("cudnn", "flash_attn", "torch_varlen"):
        monkeypatch.setattr(BACKENDS[name], "is_available", lambda n=name: n in installed)
    assert get_backend("auto", "cuda").name == expected


# ---------------------------------------------------------------- the variant pack, through a stand-in (CPU)


class _FakeGraph:
    def __init__(self, calls):
        self.calls = calls

    def execute(self, pack, workspace, handle=None):
        self.calls.append(pack)


def _fake_backend(monkeypatch):
    """A fresh CudnnBackend whose cuDNN is a stand-in that records each variant pack."""
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    b = kernels.CudnnBackend()
    calls, keys = [], []

    def build(cudnn, handle, device, key):
        keys.append(key)
        names = ("q", "k", "v", "o", "do", "stats", "dq", "dk", "dv", "seq_q", "seq_k", "off_q", "off_k",
                 "off_stats")
        return kernels_cudnn._Built(_FakeGraph(calls), {n: n for n in names}, 64)

    monkeypatch.setattr(b, "_build", build)
    monkeypatch.setattr(b, "_handle", lambda cudnn, device: None)
    monkeypatch.setattr(b, "device_types", None)  # run its CUDA path on CPU tensors
    monkeypatch.setattr(b, "is_available", lambda: True)
    return b, calls, keys


def test_variant_pack_offsets_lengths_and_stats_buffer(monkeypatch):
    b, calls, keys = _fake_backend(monkeypatch)
    q_lens, k_lens, hq, hkv, d = [1, 3, 97], [1, 50, 101], 8, 2, 128
    x = make_inputs((q_lens, k_lens, hq, hkv, d), torch.bfloat16)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    out, lse = b.forward(x["q"], x["k"], x["v"], *args, window=7)
    (pack,) = calls
    assert keys == [("fwd", torch.bfloat16, hq, hkv, d, d ** -0.5, 6, 0, Bucket(8, 128, 128, 128, 256))]
    assert pack["seq_q"].flatten().tolist() == [1, 3, 97, 0, 0, 0, 0, 0] and pack["seq_q"].shape == (8, 1, 1, 1)
    assert pack["seq_k"].flatten().tolist() == [1, 50, 101, 0, 0, 0, 0, 0]
    assert pack["off_q"].flatten().tolist() == [0, hq * d, 4 * hq * d] + [101 * hq * d] * 6
    assert pack["off_k"].flatten().tolist() == [0, hkv * d, 51 * hkv * d] + [152 * hkv * d] * 6
    assert pack["off_stats"].flatten().tolist() == [0, hq, 4 * hq] + [101 * hq] * 6
    assert {pack[n].dtype for n in ("off_q", "off_k", "off_stats")} == {torch.int32}
    assert pack["o"] is out and pack["stats"] is lse  # written in place, in distca's [T_q, H_q] layout
    assert lse.dtype == torch.float32 and lse.shape == (101, hq)
    calls.clear()
    lse_in = lse.clone().fill_(1.5)
    lse_in[0, 0] = float("-inf")
    b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse_in, *args, window=7)
    (pack,) = calls
    assert keys[-1][0] == "bwd" and pack["stats"][0, 0] == float("inf") and pack["stats"][1, 1] == 1.5
    assert {n for n in pack} == {"q", "k", "v", "o", "do", "stats", "dq", "dk", "dv", "seq_q", "seq_k",
                                 "off_q", "off_k", "off_stats"}


def test_rows_without_keys_get_zero_and_minus_inf(monkeypatch):
    b, calls, _ = _fake_backend(monkeypatch)
    x = make_inputs(([9, 4], [5, 4], 4, 2, 64), torch.float16)  # Lq > Lk: 4 rows see nothing
    out, lse = b.forward(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], 9, 5, 0.125)
    assert torch.isneginf(lse[:4]).all() and (out[:4] == 0).all()
    assert not torch.isneginf(lse[4:]).any()


def test_one_graph_per_bucket_across_length_mixes(monkeypatch):
    b, calls, keys = _fake_backend(monkeypatch)
    rng = random.Random(3)
    for _ in range(12):  # up to 4 sequences of up to 30 tokens (120 in total): one bucket
        lens = [rng.randint(1, 30) for _ in range(rng.randint(1, 4))]
        x = make_inputs((lens, lens, 4, 1, 64), torch.bfloat16, seed=rng.randint(0, 99))
        b.forward(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], max(lens), max(lens), 0.125)
    assert b.graph_builds == 1 and len(calls) == 12
    x = make_inputs(([200], [200], 4, 1, 64), torch.bfloat16)
    b.forward(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], 200, 200, 0.125)
    assert b.graph_builds == 2 and keys[-1][-1] == Bucket(8, 256, 256, 256, 256)


class _FakeHandle:
    def __init__(self, owner):
        self.owner, self.stream, self.stream_sets = owner, 0, 0  # a fresh handle runs on stream 0


def _threaded_cudnn(monkeypatch):
    """A stand-in ``cudnn`` (handles remember their stream and, as cudnn-frontend 1.32's
    ``set_stream`` does, skip a set to the same stream) and torch CUDA stream queries answering a
    stream per thread, as the local runtime's participant threads run. Returns the module."""
    fake = types.ModuleType("cudnn")
    fake.create_handle = lambda: _FakeHandle(threading.get_ident())

    def set_stream(handle, stream):
        if handle.stream != stream:
            handle.stream, handle.stream_sets = stream, handle.stream_sets + 1
    fake.set_stream = set_stream
    fake.streams = {}  # thread ident -> the stream it runs on (1, 2, ...)
    lock = threading.Lock()

    def current_stream(index=None):
        with lock:
            stream = fake.streams.setdefault(threading.get_ident(), len(fake.streams) + 1)
        return types.SimpleNamespace(cuda_stream=stream)
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return fake


class _RecordingGraph:
    def __init__(self, built_with, log):
        self.built_with, self.log = built_with, log

    def execute(self, pack, workspace, handle=None):
        time.sleep(0.002)  # let the other thread run meanwhile
        self.log.append(dict(thread=threading.get_ident(), handle=handle, stream=handle.stream,
                             built_with=self.built_with))


def test_each_thread_launches_with_its_own_handle_stream_and_graphs(monkeypatch):
    # cuDNN: a handle must not be used from two threads at once; cudnn-frontend 1.32 set_stream:
    # "a caller that [drives a Handle from two streams concurrently] needs its own handle per
    # stream". Participants run concurrently on pool threads, each on its own stream
    # (runtime/local.py _run_threads): a shared handle let one thread's kernel launch on the
    # other's stream. Graphs are built and executed per thread too (module doc, "Threads").
    fake = _threaded_cudnn(monkeypatch)
    b = kernels.CudnnBackend()
    monkeypatch.setattr(b, "device_types", None)  # run its CUDA path on CPU tensors
    monkeypatch.setattr(b, "is_available", lambda: True)
    log, builds = [], []
    names = ("q", "k", "v", "o", "do", "stats", "dq", "dk", "dv", "seq_q", "seq_k", "off_q", "off_k", "off_stats")

    def build(cudnn, handle, device, key):
        builds.append((threading.get_ident(), handle))
        return kernels_cudnn._Built(_RecordingGraph(handle, log), {n: n for n in names}, 64)
    monkeypatch.setattr(b, "_build", build)
    x = make_inputs(([5, 9], [7, 9], 4, 2, 64), torch.bfloat16)
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    barrier, errors = threading.Barrier(2), []

    def participant():
        try:
            barrier.wait()  # both threads alive at once: distinct thread identities and streams
            for _ in range(3):
                out, lse = b.forward(x["q"], x["k"], x["v"], *args, window=4)
                b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args, window=4)
            barrier.wait()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=participant) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    tids = {t.ident for t in threads}
    assert {e["thread"] for e in log} == tids and len(log) == 2 * 3 * 2
    for e in log:
        assert e["handle"].owner == e["thread"]  # the calling thread's own handle ...
        assert e["stream"] == fake.streams[e["thread"]]  # ... on the calling thread's stream ...
        assert e["built_with"] is e["handle"]  # ... running a graph built with that handle
    handles = {id(e["handle"]) for e in log}
    assert len(handles) == 2 and sorted(fake.streams.values()) == [1, 2]
    assert all(e["handle"].stream_sets == 1 for e in log)  # never re-streamed by the other thread
    # One forward and one backward graph per thread, each built once, on its own thread.
    assert b.graph_builds == 4 and sorted(t for t, _ in builds) == sorted([*tids, *tids])
    assert all(h.owner == t for t, h in builds)


# ---------------------------------------------------------------- graph arguments (CPU, needs the package)


# The keyword parameters of the compiled bindings pygraph.sdpa / pygraph.sdpa_backward lower to in
# cudnn-frontend 1.32.0 (`cudnn._compiled_module.backend_graph.sdpa.__doc__` / `.sdpa_backward.__doc__`;
# the python pygraph captures every keyword and forwards it by name, `_pygraph._CAPTURED_OPS`), so a
# misspelled one is caught here even where the package is not installed.
_SDPA_KWARGS = frozenset(
    "q k v is_inference attn_scale bias block_mask use_alibi_mask use_padding_mask seq_len_q seq_len_kv "
    "use_causal_mask use_causal_mask_bottom_right sliding_window_length diagonal_alignment "
    "diagonal_band_left_bound diagonal_band_right_bound dropout rng_dump paged_attention_k_table "
    "paged_attention_v_table paged_attention_max_seq_len_kv max_total_seq_len_q max_total_seq_len_kv "
    "compute_data_type name score_mod generate_stats implementation score_max score_sum_exp sink_token "
    "unfuse_fma cu_seq_len_q cu_seq_len_kv stats_use_log2".split())
_SDPA_BWD_POSITIONAL = ("q", "k", "v", "o", "dO", "stats")
_SDPA_BWD_KWARGS = frozenset(
    "q k v o dO stats attn_scale bias dBias use_alibi_mask use_padding_mask seq_len_q seq_len_kv "
    "max_total_seq_len_q max_total_seq_len_kv use_causal_mask use_causal_mask_bottom_right "
    "sliding_window_length diagonal_alignment diagonal_band_left_bound diagonal_band_right_bound dropout "
    "rng_dump use_deterministic_algorithm compute_data_type name score_mod score_mod_bprop sink_token "
    "dSink_token".split())


class _RecTensor:
    def __init__(self, **kw):
        self.kw = kw

    def __getattr__(self, name):  # set_output / set_dim / set_stride / set_ragged_offset / set_data_type
        if not name.startswith("set_"):
            raise AttributeError(name)

        def setter(value):
            self.kw[name[4:]] = value
            return self
        return setter


class _RecGraph:
    """A stand-in for cudnn.pygraph that records the calls describe_graph makes."""

    def __init__(self, **kw):
        self.kw, self.calls = kw, []

    def tensor(self, **kw):
        return _RecTensor(**kw)

    def sdpa(self, *args, **kw):
        assert len(args) == 3 and not set(kw) - _SDPA_KWARGS, set(kw) - _SDPA_KWARGS
        self.calls.append(("sdpa", dict(zip(("q", "k", "v"), args), **kw)))
        return [_RecTensor(), _RecTensor()]

    def sdpa_backward(self, *args, **kw):
        assert len(args) <= len(_SDPA_BWD_POSITIONAL) and not set(kw) - _SDPA_BWD_KWARGS, set(kw) - _SDPA_BWD_KWARGS
        self.calls.append(("sdpa_backward", dict(zip(_SDPA_BWD_POSITIONAL, args), **kw)))
        return [_RecTensor(), _RecTensor(), _RecTensor()]


def _rec_cudnn():
    enum = lambda *names: types.SimpleNamespace(**{n: n for n in names})  # noqa: E731
    return types.SimpleNamespace(pygraph=_RecGraph, data_type=enum("HALF", "BFLOAT16", "FLOAT", "INT32", "INT64"),
                                 diagonal_alignment=enum("TOP_LEFT", "BOTTOM_RIGHT"))


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("left,right", [(-1, 0), (6, 0), (-1, -1), (3, 2), (2, -1)])
def test_graph_call_uses_the_bindings_names_and_mask_semantics(kind, left, right):
    # Masks (cudnn-frontend 1.32 utils/attn_score_modifiers.h sliding_window_mask, BOTTOM_RIGHT with
    # seq_len tensors): keep j <= r + (s_kv - s_q) + R and j > r + (s_kv - s_q) - L, so FlashAttention's
    # inclusive (left, right) is L = left + 1, R = right. Stats: natural log (stats_use_log2 unset).
    bucket = Bucket(4, 128, 256, 256, 512)
    g, t = kernels_cudnn.describe_graph(_rec_cudnn(), (kind, torch.float16, 8, 2, 64, 0.125, left, right, bucket))
    ((op, kw),) = g.calls
    assert op == ("sdpa" if kind == "fwd" else "sdpa_backward")
    assert kw["q"] is t["q"] and kw["k"] is t["k"] and kw["v"] is t["v"]
    assert kw["use_padding_mask"] is True and kw["seq_len_q"] is t["seq_q"] and kw["seq_len_kv"] is t["seq_k"]
    assert kw["attn_scale"] == 0.125 and "stats_use_log2" not in kw
    assert kw.get("diagonal_band_left_bound") == (left + 1 if left >= 0 else None)
    assert kw.get("diagonal_band_right_bound") == (right if right >= 0 else None)
    assert kw.get("diagonal_alignment") == ("BOTTOM_RIGHT" if left >= 0 or right >= 0 else None)
    for name, n in (("off_q", 5), ("off_k", 5), ("off_stats", 5), ("seq_q", 4), ("seq_k", 4)):
        assert t[name].kw["dim"] == [n, 1, 1, 1] and t[name].kw["stride"] == [1, 1, 1, 1]
    assert t["seq_q"].kw["data_type"] == "INT32" and t["off_q"].kw["data_type"] == "INT32"
    # THD: token-major [T, H, D] seen as [B, H, S, D]; Stats [T, H] seen as [B, H, S, 1], both ragged.
    assert t["q"].kw["stride"] == [128 * 8 * 64, 64, 8 * 64, 1] and t["q"].kw["ragged_offset"] is t["off_q"]
    assert t["k"].kw["dim"] == [4, 2, 256, 64] and t["v"].kw["ragged_offset"] is t["off_k"]
    stats = t["stats"].kw
    assert stats["dim"] == [4, 8, 128, 1] and stats["stride"] == [8 * 128, 1, 8, 1]
    assert stats["ragged_offset"] is t["off_stats"] and stats["data_type"] == "FLOAT"
    if kind == "fwd":
        assert kw["generate_stats"] is True and t["o"].kw["ragged_offset"] is t["off_q"]
    else:
        assert (kw["o"], kw["dO"], kw["stats"]) == (t["o"], t["do"], t["stats"])
        assert (kw["max_total_seq_len_q"], kw["max_total_seq_len_kv"]) == (256, 512)
        assert t["dq"].kw["ragged_offset"] is t["off_q"] and t["dk"].kw["dim"] == [4, 2, 256, 64]
        assert t["dv"].kw["ragged_offset"] is t["off_k"] and t["dk"].kw["output"] is True


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("left,right", [(-1, 0), (6, 0), (-1, -1), (3, 2)])
def test_graph_arguments_validate_without_a_gpu(kind, left, right):
    cudnn = pytest.importorskip("cudnn")
    bucket = Bucket(4, 128, 256, 256, 512)
    g, t = kernels_cudnn.describe_graph(cudnn, (kind, torch.bfloat16, 8, 2, 128, 0.125, left, right, bucket))
    g.validate()
    info = g.inspect()
    (node,) = info["nodes"]
    params, tensors = node["params"], info["tensors"]
    assert params["use_padding_mask"] is True and params["attn_scale"] == 0.125
    assert params.get("diagonal_band_left_bound") == (left + 1 if left >= 0 else None)
    assert params.get("diagonal_band_right_bound") == (right if right >= 0 else None)
    if left >= 0 or right >= 0:
        assert params["diagonal_alignment"] == cudnn.diagonal_alignment.BOTTOM_RIGHT
    assert tensors["q"]["dim"] == [4, 8, 128, 128] and tensors["q"]["stride"] == [128 * 8 * 128, 128, 8 * 128, 1]
    assert tensors["k"]["dim"] == [4, 2, 256, 128] and tensors["off_q"]["dim"] == [5, 1, 1, 1]
    assert tensors["off_q"]["dtype"] == str(cudnn.data_type.INT32)
    stats = tensors[t["stats"].name]
    assert stats["dim"] == [4, 8, 128, 1] and stats["stride"] == [8 * 128, 1, 8, 1]
    assert t["stats"].ragged_offset is t["off_stats"] and t["q"].ragged_offset is t["off_q"]
    if kind == "fwd":
        assert params["generate_stats"] is True and t["o"].ragged_offset is t["off_q"]
    else:
        assert (params["max_total_seq_len_q"], params["max_total_seq_len_kv"]) == (256, 512)
        assert t["dk"].ragged_offset is t["off_k"] and tensors[t["dk"].name]["dim"] == [4, 2, 256, 128]


# ---------------------------------------------------------------- GPU (marked `gpu`: tests/conftest.py skips them without CUDA)


def _cudnn_or_skip(fresh=False):
    """The shared backend (its graphs are reused across tests), or a fresh one with an empty cache."""
    if not BACKENDS["cudnn"].is_available():
        pytest.skip("cudnn backend not available (package, sm90+ or cuDNN >= 9.6 missing)")
    return kernels.CudnnBackend() if fresh else BACKENDS["cudnn"]


def _random_case(rng, hq, hkv, d):
    n = rng.randint(1, 6)
    k_lens = [rng.choice([1, 2, 3, rng.randint(4, 300)]) for _ in range(n)]
    q_lens = [rng.choice([lk, rng.randint(1, lk)]) for lk in k_lens]  # partial queries: Lq <= Lk
    return q_lens, k_lens, hq, hkv, d


def _run_cuda(b, x, window):
    args = (x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], x["softmax_scale"])
    out, lse = b.forward(x["q"], x["k"], x["v"], *args, window=window)
    return (out, lse, *b.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args, window=window))


def _expected(x, window, fn):
    q, k, v = (x[n].detach().cpu() for n in "qkv")
    if fn is attention_ref:
        q, k, v = q.double(), k.double(), v.double()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, x["cu_seqlens_q"].cpu(), x["cu_seqlens_k"].cpu(), x["softmax_scale"], window)
    out.backward(x["dout"].cpu().to(out.dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("window", [None, 1, 7, 64])
@pytest.mark.parametrize("heads", [(8, 2, 128), (8, 1, 64)], ids=["gqa4_d128", "gqa8_d64"])
def test_gpu_matches_the_float64_oracle_over_random_lengths(seed, window, heads):
    b = _cudnn_or_skip()
    x = make_inputs(_random_case(random.Random(seed), *heads), torch.bfloat16, device="cuda", seed=seed)
    ours = _run_cuda(b, x, window)
    exact, plain = _expected(x, window, attention_ref), _expected(x, window, plain_attention)
    assert ours[1].dtype == torch.float32 and ours[1].shape == x["q"].shape[:2]
    for name, a, p, e in zip(NAMES, ours, plain, exact):
        assert max_error(a, e) <= 2 * max_error(p, e) + 1e-3, (name, max_error(a, e), max_error(p, e))


@pytest.mark.gpu
def test_gpu_rows_without_keys_and_empty_sequences():
    b = _cudnn_or_skip()
    x = make_inputs(([9, 0, 4, 1], [5, 3, 4, 1], 4, 2, 64), torch.float16, device="cuda", seed=1)
    ours = _run_cuda(b, x, None)
    exact, plain = _expected(x, None, attention_ref), _expected(x, None, plain_attention)
    for name, a, p, e in zip(NAMES, ours, plain, exact):
        assert max_error(a, e) <= 2 * max_error(p, e) + 1e-3, name


@pytest.mark.gpu
def test_gpu_one_graph_per_bucket_across_length_mixes():
    b = _cudnn_or_skip(fresh=True)
    rng = random.Random(5)
    for i in range(8):  # <= 4 sequences of <= 30 tokens: one forward and one backward graph
        q_lens, k_lens, *_ = _random_case(rng, 8, 2, 128)
        q_lens, k_lens = [min(n, 30) for n in q_lens[:4]], [min(n, 30) for n in k_lens[:4]]
        q_lens = [min(a, c) for a, c in zip(q_lens, k_lens)]
        x = make_inputs((q_lens, k_lens, 8, 2, 128), torch.bfloat16, device="cuda", seed=i)
        ours = _run_cuda(b, x, 16)
        exact, plain = _expected(x, 16, attention_ref), _expected(x, 16, plain_attention)
        for name, a, p, e in zip(NAMES, ours, plain, exact):
            assert max_error(a, e) <= 2 * max_error(p, e) + 1e-3, (i, name)
    assert b.graph_builds == 2
    x = make_inputs(CASES["odd_gqa4_d128"], torch.bfloat16, device="cuda", seed=9)  # 101 keys: a new bucket
    _run_cuda(b, x, 16)
    assert b.graph_builds == 4


@pytest.mark.gpu
def test_gpu_threads_on_their_own_streams_run_after_their_own_work():
    # As the local runtime's participants: two threads, each on a CUDA stream of its own, each
    # writing its inputs on that stream right before the call. A handle shared by the threads
    # launched one thread's kernel on the other's stream, unordered with that write (it read the
    # zeros); a handle per thread keeps every launch on its caller's stream.
    b = _cudnn_or_skip(fresh=True)
    cases = [make_inputs(([37, 64, 5], [37, 90, 40], 8, 2, 64), torch.bfloat16, device="cuda", seed=s)
             for s in (21, 22)]
    want = [tuple(t.cpu() for t in _run_cuda(b, x, 16)) for x in cases]  # this thread's graphs
    barrier, errors = threading.Barrier(2), []

    def participant(x, expected):
        try:
            stream, q_in = torch.cuda.Stream(), torch.zeros_like(x["q"])
            with torch.cuda.stream(stream):
                barrier.wait()
                for i in range(20):
                    q_in.zero_()
                    stream.synchronize()
                    torch.cuda._sleep(1_000_000)  # the write lands late on this stream ...
                    q_in.copy_(x["q"])
                    got = _run_cuda(b, dict(x, q=q_in), 16)  # ... and the kernels must wait for it
                    for name, a, e in zip(NAMES, got, expected):
                        assert max_error(a, e) <= 1e-2 * max(1.0, e.float().abs().max().item()), (i, name)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads between setting a stream and launching
    try:
        threads = [threading.Thread(target=participant, args=(x, w)) for x, w in zip(cases, want)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert b.graph_builds == 3 * 2  # forward and backward graphs of this thread and each participant
