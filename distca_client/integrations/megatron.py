"""Megatron-core adapter: a core-attention module whose ``softmax(QKᵀ)V`` runs through a
:class:`~distca_client.DistCAClient`.

It keeps ``DotProductAttention``'s constructor and ``forward`` contract, so a layer spec takes it
as its ``core_attention`` submodule (:func:`core_attention_spec`). Packed sequences come as
Megatron's ``thd`` format: ``packed_seq_params.cu_seqlens_q`` gives the documents, and
``SelfAttention`` has already squeezed the batch dimension (query ``[t, np, hn]``); without
``packed_seq_params`` each batch column of ``sbhd`` tensors is one document, cut further by the
``attention_mask`` where it holds padding or per-document blocks (:func:`sbhd_doc_lens`).

What it serves is what ``DotProductAttention`` computes, or it raises ``ValueError``: a
``config.window_size`` of ``(L, 0)`` becomes distca's ``window=L + 1`` (Megatron's row ``i`` sees
keys ``i - L .. i``); attention sinks (``softmax_type`` other than "vanilla") are refused.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import is_layer_window_attention

from distca_client.client import DistCAClient
from distca_client.integrations.per_forward import LastLengths
from scheduler.checks import is_int

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


class DistCACoreAttention(MegatronModule):
    """Causal self-attention inside each packed document, served by distca.

    Args: as Megatron's ``DotProductAttention`` (``config``: a ``TransformerConfig``;
    ``attn_mask_type``: causal or padding_causal; ``attention_type``: "self"; ``softmax_scale``:
    None means ``kv_channels ** -0.5``), plus ``client`` (default
    ``DistCAClient.local(num_servers=1)``; pass one client to every layer). A layer that
    ``config.window_size = (L, 0)`` and ``window_attn_skip_freq`` make windowed (Megatron's
    ``is_layer_window_attention``) attends with distca's ``window=L + 1``.

    Raises:
        ValueError: cross attention, a non-causal mask type, attention dropout > 0, tensor or
            context parallelism > 1, ``softmax_type`` other than "vanilla" (attention sinks), a
            windowed layer whose ``window_size`` is not ``(L, 0)`` with an int ``L >= 0``, or a
            ``client`` that is not a DistCAClient.
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
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type != "vanilla":
            problems.append(f"softmax_type={softmax_type!r} (attention sinks are not supported; "
                            f"'vanilla' only)")
        window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            window = _window(config.window_size, problems)
        if client is not None and not isinstance(client, DistCAClient):
            problems.append(f"client={client!r} (not a DistCAClient)")
        if problems:
            raise ValueError("DistCACoreAttention: " + "; ".join(problems))
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.window = window  # distca's window (keys per query), None for full causal
        self.client = DistCAClient.local(num_servers=1) if client is None else client
        self.softmax_scale = config.kv_channels ** -0.5 if softmax_scale is None else softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """Core attention in Megatron's layouts.

        Args:
            query: ``thd`` [t, np, hn] (or [t, 1, np, hn]); ``sbhd`` [s, b, np, hn].
            key, value: the same with ``ng`` query groups (GQA) instead of ``np``.
            attention_mask: ``sbhd``: None or what ``DotProductAttention`` takes, bool
                [1 or b, 1, s, s], True where masked out (:func:`sbhd_doc_lens`); ``thd``: ignored,
                ``cu_seqlens`` give the documents.
            attn_mask_type: overrides the constructor's; causal or padding_causal.
            packed_seq_params: ``qkv_format="thd"`` with equal ``cu_seqlens_q``/``cu_seqlens_kv``
                (int [num_docs + 1], ending at t); padded variants None or equal to them.

        Returns:
            ``thd``: [t, np·hn]; ``sbhd``: [s, b, np·hn]; query's dtype. Padded ``sbhd`` positions
            hold their own attention, not Megatron's: leave them out of the loss.

        Raises:
            ValueError: attention bias, a non-causal ``attn_mask_type``, another ``qkv_format``,
                cross-document ``cu_seqlens`` (q ≠ kv), an ``sbhd`` mask :func:`sbhd_doc_lens`
                refuses, a windowed layer's ``sbhd`` mask with padding or several documents
                (``DotProductAttention`` ignores the mask there), or shapes that do not match.
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
            if self.window is not None and attention_mask is None:
                doc_lens = [s] * b  # DotProductAttention builds a windowed layer's mask itself
            else:
                mask_type = attn_mask_type or self.attn_mask_type
                # read on the host once per forward: every layer gets the same mask (.per_forward)
                doc_lens = _LAST_LENGTHS.get((attention_mask,), ("sbhd", mask_type, s, b),
                                             lambda: sbhd_doc_lens(attention_mask, mask_type, s, b))
            if self.window is not None and len(doc_lens) != b:
                raise ValueError(f"DistCACoreAttention: layer {self.layer_number} has window_size="
                                 f"{self.config.window_size}, where Megatron's DotProductAttention "
                                 f"ignores attention_mask, but the mask holds padding or several "
                                 f"documents per column (pass them as thd packed_seq_params)")
            # [s, b, h, d] -> [b·s, h, d]: the columns one after another.
            q, k, v = (t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value))
            out = self._attend(q, k, v, doc_lens)
            return out.view(b, s, -1).transpose(0, 1).contiguous()
        p, t = packed_seq_params, query.shape[0]
        doc_lens = _LAST_LENGTHS.get(
            tuple(getattr(p, n, None) for n in _THD_FIELDS), ("thd", getattr(p, "qkv_format", None), t),
            lambda: thd_doc_lens(p, t))
        q, k, v = (t.squeeze(1) if t.dim() == 4 else t for t in (query, key, value))
        return self._attend(q, k, v, doc_lens).reshape(q.shape[0], -1)

    def _attend(self, q, k, v, doc_lens):
        return self.client.attend(q, k, v, doc_lens, softmax_scale=self.softmax_scale, window=self.window)


def _window(window_size, problems: list) -> int | None:
    """distca's window for a windowed layer's ``window_size``, or None after adding a problem.

    Megatron's ``get_sliding_window_causal_mask`` lets row ``i`` see keys ``i - L .. i + R``:
    ``(L, 0)`` is causal with ``L + 1`` keys per query.
    """
    if (isinstance(window_size, (tuple, list)) and len(window_size) == 2 and is_int(window_size[0])
            and window_size[0] >= 0 and is_int(window_size[1]) and window_size[1] == 0):
        return int(window_size[0]) + 1
    problems.append(f"window_size={window_size!r} (only (L, 0), an int L >= 0: query i sees keys "
                    f"i-L..i; for full causal attention set window_size=None)")
    return None


def sbhd_doc_lens(attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType, s: int,
                  b: int) -> list[int]:
    """Document lengths of an ``sbhd`` batch, column after column, read from the mask
    ``DotProductAttention`` applies, so that distca attends to what it attends to.

    A token masked from itself is padding, and each run of padding is a document of its own (what
    its tokens output is not Megatron's: nobody should read it). A real token whose mask hides the
    token before it starts a document. On every real query row the mask must then be exactly
    causal attention inside that document: a plain causal mask (one document per column), padding
    at the ends of a column (``padding_causal``), or block-diagonal causal documents
    (``reset_attention_mask``).

    Args:
        attention_mask: None (plain causal) or bool [1 or b, 1, s, s], True where masked out.
        attn_mask_type: causal or padding_causal.

    Raises:
        ValueError: padding_causal with no mask (``DotProductAttention`` then masks nothing, not
            even causally), a mask of another dtype or shape, or one that lets a real query see
            other keys than causal attention inside its document (padding between the real tokens
            of a document, a non-causal mask), naming the column, the query and the keys it sees.
    """
    if attention_mask is None:
        if attn_mask_type == AttnMaskType.padding_causal:
            raise ValueError("DistCACoreAttention: attn_mask_type=padding_causal with attention_mask="
                             "None (DotProductAttention then masks nothing); pass the [b, 1, s, s] mask")
        return [s] * b
    m = attention_mask
    if (m.dtype != torch.bool or m.dim() != 4 or m.shape[1] != 1 or tuple(m.shape[2:]) != (s, s)
            or m.shape[0] not in (1, b)):
        raise ValueError(f"DistCACoreAttention: attention_mask of {m.dtype} {tuple(m.shape)} (expected "
                         f"torch.bool [1 or {b}, 1, {s}, {s}], True where masked out)")
    lens = [length for col, mask in enumerate(m.detach()[:, 0]) for length in _column_doc_lens(col, mask)]
    return lens * b if m.shape[0] == 1 else lens  # one mask for every column


def _column_doc_lens(col: int, m: torch.Tensor) -> list[int]:
    """:func:`sbhd_doc_lens` of one column's [s, s] mask."""
    real = ~m.diagonal()
    starts = torch.ones_like(real)
    starts[1:] = (real[1:] != real[:-1]) | (real[1:] & m.diagonal(-1))
    doc = starts.cumsum(0)
    served = (doc[:, None] == doc[None, :]).tril()  # what distca lets each query see
    wrong = (m == served) & real[:, None]  # visible where distca masks, or the reverse
    if bool(wrong.any()):
        row = int(wrong.any(1).nonzero()[0])
        first = int(served[row].nonzero()[0])
        raise ValueError(f"DistCACoreAttention: attention_mask column {col} lets query {row} see keys "
                         f"{_spans(~m[row])}, not {first}-{row}: distca serves causal attention "
                         f"inside documents, and a run of padding (tokens masked from themselves) "
                         f"ends a document")
    bounds = starts.nonzero().reshape(-1).tolist() + [m.shape[0]]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def _spans(flags: torch.Tensor) -> str:
    """"0-4, 6-11": the runs of True in a 1-D bool tensor, for error messages."""
    pos = flags.nonzero().reshape(-1).tolist()
    runs = []
    for p in pos:
        if runs and runs[-1][1] == p - 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}-{z}" if z > a else f"{a}" for a, z in runs) or "none"


_LAST_LENGTHS = LastLengths()
# The packed_seq_params fields thd_doc_lens reads: its answer is reused while they are the same tensors
_THD_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


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
