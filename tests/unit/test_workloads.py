"""Workload sampling from the Pretrain / ProLong traces and packing into per-rank chunks."""

import json

import numpy as np
import pytest

from distca_sim.workloads import (
    LONG_DOC_TOKENS,
    load_trace,
    pack_documents,
    sample_batch,
    sample_documents,
    trace_file,
)

K = 1024


def test_load_trace_counts_and_cache(tmp_path):
    pre = load_trace("pretrain")
    pro = load_trace("prolong")
    assert isinstance(pre, tuple) and len(pre) == 99_519 and max(pre) == 124_913
    assert len(pro) == 77_932 and max(pro) == 340_149
    assert load_trace("pretrain") is pre            # cached
    path = tmp_path / "t.json"
    path.write_text(json.dumps([3, 1, 4]))
    assert load_trace(path) == (3, 1, 4)
    assert load_trace(str(path)) == (3, 1, 4)


def test_traces_are_package_data():
    # Read through importlib.resources from inside the package, not from the checkout's data/.
    f = trace_file("prolong")
    assert f.name == "prolong.json" and "distca_sim" in str(f)
    assert tuple(json.loads(f.read_text())) == load_trace("prolong")
    with pytest.raises(ValueError, match="unknown trace 'wiki'"):
        trace_file("wiki")


@pytest.mark.parametrize("name", ["pretrain", "prolong"])
@pytest.mark.parametrize("context_len", [64 * K, 128 * K, 1000])
def test_every_chunk_is_full(name, context_len):
    for step in (0, 1, 7):
        batch = sample_batch(name, 8, context_len, step=step)
        assert len(batch) == 8
        assert all(sum(chunk) == context_len for chunk in batch)
        assert all(d > 0 for chunk in batch for d in chunk)


@pytest.mark.parametrize("name", ["pretrain", "prolong"])
def test_deterministic_per_seed(name):
    a = sample_batch(name, 16, 128 * K, seed=3, step=2)
    assert sample_batch(name, 16, 128 * K, seed=3, step=2) == a
    assert sample_documents(name, 128 * K, seed=3) == sample_documents(name, 128 * K, seed=3)
    assert sample_documents(name, 128 * K, seed=3) != sample_documents(name, 128 * K, seed=4)
    # The returned lists are fresh: mutating them does not touch the cache.
    a[0].append(1)
    assert sample_batch(name, 16, 128 * K, seed=3, step=2)[0] != a[0]


def test_successive_steps_take_successive_chunks():
    two = sample_batch("pretrain", 8, 64 * K, step=0) + sample_batch("pretrain", 8, 64 * K, step=1)
    assert sample_batch("pretrain", 16, 64 * K, step=0) == two
    assert sample_batch("pretrain", 4, 64 * K, step=3) == sample_batch("pretrain", 16, 64 * K)[12:]


@pytest.mark.parametrize("name", ["pretrain", "prolong"])
@pytest.mark.parametrize("context_len", [128 * K, 40_000])
def test_lengths_multiple_of_16(name, context_len):
    docs = sample_documents(name, context_len)
    assert all(d % 16 == 0 and d >= 16 for d in docs)


