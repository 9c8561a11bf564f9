"""The ``cudnn`` attention backend: cuDNN fused attention through ``nvidia-cudnn-frontend``.

Install: ``pip install --no-deps nvidia-cudnn-frontend==1.32.0`` (the ``cudnn`` extra; its declared
CuTe-DSL / TVM-FFI dependencies serve other kernels, not the SDPA graphs used here). The package
(import name ``cudnn``) is imported on first use only, never when this module is imported.

Layout (packed THD, cudnn-frontend's ragged offsets): q, out, dout, dq are ``[T_q, H_q, D]``
contiguous, declared to cuDNN as ``[B, H_q, S_q, D]`` with strides ``[S_q*H_q*D, D, H_q*D, 1]`` and a
ragged offset per sequence (``cu_seqlens_q * H_q * D`` elements, ``[B + 1, 1, 1, 1]``, int32 or,
past 2^31 elements, int64); k, v, dk, dv alike with ``H_kv``. The per-sequence lengths go in ``seq_len_q`` / ``seq_len_kv`` (int32
``[B, 1, 1, 1]``, ``use_padding_mask=True``). The statistics (LSE, natural log, float32) are ragged
too: ``[B, H_q, S_q, 1]`` with strides ``[H_q*S_q, 1, H_q, 1]`` and offsets ``cu_seqlens_q * H_q``,
which is exactly distca's ``lse [T_q, H_q]`` row-major, so the forward writes it in place and the
backward reads it as is. cuDNN below 9.26 reads a *non-ragged* Stats input of ``sdpa_backward`` only
as packed BHSD (cudnn-frontend 1.32, ``CompositeSDPABackwardNode`` validation); a ragged Stats is the
other layout it accepts (sm90/sm100; refused on sm8x/sm12x), the one cudnn-frontend's own ragged
SDPA tests (``test/python/sdpa/fp16.py``) and TransformerEngine use for THD.

Masks (module doc of :mod:`distca_server.kernels`): ``diagonal_alignment=BOTTOM_RIGHT`` with a
right bound ``R`` keeps keys ``j <= r + d + R`` and a left bound ``L`` keeps ``j > r + d - L``
(cudnn-frontend ``sliding_window_mask``); a FlashAttention window ``(left, right)`` is therefore
``L = left + 1``, ``R = right`` (-1: no bound), and a sliding window W is ``L = W``, ``R = 0``.

Graphs: one built graph per shape bucket (:func:`bucket_shape`: sequences, longest query and key
sequence, query and key token totals, each rounded up to a power of two) and per (dtype, heads,
head_dim, scale, mask bounds); lengths and offsets are runtime tensors, so every mix of lengths
that fits a bucket reuses its graph. Unused sequence slots are zero-length sequences
(:func:`padded_offsets`). Nothing here copies a tensor to the host.

Threads: each thread has its own cuDNN handles (one per device) and its own built graphs, so no lock
is held across a launch. The local runtime drives participants concurrently on pool threads, each
on its own CUDA stream (``distca_server/runtime/local.py``, ``_run_threads``), and a handle runs on
the one stream last set on it: cuDNN forbids using a handle from two threads at once, and
cudnn-frontend 1.32's ``cudnn.set_stream`` assumes a handle is not driven from two streams
concurrently ("a caller that does needs its own handle per stream"). Graphs are per thread too:
a pygraph is built against the handle it was given and fills caches lazily inside ``execute``, and
cuDNN execution plans are not guaranteed thread-safe across engines, which is why torch keeps its
own cuDNN graph caches ``thread_local`` (``aten/src/ATen/native/cudnn/MHA.cpp``).
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from .dtypes import accumulation_dtype

__all__ = ["CudnnKernels", "Bucket", "bucket_shape", "padded_offsets", "rows_with_keys", "cudnn_available",
           "describe_graph", "wide_offsets"]

_MIN_SEQS, _MIN_SEQLEN, _MIN_TOKENS, _CACHE_SIZE = 8, 64, 128, 64
_MIN_BACKEND = 90600  # cuDNN 9.6: GQA with ragged offsets, ragged Stats in the backward
# cudnn-frontend 1.32 (include/cudnn_frontend/node/scaled_dot_product_flash_attention.h,
# CompositeSDPABackwardNode::pre_validate_node; node/sdpa_support_surface.h for the forward):
# fp16/bf16 SDPA forward and backward are refused on cuDNN 9.10.0 / 9.10.1, and a ragged Stats
# input of sdpa_backward is refused on sm8x and sm12x ("Packed/ragged LSE is not supported for
# bprop thd on SM8X and SM12X GPUs"): neither may count as available, or `auto` picks a backend
# whose graphs cannot be built.
_BAD_BACKENDS = frozenset({91000, 91001})
_REFUSED_MAJORS = frozenset({12})


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class Bucket(NamedTuple):
    """A graph's shape: ``seqs`` sequence slots, ``max_q`` / ``max_k`` the S dims of the graph's
    tensors, ``tokens_q`` / ``tokens_k`` bounds on the packed token totals (the backward's
    ``max_total_seq_len_q/kv``, which size its workspace)."""

    seqs: int
    max_q: int
    max_k: int
    tokens_q: int
    tokens_k: int


def bucket_shape(num_seqs, max_seqlen_q, max_seqlen_k, total_q, total_k) -> Bucket:
    """The bucket a call falls in: each bound rounded up to a power of two (at least 8 sequence
    slots, lengths at least 64, token totals at least 128), so a graph serves every call whose
    values are at most its own; unused slots cost CTAs that exit at once.

    Args: ints >= 0: the number of sequences, the longest query / key sequence (bounds, as
    FlashAttention's ``max_seqlen_*``: every sequence must fit) and the packed token totals.
    Raises: ValueError naming the offending values (non-int, bool or negative).
    """
    vals = dict(num_seqs=num_seqs, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                total_q=total_q, total_k=total_k)
    bad = {n: v for n, v in vals.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0}
    if bad:
        raise ValueError(f"bucket_shape needs ints >= 0, got {bad}")
    return Bucket(max(_MIN_SEQS, _pow2(num_seqs)), max(_MIN_SEQLEN, _pow2(max_seqlen_q)),
                  max(_MIN_SEQLEN, _pow2(max_seqlen_k)), max(_MIN_TOKENS, _pow2(total_q)),
                  max(_MIN_TOKENS, _pow2(total_k)))


def padded_offsets(cu_seqlens: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot lengths and offsets for a graph with ``slots`` sequence slots.

    Args: cu_seqlens: integer [B + 1] cumulative offsets (any device; B <= slots); slots: int.
    Returns: ``(lengths int32 [slots], offsets int64 [slots + 1])`` on cu_seqlens' device: slots
    past B are zero-length sequences starting at ``cu_seqlens[-1]``. No host synchronisation.
    Raises: ValueError if cu_seqlens is not 1-D with 1..slots+1 entries.
    """
    if cu_seqlens.dim() != 1 or not 1 <= cu_seqlens.numel() <= slots + 1:
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} must be [B + 1] with B <= slots={slots}")
    cu = cu_seqlens.to(torch.int64)
    cu = torch.cat([cu, cu[-1:].expand(slots + 1 - cu.numel())])
    return cu.diff().to(torch.int32), cu


