"""``DistCACoreAttention`` on Megatron's ``thd`` packed format equals Megatron's own local core
attention (``DotProductAttention``) run document by document: outputs and q/k/v gradients."""

import contextlib

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from distca_client import DistCAClient  # noqa: E402
from distca_client.integrations.megatron import DistCACoreAttention, core_attention_spec  # noqa: E402

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


@pytest.fixture(scope="module")
def megatron_reference():
    """Megatron's ``DotProductAttention`` on the CPU: a one-rank gloo group for its tensor-parallel
    group; its CUDA-only matmul buffer and dropout RNG fork (dropout is 0) replaced for the CPU."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mp = pytest.MonkeyPatch()
    mp.setattr(parallel_state, "get_global_memory_buffer", lambda: _CPUBuffer())
    mp.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    tp = dist.new_group([0])
    yield DotProductAttention(_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                              attention_type="self", pg_collection=ProcessGroupCollection(tp=tp))
    mp.undo()
    if started:
        dist.destroy_process_group()


def _qkvd(total, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(total, HEADS, HEAD_DIM), (total, GROUPS, HEAD_DIM), (total, GROUPS, HEAD_DIM),
              (total, HEADS * HEAD_DIM)]
    return [torch.randn(*s, generator=g) for s in shapes]


def _per_document_reference(dpa, q, k, v, dout):
    """Megatron's core attention on each document alone ([s, 1, h, d], causal mask)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs = []
    for dq, dk, dv in zip(*(t.split(DOC_LENS) for t in leaves)):
        n = dq.shape[0]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]  # True: masked out
        outs.append(dpa(dq[:, None], dk[:, None], dv[:, None], mask,
                        attn_mask_type=AttnMaskType.causal)[:, 0])
    out = torch.cat(outs)
    (out * dout).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _packed_params(cu):
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(DOC_LENS), max_seqlen_kv=max(DOC_LENS))


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
@pytest.mark.parametrize("num_servers", [1, 3])
def test_thd_packed_equals_megatron_dot_product_attention_per_document(megatron_reference, mode,
                                                                         num_servers):
    q, k, v, dout = _qkvd(sum(DOC_LENS))
    want = _per_document_reference(megatron_reference, q, k, v, dout)
    client = DistCAClient.local(num_servers, mode=mode, min_shard=4)
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
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
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
