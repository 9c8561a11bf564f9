"""The one-sided exchange (transport/symmetric.py) over the CPU shared-memory heap (transport/shm.py),
between real processes: byte-for-byte what LocalTransport delivers, growth, staging, size
mismatches refused on both ends, and a dead or departed peer failing the others in time.

The helpers here are shared with tests/unit/test_transport_nvshmem.py (same exchanges, NVSHMEM heap).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from distca_server.errors import DistCAError
from distca_server.transport.local import LocalGroup
from distca_server.transport.shm import ShmHeap, create_heap, destroy_heap
from distca_server.transport.symmetric import SymmetricTransport, key_id
from distca_server.transport.symmetric_words import DATA, signal_words

# The transports' deadline: generous, since every exchange before the one a test means to fail
# must succeed on a loaded CI machine, whose processes may start seconds apart. A failure that must
# come at once (a mismatch, a peer that closes) is shown to come well before it (TIMEOUT_S / 2).
TIMEOUT_S = 60.0
DIES_TIMEOUT_S = 2.0  # the deadline of the one exchange a dead peer is meant to fail ("dies")
SLACK_S = 10.0  # what a loaded CI machine may add to a bound; the bound is the point, not its tightness
SIZES = [0, 0, 1, 3, 64, 255, 256, 1000, 4096, 20000]  # zero-byte peers are common


def round_data(seed: int, rnd: int, P: int):
    """Round ``rnd``'s segments: ``splits[src][s][dst]`` bytes and ``send[src][s]``, the same in every
    process. Round sizes grow with ``rnd`` so buffers grow between rounds."""
    g = torch.Generator().manual_seed(seed * 1000 + rnd)
    nseg = int(torch.randint(1, 4, (1,), generator=g))
    scale = 1 + rnd // 4
    idx = torch.randint(0, len(SIZES), (P, nseg, P), generator=g)
    splits = [[[SIZES[int(i)] * scale for i in idx[src, s]] for s in range(nseg)] for src in range(P)]
    send = [[torch.randint(0, 256, (sum(splits[src][s]),), dtype=torch.uint8, generator=g)
             for s in range(nseg)] for src in range(P)]
    return splits, send


def recv_splits(splits, me: int):
    P, nseg = len(splits), len(splits[0])
    return [[splits[src][s][me] for src in range(P)] for s in range(nseg)]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def in_arena(transport, t: torch.Tensor) -> bool:
    arena = transport.heap.arena
    return t.numel() > 0 and 0 <= t.data_ptr() - arena.data_ptr() < arena.numel()


def run_rounds(transport, seed: int, rounds: int, device="cpu",
               direct: list | None = None, timeout_s: float | None = None) -> list[list[str]]:
    """Run ``rounds`` exchanges; returns per round the digests of the received segments. Even rounds
    receive into ``buffer`` views (symmetric once grown), odd rounds into fresh tensors (staged);
    ``direct`` collects, per round, whether each segment was received in place (symmetric memory);
    ``timeout_s`` is each exchange's deadline (default the transport's)."""
    me, P = transport.rank, transport.world_size
    out = []
    for rnd in range(rounds):
        splits, send = round_data(seed, rnd, P)
        rs = recv_splits(splits, me)
        if rnd % 2 == 0:
            recv = [transport.buffer(f"seg{s}", sum(x)) for s, x in enumerate(rs)]
        else:
            recv = [torch.empty(sum(x), dtype=torch.uint8, device=device) for x in rs]
        if direct is not None:
            direct.append([in_arena(transport, x) for x in recv])
        transport.exchange([x.to(device) for x in send[me]], splits[me], recv, rs, timeout_s=timeout_s)
        out.append([digest(x) for x in recv])
    return out


def in_threads(P: int, fn) -> list:
    """``fn(r)`` for every rank ``r`` of ``P``, each in its own thread; the results by rank. Fails
    the test with every error raised."""
    result: list = [None] * P
    errors = []

    def one(r):
        try:
            result[r] = fn(r)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return result


def expected_digests(seed: int, rounds: int, P: int) -> list[list[list[str]]]:
    """What LocalTransport delivers for the same rounds: ``[rank][round][segment]`` digests."""
    group = LocalGroup(P, timeout_s=30)
    return in_threads(P, lambda r: run_rounds(group.endpoint(r), seed, rounds))


# ---- processes -------------------------------------------------------------------------------------
FAILED = "<worker failed>"  # the report of a worker process whose body raised: (rank, FAILED, traceback)


@contextlib.contextmanager
def reporting(rank: int, results):
    """Around a worker process's whole body (setup included): an error is put on ``results`` as
    ``(rank, FAILED, traceback)``, for :func:`collect` to fail the test with, instead of the worker
    dying unheard while the parent waits for its report."""
    try:
        yield
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, FAILED, traceback.format_exc()))


def collect(results, procs, n: int, timeout_s: float = 300.0) -> list[tuple]:
    """``n`` reports ``(rank, *rest)`` of the worker processes ``procs`` from ``results``. Fails the
    test at once, and clearly, when a worker reports an error (:func:`reporting`), exits with a
    nonzero status, or when every worker has exited without the reports; ``timeout_s`` bounds
    only a hang (it is no deadline for the workers' work)."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n:
        try:
            report = results.get(timeout=1)
        except queue.Empty:
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if dead:
                pytest.fail(f"worker processes exited with status {dead} before reporting (see their stderr)")
            if all(p.exitcode is not None for p in procs):
                pytest.fail(f"every worker process exited, {len(got)} of {n} reports arrived: {got}")
            if time.monotonic() > deadline:
                pytest.fail(f"{len(got)} of {n} worker reports arrived within {timeout_s:g} s: {got}")
            continue
        if len(report) == 3 and report[1] == FAILED:
            pytest.fail(f"worker process {report[0]} failed:\n{report[2]}")
        got.append(report)
    return got


def _worker(rank: int, P: int, handle: dict, scenario: str, seed: int, rounds: int, results) -> None:
    with reporting(rank, results):
        heap = ShmHeap(handle, rank)
        transport = SymmetricTransport(heap, timeout_s=TIMEOUT_S)
        results.put((rank, play(transport, scenario, seed, rounds)))


def play(transport, scenario: str, seed: int, rounds: int, device="cpu"):
    """Run one scenario on this participant; returns what the parent asserts on."""
    me, P = transport.rank, transport.world_size
    if scenario == "rounds":
        direct: list = []
        out = run_rounds(transport, seed, rounds, device, direct)
        return {"digests": out, "sent": transport.bytes_sent, "direct": direct}
    if scenario == "mismatch":
        # Participant 0 sends participant 1 one byte more than 1 expects, in the second exchange.
        run_rounds(transport, seed, 1, device)
        t0 = time.monotonic()
        outcomes = []
        for _ in range(3):
            ss, rs = [[8] * P], [[8] * P]
            if me == 0:
                ss[0][1] = 9
            send = [torch.arange(sum(ss[0]), dtype=torch.uint8, device=device)]
            recv = [torch.empty(8 * P, dtype=torch.uint8, device=device)]
            try:
                transport.exchange(send, ss, recv, rs)
                outcomes.append(("ok", ""))
            except (ValueError, DistCAError) as exc:
                outcomes.append((type(exc).__name__, str(exc)))
                break
        return {"outcomes": outcomes, "elapsed": time.monotonic() - t0}
    if scenario in ("dies", "closes"):
        # The last participant completes one exchange, then dies after announcing the next
        # ("dies") or closes its endpoint instead of joining it ("closes").
        run_rounds(transport, seed, 1, device)
        last = P - 1
        if me == last:
            if scenario == "closes":
                transport.close()
                return {"closed": True}
            heap = transport.heap
            real = heap.put_signal

            def put_signal(pe, offset, src, slot, value):
                if slot == DATA * P + last:  # announced, now about to send rows: die
                    os._exit(0)
                real(pe, offset, src, slot, value)
            heap.put_signal = put_signal
        t0 = time.monotonic()
        try:  # the one exchange meant to fail: a short deadline (the transport's is TIMEOUT_S)
            run_rounds(transport, seed + 1, 1, device, timeout_s=DIES_TIMEOUT_S)
            return {"outcome": ("ok", ""), "elapsed": time.monotonic() - t0}
        except (ValueError, DistCAError) as exc:
            return {"outcome": (type(exc).__name__, str(exc)), "elapsed": time.monotonic() - t0}
    raise ValueError(f"unknown scenario {scenario!r}")


def run_group(P: int, scenario: str, seed: int = 0, rounds: int = 1, expect: int | None = None) -> dict:
    """Start ``P`` processes on one shared-memory heap; returns ``{rank: result}`` of those that
    report (``expect`` of them; default all)."""
    # Fork from a server that has imported torch and this module once: a spawn per process would
    # import torch anew each time (seconds on a busy machine).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    handle = create_heap(P, heap_bytes=64 << 20)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, P, handle, scenario, seed, rounds, results))
             for r in range(P)]
    try:
        for p in procs:
            p.start()
        got = dict(collect(results, procs, P if expect is None else expect))
        for p in procs:
            p.join(timeout=30)
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        destroy_heap(handle)


