"""Ray Train: ``DistCAClient.connect()`` inside ``TorchTrainer`` workers takes rank and world size
from the Train context; the first step's losses equal sdpa run document by document."""

import pytest

pytest.importorskip("ray.train.torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from scripts import load_script  # noqa: E402


def test_torch_trainer_workers_train_through_distca(local_ray, tmp_path, mode="inplace"):
    """In-place mode: the Train workers are the attention servers too (one TorchTrainer run is
    ~45 s here, so dedicated mode, the example's default, is run by hand: `python examples/ray_train_hf.py`)."""
    example = load_script("examples/ray_train_hf.py", "ray_train_hf")
    args = example.parse_args(["--steps", "3", "--context", "192", "--mode", mode,
                               "--job", f"ray-train-{mode}", "--storage", str(tmp_path)])
    metrics = example.run(args)

    assert metrics["world_size"] == 2
    history = metrics["history"]
    assert [h["step"] for h in history] == [0, 1, 2]
    assert all(h["plans_match_ranks"] for h in history)  # Train rank r is distca client rank r
    mean = [sum(h["rank_losses"]) / 2 for h in history]
    assert mean[-1] < mean[0]
    assert (tmp_path / "ray-train-" f"{mode}").exists()
    assert (metrics["checkpoint"] and torch.load(f"{metrics['checkpoint']}/model.pt")["lm_head.weight"].shape
            == (256, args["hidden"]))

    model = example.build_model(args, "sdpa")  # the same initial weights as every replica
    stream = example.packed_stream(args)
    for rank in range(2):
        batch, doc_lens = example.rank_batch(stream, 0, rank, 2)
        with torch.no_grad():
            logits = torch.cat([model(input_ids=doc[None]).logits[0]
                                for doc in batch["input_ids"][0].split(doc_lens)])
        labels = batch["labels"][0]
        want = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100).item()
        assert abs(history[0]["rank_losses"][rank] - want) <= 1e-5 * want