def test_pretrain_elongation_and_count():
    docs = sample_documents("pretrain", 64 * K)
    assert len(docs) == 10_000
    # At 64K the factor is 1: every sampled length is a trace length rounded up to 16.
    trace = load_trace("pretrain")
    rounded = {(d + 15) // 16 * 16 for d in trace}
    assert set(docs) <= rounded
    # At 256K the factor is 4 and the draw is the same (same seed, same pool): a trace length
    # x gives ceil16(x) at 64K and ceil16(4x) at 256K.
    d64 = sample_documents("pretrain", 64 * K, num_docs=500, seed=1)
    d256 = sample_documents("pretrain", 256 * K, num_docs=500, seed=1)
    assert len(d64) == 500
    assert all(4 * a - 64 < b <= 4 * a for a, b in zip(d64, d256))
    # num_docs is capped at the pool size (first half of the short docs + 4 x long docs).
    assert len(sample_documents("pretrain", 64 * K, num_docs=10**9)) == 49_495 + 4 * 528


def test_long_doc_upsampling_count():
    trace = np.array(load_trace("prolong"))
    n_long = int((trace >= LONG_DOC_TOKENS).sum())
    n_short_kept = int((trace < LONG_DOC_TOKENS).sum()) // 2
    docs = sample_documents("prolong", 64 * K)          # factor 1: lengths are the trace's
    assert len(docs) == 4 * n_long + n_short_kept
    long_part = docs[: 4 * n_long]
    assert all(d >= LONG_DOC_TOKENS for d in long_part)
    # Each long document appears 4 times unless it was set to 64K (prob. 0.3).
    originals = [(int(d) + 15) // 16 * 16 for d in trace[trace >= LONG_DOC_TOKENS]]
    for k, d in enumerate(long_part):
        assert d in (originals[k % n_long], LONG_DOC_TOKENS)
    # Pretrain's pool: the 4 x long docs are all there when the whole pool is drawn.
    pre = np.array(load_trace("pretrain"))
    pool = sample_documents("pretrain", 64 * K, num_docs=10**9)
    assert sum(d >= LONG_DOC_TOKENS for d in pool) == 4 * int((pre >= LONG_DOC_TOKENS).sum())


def test_prolong_long_docs_first_and_fixed_fraction():
    docs = sample_documents("prolong", 128 * K)
    n_long = 4 * 47
    assert all(d >= 128 * K for d in docs[:n_long])       # elongated long docs: >= 64K x 2
    assert all(d < 128 * K for d in docs[n_long:])
    fixed = sum(d == 128 * K for d in docs[:n_long])
    assert 0.15 * n_long < fixed < 0.45 * n_long           # Binomial(188, 0.3): mean 56.4
    # The short part is the first half of the short docs, in file order, elongated x2.
    trace = np.array(load_trace("prolong"))
    short = trace[trace < LONG_DOC_TOKENS][: 38_942]
    assert docs[n_long:] == [(2 * int(d) + 15) // 16 * 16 for d in short]
    # The first batch is made of long documents only.
    assert all(max(chunk) >= 64 * K for chunk in sample_batch("prolong", 8, 128 * K))
    assert sample_documents("prolong", 128 * K, num_docs=5) == docs[:5]


def test_pack_cuts_conserve_tokens():
    docs = [5, 10, 3, 7]
    chunks = pack_documents(docs, 8, 3)
    assert chunks == [[5, 3], [7, 1], [2, 6]]   # 10 -> 3+7, 3 -> 1+2, 7 -> 6+1
    # Concatenating the chunks gives the documents in order (with cuts), then wraps around.
    chunks = pack_documents(docs, 6, 7)               # 42 tokens: 25 + 17 of the second pass
    assert all(sum(c) == 6 for c in chunks)
    flat = [d for c in chunks for d in c]
    assert sum(flat) == 42
    # Re-join pieces at chunk borders: the stream is 5,10,3,7,5,10,... cut at multiples of 6.
    bounds = np.cumsum(flat)
    doc_bounds = set(np.cumsum(docs * 2).tolist())
    chunk_bounds = set(range(6, 43, 6))
    assert set(bounds.tolist()) == {b for b in doc_bounds | chunk_bounds if b <= 42}


def test_pack_cycles_when_documents_run_out():
    assert pack_documents([16], 64, 2) == [[16, 16, 16, 16], [16, 16, 16, 16]]
    assert pack_documents([100], 30, 4) == [[30], [30], [30], [10, 20]]
    # One document longer than many chunks.
    assert pack_documents([1000, 8], 300, 4) == [[300], [300], [300], [100, 8, 192]]


def test_real_documents_conserve_tokens():
    docs = sample_documents("pretrain", 32 * K, num_docs=300, seed=5)
    total = sum(docs)
    n = total // (32 * K)
    chunks = pack_documents(docs, 32 * K, n)
    flat = [d for c in chunks for d in c]
    # Every original document boundary within the packed prefix is a boundary of the pieces.
    piece_bounds = set(np.cumsum(flat).tolist())
    doc_bounds = {b for b in np.cumsum(docs).tolist() if b <= n * 32 * K}
    assert doc_bounds <= piece_bounds
    assert sum(flat) == n * 32 * K


def test_sample_batch_at_cluster_scale():
    # Its speed is measured in bench/planner.py; here only that 256 ranks come out whole.
    for step in range(2):
        batch = sample_batch("pretrain", 256, 512 * K, step=step)
        assert len(batch) == 256 and all(sum(c) == 512 * K for c in batch)


@pytest.mark.parametrize("call, match", [
    (lambda: load_trace("wiki"), "wiki"),
    (lambda: load_trace(42), "42"),
    (lambda: sample_documents("wiki", 1024), "wiki"),
    (lambda: sample_documents("pretrain", 0), "context_len.*0"),
    (lambda: sample_documents("pretrain", 1024.0), "context_len"),
    (lambda: sample_documents("pretrain", 1024, num_docs=0), "num_docs.*0"),
    (lambda: sample_documents("pretrain", 1024, seed=-1), "seed.*-1"),
    (lambda: pack_documents([], 8, 1), "empty"),
    (lambda: pack_documents([4, 0, 3], 8, 1), r"\(1, 0\)"),
    (lambda: pack_documents([4, 2.5], 8, 1), "2.5"),
    (lambda: pack_documents([4], 0, 1), "context_len"),
    (lambda: pack_documents([4], 8, 0), "num_ranks"),
    (lambda: sample_batch("pretrain", 0, 1024), "num_ranks.*0"),
    (lambda: sample_batch("pretrain", 8, -5), "context_len.*-5"),
    (lambda: sample_batch("pretrain", 8, 1024, step=-1), "step.*-1"),
    (lambda: sample_batch("prolong", 8, 1024, seed=True), "seed"),
])
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("name", ["pretrain", "prolong"])
def test_context_len_that_would_overflow_int64_is_refused(name):
    # Elongation multiplies a length by context_len before dividing by 64K · 16: for these traces
    # the longest document's product is the first int64 to overflow (the stream total is at
    # most 1/20 of it). At the bound every length is still positive and every chunk full.
    top = (2**63 - 1 - (LONG_DOC_TOKENS * 16 - 1)) // max(load_trace(name))
    assert min(sample_documents(name, top)) > 0
    assert all(sum(c) == top and min(c) > 0 for c in sample_batch(name, 4, top, step=3))
    for too_long in (top + 1, 100_000_000 * 2**20):  # the second: `--context 100000000M`
        for call in (sample_documents, lambda n, c: sample_batch(n, 4, c)):
            with pytest.raises(ValueError, match=f"context_len must be at most {top} .*got {too_long}$"):
                call(name, too_long)


def test_bad_trace_file_raises(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps([3, -1, "x"]))
    with pytest.raises(ValueError, match="not positive ints"):
        load_trace(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.json")