# ---- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 4])
def test_equals_local_transport_over_many_rounds(P):
    rounds = 12
    got = run_group(P, "rounds", seed=P, rounds=rounds)
    want = expected_digests(P, rounds, P)
    for r in range(P):
        assert got[r]["digests"] == want[r], f"participant {r}"
    # Both receive paths ran: in place into grown symmetric buffers, and staged (fresh tensors,
    # or buffers not yet grown).
    direct = [d for r in range(P) for rnd in got[r]["direct"] for d in rnd]
    assert any(direct) and not all(direct)
    assert not any(got[0]["direct"][0]) and any(d for rnd in got[0]["direct"][2::2] for d in rnd)
    # bytes_sent counts other participants only.
    sent0 = sum(sum(row) - row[0] for rnd in range(rounds) for row in round_data(P, rnd, P)[0][0])
    assert got[0]["sent"] == sent0


def test_round_data_has_the_cases_the_exchange_must_handle():
    """The random rounds above do contain zero-byte peers, own splits, several segments and growth."""
    P, rounds = 4, 12
    flat = [(rnd, src, s, dst, n) for rnd in range(rounds)
            for src, segs in enumerate(round_data(P, rnd, P)[0]) for s, row in enumerate(segs)
            for dst, n in enumerate(row)]
    assert any(n == 0 and src != dst for _, src, _, dst, n in flat)
    assert any(n > 0 and src == dst for _, src, _, dst, n in flat)
    assert max(s for _, _, s, _, _ in flat) >= 1
    totals = [sum(n for r, *_, n in flat if r == rnd) for rnd in range(rounds)]
    assert max(totals[8:]) > 2 * max(totals[:2])


