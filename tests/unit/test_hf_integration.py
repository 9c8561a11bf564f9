"""``attn_implementation="distca"`` on real transformers models equals ``"sdpa"`` run document by
document: logits and every parameter gradient, over 1–4 servers and both modes; padded batches
equal sdpa and eager on their real tokens, and masks it cannot serve are refused."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DataCollatorWithFlattening  # noqa: E402

from distca_client import DistCAClient  # noqa: E402
from distca_client.integrations import hf  # noqa: E402
from scheduler.config import PlanConfig  # noqa: E402

VOCAB = 61
# Odd lengths and 1-token documents; min_shard below splits the long ones across servers.
DOC_LENS = [7, 1, 13, 1, 5, 2, 11]
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _config(family):
    if family == "llama":
        return transformers.LlamaConfig(**TINY)
    if family == "qwen2":
        return transformers.Qwen2Config(**TINY)
    if family == "qwen3":  # per-head q/k RMSNorm and an explicit head_dim
        return transformers.Qwen3Config(**TINY, head_dim=16)
    if family == "mistral":  # the window is longer than every document
        return transformers.MistralConfig(**TINY, sliding_window=64)
    if family == "mistral_w4":  # a window shorter than most documents
        return transformers.MistralConfig(**TINY, sliding_window=4)
    if family == "qwen2_mixed":  # layer 0 full attention, layer 1 a window of 3
        return transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    raise AssertionError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "mistral_w4", "qwen2_mixed"]


def _model(family, attn, state=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(_config(family)), attn_implementation=attn,
                                             dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model.train()


def _packed_batch(with_cu=False):
    gen = torch.Generator().manual_seed(1)
    docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in DOC_LENS]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=with_cu)(docs)
    batch.pop("labels")
    for key in ("max_length_q", "max_length_k"):
        batch.pop(key, None)
    return batch


def _loss_weights():
    return torch.randn(sum(DOC_LENS), VOCAB, generator=torch.Generator().manual_seed(2))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


_REFERENCE = {}


def _reference(family):
    """sdpa, one document per forward: logits [T, V] and each parameter's summed gradient."""
    if family not in _REFERENCE:
        model = _model(family, "sdpa")
        ids, weights = _packed_batch()["input_ids"][0], _loss_weights()
        logits = []
        for doc, w in zip(ids.split(DOC_LENS), weights.split(DOC_LENS)):
            out = model(input_ids=doc[None]).logits[0]
            (out * w).sum().backward()
            logits.append(out.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        _REFERENCE[family] = (model.state_dict(), torch.cat(logits), grads)
    return _REFERENCE[family]


def _check_against_reference(family, client, batch):
    state, ref_logits, ref_grads = _reference(family)
    hf.register(client)
    model = _model(family, "distca", state)
    assert model.config._attn_implementation == "distca"
    logits = model(**batch).logits[0]
    (logits * _loss_weights()).sum().backward()
    assert _rel(logits.detach(), ref_logits) <= 1e-5
    for name, p in model.named_parameters():
        assert _rel(p.grad, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
@pytest.mark.parametrize("num_servers", [1, 2, 3, 4])
def test_packed_batch_equals_sdpa_per_document(family, mode, num_servers):
    client = DistCAClient.local(num_servers, config=PlanConfig(mode=mode, min_shard=4))
    _check_against_reference(family, client, _packed_batch())
    if num_servers > 1:  # the documents really were spread over the servers
        assert sum(1 for tasks in client.last_plan.server_tasks if tasks) > 1


def test_cu_seq_lens_kwargs_give_the_documents():
    """cu_seq_lens_q/k win over position_ids, here deliberately wrong (one document)."""
    batch = _packed_batch(with_cu=True)
    batch["position_ids"] = torch.arange(sum(DOC_LENS))[None]
    _check_against_reference("llama", DistCAClient.local(2, config=PlanConfig(min_shard=4)), batch)


def test_rows_without_position_ids_are_one_document_each():
    hf.register(DistCAClient.local(2))
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    state = _reference("llama")[0]
    ref = _model("llama", "sdpa", state).eval()(input_ids=ids).logits
    got = _model("llama", "distca", state).eval()(input_ids=ids).logits
    assert _rel(got, ref) <= 1e-5


def test_right_padding_mask_keeps_real_tokens_exact():
    hf.register(DistCAClient.local(2))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    state = _reference("llama")[0]
    got = _model("llama", "distca", state)(input_ids=ids, attention_mask=mask).logits
    ref = _model("llama", "sdpa", state)
    assert _rel(got[0], ref(input_ids=ids[:1]).logits[0]) <= 1e-5
    assert _rel(got[1, :5], ref(input_ids=ids[1:, :5]).logits[0]) <= 1e-5


def test_training_row_without_documents_is_refused():
    hf.register(DistCAClient.local(1))
    model = _model("llama", "distca")
    with pytest.raises(ValueError, match="no document boundaries"):
        model(input_ids=torch.zeros(1, 6, dtype=torch.long))


def test_unsupported_inputs_are_refused():
    hf.register(DistCAClient.local(1))
    batch = _packed_batch(with_cu=True)
    batch["cu_seq_lens_k"] = batch["cu_seq_lens_k"].flip(0)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        _model("llama", "distca")(**batch)
    cfg = _config("mistral")
    cfg.sliding_window = 0
    hf.register(DistCAClient.local(1))
    zero = AutoModelForCausalLM.from_config(cfg, attn_implementation="distca")
    with pytest.raises(ValueError, match="window must be a positive int"):
        zero(**_packed_batch())
    with pytest.raises(ValueError, match="KV cache"):  # generation decodes against a cache
        _model("llama", "distca").eval().generate(torch.zeros(1, 3, dtype=torch.long),
                                                  max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="not a DistCAClient"):
        hf.register("local")


def test_register_local_runs_varlen_attention_with_the_same_documents():
    state, ref_logits, ref_grads = _reference("qwen3")
    hf.register_local("distca_local_test")
    model = _model("qwen3", "distca_local_test", state)
    logits = model(**_packed_batch()).logits[0]
    (logits * _loss_weights()).sum().backward()
    assert _rel(logits.detach(), ref_logits) <= 1e-5
    for name, p in model.named_parameters():
        assert _rel(p.grad, ref_grads[name]) <= 1e-5, name
    with pytest.raises(ValueError, match="backend"):
        hf.register_local(backend="no-such-kernel")


def test_windowed_and_full_layers_get_one_plan_each():
    """Qwen2 with a window on layer 1 only: a step binds two batches of the same documents, one
    planned with the window and one without, and the result still equals sdpa."""
    assert _config("qwen2_mixed").layer_types == ["full_attention", "sliding_attention"]
    client = DistCAClient.local(3, config=PlanConfig(min_shard=2))
    _check_against_reference("qwen2_mixed", client, _packed_batch())
    windows = sorted((b.plan.window or 0) for b in client._step_traffic.batches())
    assert windows == [0, 3]
    full, windowed = sorted(client._step_traffic.batches(), key=lambda b: b.plan.window or 0)
    assert windowed.plan.comm_bytes()["forward"]["k"] <= full.plan.comm_bytes()["forward"]["k"]


def _padded_run(attn, ids, mask, weights):
    """Logits and parameter gradients of llama with ``attn`` on a padded batch."""
    model = _model("llama", attn, _reference("llama")[0])
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_left_and_right_padding_equal_transformers_on_real_tokens(reference):
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    real = mask.bool()
    weights = torch.randn(3, 12, VOCAB, generator=torch.Generator().manual_seed(6)) * real[..., None]
    hf.register(DistCAClient.local(2, config=PlanConfig(min_shard=2)))
    got, got_grads = _padded_run("distca", ids, mask, weights)
    want, want_grads = _padded_run(reference, ids, mask, weights)
    assert _rel(got[real], want[real]) <= 1e-5
    for name, grad in want_grads.items():
        assert _rel(got_grads[name], grad) <= 1e-5, name


def test_padding_between_real_tokens_is_refused():
    """transformers lets tokens 6-11 attend across the hole at 5 to tokens 0-4; distca's padding
    documents would cut them off, so it refuses rather than compute something else."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :2] = 0  # left padding is fine
    mask[1, [5, 8, 9]] = 0
    hf.register(DistCAClient.local(1))
    with pytest.raises(ValueError, match=r"row 1 pads positions \[5, 8, 9\] between real tokens"):
        _model("llama", "distca")(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="4-D attention_mask"):
        hf.document_lengths(1, 4, None, None, None, torch.ones(1, 1, 4, 4, dtype=torch.bool), training=False)


def test_attention_runs_in_the_autocast_dtype_under_autocast():
    """RoPE hands float32 q, k, v to attention under bf16 autocast; the adapter casts them back to
    the autocast dtype (as transformers' sdpa and flash attentions do), and gradients flow."""
    seen = []

    def spy(q, k, v, doc_lens, softmax_scale=None, window=None):
        seen.append((q.dtype, k.dtype, v.dtype))
        return q.new_zeros(q.shape) + q.sum() * 0

    class Module(torch.nn.Module):
        is_causal = True
        training = True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = hf.attention_forward(spy, Module(), q, k, v, None, position_ids=pos)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32
    hf.attention_forward(spy, Module(), q, k, v, None, position_ids=pos)
    assert seen[-1] == (torch.float32,) * 3  # no autocast: untouched


@pytest.mark.parametrize("with_cu", [False, True])
def test_document_lengths_are_read_once_per_forward(monkeypatch, with_cu):
    """Every layer gets the same position_ids / cu_seq_lens tensors: their values are read on the
    host once per forward (on a GPU each read waits for the previous layer's exchange), and read
    again when the tensors change, in place or for new ones."""
    seen = []
    real = hf.document_lengths

    def counting(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "document_lengths", counting)
    hf.register(DistCAClient.local(2, config=PlanConfig(min_shard=4)))
    model = _model("llama", "distca", _reference("llama")[0])
    batch = _packed_batch(with_cu=with_cu)
    first = model(**batch).logits
    assert len(seen) == 1 and TINY["num_hidden_layers"] > 1
    model(**batch)
    assert len(seen) == 1  # the same tensors, unchanged
    # In place: the documents' lengths change (two documents swap places), the tensors do not.
    swapped = DOC_LENS[1:2] + DOC_LENS[:1] + DOC_LENS[2:]
    if with_cu:
        batch["cu_seq_lens_q"].copy_(torch.tensor([0] + swapped).cumsum(0).to(batch["cu_seq_lens_q"].dtype))
        batch["cu_seq_lens_k"].copy_(batch["cu_seq_lens_q"])
    else:
        batch["position_ids"].copy_(torch.cat([torch.arange(n) for n in swapped])[None])
    model(**batch)
    assert len(seen) == 2
    assert hf._layer_document_lengths(1, sum(DOC_LENS), batch.get("position_ids"), batch.get("cu_seq_lens_q"),
                                      batch.get("cu_seq_lens_k"), None, True) == swapped
    fresh = _packed_batch(with_cu=with_cu)  # equal values, new tensors
    assert torch.equal(model(**fresh).logits, first)
    assert len(seen) == 3
