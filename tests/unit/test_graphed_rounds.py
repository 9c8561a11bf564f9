"""Captured rounds (distca_server/runtime/graphed.py, JobConfig.cuda_graphs).

On the CPU: a client with ``cuda_graphs`` on the CPU runs its rounds eagerly and exactly;
``RoundGraphs``' bookkeeping (warm-up rounds, the capture, retrying a capture whose routes are not
installed yet, turning graphs off when a capture fails, the least recently used capture going
when the graph words run out, a capture that can no longer replay being made again) with a
recording stand-in for the CUDA capture; kept-activation rounds replayed by a stand-in for the
graph that runs the recorded round again on a thread (what a replay computes, through the
participants' real rounds over the in-process heap), against the eager client and the float64
reference; a replay's copies grouped by dtype pair (``copy_groups``, as CUDA copies them) on a bf16
plan. The ``gpu`` test runs forward and backward rounds of several layers and two steps from
CUDA graphs, stateless and kept-activation plans, against the eager client and the float64
reference.
"""

from __future__ import annotations

import time
import types

import pytest
import torch

import distca_server.runtime.graphed as graphed
from distca_client import DistCAClient
from distca_server.errors import DistCAError
from distca_server.refs import attend_with_grads_ref
from distca_server.runtime.cpu_replay import cpu_replays as replay_on_cpu
from distca_server.runtime.graphed import WARMUP_ROUNDS, RoundGraphs
from distca_server.transport.local_heap import HeapGroup
from distca_server.transport.symmetric_words import GRAPH_BLOCKS
from scheduler.config import JobConfig, PlanConfig
from scheduler.cost import RoundKind
from gpu_subprocess import run_fresh
from test_exchange_graph import Static
from test_transport_routed import play, recv_splits, route_data
from test_transport_symmetric import in_threads



def stateless_job(servers: int, **kw) -> JobConfig:
    return JobConfig(servers=servers, transport="shm", cuda_graphs=True,
                     plan=PlanConfig(mode="inplace", keep_activations=False, min_shard=32), **kw)


def layers(client, lens, steps: int, n_layers: int, device, dtype=torch.float32, seed: int = 0):
    """Forward and backward of ``n_layers`` attention layers per step; every output and gradient."""
    g = torch.Generator().manual_seed(seed)
    T, got = sum(lens), []
    for step in range(steps):
        for _ in range(n_layers):
            q, k, v = (torch.randn(T, h, 16, generator=g).to(device, dtype).requires_grad_() for h in (4, 2, 2))
            dout = torch.randn(T, 4, 16, generator=g).to(device, dtype)
            out = client.attend(q, k, v, lens)
            out.backward(dout)
            got.append((q, k, v, dout, out.detach(), q.grad, k.grad, v.grad))
        client.new_step()
    return got


def test_cuda_graphs_on_the_cpu_run_the_rounds_eagerly_and_exactly():
    lens = [37, 1, 90, 128, 5]
    client = DistCAClient.local(config=stateless_job(2))
    try:
        got = layers(client, lens, steps=2, n_layers=3, device="cpu", dtype=torch.float64)
        assert client._runtime.graphs.replays == 0
    finally:
        client.close()
    for q, k, v, dout, out, dq, dk, dv in got:
        ref = attend_with_grads_ref(q, k, v, lens, dout, 16 ** -0.5)
        for a, b in zip((out, dq, dk, dv), ref):
            torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-9)


class FakeCapture:
    """Stands in for CapturedRound: records what it was made with and each replay."""
    made: list = []
    fail: BaseException | None = None

    def __init__(self, participants, transports, kind, scale, inputs, outputs, rows, kept):
        if FakeCapture.fail is not None:
            raise FakeCapture.fail
        self.args, self.replays, self.ok = (participants, transports, kind, scale), [], True
        FakeCapture.made.append(self)

    def usable(self):
        return self.ok

    def release(self):
        self.released = True

    def replay(self, participants, inputs, outputs, kept, abort):
        self.replays.append((inputs, outputs, len(participants), kept))


@pytest.fixture
def fake(monkeypatch):
    FakeCapture.made, FakeCapture.fail = [], None
    monkeypatch.setattr(graphed, "CapturedRound", FakeCapture)
    return FakeCapture


def run(graphs, key, kind=RoundKind.FORWARD, scale=0.25, n=2, kept=None):
    return graphs.run(key, ["p"] * n, ["t"] * n, kind, scale, ("in",), ("out",), None, kept)


