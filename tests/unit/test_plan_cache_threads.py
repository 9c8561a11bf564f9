"""Every plan cache of the project under threads (issue 9, item 4): 8 threads over 20 batch shapes,
more shapes than a cache keeps, so lookups, moves to the end and evictions race (the switch
interval is 1 µs so a race between two bytecodes shows up). No call may raise, and each call must
get the plan of its own shape.

The caches keyed by batch shape: the local runtime's plans and the step's batches
(``LocalRuntime.step_for``, under the runtime's lock) and the simulator's plans
(``distca_sim.systems._planned``, which had no lock: this test raised ``KeyError`` in 2-6 of the 8
threads until it got one). The others are single-threaded by design or locked where they are
filled: the scheduler's ``Coordinator.plans`` lives on the actor's event loop, the dedicated
server's parts under its condition variable, a Ray client's batches under its runtime lock.
"""

from __future__ import annotations

import random
import sys
import threading

import pytest
import torch

from distca_client import DistCAClient
from distca_server.runtime.local import PLANS_KEPT, split_documents
from distca_server.wire import RowFormat
from distca_sim import systems
from scheduler import CostModel, PlanConfig

THREADS, SHAPES = 8, 20
COST = CostModel(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype_bytes=4)


def _shapes(seed: int = 0) -> list[list[int]]:
    """SHAPES distinct small batches (quick to plan: the threads spend their time in the caches)."""
    rng = random.Random(seed)
    return [[rng.randint(1, 40) for _ in range(rng.randint(1, 4))] + [i + 1] for i in range(SHAPES)]


@pytest.fixture
def tight_switching():
    """Switch threads every microsecond: a race between two bytecodes shows up in a few calls."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _hammer(call, calls: int) -> list[BaseException]:
    """Run ``call(shape_index)`` from THREADS threads, ``calls`` times each over random shapes
    (each thread its own order), all released together; returns what they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(seed):
        rng = random.Random(seed)
        start.wait()
        try:
            for _ in range(calls):
                call(rng.randrange(SHAPES))
        except BaseException as exc:  # noqa: BLE001 - collected and reported by the test
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


def test_local_runtime_plan_cache(tight_switching):
    assert SHAPES > PLANS_KEPT  # evictions happen while others look up
    shapes = _shapes()
    fmt = RowFormat(COST, torch.float32)
    with DistCAClient.local(3, config=PlanConfig(mode="dedicated", min_shard=8), num_ranks=2) as client:
        runtime = client._runtime
        wrong: list[str] = []

        def call(i):
            batch = runtime.step_for(shapes[i], fmt, torch.device("cpu"))
            if batch.plan.doc_lens_per_rank != split_documents(shapes[i], 2):
                wrong.append(f"shape {i} got the plan of {batch.plan.doc_lens_per_rank}")
            runtime.new_step()  # the next lookup of a shape misses the step's batches: plan cache
        errors = _hammer(call, 100)
    assert errors == [] and wrong == []


def test_simulator_plan_cache(tight_switching, monkeypatch):
    monkeypatch.setattr(systems, "_PLAN_CACHE_SIZE", SHAPES // 2)  # evict while others look up
    monkeypatch.setattr(systems, "_PLAN_CACHE", type(systems._PLAN_CACHE)())
    batches = [[lens[: len(lens) // 2 + 1], lens[len(lens) // 2 + 1:] or [7]] for lens in _shapes(1)]
    expected = [int(sum(sum(r) for r in b)) for b in batches]
    wrong: list[str] = []

    def call(i):
        q_len = systems._planned(batches[i], COST, 0.05, 8, True).ql
        if int(q_len.sum()) != expected[i]:  # every query row of the batch, once
            wrong.append(f"shape {i}: {int(q_len.sum())} query rows, not {expected[i]}")
    errors = _hammer(call, 1500)  # unlocked, this raised KeyError in 6 of 8 threads
    assert errors == [] and wrong == []