def test_transport_grows_symmetric_buffers_and_serves_them_afterwards():
    """In one process (P=1): a too-large ``buffer`` is private until an exchange grows the array."""
    handle = create_heap(1, heap_bytes=1 << 20)
    try:
        t = SymmetricTransport(ShmHeap(handle, 0), timeout_s=1)
        a = t.buffer("server", 1000)
        lo, hi = t.heap.arena.data_ptr(), t.heap.arena.data_ptr() + t.heap.arena.numel()
        assert not lo <= a.data_ptr() < hi
        t.exchange([torch.zeros(0, dtype=torch.uint8)], [[0]], [torch.zeros(0, dtype=torch.uint8)], [[0]])
        b = t.buffer("server", 1000)
        assert lo <= b.data_ptr() < hi
        assert t.buffer("server", 500).data_ptr() == b.data_ptr()
        # The heap is finite: a request beyond it fails on every PE alike, with DistCAError.
        t.buffer("huge", 2 << 20)
        with pytest.raises(DistCAError, match="no room"):
            t.exchange([torch.zeros(0, dtype=torch.uint8)], [[0]], [torch.zeros(0, dtype=torch.uint8)], [[0]])
        t.close()
    finally:
        destroy_heap(handle)


def test_mismatched_sizes_are_refused_on_both_ends():
    got = run_group(3, "mismatch")
    kind0, msg0 = got[0]["outcomes"][-1]
    kind1, msg1 = got[1]["outcomes"][-1]
    assert kind0 == "ValueError" and "participant 0 sends participant 1" in msg0 and "[9]" in msg0, msg0
    assert kind1 == "ValueError" and "participant 0 sent segment bytes [9]" in msg1 and "[8]" in msg1, msg1
    # The third participant finds the group aborted (now or at its next exchange), without waiting.
    kind2, msg2 = got[2]["outcomes"][-1]
    assert kind2 == "DistCAError" and "found a mismatch (sizes" in msg2, got[2]
    assert got[2]["elapsed"] < TIMEOUT_S / 2  # at once: well before its deadline


