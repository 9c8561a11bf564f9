"""Ray Train: the training demo's ``TorchTrainer`` workers call ``DistCAClient.connect()``, which
takes rank and world size from the Train context; the first step's losses equal sdpa run
document by document."""

from dataclasses import replace

import pytest

pytest.importorskip("ray.train.torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from scripts import load_script  # noqa: E402


def test_torch_trainer_workers_train_through_distca(local_ray, tmp_path):
    """In-place mode: the Train workers are the attention servers too (dedicated mode is
    test_train_llama's)."""
    train_llama = load_script("examples/train_llama.py", "train_llama")
    from llama_data import PackedStream, collate, load_corpus
    from llama_worker import TrainConfig, build_model

    cfg = TrainConfig(name="ray-train-inplace", steps=3, mode="inplace", workers=2, context=192,
                      layers=2, hidden=64, min_shard=32, runs_dir=str(tmp_path))
    metrics = train_llama.train(cfg, progress=False)

    assert metrics["workers"] == 2 and metrics["servers"] == 2
    history = metrics["steps"]
    assert [h["step"] for h in history] == [0, 1, 2]
    assert all(h["plans_match_ranks"] for h in history)  # Train rank r is distca client rank r
    assert history[-1]["loss"] < history[0]["loss"]
    assert metrics["model_state"]["lm_head.weight"].shape == (256, cfg.hidden)

    model = build_model(replace(cfg), "sdpa")  # the same initial weights as every replica
    stream = PackedStream(load_corpus(cfg.data), cfg.context, cfg.seed)
    for rank, (tokens, doc_lens) in enumerate(stream.batch(0, 2)):
        batch = collate(tokens, doc_lens)
        with torch.no_grad():
            logits = torch.cat([model(input_ids=doc[None]).logits[0]
                                for doc in batch["input_ids"][0].split(doc_lens)])
        labels = batch["labels"][0]
        want = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100).item()
        assert abs(history[0]["rank_losses"][rank] - want) <= 1e-5 * want
