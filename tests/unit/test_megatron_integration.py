"""``DistCACoreAttention`` on Megatron's ``thd`` packed format equals Megatron's own local core
attention (``DotProductAttention``) run document by document: outputs and q/k/v gradients; so
do sliding windows and ``sbhd`` padding masks, and what it cannot serve it refuses."""

import contextlib
import re

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.fusions import fused_softmax  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from distca_client import DistCAClient  # noqa: E402
from distca_client.integrations.megatron import DistCACoreAttention, core_attention_spec  # noqa: E402
from scheduler.config import PlanConfig  # noqa: E402

DOC_LENS = [7, 1, 13, 1, 5, 2]
HEADS, GROUPS, HEAD_DIM = 4, 2, 16


def _config(**kw):
    return TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, use_cpu_initialization=True,
                             attention_dropout=0.0, **kw)


class _CPUBuffer:
    """Megatron's global matmul buffer, allocated on the CPU (its own allocates on CUDA)."""

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


class _CUDAFactoriesOnCPU(TorchFunctionMode):
    """Runs Megatron's own code that creates tensors with ``device="cuda"`` on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def megatron_dpa():
    """Builds Megatron's ``DotProductAttention`` on the CPU: a one-rank gloo group for its
    tensor-parallel group; its CUDA-only matmul buffer and dropout RNG fork (dropout is 0)
    replaced for the CPU, and its sliding-window mask built on the CPU."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mp = pytest.MonkeyPatch()
    mp.setattr(parallel_state, "get_global_memory_buffer", lambda: _CPUBuffer())
    mp.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    window_mask = fused_softmax.get_sliding_window_causal_mask

    def window_mask_on_cpu(*args):
        with _CUDAFactoriesOnCPU():
            return window_mask(*args)

    mp.setattr(fused_softmax, "get_sliding_window_causal_mask", window_mask_on_cpu)
    tp = dist.new_group([0])
    yield lambda config, mask_type=AttnMaskType.causal, layer_number=1: DotProductAttention(
        config, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self",
        pg_collection=ProcessGroupCollection(tp=tp))
    mp.undo()
    if started:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_reference(megatron_dpa):
    return megatron_dpa(_config())


def _qkvd(total, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(total, HEADS, HEAD_DIM), (total, GROUPS, HEAD_DIM), (total, GROUPS, HEAD_DIM),
              (total, HEADS * HEAD_DIM)]
    return [torch.randn(*s, generator=g) for s in shapes]


def _causal(n):
    return torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]  # True: masked out


