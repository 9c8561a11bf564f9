"""Host time of one attention layer through distca, forward + backward, with its rounds replayed
(issue 22 item 4's ``host_us_per_layer_graphed``, the host's own share, measured on the CPU).

``DistCAClient.local(--servers)`` with ``JobConfig(cuda_graphs=True)`` over the in-process heap:
after their warm-up every round is replayed from its capture, so what is left on the host is
distca's own work per layer: the operator and its autograd node, the checks, the step's batch,
the round's place in the order, and the replay (static inputs in, every participant's recording,
outputs and kept rows out). On the CPU a CUDA graph cannot be replayed, so each participant's
recording is stood in for by :class:`~distca_server.runtime.cpu_replay.ThreadReplay` with
``runs=2``: its first replay of each of the two signal sets runs the recorded round for real (on
a thread of its own, so the participants' exchanges meet), later ones queue nothing, as a CUDA
graph's replay queues its work and returns. The batch's inputs are the same every layer, so the
no-op replays' outputs are the real ones, and the benchmark checks them: every layer's output
and the gradients equal an eager client's.

Rows, per run (µs per layer, forward + backward, of the process's CPU time, so that work
handed to another thread, e.g. the watchdog's, is counted; best of ``--repeats`` timings of
``--steps`` steps of ``--layers`` layers, then one backward through all of them):

- ``autograd.Function``: a no-op ``torch.autograd.Function`` of q, k, v (the floor of any
  differentiable Python op);
- ``custom op``: a no-op ``torch.library.custom_op`` pair with distca's signature and
  ``register_autograd`` (what dispatching ``distca::attend_fwd`` / ``attend_bwd`` costs);
- ``distca attend``: ``client.attend`` and the backward, as training calls it;
- ``distca via operator``: the same rounds called through ``torch.ops.distca.attend_fwd`` (the
  path compiled code takes), the baseline the eager path is compared with;
- ``transport's part of the replays``: what the stand-in leaves out, measured apart
  (:func:`transport_replay_us`) and summed over the layer's replays (each participant's forward
  and backward round);
- ``distca attend + transport``: the two together, distca's whole host work per replayed layer
  before the CUDA calls.

On a GPU the host also pays for queuing each copy and replay (a few µs per CUDA call). With
``--device cuda`` (the GPU session's ``host`` stage runs both) the same rows are timed with the
tensors on the GPU (bf16, head_dim 16) and every recording a CUDA graph replayed for real, the
transport's part and the CUDA calls included in the distca rows: 8 layers per step, beside the
``kernels`` stage's one layer of 8K tokens (``host_us_per_layer_graphed``).

Usage::

    python bench/host_path.py               # 2 participants, 8 layers
    python bench/host_path.py --quick
    python bench/host_path.py --device cuda --json bench/results/host_path_cuda.json
    python bench/host_path.py --profile 20  # and where distca attend's time goes (cProfile)

Writes JSON to ``--json`` (default ``bench/results/host_path.json``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.report import finish  # noqa: E402
from distca_client import DistCAClient  # noqa: E402
from distca_client.op import client_key, keeps_activations  # noqa: E402
from distca_server.runtime.cpu_replay import cpu_replays  # noqa: E402
from distca_server.transport.local_heap import HeapGroup  # noqa: E402
from distca_server.transport.routed import RoutedTransport  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402

LENS = [60, 1, 17, 90, 29, 11]  # documents that the plan splits across both participants (min_shard 8)
HEADS_Q, HEADS_KV, DIM = 2, 1, 8  # small rows: the CPU copies them synchronously, a GPU queues them
CUDA_DIM, CUDA_DTYPE = 16, torch.bfloat16  # on CUDA: the shape and dtype the gpu test of graphed rounds runs
CPU = torch.device("cpu")


class _Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return torch.empty_like(dout), None, None


@torch.library.custom_op("distca_bench::fwd", mutates_args=())
def _op_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens: torch.Tensor, client: int,
            softmax_scale: float | None, window: int | None, counts: bool, pending: int,
            kept: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:2]), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("distca_bench::bwd", mutates_args=())
def _op_bwd(dout: torch.Tensor, rnd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)


def _op_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(output[2])


def _op_backward(ctx, dout, _dlse, _drnd):
    return (*torch.ops.distca_bench.bwd(dout, ctx.saved_tensors[0]),) + (None,) * 7


_op_fwd.register_autograd(_op_backward, setup_context=_op_setup)


class _PassesOnceJoined:
    """A replay's marker as a GPU's event behaves when the device finishes the work soon: not yet
    passed when the handle's ``wait`` joins it (the caller's stream waits on the device), passed
    at the next look."""

    __slots__ = ("passed",)

    def __init__(self):
        self.passed = False

    def done(self) -> bool:
        return self.passed

    def wait(self, timeout_s: float) -> bool:
        self.passed = True
        return True

    def join(self) -> None:
        self.passed = True


def _in_threads(n: int, fn) -> None:
    """``fn(r)`` for r < n, each on a thread of its own (participants' exchanges must meet); the
    first error raised, re-raised here."""
    errors: list = []

    def one(r):
        try:
            fn(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError("a participant's exchanges did not finish within 120 s")


def transport_replay_us(participants: int, exchanges: int, replays: int, repeats: int) -> float:
    """The transport's own host work per participant and replayed round, in µs of this thread's
    CPU time: :meth:`~distca_server.transport.exchange_graph.ExchangeGraph.replay` of a graph of
    ``exchanges`` captured exchanges and its handle's ``wait`` (the entries, their deadlines and
    markers, settling and resolving the previous replays' exchanges from their snapshots, the
    watchdog's poke), what :class:`~distca_server.runtime.cpu_replay.ThreadReplay` leaves out of
    the rows above. Over the in-process heap on the CPU (64 bytes per peer and exchange), the
    graphs captured and replayed for real first; then the stream's own calls (``begin``, the
    replay's launch, ``mark``) are stubbed (a marker passes once its handle joined it, as on a
    GPU), so the time is distca's Python alone: on a GPU each of those is one to three CUDA calls
    more. Every participant's graph is replayed from this thread, then each handle waited for, as
    :meth:`~distca_server.runtime.graphed.CapturedRound.replay` does. Best of ``repeats``."""
    group = HeapGroup(participants, timeout_s=120)
    ts = [group.endpoint(r) for r in range(participants)]
    splits = [[[64] * participants] for _ in range(participants)]
    recv_splits = [[64] * participants]

    def one_round(r):
        t = ts[r]
        for j in range(exchanges):
            send = [torch.zeros(64 * participants, dtype=torch.uint8)]
            recv = [t.buffer(f"host-path-{j}", 64 * participants)]
            t.exchange(send, splits[r], recv, recv_splits, route=("host_path", j)).wait()
    try:
        _in_threads(participants, lambda r: [one_round(r) for _ in range(2)])  # the buffers grow, routes install
        graphs: list = [None] * participants

        def capture(r):
            graphs[r] = ts[r].graph(lambda: one_round(r))
            for _ in range(4):
                graphs[r].replay().wait()
        _in_threads(participants, capture)
        for t in ts:
            t._drain()
            st = t._stream
            st.begin, st.replay = (lambda: None), (lambda graph: None)
            st.mark, st.synchronous = _PassesOnceJoined, False
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            for _ in range(replays):
                for handle in [g.replay() for g in graphs]:
                    handle.wait()
            best = min(best, (time.process_time() - t0) / replays / participants * 1e6)
        return best
    finally:
        for t in ts:
            t.close()


@contextlib.contextmanager
def counting_exchanges():
    """While inside, a Counter of the exchanges each participant (by rank) makes."""
    counts: collections.Counter = collections.Counter()
    saved = RoutedTransport.exchange

    def exchange(self, *args, **kwargs):
        counts[self.rank] += 1
        return saved(self, *args, **kwargs)
    RoutedTransport.exchange = exchange
    try:
        yield counts
    finally:
        RoutedTransport.exchange = saved


def per_layer_us(run_step, layers: int, steps: int, repeats: int, device: torch.device = CPU) -> float:
    """Best of ``repeats`` timings of ``steps`` calls of ``run_step``, µs per layer of this
    process's CPU time (``time.process_time``: the host work itself, every thread's, without the
    time another process held the core; on the CPU nothing here waits, every replay after the
    first two is a no-op). On CUDA the current stream, which waited for every replay, is
    synchronized before each timing, outside it (never the device: a peer's stream may hold a
    device-side wait)."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        t0 = time.process_time()
        for _ in range(steps):
            run_step()
        best = min(best, (time.process_time() - t0) / steps / layers * 1e6)
    return best