def rows_with_keys(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, left: int, right: int) -> torch.Tensor:
    """bool [total_q]: whether query row t sees at least one key under the bottom-right window
    ``(left, right)`` (FlashAttention's convention, -1 unbounded). False for rows outside every
    sequence (before ``cu_q[0]`` or from ``cu_q[-1]``). Device-side, no host synchronisation."""
    cq, ck = cu_q.to(torch.int64), cu_k.to(torch.int64)
    if cq.numel() < 2:
        return torch.zeros(total_q, dtype=torch.bool, device=cq.device)
    t = torch.arange(total_q, device=cq.device)
    b = torch.searchsorted(cq[1:].contiguous(), t, right=True)  # sequence of row t (B: none)
    inside = (b < cq.numel() - 1) & (t >= cq[0])
    b = b.clamp(max=cq.numel() - 2)
    lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
    diag = (t - cq[b]) + lk - lq
    lo = torch.zeros_like(diag) if left < 0 else (diag - left).clamp(min=0)
    hi = lk - 1 if right < 0 else torch.minimum(lk - 1, diag + right)
    return inside & (lo <= hi)


@functools.lru_cache(maxsize=None)
def cudnn_available() -> bool:
    """True when the ``cudnn`` package imports, CUDA is available, the current GPU is sm90 or newer
    but not sm12x (ragged Stats refused in the backward) and the cuDNN library is at least 9.6 and
    not 9.10.0 / 9.10.1 (``_BAD_BACKENDS``). Asked on first use (cached), never at import."""
    if importlib.util.find_spec("cudnn") is None or not torch.cuda.is_available():
        return False
    major = torch.cuda.get_device_capability()[0]
    if major < 9 or major in _REFUSED_MAJORS:
        return False
    try:
        import cudnn
        version = int(cudnn.backend_version())
        return version >= _MIN_BACKEND and version not in _BAD_BACKENDS
    except Exception:  # noqa: BLE001 - a broken install (no libcudnn, ABI mismatch) is "not available"
        return False


