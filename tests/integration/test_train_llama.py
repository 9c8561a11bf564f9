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
    # where each session began, for the summary to leave out each one's warm-up step
    assert straight["session_starts"] == first["session_starts"] == [0] and resumed["session_starts"] == [0, 2]
    assert json.loads((tmp_path / "resumed" / "metrics.json").read_text())["session_starts"] == [0, 2]
    assert llama_worker.read_state(resumed["checkpoint"])["session_starts"] == [0, 2]
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


# ---- the command before anything starts: Ray, settings, --resume (no Ray started) -----------------
class _RayStarted(Exception):
    """Raised by a stand-in for _ensure_ray: the command got as far as starting Ray."""


def _no_ray(*_):
    raise _RayStarted


def test_ray_is_joined_where_a_cluster_runs_else_started_locally_with_resources(monkeypatch):
    """`ray job submit` (RAY_ADDRESS) or `ray start` (its record, a raylet here naming it): joined
    without resources, which Ray refuses when joining; else a local instance, "local" explicitly,
    with them. A record a crashed cluster left behind is passed over."""
    from ray._private import services
    calls, running, recorded = [], set(), "10.0.0.7:6379"
    monkeypatch.setattr(train_llama.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(train_llama.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: recorded)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: running)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.8:6379")
    assert train_llama._ensure_ray(1)  # a job's driver
    monkeypatch.delenv("RAY_ADDRESS")
    running.add(recorded)
    assert train_llama._ensure_ray(1)  # on a node of a `ray start` cluster
    running.clear()
    assert train_llama._ensure_ray(1)  # the record of a cluster that is gone
    for joined in calls[:2]:
        assert joined["address"] == "auto", joined
        assert not {"num_cpus", "num_gpus", "object_store_memory", "include_dashboard"} & joined.keys()
        assert joined["namespace"] == "distca" and "PYTHONPATH" in joined["runtime_env"]["env_vars"]
    started = calls[2]
    assert started["address"] == "local" and started["num_gpus"] == 1 and started["num_cpus"] >= 1
    assert started["runtime_env"] == calls[0]["runtime_env"]


def _checkpoints(monkeypatch, runs_dir: Path, **states):
    """Ray Train's ``Result.from_path`` over hand-written checkpoints: ``name=(TrainConfig, step)``
    writes ``<runs_dir>/<name>/train/checkpoint_0/state.json``; a run without one is Ray's
    RuntimeError."""
    from types import SimpleNamespace
    from dataclasses import asdict
    from ray.train import Result
    for name, (cfg, step) in states.items():
        folder = runs_dir / name / train_llama.TRAIN_DIR / "checkpoint_0"
        folder.mkdir(parents=True)
        (folder / llama_worker.STATE_FILE).write_text(json.dumps({"step": step, "config": asdict(cfg), "steps": []}))

    def from_path(path):
        found = sorted(Path(path).glob("checkpoint_*"))
        if not found:
            raise RuntimeError(f"no run at {path}")
        return SimpleNamespace(checkpoint=SimpleNamespace(path=str(found[-1])))
    monkeypatch.setattr(Result, "from_path", staticmethod(from_path))


