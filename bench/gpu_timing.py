"""Timing of GPU kernels for the GPU benchmarks (``bench/gpu_kernels.py``, ``bench/gpu_backends.py``).

What measuring on a lent GPU asks (the workplace's method for GPU sessions), in one place:

- **Time properly** (:class:`Timer`): CUDA events around a call on CUDA (or, ``host=True``, the
  host clock after ``torch.cuda.synchronize``), ``time.perf_counter`` on the CPU; ``warmup``
  untimed runs first, the median of ``repeats`` timed ones. Times are returned in **seconds**.
  A first call is timed apart (:meth:`Timer.first_s`: a kernel or graph build shows there).
- **Alternating rounds** (:meth:`Timer.rounds_s`): callables compared with one another run in
  rounds, one call of each per round (A B A B ...), so a clock or thermal drift falls on all alike.
- **Spreads** (:func:`spread_ms`): a row keeps the median and the min and max of its rounds, in
  **milliseconds**; two kernels closer than their spread are a tie.
- **Poisoned outputs** (:func:`poison_freed`): before a guarded call, blocks of the outputs' sizes
  are filled with NaN and freed, so an output a kernel never writes cannot pass the guard.
- **Memory** (:func:`usable_bytes`, :func:`kv_row_limit`): bytes a new allocation can get, and the
  KV rows one call may hold.
- **Partial JSON kept on SIGTERM** (:func:`run_sections`, :func:`write_partial`): the JSON is
  rewritten whole (a rename) after every row and section with ``"partial": true``; SIGTERM (a
  session stage's ``timeout``) becomes SystemExit, the JSON is written once more with
  ``"interrupted"``, and the exit status is 143.

No Ray: the GPU machine has none (only torch and the standard library are imported).
"""

from __future__ import annotations

import json
import math
import signal
import statistics
import time
import traceback
from pathlib import Path

import torch


class Timer:
    """Seconds of zero-argument callables: CUDA events (or, ``host=True``, the host clock after
    synchronising) on CUDA, ``perf_counter`` on CPU; ``warmup`` untimed runs (or rounds) first,
    then ``repeats`` timed ones."""

    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def one_s(self, fn, host: bool = False) -> float:
        """Seconds of one call of ``fn`` (the device idle before it)."""
        if self.device.type == "cuda" and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - t0

    def first_s(self, fn):
        """``(seconds, fn())`` of a first call, host clock around it, synchronised: what a first
        call costs beyond the kernel (a cuDNN graph build, a compile) shows here."""
        self._sync()
        t0 = time.perf_counter()
        value = fn()
        self._sync()
        return time.perf_counter() - t0, value

    def median_s(self, fn, host: bool = False) -> float:
        for _ in range(self.warmup):
            fn()
        self._sync()
        return statistics.median(self.one_s(fn, host) for _ in range(self.repeats))

    def rounds_s(self, fns: dict) -> dict[str, list[float]]:
        """``{name: [seconds of each timed round]}`` of ``fns`` ({name: callable}) run in rounds,
        each round one call of every callable in order (A B A B ...): ``warmup`` untimed rounds,
        then ``repeats`` timed ones. Alternating rounds spread a clock or thermal drift over all
        callables alike, where one callable's repeats after another's would hand it to one of them."""
        for _ in range(self.warmup):
            for fn in fns.values():
                fn()
        self._sync()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(self.repeats):
            for name, fn in fns.items():
                times[name].append(self.one_s(fn))
        return times

    def host_s(self, fn) -> float:
        """Median seconds from calling ``fn`` to its return, the device synchronised before and
        after but not inside: the host's own time (on a GPU, launches and Python)."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self._sync()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            self._sync()
        return statistics.median(times)


def spread_ms(prefix: str, seconds: list[float]) -> dict:
    """``{prefix_ms: median, prefix_ms_min, prefix_ms_max}`` in milliseconds of timed rounds: the
    median is the number, min and max the spread (two backends closer than it are a tie)."""
    return {f"{prefix}_ms": statistics.median(seconds) * 1e3, f"{prefix}_ms_min": min(seconds) * 1e3,
            f"{prefix}_ms_max": max(seconds) * 1e3}


def poison_freed(device: torch.device, likes: list[tuple], copies: int = 2) -> None:
    """Fill ``copies`` blocks of each ``(shape, dtype)`` in ``likes`` with NaN, then free them,
    before a guarded call. PyTorch's caching allocator hands a freed block to the next request of
    its size, so a backend output the kernel never writes would otherwise read whatever the last
    tensor of that size held: often another backend's correct result, which passes the guard. Two
    copies: a call's outputs come in pairs of one size (out and dQ like Q, dK and dV like K)."""
    blocks = [torch.full(shape, math.nan, dtype=dtype, device=device) for shape, dtype in likes
              for _ in range(copies)]
    del blocks