def _with_grads(fn, q, k, v, dout):
    """``fn(q, k, v)`` and the q, k, v gradients of ``sum(out * dout)``."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    (out * dout).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _per_document_reference(dpa, q, k, v, dout):
    """Megatron's core attention on each document alone ([s, 1, h, d], causal mask)."""
    def per_document(*leaves):
        return torch.cat([dpa(dq[:, None], dk[:, None], dv[:, None], _causal(dq.shape[0]),
                              attn_mask_type=AttnMaskType.causal)[:, 0]
                          for dq, dk, dv in zip(*(t.split(DOC_LENS) for t in leaves))])
    return _with_grads(per_document, q, k, v, dout)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _close(got, want):
    """Within 1e-5 of ``want``'s largest entry, or of 1 where that is smaller (a window of one
    key makes dq exactly 0 in theory, and rounding noise in practice)."""
    return (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def _packed_params(cu):
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(DOC_LENS), max_seqlen_kv=max(DOC_LENS))


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
@pytest.mark.parametrize("num_servers", [1, 3])
def test_thd_packed_equals_megatron_dot_product_attention_per_document(megatron_reference, mode,
                                                                         num_servers):
    q, k, v, dout = _qkvd(sum(DOC_LENS))
    want = _per_document_reference(megatron_reference, q, k, v, dout)
    client = DistCAClient.local(num_servers, config=PlanConfig(mode=mode, min_shard=4))
    core = DistCACoreAttention(_config(), 1, AttnMaskType.causal, "self", client=client)
    cu = torch.tensor([0, *torch.tensor(DOC_LENS).cumsum(0).tolist()], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = core(*leaves, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=_packed_params(cu))
    assert out.shape == (sum(DOC_LENS), HEADS * HEAD_DIM)
    (out * dout).sum().backward()
    for got, ref in zip([out.detach()] + [t.grad for t in leaves], want):
        assert _rel(got, ref) <= 1e-5
    # [t, 1, h, d] (thd before SelfAttention's squeeze) is the same batch.
    again = core(q[:, None], k[:, None], v[:, None], None, packed_seq_params=_packed_params(cu))
    torch.testing.assert_close(again, out.detach(), rtol=0, atol=0)


def test_sbhd_columns_are_documents(megatron_reference):
    s, b = 9, 3
    q, k, v, _ = _qkvd(s * b, seed=1)
    q, k, v = (t.view(s, b, *t.shape[1:]) for t in (q, k, v))
    mask = _causal(s)
    want = megatron_reference(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
    core = build_module(core_attention_spec(DistCAClient.local(2)), config=_config(), layer_number=1,
                        attn_mask_type=AttnMaskType.causal, attention_type="self",
                        cp_comm_type=None, softmax_scale=None, pg_collection=None)
    assert isinstance(core, DistCACoreAttention)
    got = core(q, k, v, mask)
    assert got.shape == want.shape == (s, b, HEADS * HEAD_DIM)
    assert _rel(got, want) <= 1e-5


def test_unsupported_settings_are_refused():
    cfg = _config()
    with pytest.raises(ValueError, match="attention_type='cross'.*attn_mask_type"):
        DistCACoreAttention(cfg, 1, AttnMaskType.no_mask, "cross")
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        DistCACoreAttention(cfg, 1, AttnMaskType.causal, "self", attention_dropout=0.1)
    core = DistCACoreAttention(cfg, 1, AttnMaskType.causal, "self", client=DistCAClient.local(1))
    q, k, v, _ = _qkvd(sum(DOC_LENS))
    cu = torch.tensor([0, 7, 8, 21, 22, 27, 29], dtype=torch.int32)
    bad = _packed_params(cu)
    bad.cu_seqlens_kv = torch.tensor([0, 29], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        core(q, k, v, None, packed_seq_params=bad)
    with pytest.raises(ValueError, match="rise strictly"):
        core(q, k, v, None, packed_seq_params=_packed_params(torch.tensor([0, 7, 30])))
    with pytest.raises(ValueError, match="qkv_format='sbhd'"):
        core(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))


def _sbhd(total, s, seed):
    return [t.view(s, total // s, *t.shape[1:]) for t in _qkvd(total, seed)]


@pytest.mark.parametrize("window_size,skip_freq,layer", [
    ((4, 0), None, 1), ((0, 0), None, 1), ((2, 0), 2, 1),
    ((2, 0), 2, 2),  # window_attn_skip_freq=2 makes layer 2 full attention
])
def test_window_size_equals_megatron_sliding_window(megatron_dpa, window_size, skip_freq, layer):
    """Megatron's (L, 0) lets query i see keys i-L..i: distca's window L + 1, thd and sbhd."""
    cfg = _config(window_size=window_size, window_attn_skip_freq=skip_freq)
    dpa = megatron_dpa(cfg, layer_number=layer)
    core = DistCACoreAttention(cfg, layer, AttnMaskType.causal, "self",
                               client=DistCAClient.local(2, config=PlanConfig(min_shard=2)))
    q, k, v, dout = _qkvd(sum(DOC_LENS), seed=5)
    cu = torch.tensor([0, *torch.tensor(DOC_LENS).cumsum(0).tolist()], dtype=torch.int32)
    got = _with_grads(lambda *t: core(*t, None, packed_seq_params=_packed_params(cu)), q, k, v, dout)
    for g, w in zip(got, _per_document_reference(dpa, q, k, v, dout)):
        assert _close(g, w)
    q, k, v, dout = _sbhd(24, 12, seed=6)
    got, want = (_with_grads(lambda *t: m(*t, _causal(12)), q, k, v, dout) for m in (core, dpa))
    for g, w in zip(got, want):
        assert _close(g, w)
    assert core.window == (None if skip_freq and layer % skip_freq == 0 else window_size[0] + 1)


def _padding_mask(s):
    """Megatron's [3, 1, s, s] mask, True where masked out: causal, padded keys masked. Column 0
    is left-padded by 4, column 1 right-padded from 9, column 2 holds 2 padding tokens and then
    two documents (a block-diagonal ``reset_attention_mask`` mask). Also the real tokens [s, 3]."""
    real = torch.ones(3, s, dtype=torch.bool)
    real[0, :4] = real[1, 9:] = real[2, :2] = False
    doc = torch.zeros(3, s, dtype=torch.long)
    doc[2, 7:] = 1
    visible = ~_causal(s)[0] & (doc[:, :, None] == doc[:, None, :]) & real[:, None, :]
    return ~visible[:, None], real.T


@pytest.mark.parametrize("mask_type", [AttnMaskType.padding_causal, AttnMaskType.causal])
def test_sbhd_padding_masks_equal_megatron_on_real_tokens(megatron_dpa, mask_type):
    """DotProductAttention applies a given mask under either mask type; padding becomes distca
    documents of their own, whose outputs nobody reads (no loss on them)."""
    mask, real = _padding_mask(12)
    q, k, v, dout = _sbhd(36, 12, seed=7)
    dout = dout * real[:, :, None]
    want = _with_grads(lambda *t: megatron_dpa(_config(), mask_type)(*t, mask), q, k, v, dout)
    client = DistCAClient.local(2, config=PlanConfig(min_shard=2))
    core = DistCACoreAttention(_config(), 1, mask_type, "self", client=client)
    got = _with_grads(lambda *t: core(*t, mask), q, k, v, dout)
    assert _rel(got[0][real], want[0][real]) <= 1e-5
    for g, w in zip(got[1:], want[1:]):
        assert _close(g, w)


def test_settings_and_masks_it_cannot_serve_are_refused():
    for softmax_type in ("learnable", "off-by-one"):  # attention sinks
        with pytest.raises(ValueError, match=f"softmax_type='{softmax_type}'"):
            DistCACoreAttention(_config(softmax_type=softmax_type), 1, AttnMaskType.causal, "self")
    for window_size in [(2, 1), (-1, 0)]:  # looks ahead; TE's "unbounded"
        with pytest.raises(ValueError, match=re.escape(f"window_size={window_size}")):
            DistCACoreAttention(_config(window_size=window_size), 1, AttnMaskType.causal, "self")
    q, k, v, _ = _sbhd(12, 12, seed=8)
    core = DistCACoreAttention(_config(), 1, AttnMaskType.padding_causal, "self",
                               client=DistCAClient.local(1))
    hole = _causal(12).clone()
    hole[..., 5] = True  # key 5 is padding, with real tokens on both sides
    with pytest.raises(ValueError, match="column 0 lets query 6 see keys 0-4, 6, not 6-6"):
        core(q, k, v, hole)
    with pytest.raises(ValueError, match="lets query 0 see keys 0-11"):  # not causal
        core(q, k, v, torch.zeros(1, 1, 12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding_causal with attention_mask=None"):
        core(q, k, v, None)
    with pytest.raises(ValueError, match="attention_mask of torch.float32"):
        core(q, k, v, _causal(12).float())
    windowed = DistCACoreAttention(_config(window_size=(3, 0)), 1, AttnMaskType.padding_causal, "self",
                                   client=DistCAClient.local(1))
    left_padded = _causal(12).clone()
    left_padded[..., :2] = True
    with pytest.raises(ValueError, match="ignores attention_mask"):
        windowed(q, k, v, left_padded)


def test_document_lengths_are_read_once_per_forward(monkeypatch):
    """Every layer gets the same packed_seq_params / mask tensors: their values are read on the host
    once (a GPU read waits for the device), again when they change in place or are new tensors."""
    from distca_client.integrations import megatron as adapter
    calls = []
    for name in ("thd_doc_lens", "sbhd_doc_lens"):
        real = getattr(adapter, name)
        monkeypatch.setattr(adapter, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    client = DistCAClient.local(2, config=PlanConfig(min_shard=4))
    layers = [DistCACoreAttention(_config(), n, AttnMaskType.causal, "self", client=client) for n in (1, 2)]
    q, k, v, _ = _qkvd(sum(DOC_LENS))
    cu = torch.tensor([0, *torch.tensor(DOC_LENS).cumsum(0).tolist()], dtype=torch.int32)
    params = _packed_params(cu)
    for layer in layers:
        layer(q, k, v, None, packed_seq_params=params)
    assert calls == ["thd_doc_lens"]
    cu[1:].copy_(torch.tensor(DOC_LENS[::-1]).cumsum(0))  # in place: other documents
    out = layers[0](q, k, v, None, packed_seq_params=params)
    assert calls == ["thd_doc_lens"] * 2 and sum(client.last_plan.doc_lens_per_rank, []) == DOC_LENS[::-1]
    s, b = 9, 3
    qs, ks, vs = (t[:s * b].reshape(s, b, *t.shape[1:]) for t in (q, k, v))
    mask = _causal(s)
    for layer in layers:
        layer(qs, ks, vs, mask)
    layers[0](qs, ks, vs, mask.clone())  # equal values, a new tensor
    assert calls[2:] == ["sbhd_doc_lens"] * 2
    assert out.shape == (sum(DOC_LENS), HEADS * HEAD_DIM)