def test_a_relative_data_path_reaches_the_workers_resolved(tmp_path, monkeypatch):
    """Every Train worker reads --data again from its own working directory: the command hands
    them the path resolved, and --resume compares resolved paths (a checkpoint of an older version
    holds the relative one)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("x" * 200)
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg, _ = train_llama.parse_args(["--data", "docs", "--attention", "local", "--runs-dir", "runs"])
    assert cfg.data == str((tmp_path / "docs").resolve())
    _checkpoints(monkeypatch, tmp_path / "runs", demo=(replace(cfg, data="docs"), 2))
    assert train_llama.latest_checkpoint(replace(cfg, resume=True))  # the same data, resolved
    assert train_llama.latest_checkpoint(replace(cfg, resume=True, data="./docs/"))
    with pytest.raises(ValueError, match=f"data: saved '{tmp_path / 'docs'}', now '{tmp_path / 'other'}'"):
        train_llama.latest_checkpoint(replace(cfg, resume=True, data="other"))


def test_resume_checks_every_run_of_the_command_before_ray_starts(tmp_path, monkeypatch):
    """With --compare-local (the default) --resume continues two runs: a missing checkpoint of the
    second is refused before Ray starts, not after the first run has trained to the end."""
    argv = ["--runs-dir", str(tmp_path), "--name", "r", "--steps", "3", "--resume"]
    cfg, compare = train_llama.parse_args(argv)
    assert compare
    _checkpoints(monkeypatch, tmp_path, r=(cfg, 2))
    monkeypatch.setattr(train_llama, "_ensure_ray", _no_ray)
    with pytest.raises(ValueError, match=f"--resume: no Ray Train checkpoint under {tmp_path / 'r-local'}"):
        train_llama.main(argv, progress=False)
    _checkpoints(monkeypatch, tmp_path, **{"r-local": (replace(cfg, name="r-local", attention="local"), 2)})
    with pytest.raises(_RayStarted):  # both can continue: the command goes on to start Ray
        train_llama.main(argv, progress=False)


@pytest.mark.parametrize("argv, words", [
    (["--grad-clip", "0"], "grad_clip must be a finite number > 0, got 0.0"),
    (["--grad-clip", "-1"], "grad_clip must be a finite number > 0, got -1.0"),
    (["--grad-clip", "inf"], "grad_clip must be a finite number > 0, got inf"),
    (["--lr", "-0.001"], "lr must be a finite number > 0, got -0.001"),
    (["--lr", "nan"], "lr must be a finite number > 0, got nan"),
    (["--weight-decay", "-0.1"], "weight_decay must be a finite number >= 0, got -0.1"),
    (["--seed", "-1"], "seed must be an int >= 0, got -1"),
    (["--warmup", "-1"], "warmup must be an int >= 0, got -1"),
])
def test_optimizer_and_seed_settings_are_named_before_ray_starts(argv, words):
    with pytest.raises(ValueError) as info:
        train_llama.parse_args(argv)
    assert str(info.value) == f"train config: {words}"


def test_the_optimizer_and_seed_edges_are_accepted_and_every_bad_one_named_at_once():
    llama_worker.TrainConfig(weight_decay=0.0, warmup=0, seed=0, lr=1e-9, grad_clip=1e-9).validate()
    with pytest.raises(ValueError) as info:
        llama_worker.TrainConfig(lr=0.0, grad_clip=0.0, weight_decay=-1.0, seed=-2, warmup=-3).validate()
    for name in ("lr", "grad_clip", "weight_decay", "seed", "warmup"):
        assert str(info.value).count(f"{name} must be") == 1, (name, str(info.value))


def test_servers_are_refused_in_place_as_distca_up_refuses_them():
    with pytest.raises(ValueError) as info:
        train_llama.parse_args(["--servers", "3"])
    assert str(info.value) == ("--servers 3 is for dedicated mode: in in-place mode every client rank serves its "
                               "share of attention (the job has as many servers as clients); drop --servers, or "
                               "use --mode dedicated")
    assert train_llama.parse_args(["--mode", "dedicated", "--servers", "3"])[0].servers == 3
    cfg, _ = train_llama.parse_args(["--mode", "dedicated"])
    assert cfg.servers == llama_worker.TrainConfig().servers and cfg.num_servers == cfg.servers
    cfg, _ = train_llama.parse_args(["--workers", "3"])
    assert cfg.num_servers == 3  # in place: one per worker


def test_bad_settings_are_one_line_errors_before_ray_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_llama, "_ensure_ray", _no_ray)
    for argv, words in ((["--workers", "0"], "train config: workers=0 (must be >= 1)"),
                        (["--data", str(tmp_path / "missing")],
                         f"train config: data='{tmp_path / 'missing'}': no such file or folder"),
                        (["--data", __file__], f"train config: data='{__file__}': not a folder or a .jsonl file"),
                        (["--resume", "--runs-dir", str(tmp_path), "--name", "never"],
                         f"--resume: no Ray Train checkpoint under {tmp_path / 'never' / 'train'}"),
                        (["--servers", "2"], "--servers 2 is for dedicated mode")):
        assert train_llama.cli(argv) == 1, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.splitlines()[-1].startswith(f"train_llama.py: error: {words}"), (argv, err)


def test_the_command_exits_1_with_one_line():
    import subprocess
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_llama.py"), "--workers", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "train_llama.py: error: train config: workers=0 (must be >= 1)"


def test_each_session_warm_up_step_is_left_out_and_the_wall_is_this_sessions():
    """After --resume the history holds two sessions: each one's first step warms up (step 0, the
    step it continued at), and the command's wall covers only the session that ran last."""
    times = [9.0, 1.0, 1.0, 7.0, 1.0]  # a session starts at 0 and at 3
    steps = [{"step": i, "step_time_s": t, "loss": 5.0, "imbalance_before": 1.2, "imbalance_after": 1.0,
              "bytes": 0} for i, t in enumerate(times)]
    run = {"name": "r", "attention": "local", "steps": steps, "session_starts": [0, 3], "tokens_per_step": 100,
           "wall_s": 12.0}
    assert [r["step"] for r in llama_report.warm_steps(run)] == [1, 2, 4]
    assert llama_report.step_time(run) == 1.0
    row = llama_report.summary_table([run]).splitlines()[-1]
    assert row.split()[5:8] == ["1.00", "s", "100"], row  # step time, tokens/s of the warm steps
    assert row.endswith("12 s (this session)")
    old = {k: v for k, v in run.items() if k != "session_starts"}  # a metrics.json of an older version
    assert [r["step"] for r in llama_report.warm_steps(old)] == [1, 2, 3, 4]
    assert llama_report.summary_table([old]).splitlines()[-1].endswith("12 s")
    one = dict(run, steps=steps[:1], session_starts=[0])
    assert llama_report.warm_steps(one) == steps[:1] and llama_report.step_time(one) == 9.0


def test_the_demo_doc_names_functions_that_exist():
    import re
    import llama_data
    import llama_device
    text = (ROOT / "docs" / "demo.md").read_text()
    modules = {"llama_data": llama_data, "llama_device": llama_device, "llama_report": llama_report,
               "llama_worker": llama_worker, "train_llama": train_llama}
    named = re.findall(r"`(llama_\w+|train_llama)\.(\w+)", text)
    for module, name in named:
        assert hasattr(modules[module], name), f"docs/demo.md names {module}.{name}"
    for name, path in re.findall(r"`(\w+)` in `([\w/]+\.py)`", text):
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"docs/demo.md: {name} in {path}"