def wide_offsets(bucket: Bucket, hq: int, hkv: int, d: int) -> bool:
    """Whether a bucket's ragged offsets (in elements) need int64: int32 while every offset fits,
    as TransformerEngine chooses them."""
    return max(bucket.tokens_q * hq, bucket.tokens_k * hkv) * d >= 2 ** 31


def _data_type(cudnn, dtype):
    return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


def _thd(graph, name, b, h, s, d, offset, data_type=None):
    """A packed [T, h, d] tensor as cuDNN sees it: [b, h, s, d], BSHD strides, ragged offsets."""
    return graph.tensor(name=name, dim=[b, h, s, d], stride=[s * h * d, d, h * d, 1], data_type=data_type,
                        ragged_offset=offset)


def _set_thd(t, b, h, s, d, offset):
    return t.set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1]).set_ragged_offset(offset)


def describe_graph(cudnn, key, handle=None):
    """The cudnn-frontend graph of ``key = (kind, dtype, hq, hkv, d, scale, left, right, bucket)``,
    ``kind`` "fwd" or "bwd", not yet validated or built. Returns ``(graph, tensors)``, tensors by
    name (the variant pack's keys). Builds nothing on the GPU: CPU tests check the arguments."""
    kind, dtype, hq, hkv, d, scale, left, right, bk = key
    io = _data_type(cudnn, dtype)
    f32, i32, i64 = cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.INT64
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    n, sq, sk = bk.seqs, bk.max_q, bk.max_k
    offset_type = i64 if wide_offsets(bk, hq, hkv, d) else i32
    t = {name: g.tensor(name=name, dim=[n + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=offset_type)
         for name in ("off_q", "off_k", "off_stats")}
    t.update({name: g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
              for name in ("seq_q", "seq_k")})
    t["q"] = _thd(g, "q", n, hq, sq, d, t["off_q"])
    t["k"] = _thd(g, "k", n, hkv, sk, d, t["off_k"])
    t["v"] = _thd(g, "v", n, hkv, sk, d, t["off_k"])
    mask = dict(attn_scale=float(scale), use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_k"])
    if left >= 0 or right >= 0:
        mask["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        if left >= 0:
            mask["diagonal_band_left_bound"] = left + 1
        if right >= 0:
            mask["diagonal_band_right_bound"] = right
    stats_dim, stats_stride = [n, hq, sq, 1], [hq * sq, 1, hq, 1]
    if kind == "fwd":
        o, stats = g.sdpa(t["q"], t["k"], t["v"], generate_stats=True, name="sdpa", **mask)
        t["o"] = _set_thd(o, n, hq, sq, d, t["off_q"])
        t["stats"] = stats.set_output(True).set_data_type(f32).set_dim(stats_dim).set_stride(
            stats_stride).set_ragged_offset(t["off_stats"])
        return g, t
    t["o"] = _thd(g, "o", n, hq, sq, d, t["off_q"])
    t["do"] = _thd(g, "do", n, hq, sq, d, t["off_q"])
    t["stats"] = g.tensor(name="stats", dim=stats_dim, stride=stats_stride, data_type=f32,
                          ragged_offset=t["off_stats"])
    dq, dk, dv = g.sdpa_backward(t["q"], t["k"], t["v"], t["o"], t["do"], t["stats"], name="sdpa_backward",
                                 max_total_seq_len_q=bk.tokens_q, max_total_seq_len_kv=bk.tokens_k, **mask)
    t["dq"] = _set_thd(dq, n, hq, sq, d, t["off_q"])
    t["dk"] = _set_thd(dk, n, hkv, sk, d, t["off_k"])
    t["dv"] = _set_thd(dv, n, hkv, sk, d, t["off_k"])
    return g, t


class _Built(NamedTuple):
    graph: object
    tensors: dict
    workspace: int


class CudnnKernels:
    """The ``cudnn`` backend's kernels (mixed into :class:`distca_server.kernels.CudnnBackend` with
    the FlashAttention-style one-call-per-(left, right) driver): fp16/bf16, head_dim a multiple of
    8 up to 256, GQA with H_q a multiple of H_kv; other dtypes go to the reference math.

    ``graph_builds`` counts the graphs built (forward and backward, all threads); each thread's
    ``graphs`` (:meth:`_local`) is an LRU of at most 64 built graphs keyed by (kind, device, dtype,
    heads, head_dim, scale, bounds, bucket), built and executed with that thread's handles (module
    doc, "Threads"). Raises RuntimeError when cuDNN refuses a graph (the message names the key and
    cuDNN's reason).
    """

    name = "cudnn"
    device_types = ("cuda",)

    def __init__(self):
        self._threads = threading.local()
        self._lock = threading.Lock()  # graph_builds only: never held across a build or a launch
        self.graph_builds = 0

    def _local(self):
        """The calling thread's ``handles`` ({device index: cudnn.Handle}) and ``graphs`` (LRU),
        made on its first call. A thread's handles live as long as the backend (cudnn.Handle does not
        destroy its cudnnHandle_t when collected); the local runtime's pool threads are long-lived."""
        local = self._threads
        if not hasattr(local, "graphs"):
            local.handles, local.graphs = {}, OrderedDict()
        return local

    def is_available(self):
        return cudnn_available()

    def _kernel_handles(self, q):
        return q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] % 8 == 0 and q.shape[2] <= 256

    def _handle(self, cudnn, device):
        """The calling thread's cuDNN handle for ``device`` (made on its first use there), set to
        the thread's current torch stream."""
        handles, index = self._local().handles, device.index
        if index not in handles:
            with torch.cuda.device(index):
                handles[index] = cudnn.create_handle()
        handle = handles[index]
        cudnn.set_stream(handle, torch.cuda.current_stream(index).cuda_stream)
        return handle

    def _graph(self, cudnn, handle, device, key) -> _Built:
        """The calling thread's graph for ``key`` on ``device``, built with ``handle`` (that
        thread's) on first use; no other thread sees it."""
        graphs, full = self._local().graphs, (device.index, *key)
        built = graphs.get(full)
        if built is not None:
            graphs.move_to_end(full)
            return built
        built = self._build(cudnn, handle, device, key)
        with self._lock:
            self.graph_builds += 1
        graphs[full] = built
        if len(graphs) > _CACHE_SIZE:
            graphs.popitem(last=False)
        return built

    @staticmethod
    def _build(cudnn, handle, device, key) -> _Built:
        """validate -> operation graph -> plans (heuristics A, then FALLBACK) -> support -> build."""
        try:
            with torch.cuda.device(device):
                graph, tensors = describe_graph(cudnn, key, handle)
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
                return _Built(graph, tensors, int(graph.get_workspace_size()))
        except Exception as e:  # noqa: BLE001 - cuDNN's own error types vary by version
            raise RuntimeError(f"cuDNN cannot build the {key[0]} attention graph for {key}: {e}") from e

    def _run(self, key, pack, cu_q, cu_k, hq, hkv, d, device):
        import cudnn

        if device.type == "cuda" and device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        handle = self._handle(cudnn, device)
        built = self._graph(cudnn, handle, device, key)
        bucket = key[-1]
        len_q, off_q = padded_offsets(cu_q, bucket.seqs)
        len_k, off_k = padded_offsets(cu_k, bucket.seqs)
        wide = torch.int64 if wide_offsets(bucket, hq, hkv, d) else torch.int32
        pack.update(seq_q=len_q.view(-1, 1, 1, 1), seq_k=len_k.view(-1, 1, 1, 1),
                    off_q=(off_q * (hq * d)).to(wide).view(-1, 1, 1, 1),
                    off_k=(off_k * (hkv * d)).to(wide).view(-1, 1, 1, 1),
                    off_stats=(off_q * hq).to(wide).view(-1, 1, 1, 1))
        workspace = torch.empty(max(built.workspace, 1), dtype=torch.uint8, device=device)
        built.graph.execute({built.tensors[n]: x for n, x in pack.items()}, workspace, handle=handle)

    def _key(self, kind, q, k, cu_q, max_q, max_k, scale, left, right):
        bucket = bucket_shape(cu_q.numel() - 1, int(max_q), int(max_k), q.shape[0], k.shape[0])
        return (kind, q.dtype, q.shape[1], k.shape[1], q.shape[2], float(scale), int(left), int(right), bucket)

    def _banded_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        left, right):
        """One kernel call: out [T_q, H_q, D] (q's dtype), lse [T_q, H_q] float32, natural log,
        -inf (and out 0) on rows that see no key or lie outside every sequence."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=accumulation_dtype(q.dtype), device=q.device)
        if q.shape[0] and k.shape[0] and cu_seqlens_q.numel() > 1:
            key = self._key("fwd", q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, left, right)
            self._run(key, dict(q=q, k=k, v=v, o=out, stats=lse), cu_seqlens_q, cu_seqlens_k,
                      q.shape[1], k.shape[1], q.shape[2], q.device)
        seen = rows_with_keys(cu_seqlens_q, cu_seqlens_k, q.shape[0], left, right)
        out.masked_fill_(~seen[:, None, None], 0.0)
        lse.masked_fill_(~seen[:, None], float("-inf"))
        return out, lse

    def _banded_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, scale, left, right):
        """dq [T_q, H_q, D], dk, dv [T_k, H_kv, D] in q's dtype; zero outside every sequence. Rows
        whose lse is -inf (no visible key) reach cuDNN as +inf, so their P = exp(S - lse) is 0."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if q.shape[0] and k.shape[0] and cu_seqlens_q.numel() > 1:
            stats = lse.float().masked_fill(lse == float("-inf"), float("inf")).contiguous()
            key = self._key("bwd", q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, left, right)
            pack = dict(q=q, k=k, v=v, o=out.to(q.dtype).contiguous(), do=dout.to(q.dtype).contiguous(),
                        stats=stats, dq=dq, dk=dk, dv=dv)
            self._run(key, pack, cu_seqlens_q, cu_seqlens_k, q.shape[1], k.shape[1], q.shape[2], q.device)
        return dq, dk, dv
