"""Megatron-core adapter: a core-attention module whose ``softmax(QKᵀ)V`` runs through a
:class:`~distca_client.DistCAClient`.

It keeps ``DotProductAttention``'s constructor and ``forward`` contract, so a layer spec takes it
as its ``core_attention`` submodule (:func:`core_attention_spec`). Packed sequences come as
Megatron's ``thd`` format: ``packed_seq_params.cu_seqlens_q`` gives the documents, and
``SelfAttention`` has already squeezed the batch dimension (query ``[t, np, hn]``); without
``packed_seq_params`` each batch column of ``sbhd`` tensors is one document.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from distca_client.client import DistCAClient

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


class DistCACoreAttention(MegatronModule):
    """Causal self-attention inside each packed document, served by distca.

    Args: as Megatron's ``DotProductAttention`` (``config``: a ``TransformerConfig``;
    ``attn_mask_type``: causal or padding_causal; ``attention_type``: "self"; ``softmax_scale``:
    None means ``kv_channels ** -0.5``), plus ``client`` (default
    ``DistCAClient.local(num_servers=1)``; pass one client to every layer).

    Raises:
        ValueError: cross attention, a non-causal mask type, attention dropout > 0, tensor or
            context parallelism > 1, or a ``client`` that is not a DistCAClient.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, *,
                 client: DistCAClient | None = None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        problems = []
        if attention_type != "self":
            problems.append(f"attention_type={attention_type!r} (self-attention only)")
        if attn_mask_type not in _CAUSAL:
            problems.append(f"attn_mask_type={attn_mask_type} (causal only)")
        if dropout:
            problems.append(f"attention_dropout={dropout} (must be 0)")
        for name in ("tensor_model_parallel_size", "context_parallel_size"):
            if getattr(config, name, 1) != 1:
                problems.append(f"{name}={getattr(config, name)} (distca does its own balancing; 1 only)")
        if client is not None and not isinstance(client, DistCAClient):
            problems.append(f"client={client!r} (not a DistCAClient)")
        if problems:
            raise ValueError("DistCACoreAttention: " + "; ".join(problems))
        self.layer_number = layer_number
        self.client = DistCAClient.local(num_servers=1) if client is None else client
        self.softmax_scale = config.kv_channels ** -0.5 if softmax_scale is None else softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """Core attention in Megatron's layouts.

        Args:
            query: ``thd`` [t, np, hn] (or [t, 1, np, hn]); ``sbhd`` [s, b, np, hn].
            key, value: the same with ``ng`` query groups (GQA) instead of ``np``.
            attention_mask: ignored: distca's attention is causal inside each document.
            packed_seq_params: ``qkv_format="thd"`` with equal ``cu_seqlens_q``/``cu_seqlens_kv``
                (int [num_docs + 1], ending at t); padded variants None or equal to them.

        Returns:
            ``thd``: [t, np·hn]; ``sbhd``: [s, b, np·hn]; query's dtype.

        Raises:
            ValueError: attention bias, a non-causal ``attn_mask_type``, another ``qkv_format``,
                cross-document ``cu_seqlens`` (q ≠ kv), or shapes that do not match.
        """
        if attention_bias is not None:
            raise ValueError("DistCACoreAttention: attention_bias is not supported")
        if attn_mask_type is not None and attn_mask_type not in _CAUSAL:
            raise ValueError(f"DistCACoreAttention: attn_mask_type={attn_mask_type} (causal only)")
        if packed_seq_params is None:
            if query.dim() != 4:
                raise ValueError(f"DistCACoreAttention: sbhd query of shape {tuple(query.shape)} "
                                 f"(expected [s, b, np, hn])")
            s, b = query.shape[:2]
            # [s, b, h, d] -> [b·s, h, d]: each batch column is one document of s tokens.
            q, k, v = (t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value))
            out = self.client.attend(q, k, v, [s] * b, softmax_scale=self.softmax_scale)
            return out.view(b, s, -1).transpose(0, 1).contiguous()
        doc_lens = thd_doc_lens(packed_seq_params, query.shape[0])
        q, k, v = (t.squeeze(1) if t.dim() == 4 else t for t in (query, key, value))
        out = self.client.attend(q, k, v, doc_lens, softmax_scale=self.softmax_scale)
        return out.reshape(out.shape[0], -1)


def thd_doc_lens(packed_seq_params, total_tokens: int) -> list[int]:
    """Document lengths of a ``thd`` batch from ``packed_seq_params.cu_seqlens_q``.

    Raises:
        ValueError: ``qkv_format`` other than "thd", ``cu_seqlens_q`` ≠ ``cu_seqlens_kv``, padded
            cu_seqlens that differ from the unpadded ones, or lengths that do not rise strictly
            from 0 to ``total_tokens``.
    """
    p = packed_seq_params
    if p.qkv_format != "thd":
        raise ValueError(f"DistCACoreAttention: qkv_format={p.qkv_format!r} with packed_seq_params "
                         f"(thd only)")
    cu = torch.as_tensor(p.cu_seqlens_q).cpu()
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(p, name, None)
        if other is None and name.endswith("padded"):
            continue
        if other is None or not torch.equal(torch.as_tensor(other).cpu(), cu):
            raise ValueError(f"DistCACoreAttention: {name}={other} differs from cu_seqlens_q={cu} "
                             f"(self-attention over unpadded documents only)")
    bounds = cu.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total_tokens or any(
            b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"DistCACoreAttention: cu_seqlens_q={bounds} must rise strictly from 0 to "
                         f"the {total_tokens} tokens of the batch")
    return [b - a for a, b in zip(bounds, bounds[1:])]


def core_attention_spec(client: DistCAClient) -> ModuleSpec:
    """The ``core_attention`` submodule spec of a Megatron layer spec, every layer sharing
    ``client`` (e.g. ``spec.submodules.self_attention.submodules.core_attention =
    core_attention_spec(client)``)."""
    return ModuleSpec(module=DistCACoreAttention, params={"client": client})