def test_a_round_is_captured_after_its_warm_up_and_replayed_from_then_on(fake):
    g = RoundGraphs()
    assert [run(g, "shape") for _ in range(WARMUP_ROUNDS)] == [False] * WARMUP_ROUNDS and not fake.made
    assert run(g, "shape") and run(g, "shape")
    (cap,) = fake.made
    assert cap.args == (["p", "p"], ["t", "t"], RoundKind.FORWARD, 0.25) and len(cap.replays) == 2
    assert cap.replays[0] == (("in",), ("out",), 2, None)  # the batch's tensors, its 2 participants
    assert g.replays == 2
    # another kind or scale is another round: its own warm-up, and so is a kept-activation one
    assert not run(g, "shape", kind=RoundKind.BACKWARD) and not run(g, "shape", scale=0.5)
    assert not run(g, "shape", kept=7)
    run(g, "shape", kept=8)
    assert run(g, "shape", kept=9) and fake.made[-1].replays == [(("in",), ("out",), 2, 9)]
    g.clear()  # the group went: everything starts over
    assert not run(g, "shape")


def test_a_capture_whose_routes_are_not_installed_waits_one_more_round(fake):
    g = RoundGraphs()
    for _ in range(WARMUP_ROUNDS):
        run(g, "s")
    fake.fail = ValueError("route not installed")
    assert not run(g, "s")
    fake.fail = None
    assert not run(g, "s") and run(g, "s") and len(fake.made) == 1


def test_a_failed_capture_turns_graphs_off_with_a_warning(fake):
    g = RoundGraphs()
    for _ in range(WARMUP_ROUNDS):
        run(g, "s")
    fake.fail = RuntimeError("operation not permitted when stream is capturing")
    with pytest.warns(RuntimeWarning, match="without CUDA graphs.*not permitted"):
        assert not run(g, "s")
    fake.fail = None
    assert not any(run(g, "s") for _ in range(3)) and "not permitted" in g.disabled


def test_captures_beyond_the_graph_words_go_least_recently_used_first_and_unusable_ones_are_made_again(fake):
    g = RoundGraphs()
    keys = [f"shape{i}" for i in range(GRAPH_BLOCKS + 1)]
    for key in keys:
        for _ in range(WARMUP_ROUNDS + 1):
            run(g, key)
    assert len(fake.made) == GRAPH_BLOCKS + 1
    first = fake.made[0]
    assert getattr(first, "released", False) and not any(getattr(c, "released", False) for c in fake.made[1:])
    assert run(g, keys[-1]) and len(fake.made) == GRAPH_BLOCKS + 1  # kept
    assert run(g, keys[1]) and len(fake.made) == GRAPH_BLOCKS + 1  # kept, now the most recently used
    assert run(g, keys[0]) and fake.made[-1] is not first  # its warm-up is done: captured again at once,
    assert fake.made[2].released  # taking the words of the least recently used (keys[2])
    fake.made[-1].ok = False  # e.g. the buffers grew: made again at once
    assert run(g, keys[0]) and len(fake.made) == GRAPH_BLOCKS + 3


class _Exchanging:
    """A participant whose forward round is a :class:`Static`'s exchanges (what the transports see
    of a real round); ``fail``: its next round first exchanges a route that is not installed (the
    ValueError a capture of a route whose buffers grew late raises, which RoundGraphs retries)."""

    def __init__(self, static):
        self.static, self.fail, self.traffic = static, False, {}

    def forward_steps(self, t, *args, out=None, lse=None):
        s, (_, splits) = self.static, self.static.exchanges[0]
        if self.fail:
            self.fail = False
            yield t.exchange(s.send[0], splits[t.rank], s.recv[0], recv_splits(splits, t.rank), route=("test", "never"))
        yield from s.run()

    def layout(self, kind):
        return types.SimpleNamespace(sent={})


