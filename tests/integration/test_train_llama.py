"""The training demo: data loading and packing, document-aware batches, and its Ray Train job:
distca == local training step for step, Ray Train checkpoints and resume."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import llama_data  # noqa: E402
from llama_data import Corpus, PackedStream, collate, load_corpus  # noqa: E402


# ---- data ------------------------------------------------------------------------------------------
def test_stdlib_corpus_is_found_and_heavy_tailed():
    corpus = load_corpus()
    assert corpus.source == str(llama_data.stdlib_dir())
    lens = np.array([len(d) for d in corpus.documents])
    assert len(lens) > 300 and lens.min() >= 100
    assert lens.max() > 30 * np.median(lens)  # a few huge files among many small ones
    assert corpus.num_tokens == lens.sum()
    assert load_corpus().documents[17].tobytes() == corpus.documents[17].tobytes()  # fixed order


def test_folder_and_jsonl_sources(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text("x" * 150)
    (tmp_path / "docs" / "sub" / "b.md").write_text("y" * 300)
    (tmp_path / "docs" / "tiny.txt").write_text("too short")
    folder = load_corpus(tmp_path / "docs")
    assert sorted(len(d) for d in folder.documents) == [150, 300]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": "é" * 100}) + "\n\n" + json.dumps({"text": "z" * 120}) + "\n")
    assert [len(d) for d in load_corpus(jsonl).documents] == [200, 120]  # UTF-8 bytes
    jsonl.write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match="text"):
        load_corpus(jsonl)
    with pytest.raises(ValueError):
        load_corpus(tmp_path / "missing")


def _toy_corpus():
    rng = np.random.default_rng(3)
    lens = [5, 1, 23, 9, 2, 40, 7]
    return Corpus("toy", [rng.integers(0, 256, n).astype(np.uint8) for n in lens])


def test_packing_cuts_documents_and_continues_them_in_the_next_chunk():
    corpus, context = _toy_corpus(), 8
    stream = PackedStream(corpus, context, seed=1)
    order = np.random.default_rng([1, 0]).permutation(len(corpus.documents))
    epoch = np.concatenate([corpus.documents[i] for i in order])
    doc_of_token = np.repeat(np.arange(len(order)), [len(corpus.documents[i]) for i in order])
    n_chunks = 3 * len(epoch) // context + 1  # runs into the second and third epochs
    chunks = [stream.chunk(i) for i in range(n_chunks)]
    for tokens, lens in chunks:
        assert len(tokens) == context == sum(lens) and min(lens) >= 1
    # Chunks laid end to end are the shuffled documents laid end to end.
    flat = np.concatenate([t for t, _ in chunks])
    np.testing.assert_array_equal(flat[:len(epoch)], epoch)
    # Every piece boundary is a document boundary or a chunk boundary, nothing else.
    cuts = {c * context + o for c, (_, lens) in enumerate(chunks) for o in np.cumsum([0] + lens[:-1])}
    doc_starts = set(np.flatnonzero(np.diff(doc_of_token)) + 1) | {0}
    chunk_starts = set(range(0, len(epoch), context))
    assert {c for c in cuts if c < len(epoch)} == doc_starts | chunk_starts
    # The 40-token document spans several chunks: it is cut and continues.
    assert any(lens[0] == context for _, lens in chunks[:len(epoch) // context])
    # The next epoch reshuffles, and the stream is a pure function of (corpus, context, seed).
    second = flat[len(epoch):2 * len(epoch)]
    assert sorted(second.tolist()) == sorted(epoch.tolist()) and not np.array_equal(second, epoch)
    again = PackedStream(corpus, context, seed=1)
    for i in (5, 0, n_chunks - 1):
        np.testing.assert_array_equal(again.chunk(i)[0], chunks[i][0])
        assert again.chunk(i)[1] == chunks[i][1]
    for a, b in zip(stream.batch(2, 3), [stream.chunk(i) for i in (6, 7, 8)], strict=True):
        np.testing.assert_array_equal(a[0], b[0])  # rank r of step s gets chunk s * W + r
        assert a[1] == b[1]


def test_collated_chunks_restart_positions_and_no_target_crosses_a_document():
    tokens = np.arange(6, dtype=np.uint8)
    batch = collate(tokens, [3, 1, 2])
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 1, 2, -100, -100, 5]]  # each document's first token
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 4, 6]
    assert collate(tokens, [6])["cu_seq_lens_q"].tolist() == [0, 6]  # one document, said so


# ---- training through Ray Train --------------------------------------------------------------------
ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")
pytest.importorskip("transformers")
train_llama = pytest.importorskip("train_llama")
llama_worker = pytest.importorskip("llama_worker")
llama_report = pytest.importorskip("llama_report")


def test_a_document_looks_the_same_wherever_packing_puts_it():
    """Rotary positions restart per document and attention stays inside it, so a document's
    logits from the Hugging Face Llama do not depend on what was packed before it."""
    from distca_client.integrations import hf
    hf.register_local(llama_worker.ATTENTION["local"])
    cfg = llama_worker.TrainConfig(layers=2, hidden=32, heads=4, kv_heads=2, context=64)
    model = llama_worker.build_model(cfg, llama_worker.ATTENTION["local"]).double()
    doc = np.random.default_rng(0).integers(0, 256, 37).astype(np.uint8)
    other = np.random.default_rng(1).integers(0, 256, 20).astype(np.uint8)

    alone = model(**collate(doc, [37])).logits[0]
    packed = model(**collate(np.concatenate([other, doc]), [20, 37]))
    torch.testing.assert_close(packed.logits[0, 20:], alone, rtol=0, atol=1e-12)
    assert torch.isfinite(packed.loss)


def test_model_config_errors_name_every_problem():
    with pytest.raises(ValueError, match="hidden=30.*heads=4"):
        llama_worker.TrainConfig(hidden=30, heads=4).validate()
    with pytest.raises(ValueError, match="kv_heads=3"):
        llama_worker.TrainConfig(hidden=64, heads=4, kv_heads=3).validate()


def test_job_settings_are_named_before_ray_starts():
    """The distca job's settings are checked as launch checks them, by validate(), which runs
    before Ray starts and before the run folder is emptied."""
    with pytest.raises(ValueError) as info:
        llama_worker.TrainConfig(epsilon=-1, min_shard=0).validate()
    assert str(info.value) == ("train config: epsilon must be a finite number >= 0, got -1; "
                               "min_shard must be a positive int, got 0")
    with pytest.raises(ValueError) as info:  # every one at once, each once: plan and job fields together
        llama_worker.TrainConfig(mode="x", servers=0, transport="tcp", epsilon=float("inf")).validate()
    text = str(info.value)
    for words in ("transport='tcp'", "epsilon must be a finite number >= 0, got inf", "mode must be one of",
                  "servers must be a positive int, got 0"):
        assert text.count(words) == 1, (words, text)
    assert text.count("transport") == 1 and text.count("mode") == 1
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got -1.0"):
        train_llama.parse_args(["--epsilon", "-1"])


def test_loss_agreement_is_relative_over_the_first_steps():
    a = [{"step": i, "loss": 5.0 - i * 0.1} for i in range(12)]
    b = [dict(r, loss=r["loss"] * (1 + 2e-6)) for r in a]
    got = llama_report.loss_agreement(a, b)
    assert got["first"] == 10 and got["agree"] and got["max_rel_first"] == pytest.approx(2e-6, rel=1e-3)
    b[3]["loss"] += 1e-3
    assert not llama_report.loss_agreement(a, b)["agree"]
    b[3]["loss"] -= 1e-3
    b[11]["loss"] += 1e-3  # after the first 10 steps: reported, not judged
    got = llama_report.loss_agreement(a, b)
    assert got["agree"] and got["max_abs_all"] == pytest.approx(1e-3, rel=1e-2)
    with pytest.raises(ValueError, match="no common step"):
        llama_report.loss_agreement(a, [])


def _tiny(tmp_path, **kw):
    return replace(llama_worker.TrainConfig(layers=2, hidden=64, heads=4, kv_heads=2, context=512,
                                            workers=2, min_shard=32, runs_dir=str(tmp_path)), **kw)


def test_distca_training_equals_local_training(local_ray, tmp_path):
    """Same seed, same data: 3 AdamW steps of two Ray Train workers with attention on 2 dedicated
    servers and with local attention give the same losses and the same parameters (float32)."""
    base = _tiny(tmp_path, steps=3, mode="dedicated", servers=2)
    distca = train_llama.train(replace(base, name="d", attention="distca"), progress=False)
    local = train_llama.train(replace(base, name="l", attention="local"), progress=False)

    for a, b in zip(distca["steps"], local["steps"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a["loss"], b["loss"])
    assert llama_report.loss_agreement(distca["steps"], local["steps"])["agree"]
    assert distca["steps"][0]["loss"] == pytest.approx(np.log(256), abs=0.1)  # starts uniform
    assert all(s["plans_match_ranks"] for s in distca["steps"])  # Train rank r is distca client rank r
    assert distca["model_state"].keys() == local["model_state"].keys()
    for name, p in distca["model_state"].items():
        torch.testing.assert_close(p, local["model_state"][name], rtol=0, atol=1e-5, msg=name)
    init = llama_worker.build_model(base, "sdpa").state_dict()
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(distca["model_state"][q_proj], init[q_proj])

    # metrics: the keys, the scheduler's plan figures, files written
    run = tmp_path / "d"
    saved = json.loads((run / "metrics.json").read_text())
    assert saved["attention"] == "distca" and json.loads((tmp_path / "l" / "metrics.json").read_text())[
        "attention"] == "local"
    assert set(saved["data"]) == {"source", "documents", "tokens"}
    assert saved["data"]["source"] == str(llama_data.stdlib_dir())
    for step in saved["steps"]:
        assert {"loss", "step_time_s", "imbalance_before", "imbalance_after", "bytes"} <= step.keys()
        assert step["bytes"] > 0  # dedicated servers: every row moves
        assert step["imbalance_after"] <= step["imbalance_before"] + 1e-9
        assert len(step["server_flops"]) == 2 and len(step["rank_losses"]) == 2
        assert sum(step["server_flops"]) == pytest.approx(sum(step["rank_flops"]))
    for name in ("loss.png", "balance.png"):
        assert (run / name).stat().st_size > 0
    # the final checkpoint is Ray Train's, in the run's Train storage
    assert Path(distca["checkpoint"]).parent == (run / train_llama.TRAIN_DIR).resolve()
    assert llama_worker.read_state(distca["checkpoint"])["step"] == 3
    assert not (tmp_path / "l" / "balance.png").exists()  # nothing is balanced with local attention


def test_resume_continues_at_the_saved_step_with_identical_parameters(local_ray, tmp_path):
    base = _tiny(tmp_path, attention="local", context=256)
    # save_every=1: a Ray Train checkpoint after every step; the run keeps only its latest
    straight = train_llama.train(replace(base, name="straight", steps=3, save_every=1), progress=False)
    kept = [p for p in (tmp_path / "straight" / train_llama.TRAIN_DIR).glob("checkpoint_*") if p.is_dir()]
    assert [k.resolve() for k in kept] == [Path(straight["checkpoint"]).resolve()]
    assert llama_worker.read_state(kept[0])["step"] == 3
    first = train_llama.train(replace(base, name="resumed", steps=2), progress=False)
    ckpt = torch.load(Path(first["checkpoint"]) / llama_worker.MODEL_FILE, weights_only=True)
    assert llama_worker.read_state(first["checkpoint"])["step"] == 2 and ckpt["optimizer"]["state"]
    resumed = train_llama.train(replace(base, name="resumed", steps=3, resume=True), progress=False)

    assert [s["step"] for s in resumed["steps"]] == [0, 1, 2]
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in straight["steps"]]
    for name, p in straight["model_state"].items():
        assert torch.equal(p, resumed["model_state"][name]), name
    with pytest.raises(ValueError, match="hidden"):
        train_llama.train(replace(base, name="resumed", steps=4, hidden=32, resume=True), progress=False)
    with pytest.raises(ValueError, match="nothing to do"):
        train_llama.train(replace(base, name="resumed", steps=3, resume=True), progress=False)
    with pytest.raises(ValueError, match="no Ray Train checkpoint"):
        train_llama.train(replace(base, name="never-ran", steps=3, resume=True), progress=False)


def test_command_line_defaults_are_the_demo():
    cfg, compare = train_llama.parse_args([])
    assert cfg.attention == "distca" and compare and cfg.name == "demo"
    cfg, compare = train_llama.parse_args(["--attention", "local", "--steps", "5", "--kv-heads", "1"])
    assert cfg.attention == "local" and not compare and cfg.steps == 5 and cfg.kv_heads == 1