def profile_rows(run_step, layers: int, steps: int, top: int = 30) -> list[dict]:
    """Where a replayed layer's host time goes: ``steps`` calls of ``run_step`` under cProfile,
    the ``top`` functions by their own time (``tottime``: a C function's, e.g. a CUDA call's, is
    its whole cost), each as µs and calls per layer. cProfile slows Python calls more than C
    ones, so the shares are a guide and the µs are not the timed rows'."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        run_step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    n = steps * layers
    rows = [dict(function=f"{Path(f).name}:{line}({name})" if line else name, own_us_per_layer=tt / n * 1e6,
                 cum_us_per_layer=ct / n * 1e6, calls_per_layer=nc / n)
            for (f, line, name), (_, nc, tt, ct, _) in stats.items()]
    total = sum(r["own_us_per_layer"] for r in rows)
    rows.sort(key=lambda r: -r["own_us_per_layer"])
    for r in rows:
        r["share"] = r["own_us_per_layer"] / total
    return rows[:top]


def distca_runs(args, inputs, dout) -> tuple[dict, dict, dict]:
    """(µs per layer, checks) of the eager attend path and the operator path, replayed rounds,
    and the exchanges each participant makes in a forward and a backward round (by kind)."""
    plan, device = PlanConfig(min_shard=8), args.device
    # The same rounds give the same bits on the CPU; on a GPU the kernels' backward may sum dQ with
    # atomics (FlashAttention-2 unless deterministic), so bf16 results may differ in rounding.
    tolerance = 1e-6 if device.type == "cpu" else 1e-2
    reference = DistCAClient.local(config=JobConfig(servers=args.servers, transport="shm", timeout_s=120, plan=plan))
    with contextlib.ExitStack() as stack:
        stack.callback(reference.close)
        if device.type == "cpu":  # on CUDA the recordings are CUDA graphs, replayed for real
            stack.enter_context(cpu_replays(runs=2))
        client = DistCAClient.local(config=JobConfig(servers=args.servers, transport="shm", cuda_graphs=True,
                                                     timeout_s=120, plan=plan))
        stack.callback(client.close)
        leaves = [t.detach().requires_grad_() for t in inputs]
        key, lens_t = client_key(client), torch.tensor(LENS, dtype=torch.int64)

        def attend_eager():
            return client.attend(*leaves, LENS)

        def attend_op():
            kept = keeps_activations(key)
            return torch.ops.distca.attend_fwd(*leaves, lens_t, key, None, None, True, 0, kept)[0]

        def step(attend, layers=args.layers, leaves=leaves):
            for t in leaves:
                t.grad = None
            outs = [attend() for _ in range(layers)]
            torch.stack(outs).backward(dout.expand(layers, *dout.shape))
            return outs

        ref_leaves = [t.detach().requires_grad_() for t in inputs]
        with counting_exchanges() as forward_exchanges:
            ref_out = reference.attend(*ref_leaves, LENS)
        with counting_exchanges() as backward_exchanges:
            ref_out.backward(dout)
        # the eager client's step, as the replayed ones run it (the gradients summed over the
        # layers in the same order: bit for bit the replayed step's, in bf16 too)
        ref_outs = step(lambda: reference.attend(*ref_leaves, LENS), leaves=ref_leaves)
        moved = sum(b for kind in reference.traffic().values() for b in kind.values())
        if not moved:
            raise AssertionError(f"the plan of {LENS} moves nothing: no exchange to replay")
        paths = (("distca attend", attend_eager), ("distca via operator", attend_op))
        checks = {}
        for name, attend in paths:
            for _ in range(4):  # warm-up: 2 eager rounds per kind, then the captures and their first replays
                outs = step(attend)
            pairs = list(zip(outs, ref_outs)) + [(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
            err = max((a - b).abs().max().item() for a, b in pairs)
            rel = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in pairs)
            if client._runtime.graphs.disabled is not None:
                raise AssertionError(f"{name}: capturing a round failed: {client._runtime.graphs.disabled}")
            checks[name] = err
            if rel > tolerance:
                raise AssertionError(f"{name}: replayed rounds differ from the eager client by {err:.2e} "
                                     f"({rel:.2e} of the largest value; at most {tolerance:g})")
        replays_before = client._runtime.graphs.replays
        times = {name: per_layer_us(lambda a=attend: step(a), args.layers, args.steps, args.repeats, device)
                 for name, attend in paths}
        replayed = client._runtime.graphs.replays - replays_before
        expected = 2 * 2 * args.layers * args.steps * args.repeats  # 2 paths x (forward + backward)
        if replayed != expected:
            raise AssertionError(f"{replayed} rounds replayed while timing, expected {expected}")
        if args.profile:
            checks["profile"] = profile_rows(lambda: step(attend_eager), args.layers, args.profile)
        exchanges = {"forward": [forward_exchanges[r] for r in range(args.servers)],
                     "backward": [backward_exchanges[r] for r in range(args.servers)]}
        return times, checks, exchanges


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=2, help="participants (in-place servers)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60, help="steps per timing")
    ap.add_argument("--repeats", type=int, default=7, help="timings; the best is reported")
    ap.add_argument("--quick", action="store_true", help="10 steps per timing, 3 timings")
    ap.add_argument("--device", type=torch.device, default=CPU,
                    help="cuda: the tensors on the GPU and the recordings CUDA graphs replayed for real (the "
                         "transport's part is then in the distca rows, not measured apart)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS steps of distca attend (cProfile): the top functions by their own "
                         "time, printed and in the JSON's profile")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "host_path.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 10, 3
    if args.device.type not in ("cpu", "cuda") or (args.device.type == "cuda" and not torch.cuda.is_available()):
        ap.error(f"--device {args.device}: cpu, or cuda where a GPU is present")
    cuda = args.device.type == "cuda"
    torch.set_num_threads(1)  # host time, not kernel time: one thread, as a GPU host issues work
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    T, dim, dtype = sum(LENS), CUDA_DIM if cuda else DIM, CUDA_DTYPE if cuda else torch.float32
    q, k, v, dout = (torch.randn(T, h, dim, generator=gen).to(args.device, dtype)
                     for h in (HEADS_Q, HEADS_KV, HEADS_KV, HEADS_Q))
    x = q.detach().requires_grad_()
    floor = per_layer_us(lambda: torch.stack([_Floor.apply(x, k, v) for _ in range(args.layers)]).sum().backward(),
                         args.layers, args.steps, args.repeats, args.device)
    lens_t = torch.tensor(LENS)
    custom = per_layer_us(lambda: torch.stack([torch.ops.distca_bench.fwd(x, k, v, lens_t, 1, None, None, True, 0,
                                                                          True)[0]
                                               for _ in range(args.layers)]).sum().backward(),
                          args.layers, args.steps, args.repeats, args.device)
    times, checks, exchanges = distca_runs(args, (q, k, v), dout)
    profile = checks.pop("profile", [])
    rows = [dict(path="autograd.Function", us_per_layer=floor), dict(path="custom op", us_per_layer=custom)]
    rows += [dict(path=name, us_per_layer=us, max_abs_err=checks[name]) for name, us in times.items()]
    per_graph, transport = {}, 0.0
    if not cuda:
        # the transport's part of each replay (left out of the stand-in's rows): per participant, a
        # forward and a backward round per layer, each replaying a graph of that round's exchanges
        per_graph = {n: transport_replay_us(args.servers, n, args.steps * args.layers, args.repeats)
                     for n in sorted({n for ns in exchanges.values() for n in ns if n})}
        transport = sum(per_graph.get(n, 0.0) for ns in exchanges.values() for n in ns)
        rows += [dict(path="transport's part of the replays", us_per_layer=transport, exchanges_per_round=exchanges,
                      us_per_participant_replay={str(n): us for n, us in per_graph.items()}),
                 dict(path="distca attend + transport", us_per_layer=times["distca attend"] + transport)]
    base = times["distca via operator"]
    for r in rows:
        r["vs_floor"] = r["us_per_layer"] / floor
        r["vs_operator_path"] = r["us_per_layer"] / base

    def show():
        print("| path | µs / layer (fwd + bwd) | × autograd.Function | × distca via operator |")
        print("|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['path']} | {r['us_per_layer']:.1f} | {r['vs_floor']:.2f} | {r['vs_operator_path']:.2f} |")
        if profile:
            print(f"\ndistca attend under cProfile ({args.profile} steps), the top functions by their own time:\n")
            print("| function | own µs / layer | share | calls / layer |")
            print("|---|---:|---:|---:|")
            for r in profile[:15]:
                print(f"| `{r['function']}` | {r['own_us_per_layer']:.1f} | {r['share']:.1%} | "
                      f"{r['calls_per_layer']:.2f} |")
    eager = times["distca attend"]
    headline = [f"{args.servers} participants, {args.layers} layers, {T} tokens, replayed rounds"
                f"{' (CUDA graphs on ' + torch.cuda.get_device_name(args.device) + ')' if cuda else ''}: distca attend "
                f"{eager:.0f} µs per layer on the host ({eager / base:.2f}x the operator path's {base:.0f} µs; "
                f"the floor of a Python autograd op is {floor:.0f} µs, a custom op's {custom:.0f} µs)"]
    if not cuda:
        headline.append(f"the transport's part of the replays: {transport:.0f} µs per layer ("
                        + ", ".join(f"{us:.1f} µs per participant and replay of {n} exchanges"
                                    for n, us in per_graph.items())
                        + f"); with it {eager + transport:.0f} µs per layer, before the CUDA calls")
    finish(show, headline, time.perf_counter() - start, args.json,
           {"args": vars(args) | {"json": str(args.json), "device": str(args.device)}, "lens": LENS,
            "dtype": str(dtype).removeprefix("torch."), "head_dim": dim, "rows": rows, "profile": profile})
    return 0


if __name__ == "__main__":
    sys.exit(main())