@pytest.mark.parametrize("fails", [0, 1, 2])
def test_a_capture_that_fails_part_way_is_made_again_with_equal_tags_and_replays(fails):
    """Participants are captured one after another; participant ``fails``'s capture raises the
    ValueError RoundGraphs retries, so the ones before it counted a capture and the ones after it
    never tried. The retried capture has the same graph tag and block on every participant, and
    its replays deliver (before, participant 0 waited for a tag its peers never sent, or a block
    they never used, and every replay timed out)."""
    P = 3
    group = HeapGroup(P, timeout_s=30)  # what a regression costs; the fixed path waits for no deadline
    ts = [group.endpoint(r) for r in range(P)]
    try:
        splits = route_data(11, P)
        in_threads(P, lambda r: play(ts[r], [("r", splits)] * 2))  # grow, install
        statics = [Static(t, [("r", splits)]) for t in ts]
        parts = [_Exchanging(s) for s in statics]
        g = RoundGraphs()

        def round_(step=0):
            for s in statics:
                s.fill(step)
            return g.run("shape", parts, ts, RoundKind.FORWARD, 0.25, (torch.zeros(4),),
                         (torch.zeros(4), torch.zeros(4)), lambda p, tensors: list(tensors))
        assert not any(round_() for _ in range(WARMUP_ROUNDS))  # the warm-up: eager rounds
        parts[fails].fail = True
        assert not round_()  # the capture failed part-way: eager once more
        assert all(t._graphs == [None] * GRAPH_BLOCKS for t in ts)  # every block given back
        assert not round_()
        for step in range(3):  # captured, then replayed
            assert round_(step)
            for s in statics:
                s.check(step)
        assert g.replays == 3 and g.disabled is None
        assert len({t._graph_tag for t in ts}) == 1 and ts[0]._graph_tag >= 1
        assert len({t._graph_order[-1] for t in ts}) == 1
    finally:
        group.close()


GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # a rounding step of the last summand, with margin


