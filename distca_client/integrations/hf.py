"""Hugging Face transformers adapter: ``attn_implementation="distca"`` runs a model's core
attention through a :class:`~distca_client.DistCAClient`.

Three lines in a training script::

    from distca_client.integrations import hf
    hf.register()                       # or hf.register(DistCAClient.connect()) in a Ray job
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="distca")

Sliding-window layers (Mistral, Qwen2/3 with ``use_sliding_window``, Gemma-style models mixing
windowed and full layers) pass transformers' ``sliding_window`` through as ``attend``'s ``window``
(query ``i`` sees keys ``i - sliding_window + 1 .. i``, transformers' own mask): a step with both
kinds of layer gets one plan per window.

Document boundaries come the way transformers' packed batches carry them: ``cu_seq_lens_q/k``
keyword arguments, or ``position_ids`` that restart per document (what
``DataCollatorWithFlattening`` produces), plus the rows of the batch and, when there is padding,
the 2-D attention mask's runs of real and padded tokens (padding at either end of a row; a row
with padding between real tokens is refused, since transformers attends across such a hole and
documents cannot). The registered mask hook is
transformers' own flash-attention one: it hands the attention function the 2-D padding mask (or
None) instead of a dense 4-D mask, which distca has no use for.

``torch.compile(model, fullgraph=True)`` traces a model on ``"distca"`` whole: under compile the
document lengths come from the operator ``distca::hf_document_lengths`` (:func:`document_lengths`
run when the compiled code runs) as a tensor for ``attend``, so a new packing of the batch is data,
not a recompile (docs/api.md). ``register_local`` attention is eager only.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from distca_client import op as _op  # noqa: F401  (registers the distca operators)
from distca_client.client import DistCAClient
from distca_client.integrations.per_forward import LastLengths
from distca_client.functional import varlen_attention
from distca_server.kernels import check_backend_name

NAME = "distca"


def register(client: DistCAClient | None = None, name: str = NAME) -> DistCAClient:
    """Register attention ``name`` with transformers, served by ``client``.

    After this, ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``from_pretrained``, or ``model.set_attn_implementation(name)``) sends every attention layer's
    ``softmax(QKᵀ)V`` through ``client.attend``. Registering the same name again replaces the
    client for every model using it.

    Args:
        client: the client to use; None builds ``DistCAClient.local(num_servers=1)``.
        name: the ``attn_implementation`` string.

    Returns:
        the client the attention runs through.

    Raises:
        ValueError: ``client`` is not a DistCAClient or ``name`` is not a non-empty str.
    """
    if client is None:
        client = DistCAClient.local(num_servers=1)
    if not isinstance(client, DistCAClient):
        raise ValueError(f"register: client={client!r} is not a DistCAClient")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name={name!r} must be a non-empty str")

    _register(name, client.attend)
    return client


def register_local(name: str = "distca_local", backend: str = "auto") -> None:
    """Register attention ``name`` that runs :func:`~distca_client.varlen_attention` on the
    model's own device: the same document handling as :func:`register` with nothing served, for
    comparing a distca run with a local one.

    Raises:
        ValueError: an unknown ``backend`` or an empty ``name``.
    """
    check_backend_name(backend)
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_local: name={name!r} must be a non-empty str")
    _register(name, functools.partial(varlen_attention, backend=backend))


def _register(name: str, attend) -> None:
    def distca_attention_forward(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(attend, module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, distca_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)


def attention_forward(attend, module: torch.nn.Module, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                      *, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      cu_seq_lens_q: torch.Tensor | None = None,
                      cu_seq_lens_k: torch.Tensor | None = None,
                      **_ignored) -> tuple[torch.Tensor, None]:
    """One layer's attention in transformers' calling convention, through ``attend``.

    Args:
        attend: ``DistCAClient.attend`` or ``varlen_attention`` (q, k, v, doc_lens, softmax_scale,
            window).
        query: [B, H_q, S, D]; key, value: [B, H_kv, S, D] (transformers' layout).
        attention_mask: None or the 2-D [B, S] padding mask (the flash-attention mask hook); in
            each row the real tokens must be one run, padding only at the ends.
        position_ids: [B or 1, S] int, restarting (any step other than +1) at each document.
        cu_seq_lens_q, cu_seq_lens_k: equal 1-D int tensors [num_docs + 1] over the flattened
            B·S tokens; they win over ``position_ids``.
        sliding_window: the layer's window (None for a full-attention layer), passed on as
            ``window``.

    Returns:
        (out [B, S, H_q, D] in query's dtype, or the autocast dtype under autocast, as
        transformers' sdpa and flash attentions cast q, k, v to it; None): the layout
        transformers' flash and sdpa attentions return.

    Raises:
        ValueError: features distca does not serve (dropout > 0, softcap, attention sinks,
            non-causal, a KV cache with fewer queries than keys), a ``sliding_window`` that is not
            a positive int, unequal ``cu_seq_lens_q``/``cu_seq_lens_k``, an ``attention_mask``
            :func:`document_lengths` refuses, or a training forward of a single row with no
            document information.
    """
    batch, heads_q, seq, head_dim = query.shape
    problems = []
    if dropout:
        problems.append(f"dropout={dropout} (attention dropout is not supported; set attention_dropout=0)")
    if softcap is not None:
        problems.append(f"softcap={softcap} (logit soft-capping is not supported)")
    if s_aux is not None:
        problems.append("s_aux (attention sinks are not supported)")
    if is_causal is False or (is_causal is None and not getattr(module, "is_causal", True)):
        problems.append("is_causal=False (distca attention is causal)")
    if key.shape[2] != seq:
        problems.append(f"{seq} queries but {key.shape[2]} keys (a KV cache: decode with "
                        f"model.set_attn_implementation('sdpa'))")
    if problems:
        raise ValueError("distca attention: " + "; ".join(problems))

    kind = query.device.type
    if torch.is_autocast_enabled(kind):
        # As transformers' sdpa and flash attentions do: under autocast RoPE multiplies the low-
        # precision projections by float32 cos/sin, so q and k (and v) arrive in float32, where
        # GPU FlashAttention kernels refuse and a backend would fall back to the O(S²) reference.
        dtype = torch.get_autocast_dtype(kind)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if torch.compiler.is_compiling():  # found when the compiled code runs: see document_lengths_op
        doc_lens = torch.ops.distca.hf_document_lengths(position_ids, cu_seq_lens_q, cu_seq_lens_k,
                                                        attention_mask, batch, seq, module.training)
    else:
        doc_lens = _layer_document_lengths(batch, seq, position_ids, cu_seq_lens_q, cu_seq_lens_k,
                                           attention_mask, module.training)
    # [B, H, S, D] -> [B·S, H, D]: a view when the projections' [B, S, H, D] memory is intact,
    # which is what transformers' attention modules produce (view + transpose + RoPE).
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3])
               for t in (query, key, value))
    out = attend(q, k, v, doc_lens, softmax_scale=scaling, window=sliding_window)
    return out.view(batch, seq, heads_q, head_dim), None


def document_lengths(batch: int, seq: int, position_ids: torch.Tensor | None,
                     cu_seq_lens_q: torch.Tensor | None, cu_seq_lens_k: torch.Tensor | None,
                     attention_mask: torch.Tensor | None, *, training: bool) -> list[int]:
    """Document lengths, in packing order, of a [batch, seq] token grid flattened row by row.

    A document ends at a row's end, where ``position_ids`` do not step by +1, and where the
    padding mask switches between real and padded tokens (padding runs become documents of their
    own, whose outputs nobody reads). ``cu_seq_lens_q/k``, when given, are the lengths directly.

    Raises:
        ValueError: unequal or malformed ``cu_seq_lens``, ``position_ids`` of the wrong shape, an
            ``attention_mask`` that is not 2-D or whose row has padding between real tokens
            (transformers lets the tokens after such a hole attend to those before it; naming
            the row and the positions), or ``training`` with a single row and no document
            information at all (it would attend across the documents packed into it).
    """
    total = batch * seq
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if cu_seq_lens_q is None or cu_seq_lens_k is None or not torch.equal(
                torch.as_tensor(cu_seq_lens_q).cpu(), torch.as_tensor(cu_seq_lens_k).cpu()):
            raise ValueError(f"distca attention: cu_seq_lens_q={cu_seq_lens_q} and cu_seq_lens_k="
                             f"{cu_seq_lens_k} must both be given and equal (self-attention)")
        cu = torch.as_tensor(cu_seq_lens_q).cpu().tolist()
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"distca attention: cu_seq_lens_q={cu} must rise strictly from 0 to "
                             f"the {total} tokens of the batch")
        return [b - a for a, b in zip(cu, cu[1:])]

    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[:, 0] = True
    restarts = False
    if position_ids is not None:
        pos = position_ids.detach().cpu()
        if pos.dim() != 2 or pos.shape[1] != seq or pos.shape[0] not in (1, batch):
            raise ValueError(f"distca attention: position_ids of shape {tuple(pos.shape)} do not "
                             f"match a batch of {batch} rows of {seq} tokens")
        steps = pos.expand(batch, seq).diff(dim=1) != 1
        starts[:, 1:] |= steps
        restarts = bool(steps.any())
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"distca attention: a {attention_mask.dim()}-D attention_mask of shape "
                         f"{tuple(attention_mask.shape)} (distca takes a 2-D padding mask; documents "
                         f"come from position_ids or cu_seq_lens_q/k)")
    padded = attention_mask is not None and not bool(attention_mask.all())
    if padded:
        mask = attention_mask[:, -seq:].detach().cpu().bool()
        _check_padding_at_ends(mask)
        starts[:, 1:] |= mask[:, 1:] != mask[:, :-1]
    if training and batch == 1 and seq > 1 and not restarts and not padded:
        raise ValueError(
            f"distca attention: a training forward of one packed row of {seq} tokens carries no "
            f"document boundaries; pass position_ids restarting at each document "
            f"(DataCollatorWithFlattening) or cu_seq_lens_q/cu_seq_lens_k (for a row that is one "
            f"document: [0, {seq}])")
    idx = torch.nonzero(starts.reshape(-1)).reshape(-1).tolist() + [total]
    return [b - a for a, b in zip(idx, idx[1:])]


_LAST_LENGTHS = LastLengths()


def _layer_document_lengths(batch, seq, position_ids, cu_seq_lens_q, cu_seq_lens_k, attention_mask,
                            training) -> list[int]:
    """:func:`document_lengths`, read on the host once per forward (:mod:`.per_forward`): every
    layer gets the same tensors. Same errors as :func:`document_lengths`."""
    tensors = (position_ids, cu_seq_lens_q, cu_seq_lens_k, attention_mask)
    return _LAST_LENGTHS.get(tensors, (batch, seq, bool(training)),
                             lambda: document_lengths(batch, seq, *tensors, training=training))


@torch.library.custom_op("distca::hf_document_lengths", mutates_args=())
def document_lengths_op(position_ids: Optional[torch.Tensor], cu_seq_lens_q: Optional[torch.Tensor],
                        cu_seq_lens_k: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                        batch: int, seq: int, training: bool) -> torch.Tensor:
    """:func:`document_lengths` as an operator for torch.compile: the lengths depend on the
    tensors' values, so they are found when the compiled code runs (with the same checks and
    errors), and the compiled graph sees a 1-D int64 CPU tensor whose length is a runtime value
    (no recompile when the documents change).

    Raises:
        ValueError: as :func:`document_lengths`.
    """
    lens = document_lengths(batch, seq, position_ids, cu_seq_lens_q, cu_seq_lens_k, attention_mask,
                            training=training)
    return torch.tensor(lens, dtype=torch.int64)


@document_lengths_op.register_fake
def _document_lengths_fake(position_ids, cu_seq_lens_q, cu_seq_lens_k, attention_mask, batch, seq, training):
    return torch.empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.int64, device="cpu")


def _check_padding_at_ends(mask: torch.Tensor) -> None:
    """Refuse a [B, S] padding mask (True: real) with padding between a row's real tokens: a
    padding run becomes a document, and the real tokens after it would lose the ones before it,
    which transformers' attention still lets them see."""
    pos = torch.arange(mask.shape[1])
    first = torch.where(mask, pos, mask.shape[1]).amin(1, keepdim=True)
    last = torch.where(mask, pos, -1).amax(1, keepdim=True)
    holes = ~mask & (pos >= first) & (pos <= last)
    if bool(holes.any()):
        row = int(holes.any(1).nonzero()[0])
        raise ValueError(f"distca attention: attention_mask row {row} pads positions "
                         f"{holes[row].nonzero().reshape(-1).tolist()[:16]} between real tokens "
                         f"(padding must lie at the ends of a row, its real tokens one run)")