def usable_bytes(free: int, reserved: int, allocated: int) -> int:
    """Bytes a new allocation can get: the driver's free bytes (``torch.cuda.mem_get_info``) plus
    the bytes PyTorch's caching allocator reserves and no tensor holds (``memory_reserved −
    memory_allocated``), which it releases and retries with before it fails. Counting only the
    first, a section sized itself after an earlier one's freed tensors without them (H200:
    128-token shards ran 3.36M KV rows, every later size about 660K)."""
    return free + reserved - allocated


def kv_row_limit(args, hq: int, hkv: int, dim: int) -> float:
    """KV rows one call may hold: ``--max-kv-rows``, else 60% of the GPU's usable memory
    (:func:`usable_bytes`) over the bytes a backward call needs per KV row (k, v, dk, dv, and the
    GQA-expanded dK/dV of H_q heads that FlashAttention-2's varlen backward allocates); no limit on
    the CPU."""
    if args.max_kv_rows is not None:
        return args.max_kv_rows
    if args.device.type != "cuda":
        return math.inf
    row_bytes = args.dtype.itemsize * dim * (4 * hkv + 2 * hq)
    free = usable_bytes(torch.cuda.mem_get_info(args.device)[0], torch.cuda.memory_reserved(args.device),
                        torch.cuda.memory_allocated(args.device))
    return 0.6 * free / row_bytes


def write_partial(path: Path, result: dict) -> None:
    """``result`` so far, marked ``partial: true``, written to ``path`` through a temporary file
    renamed over it, so that a kill mid-write (``timeout -k 5`` sends SIGKILL 5 s after SIGTERM)
    leaves the last complete version, never half a JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(result, partial=True), indent=1))
    tmp.replace(path)


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # the shell's status of a process killed by the signal


def run_sections(sections: list[str], runs: dict, result: dict, path: Path, device: torch.device) -> None:
    """``runs[name](on_row)`` for each of ``sections`` in order, ``result[name]`` its return value.
    The JSON at ``path`` is rewritten (:func:`write_partial`) after each row ``on_row`` gets
    (``result[name]`` grows row by row) and each section. A section that raises (a failed guard
    too) loses its rows, its error goes to ``result["errors"]``, and the next one runs. SIGTERM
    (the stage's ``timeout``) becomes SystemExit: the JSON is written once more, with
    ``interrupted`` naming the section, and the exit goes on (status 143)."""
    previous = signal.signal(signal.SIGTERM, _sigterm)
    current = None
    try:
        for current in sections:
            print(f"-- {current}", flush=True)

            def on_row(row, name=current):
                result.setdefault(name, []).append(row)
                write_partial(path, result)
            try:  # one section's failure (a failed guard too) must not cost the others' numbers
                result[current] = runs[current](on_row)
            except Exception as exc:  # noqa: BLE001  (reported, and the exit status is 1)
                traceback.print_exc()
                result.pop(current, None)
                result["errors"][current] = f"{type(exc).__name__}: {exc}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_partial(path, result)
    except BaseException as exc:  # SIGTERM's SystemExit, Ctrl-C: keep what finished, then go on
        result["interrupted"] = f"{type(exc).__name__} during section {current}"
        write_partial(path, result)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