def _gpu_layers() -> None:
    """2 and 3 in-place participants on CUDA, bf16 and float32, stateless and kept-activation plans:
    graphed rounds equal the eager ones (outputs bit for bit, the same kernels on the same rows;
    gradients to rounding, see below) and the float64 reference to dtype rounding."""
    lens = [300, 1, 77, 512, 129, 31]
    for servers in (2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            for keep in (False, True):
                outs = []
                for graphs in (False, True):
                    job = JobConfig(servers=servers, transport="nvshmem", cuda_graphs=graphs, heap_bytes=64 << 20,
                                    plan=PlanConfig(mode="inplace", keep_activations=keep, min_shard=64))
                    client = DistCAClient.local(config=job)
                    try:
                        run = kept_layers if keep else layers
                        outs.append(run(client, lens, steps=2, n_layers=4, device="cuda", dtype=dtype, seed=servers))
                        if graphs:
                            g = client._runtime.graphs
                            assert g.disabled is None, g.disabled
                            assert g.replays >= 2 * (2 * 4 - WARMUP_ROUNDS) - 1, g.replays
                    finally:
                        client.close()
                for eager, replayed in zip(*outs):
                    assert torch.equal(eager[4], replayed[4]), (servers, dtype, keep)  # out: the same kernels
                    # the gradients to rounding: FlashAttention-2's backward sums a document's dQ over
                    # its key blocks with atomics (not deterministic), eager or replayed alike
                    for a, b in zip(eager[5:], replayed[5:]):
                        torch.testing.assert_close(a, b, rtol=GRAD_RTOL[dtype], atol=GRAD_RTOL[dtype],
                                                   msg=lambda m: f"{(servers, dtype, keep)}: {m}")
                q, k, v, dout, out, dq, dk, dv = outs[1][-1]
                ref = attend_with_grads_ref(q, k, v, lens, dout, 16 ** -0.5)
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                for a, b in zip((out, dq, dk, dv), ref):
                    torch.testing.assert_close(a.double().cpu(), b, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_graphed_rounds_on_the_gpu_equal_the_eager_ones():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run_fresh("test_graphed_rounds", "_gpu_layers", 300, "graphed rounds")


@pytest.fixture
def cpu_replays():
    with replay_on_cpu():
        yield


def kept_job(servers: int, mode: str, graphs: bool, **plan) -> JobConfig:
    return JobConfig(servers=servers, transport="shm", cuda_graphs=graphs, timeout_s=60,
                     plan=PlanConfig(mode=mode, **{"min_shard": 16, **plan}))


KEPT_CASES = [  # (servers, mode, ranks, document lengths, PlanConfig fields)
    # nothing moves: each server computes its own rank's rows where they are and keeps them by reference
    (2, "inplace", 2, [256, 256], {}),
    (2, "inplace", 2, [300, 1, 77, 512, 129, 31], {}),
    (3, "inplace", 3, [300, 1, 77, 512, 129, 31], {}),
    # key blocks split onto idle servers: the client role keeps merged O and LSE rows
    (4, "dedicated", 2, [2048, 5], {"min_shard": 512, "partial_kv": True})]


@pytest.mark.parametrize("servers,mode,ranks,lens,plan", KEPT_CASES)
def test_kept_activation_rounds_replayed_keep_and_take_their_rows_as_the_eager_ones(cpu_replays, servers, mode,
                                                                                    ranks, lens, plan):
    """Forward rounds replayed keep each layer's rows under its own key (copies, or the caller's
    own tensors where the eager round keeps them by reference, never the recording's); backward
    rounds replayed take them back: every output and gradient equals the eager client's bit for
    bit and the float64 reference."""
    got, merged, home = [], [], []
    for graphs in (False, True):
        client = DistCAClient.local(config=kept_job(servers, mode, graphs, **plan), num_ranks=ranks)
        runtime = client._runtime

        def check_kept():  # after the forward rounds of a step: what the participants keep
            if not graphs or not runtime.graphs._captured:
                return
            def storage(x):  # an empty tensor has no memory to share
                return x.untyped_storage().data_ptr() if x.numel() else None
            captured = list(runtime.graphs._captured.values())
            static = {storage(x) for c in captured for x in c.inputs}
            static |= {storage(x) for c in captured for sets in c.stash for rows in sets for d in rows if d
                       for x in d.values()}
            for parts in runtime._bound.values():
                held = [x for p in parts for rows, _ in p.kept.values() for x in rows.values()]
                held += [x for p in parts for m in p.kept_merged.values() for x in m.values()]
                assert held and not (static & {storage(x) for x in held}) - {None}
                merged.extend(m for p in parts for m in p.kept_merged.values())
                home.extend(p.inputs_home for p in parts)
        try:
            got.append(kept_layers(client, lens, steps=2, n_layers=4, check=check_kept))
            if graphs:
                kinds = {key[1:] for key in runtime.graphs._captured}
                assert kinds == {(RoundKind.FORWARD, 16 ** -0.5, True), (RoundKind.BACKWARD, 16 ** -0.5, True)}
                # every round after the warm-up, but for one more forward: the first round forms the group
                assert runtime.graphs.replays == 2 * (2 * 4 - WARMUP_ROUNDS) - 1
        finally:
            client.close()
    assert bool(merged) == plan.get("partial_kv", False)  # the merged rows were tested where they exist
    assert any(home) == (lens == [256, 256])  # and so were rows kept by reference
    for eager, replayed in zip(*got):
        for a, b in zip(eager[4:], replayed[4:]):
            assert torch.equal(a, b)
    for q, k, v, dout, out, dq, dk, dv in got[1]:
        ref = attend_with_grads_ref(q, k, v, lens, dout, 16 ** -0.5)
        for a, b in zip((out, dq, dk, dv), ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def kept_layers(client, lens, steps: int, n_layers: int, check=lambda: None, device="cpu", dtype=torch.float64,
                seed: int = 5):
    """Like :func:`layers`, but every layer's forward before the backward of all (as a model
    trains, each layer's rows kept meanwhile); ``check()`` runs between them."""
    g = torch.Generator().manual_seed(seed)
    T, got = sum(lens), []
    for _ in range(steps):
        step = []
        for _ in range(n_layers):
            q, k, v = (torch.randn(T, h, 16, generator=g).to(device, dtype).requires_grad_() for h in (4, 2, 2))
            step.append((q, k, v, torch.randn(T, 4, 16, generator=g).to(device, dtype), client.attend(q, k, v, lens)))
        check()
        for q, k, v, dout, out in reversed(step):
            out.backward(dout)
        got += [(q, k, v, dout, out.detach(), q.grad, k.grad, v.grad) for q, k, v, dout, out in step]
        client.new_step()
    return got


@pytest.mark.parametrize("keep", [False, True])
def test_traffic_of_replayed_rounds_is_the_eager_rounds(cpu_replays, keep):
    """``traffic()`` counts a replayed round as its eager round: one forward and one backward
    per step sum to ``last_plan.comm_bytes()`` every step. Before, a recording counted into the
    participants of the step it was captured in (or, on a GPU, nothing): later steps read
    half, then nothing (found by a review)."""
    lens = [300, 1, 77, 512, 129, 31]
    seen = {}
    for graphs in (False, True):
        config = JobConfig(servers=3, transport="shm", cuda_graphs=graphs, timeout_s=60,
                           plan=PlanConfig(mode="inplace", keep_activations=keep, min_shard=16))
        with DistCAClient.local(config=config) as client:
            q, k, v = (torch.randn(sum(lens), h, 8, requires_grad=True) for h in (4, 2, 2))
            per_step = []
            for _ in range(5):
                client.attend(q, k, v, lens).sum().backward()
                client.new_step()
                per_step.append(client.traffic())
            want = client.last_plan.comm_bytes()
            if graphs:
                assert client._runtime.graphs.replays >= 4
        for traffic in per_step:
            for kind in ("forward", "backward"):
                assert sum(traffic[kind].values()) == want[kind]["total"], (graphs, traffic, want)
        seen[graphs] = per_step
    assert seen[True] == seen[False]


def test_a_replayed_backward_round_checks_its_kept_rows_as_the_eager_one(cpu_replays):
    """A kept Q modified in place between a replayed forward round and its replayed backward
    round fails the backward as an eager one does (the autograd check on saved tensors)."""
    lens = [300, 1, 77, 512, 129, 31]
    client = DistCAClient.local(config=kept_job(2, "inplace", True))
    try:
        kept_layers(client, lens, steps=1, n_layers=3, check=lambda: None)  # warms both kinds up
        q, k, v = (torch.randn(sum(lens), h, 16, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
        outs = [client.attend(x, k, v, lens) for x in (q * 1, q * 1, q * 1)]
        replays = client._runtime.graphs.replays
        assert replays >= 1
        # the in-place server keeps its own rows by reference: change one under it
        parts = next(iter(client._runtime._bound.values()))
        rows = next(rows for p in parts if p.kept for rows, _ in [p.kept[max(p.kept)]])
        rows["q"].add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as failed:
            outs[-1].backward(torch.ones_like(outs[-1]))
        # it was the replayed backward round that checked, before replaying
        assert any(entry.path.name == "graphed.py" for entry in failed.traceback)
    finally:
        client.close()


def test_a_failed_replay_still_waits_for_every_participants_replay_then_raises_the_first_error():
    """A replay's caller stream must wait for every participant's recording, a failing one too:
    work it queues later (the next round's input copies, a new group's allocations) must not
    overtake a recording still running on the device."""
    waited = []

    class Handle:
        def __init__(self, i, error=None):
            self.i, self.error = i, error

        def wait(self):
            waited.append(self.i)
            if self.error is not None:
                raise self.error

    class Graph:
        next_set = 0

        def __init__(self, i, error=None):
            self.i, self.error = i, error

        def replay(self):
            return Handle(self.i, self.error)
    def captured_with(graphs):
        captured = object.__new__(graphed.CapturedRound)
        captured.kind, captured.keeps, captured.inputs, captured.outputs = RoundKind.FORWARD, False, (), ()
        captured.graphs = graphs
        return captured
    first = DistCAError("participant 0's replay failed")
    aborted = []
    with pytest.raises(DistCAError) as err:
        captured_with([Graph(0, first), Graph(1, DistCAError("later")), Graph(2)]).replay(
            ["p0", "p1", "p2"], (), (), abort=aborted.append)
    # every handle waited for; the group aborted once, at the first failure (the peers stop waiting)
    assert err.value is first and waited == [0, 1, 2] and aborted == [first]
    # the cause is raised, not the peers' DistCAErrors that the abort made
    cause = RuntimeError("participant 1's kernel failed")
    waited.clear(), aborted.clear()
    with pytest.raises(RuntimeError) as err:
        captured_with([Graph(0, DistCAError("aborted")), Graph(1, cause), Graph(2)]).replay(
            ["p0", "p1", "p2"], (), (), abort=aborted.append)
    assert err.value is cause and waited == [0, 1, 2] and len(aborted) == 1

    class Unqueued(Graph):
        def replay(self):
            raise self.error
    # a participant whose replay cannot be queued: the group is aborted before the earlier
    # participants' replays are waited for (their peers never send), the later ones not queued
    refused = ValueError("participant 1: this graph was released")
    waited.clear(), aborted.clear()
    with pytest.raises(ValueError) as err:
        captured_with([Graph(0), Unqueued(1, refused), Graph(2)]).replay(["p0", "p1", "p2"], (), (),
                                                                       abort=aborted.append)
    assert err.value is refused and aborted == [refused] and waited == [0]


def test_a_replayed_round_that_fails_mid_round_stops_its_peers_and_the_next_round_is_exact(cpu_replays,
                                                                                          monkeypatch):
    """A participant's round that raises while replayed aborts the group at once, as a failed eager
    round does: the error is the participant's own, not a peer's timeout, and the next rounds,
    another batch's first, run on a new group, exact (before, the group stayed, one participant
    an exchange behind the others, and the next round that moved rows timed out)."""
    from distca_server.executor import ServerExecutor
    real, fail = ServerExecutor.forward, []

    def forward(self, *args, **kwargs):
        if fail:
            fail.clear()
            raise RuntimeError("injected kernel failure")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(ServerExecutor, "forward", forward)
    moving, other = [300, 1, 77, 512, 129, 31], [100, 20, 8]
    client = DistCAClient.local(config=JobConfig(servers=2, transport="shm", cuda_graphs=True, timeout_s=60,
                                                 plan=PlanConfig(mode="inplace", keep_activations=False,
                                                                 min_shard=16)))
    try:
        layers(client, moving, steps=2, n_layers=2, device="cpu", dtype=torch.float64)  # captured, replayed
        replays = client._runtime.graphs.replays
        assert replays > 0 and client.traffic()  # rows move between the participants
        q, k, v = (torch.randn(sum(moving), h, 16, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
        fail.append(1)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="injected kernel failure"):
            client.attend(q, k, v, moving)
        assert time.monotonic() - t0 < 30  # the peer did not wait out its 60 s deadline
        assert client._runtime.graphs.replays == replays  # it was a replayed round that failed
        for lens in (other, moving):
            for q, k, v, dout, out, dq, dk, dv in layers(client, lens, steps=2, n_layers=2, device="cpu",
                                                         dtype=torch.float64):
                ref = attend_with_grads_ref(q, k, v, lens, dout, 16 ** -0.5)
                for a, b in zip((out, dq, dk, dv), ref):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    finally:
        client.close()


def test_copy_groups_keep_each_call_to_one_dtype_pair_and_copy_every_tensor_once():
    """CUDA's ``_foreach_copy_`` copies a list in one kernel only if its destinations share one
    dtype and its sources another: a replay's copies go in one call per (dtype, dtype) pair."""
    g = torch.Generator().manual_seed(3)
    shapes = [(5, 2, 4), (5, 2), (0, 2, 4), (1, 1, 4), (7, 2), (3, 1, 4)]
    kinds = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
             (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float64), (torch.float16, torch.float16)]
    src = [torch.randn(s, generator=g).to(b) for s, (_, b) in zip(shapes, kinds)]
    dst = [torch.zeros(s, dtype=a) for s, (a, _) in zip(shapes, kinds)]
    groups = graphed.copy_groups(dst, src)
    assert [len(d) for d, _ in groups] == [3, 1, 1, 1]  # first-seen order, every pair in one group
    for d, s in groups:
        assert len({x.dtype for x in d}) == 1 and len({x.dtype for x in s}) == 1
        torch._foreach_copy_(d, s)
    assert sorted(id(x) for d, _ in groups for x in d) == sorted(id(x) for x in dst)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(d.dtype))


def test_replayed_bf16_rounds_copied_by_dtype_groups_equal_the_eager_ones(cpu_replays, monkeypatch):
    """A bf16 kept-activation plan's replayed rounds, their copies made as on CUDA (one call per
    :func:`copy_groups` group): the forward's outputs and kept rows, and the backward's kept rows
    in, each mix bf16 rows with the float32 LSE (two groups); outputs and gradients equal the
    eager client's bit for bit."""
    calls = []

    def copy_as_on_cuda(dst, src):
        groups = graphed.copy_groups(dst, src) if dst else []
        calls.append(len(groups))
        for d, s in groups:
            torch._foreach_copy_(d, s, non_blocking=True)
    monkeypatch.setattr(graphed, "_copy_all", copy_as_on_cuda)
    lens, got = [300, 1, 77, 512, 129, 31], []
    for graphs in (False, True):
        client = DistCAClient.local(config=kept_job(2, "inplace", graphs))
        try:
            got.append(kept_layers(client, lens, steps=2, n_layers=3, dtype=torch.bfloat16))
            if graphs:
                assert client._runtime.graphs.replays > 0
        finally:
            client.close()
    assert 2 in calls  # rows and LSE copied in a round, in two calls
    for eager, replayed in zip(*got):
        for a, b in zip(eager[4:], replayed[4:]):
            assert torch.equal(a, b)