def test_peer_that_dies_mid_exchange_fails_the_others_within_the_timeout():
    P = 3
    got = run_group(P, "dies", expect=P - 1)
    assert set(got) == {0, 1}
    for r in (0, 1):
        kind, msg = got[r]["outcome"]
        assert kind == "DistCAError", got[r]
        # Either it timed out itself (naming the dead participant) or its peer's abort woke it.
        assert f"participants [{P - 1}]" in msg or "timed out" in msg, msg
        # by the failing exchange's own deadline (not the transport's TIMEOUT_S), plus what a
        # loaded machine may add
        assert got[r]["elapsed"] < DIES_TIMEOUT_S + SLACK_S


def test_peer_that_closes_fails_the_others_at_once():
    P = 3
    got = run_group(P, "closes")
    assert got[P - 1] == {"closed": True}
    for r in range(P - 1):
        kind, msg = got[r]["outcome"]
        assert kind == "DistCAError" and f"participant {P - 1} left the group" in msg, msg
        assert got[r]["elapsed"] < TIMEOUT_S / 2  # at once: well before its deadline


def test_heap_handle_is_small_and_msgpack_able():
    import msgpack
    handle = create_heap(4, heap_bytes=1 << 20)
    try:
        assert msgpack.unpackb(msgpack.packb(handle)) == handle
        heap = ShmHeap(handle, 3)
        assert heap.signals().shape == (signal_words(4),) and not heap.signals().any()
        heap.close()
        with pytest.raises(ValueError, match="rank 4 out of range"):
            ShmHeap(handle, 4)
    finally:
        destroy_heap(handle)
    with pytest.raises(ValueError, match="heap_bytes"):
        create_heap(4, heap_bytes=100)


@pytest.mark.parametrize("case", ["segments", "sum", "own split"])
def test_bad_arguments_are_refused_before_anything_moves(case):
    """Refused with ValueError, and the group aborted (its peers fail at once): the next
    exchange is a DistCAError naming why."""
    handle = create_heap(1, heap_bytes=1 << 20)
    try:
        t = SymmetricTransport(ShmHeap(handle, 0), timeout_s=1)
        one = torch.zeros(4, dtype=torch.uint8)
        if case == "segments":
            with pytest.raises(ValueError, match="at most 16 segments"):
                t.exchange([one] * 17, [[4]] * 17, [one] * 17, [[4]] * 17)
        elif case == "sum":
            with pytest.raises(ValueError, match="sum to 3"):
                t.exchange([one], [[3]], [one], [[4]])
        else:
            with pytest.raises(ValueError, match="to itself has 4 bytes, expected 2"):
                t.exchange([one], [[4]], [one[:2]], [[2]])
        with pytest.raises(DistCAError, match="aborted"):
            t.exchange([one], [[4]], [one], [[4]])
        t.close()
        with pytest.raises(DistCAError, match="closed"):
            t.exchange([one], [[4]], [one], [[4]])
    finally:
        destroy_heap(handle)


