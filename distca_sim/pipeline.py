"""Schedules of the step-time simulator: the 1F1B pipeline, distca's tick schedule, ping-pong.

Pure Python + numpy. Units: seconds.

Three pieces, each small enough to check by hand (``tests/test_simulate.py`` does):

* :func:`pipeline_1f1b` — the non-interleaved one-forward-one-backward schedule of PipeDream-Flush
  / Megatron-LM (Narayanan et al., SC'21, §2.2) as a dependency graph with arbitrary per-stage,
  per-microbatch times. Equal times give the textbook makespan ``(m + p − 1)(f + b)``, i.e. a
  bubble fraction ``(p − 1) / (m + p − 1)``; unequal ones give stage-imbalance stalls.
* :func:`tick_schedule` — the same 1F1B order cut into *ticks* in which every pipeline stage runs
  either one forward or one backward of a microbatch, or idles. distca runs in ticks: every layer
  of a tick is one all-to-all over all ranks of all stages, and ranks idle in a bubble act as
  in-place attention servers for the busy ones (DistCA §4.1).
* :func:`run_rounds` — one tick's layers as rounds of *linear compute → dispatch all-to-all →
  core attention → return all-to-all*, either sequential or ping-pong: each microbatch is split
  into two nano-batches and the communication of one hides under the other's compute
  (DistCA §4.2, Fig. 7). Compute and network are two streams; an all-to-all starts when every rank
  has produced its part and the network is free (collectives are serialised on one communicator).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["pipeline_1f1b", "tick_schedule", "Round", "run_rounds"]


def pipeline_1f1b(fwd, bwd, p2p_s: float = 0.0) -> tuple[float, np.ndarray]:
    """Makespan of a 1F1B pipeline with per-(stage, microbatch) op times.

    Args:
        fwd, bwd: ``[p][m]`` seconds of the forward / backward of microbatch ``i`` on stage ``s``.
        p2p_s: seconds to hand activations (or their gradients) from one stage to the next.

    Stage ``s`` runs ``min(p − s − 1, m)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards (Megatron-LM's ``forward_backward_pipelining``).
    ``F(s, i)`` waits for ``F(s − 1, i)``; ``B(s, i)`` for ``B(s + 1, i)``, and on the last stage
    for ``F(p − 1, i)``.

    Returns:
        ``(makespan, busy)``: seconds from the first op to the last, and each stage's busy seconds.

    Raises:
        ValueError: shapes that differ or are empty, or negative times.
    """
    f = np.asarray(fwd, dtype=np.float64)
    b = np.asarray(bwd, dtype=np.float64)
    if f.ndim != 2 or f.shape != b.shape or f.size == 0:
        raise ValueError(f"fwd and bwd must be equal non-empty [p][m] arrays, "
                         f"got {f.shape}, {b.shape}")
    if (f < 0).any() or (b < 0).any() or p2p_s < 0:
        raise ValueError("op times and p2p_s must be >= 0")
    p, m = f.shape
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops = [("F", i) for i in range(warm)]
        for j in range(m - warm):
            ops += [("F", warm + j), ("B", j)]
        ops += [("B", i) for i in range(m - warm, m)]
        orders.append(ops)
    end = {}
    free = [0.0] * p
    pos = [0] * p
    remaining = 2 * p * m
    while remaining:
        progressed = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            if kind == "F":
                dep = end.get(("F", s - 1, i), None) if s else 0.0
                dep = None if dep is None else dep + (p2p_s if s else 0.0)
            elif s == p - 1:
                dep = end.get(("F", s, i))
            else:
                dep = end.get(("B", s + 1, i))
                dep = None if dep is None else dep + p2p_s
            if dep is None:
                continue
            start = max(free[s], dep)
            free[s] = end[(kind, s, i)] = start + (f[s, i] if kind == "F" else b[s, i])
            pos[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:  # cannot happen for 1F1B; guards against a broken order
            raise AssertionError("1F1B schedule deadlocked")
    return max(free), f.sum(axis=1) + b.sum(axis=1)


def tick_schedule(p: int, m: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """1F1B cut into ticks: ``[(kind, [(stage, microbatch), ...]), ...]``, ``kind`` "F" or "B".

    Forward tick ``k`` runs microbatch ``k − s`` on stage ``s``; backward tick ``j`` runs
    ``j − (p − 1 − s)``. Order: ``p − 1`` warm-up forward ticks, then forward tick ``p − 1 + j``
    and backward tick ``j`` alternately for ``j < m``, then the ``p − 1`` drain backward ticks:
    ``2 (m + p − 1)`` ticks, each stage busy in ``2m`` of them. With equal op times this is as long
    as :func:`pipeline_1f1b`; it keeps at most ``p`` microbatches alive on stage 0, like 1F1B.

    Raises:
        ValueError: ``p`` or ``m`` not a positive int.
    """
    for name, v in (("p", p), ("m", m)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")

    def fwd(k):
        return ("F", [(s, k - s) for s in range(p) if 0 <= k - s < m])

    def bwd(j):
        return ("B", [(s, j - (p - 1 - s)) for s in range(p) if 0 <= j - (p - 1 - s) < m])
    ticks = [fwd(k) for k in range(p - 1)]
    for j in range(m):
        ticks += [fwd(p - 1 + j), bwd(j)]
    ticks += [bwd(j) for j in range(m, m + p - 1)]
    return ticks


@dataclass
class Round:
    """One use of a plan inside a tick: linear work, then a dispatch, core attention, a return.

    Args:
        lin: ``[R]`` seconds of linear compute each rank runs *before* this round's dispatch (the
            rest of the previous layer plus this layer's part before core attention).
        ca: ``[R]`` seconds of core attention each server runs in the round (kernel work only).
        dispatch_bw_s, return_bw_s: seconds the busiest link needs for the round's dispatch /
            return all-to-all at full size (bandwidth part).
        latency_s: fixed cost of one all-to-all call (paid per call, also per nano-batch).
    """

    lin: np.ndarray
    ca: np.ndarray
    dispatch_bw_s: float = 0.0
    return_bw_s: float = 0.0
    latency_s: float = 0.0


def _comm(bw_s: float, latency_s: float, parts: int) -> float:
    return latency_s + bw_s / parts if bw_s > 0 else 0.0


def run_rounds(rounds: list[Round], tail, *, ping_pong: bool = True,
               launch_s: float = 0.0) -> tuple[float, np.ndarray]:
    """Seconds to run ``rounds`` then ``tail`` on ``R`` in-place ranks, and each rank's busy time.

    Sequential (``ping_pong=False``): per round, linear → dispatch → attention → return; all
    communication is exposed. Ping-pong: every rank's linear work, every server's attention work
    and the bytes of each all-to-all are split in two equal nano-batches; the compute stream runs
    ``lin₀, lin₁, CA₀, CA₁`` and the network ``D₀, D₁, R₀, R₁``, so ``D₀`` hides under ``lin₁``,
    ``D₁`` under ``CA₀``, ``R₀`` under ``CA₁`` and ``R₁`` under the next round's ``lin₀``. A
    nano-batch's next linear work waits for its own return (its attention output).

    Per fused attention call a server with work pays ``launch_s`` (two calls per round with
    ping-pong). With ``d ≤ min(lin/2, ca/2)`` per nano-batch, ``n`` equal rounds take
    ``n·(lin + ca) + d`` (only the last return shows); sequentially ``n·(lin + ca + 2d)``.

    Returns:
        ``(makespan, busy)``: seconds until every rank finishes ``tail``, and per-rank compute
        seconds (linear + attention + launches).
    """
    tail = np.asarray(tail, dtype=np.float64)
    parts = 2 if ping_pong else 1
    comp = np.zeros(tail.shape)
    busy = np.zeros(tail.shape)
    net = 0.0
    ret = [0.0] * parts
    for rd in rounds:
        lin = np.asarray(rd.lin, dtype=np.float64) / parts
        ca = np.asarray(rd.ca, dtype=np.float64)
        ca_k = ca / parts + launch_s * (ca > 0)
        d = _comm(rd.dispatch_bw_s, rd.latency_s, parts)
        r = _comm(rd.return_bw_s, rd.latency_s, parts)
        d_end = [0.0] * parts
        for k in range(parts):
            comp = np.maximum(comp, ret[k]) + lin
            net = d_end[k] = max(net, float(comp.max())) + d
        for k in range(parts):
            comp = np.maximum(comp, d_end[k]) + ca_k
            net = ret[k] = max(net, float(comp.max())) + r
        busy += parts * (lin + ca_k)
    for k in range(parts):
        comp = np.maximum(comp, ret[k]) + tail / parts
    busy += tail
    return float(max(comp.max(), net)), busy