class _ShmGroup:
    """A stand-in for LocalGroup whose endpoints are symmetric transports on one shm heap (the
    local runtime's participant threads exchange through it like processes would)."""

    made: list = []

    def __init__(self, world_size: int, timeout_s: float):
        self.handle = create_heap(world_size, heap_bytes=32 << 20)
        self.eps = [SymmetricTransport(ShmHeap(self.handle, r), timeout_s=timeout_s)
                    for r in range(world_size)]
        self.broken = False
        _ShmGroup.made.append(self)

    def endpoint(self, rank: int, device="cpu"):
        return self.eps[rank]

    def abort(self, rank: int, reason: str) -> None:
        self.broken = True
        self.eps[rank].close()

    def close(self) -> None:
        pass  # the test reads the endpoints' state after the client closed, then closes them


@pytest.mark.parametrize("mode, servers, ranks", [("inplace", 3, 3), ("dedicated", 2, 2)])
def test_attention_rounds_over_the_symmetric_transport_equal_the_local_transport(monkeypatch, mode,
                                                                                  servers, ranks):
    """Real rounds (forward with kept activations, backward) of DistCAClient.local: the same
    outputs and gradients whether the participants exchange through LocalTransport or through the
    one-sided exchange, whose buffers are then symmetric and received into in place."""
    from distca_client import DistCAClient
    import distca_server.runtime.local as runtime_local
    from scheduler.config import PlanConfig

    def step(client, seed):
        g = torch.Generator().manual_seed(seed)
        lens = [37, 5, 90, 12, 64]
        T = sum(lens)
        q, k, v, dout = (torch.randn(T, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = client.attend(*leaves, lens)
        (out * dout).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    kwargs = dict(config=PlanConfig(mode=mode, min_shard=8), num_ranks=ranks)
    with DistCAClient.local(servers, **kwargs) as client:
        want = [step(client, seed) for seed in range(3)]
    _ShmGroup.made.clear()
    monkeypatch.setattr(runtime_local.LocalRuntime, "group_factory", _ShmGroup)  # blocking: participant threads
    try:
        with DistCAClient.local(servers, **kwargs) as client:
            got = [step(client, seed) for seed in range(3)]
        assert len(_ShmGroup.made) == 1
        eps = _ShmGroup.made[0].eps
        assert sum(t.bytes_sent for t in eps) > 0 and all(t._seq >= 6 for t in eps)
        # Each endpoint's buffers were grown into symmetric arrays by the first rounds.
        assert all(len(t._arrays) >= 2 for t in eps)
    finally:
        for g in _ShmGroup.made:
            for t in g.eps:
                t.close()
            destroy_heap(g.handle)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def _threads(P: int, fn):
    """Run ``fn(rank)`` on ``P`` threads; returns their results (raises the first error)."""
    out, errors = [None] * P, []

    def one(r):
        try:
            out[r] = fn(r)
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def test_strided_receive_views_and_many_growing_keys():
    """A non-contiguous receive view is staged and filled in place; more growth requests than one
    announce carries are granted over the following exchanges."""
    P = 2
    handle = create_heap(P, heap_bytes=8 << 20)
    try:
        eps = [SymmetricTransport(ShmHeap(handle, r), timeout_s=5) for r in range(P)]
        send = [torch.arange(12, dtype=torch.uint8) + 100 * r for r in range(P)]

        def strided(r):
            t = eps[r]
            for i in range(10):
                t.buffer(f"key{i}", 1000 + i)
            wide = torch.zeros(24, dtype=torch.uint8)
            t.exchange([send[r]], [[6, 6]], [wide[::2]], [[6, 6]])
            return wide
        got = _threads(P, strided)
        for r in range(P):
            want = torch.cat([send[0][6 * r:6 * r + 6], send[1][6 * r:6 * r + 6]])
            assert torch.equal(got[r][::2], want) and not got[r][1::2].any()
        grown = [k for k in range(10) if eps[0]._capacity(key_id(f"key{k}"))]
        assert len(grown) == 7  # one announce carries 8 requests, staging's included

        def empty(r):
            z = torch.zeros(0, dtype=torch.uint8)
            eps[r].exchange([z], [[0, 0]], [z], [[0, 0]])
        _threads(P, empty)
        for t in eps:
            assert all(t._capacity(key_id(f"key{k}")) >= 1000 + k for k in range(10))
            assert t.buffer("key9", 1009).data_ptr() - t.heap.arena.data_ptr() in range(t.heap.arena.numel())
        # Every PE made the same allocations: the heap stays symmetric.
        assert eps[0]._arrays == eps[1]._arrays
        for t in eps:
            t.close()
    finally:
        destroy_heap(handle)


@pytest.mark.parametrize("kind, how", [("symmetric", "close"), ("routed", "close"), ("routed", "abandon")])
def test_giving_up_on_another_thread_ends_a_host_driven_wait_at_once(kind, how):
    """A host-driven exchange waiting for a peer that never comes ends with DistCAError once its own
    PE gives up on another thread (what the local runtime does to a failed round, and a client's
    watcher when the group failed elsewhere), not at its deadline; close() lets it stop before the
    heap goes, so it raises DistCAError, not a read of an unmapped heap."""
    from distca_server.transport.routed import RoutedTransport
    from distca_server.transport.symmetric_words import ABORT, ANNOUNCE
    handle = create_heap(2, heap_bytes=1 << 20)
    try:
        other = ShmHeap(handle, 1)  # participant 1 attaches, and never exchanges
        cls = RoutedTransport if kind == "routed" else SymmetricTransport
        t = cls(ShmHeap(handle, 0), timeout_s=TIMEOUT_S)
        one = torch.arange(4, dtype=torch.uint8)
        out = {}

        def exchange():
            start = time.monotonic()
            try:
                t.exchange([one], [[2, 2]], [torch.zeros(4, dtype=torch.uint8)], [[2, 2]])
                out["outcome"] = "returned"
            except Exception as exc:  # noqa: BLE001 - asserted below
                out["outcome"] = exc
            out["elapsed"] = time.monotonic() - start
        waiter = threading.Thread(target=exchange)
        waiter.start()
        until = time.monotonic() + TIMEOUT_S / 2
        while not other.signals()[t._slot(ANNOUNCE, 0)] and time.monotonic() < until:
            time.sleep(0.01)  # until participant 0 has announced: it waits for participant 1 now
        assert other.signals()[t._slot(ANNOUNCE, 0)], "participant 0 never announced"
        getattr(t, how)(*(["the round failed elsewhere"] if how == "abandon" else []))
        waiter.join(TIMEOUT_S + SLACK_S)
        assert not waiter.is_alive()
        exc = out["outcome"]
        assert isinstance(exc, DistCAError), exc
        state = "closed" if how == "close" else "aborted: the round failed elsewhere"
        assert f"stopped waiting for participants [1]: the group is {state}" in str(exc), exc
        assert out["elapsed"] < TIMEOUT_S / 2  # at once, not at the deadline
        if how == "abandon":  # participant 1 is told; a later exchange here is refused
            assert other.signals()[t._slot(ABORT, 0)]  # ABORT word from participant 0
            with pytest.raises(DistCAError, match="the group is aborted"):
                t.exchange([one], [[2, 2]], [torch.zeros(4, dtype=torch.uint8)], [[2, 2]])
            t.close()
        else:
            assert other.signals()[t._slot(ABORT, 0)]  # CLOSED word from participant 0
        other.close()
    finally:
        destroy_heap(handle)
