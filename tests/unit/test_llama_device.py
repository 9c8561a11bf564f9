"""The training demo's device settings (examples/llama_device.py) and its distca-vs-local check per
dtype: validation, GPU shares, Ray resources, the bf16 tolerance and the session summary. No Ray,
no GPU: what the GPU path (`make demo-gpu`) decides before anything starts."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import llama_device  # noqa: E402
import llama_report  # noqa: E402
from llama_worker import TrainConfig  # noqa: E402

GPU = TrainConfig(device="cuda", dtype="bfloat16", transport="nvshmem", workers=2)


@pytest.mark.parametrize("fields, named", [
    ({"device": "gpu"}, "device='gpu'"),
    ({"dtype": "float16"}, "dtype='float16'"),
    ({"transport": "nccl"}, "transport='nccl'"),
    ({"device": "cuda", "transport": "shm"}, "transport='shm' cannot move cuda"),
    ({"transport": "nvshmem"}, "transport='nvshmem' cannot move cpu"),
    ({"gpus_per_worker": 0.5}, "gpus_per_worker=0.5 needs device='cuda'"),
    ({"device": "cuda", "gpus_per_worker": 0.0}, "gpus_per_worker=0.0"),
    ({"device": "cuda", "gpus_per_worker": 1.5}, "gpus_per_worker=1.5"),
    ({"device": "cuda", "gpus_per_worker": float("nan")}, "gpus_per_worker=nan"),
    ({"device": "cuda", "gpus_per_worker": 0.12345}, "4 decimals"),
])
def test_bad_device_settings_are_named(fields, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        replace(TrainConfig(), **fields).validate()


def test_the_cpu_demo_and_the_gpu_path_are_valid_and_the_cpu_demo_is_unchanged():
    TrainConfig().validate()
    GPU.validate()
    replace(TrainConfig(), transport="shm").validate()  # the CPU twin of the GPU path
    cpu = TrainConfig()
    assert (cpu.device, cpu.dtype, cpu.transport, cpu.gpus_per_worker) == ("cpu", "float32", "torch_dist", None)
    assert cpu.job_config().transport == "torch_dist"  # the job the CPU demo always launched
    assert GPU.job_config().transport == "nvshmem" and GPU.job_config().plan.mode == "inplace"
    assert llama_device.gpu_share(cpu) is None and llama_device.torch_config(cpu) is None
    assert llama_device.worker_resources(cpu, 2.0) == (False, {"CPU": 0.5})
    assert llama_device.server_options(cpu) == {"num_cpus": 0}


def test_workers_share_one_gpu_by_default():
    for workers, share in ((2, 0.5), (3, 0.3333), (4, 0.25)):
        cfg = replace(GPU, workers=workers)
        assert llama_device.gpu_share(cfg) == share and share * workers <= 1
        assert llama_device.worker_resources(cfg, 16.0) == (True, {"CPU": 1.0, "GPU": share})
        llama_device.check_gpus(cfg, 1.0)
    # dedicated distca servers hold a share too; local attention runs have none
    dedicated = replace(GPU, mode="dedicated", servers=2)
    assert llama_device.gpu_holders(dedicated) == 4 and llama_device.gpu_share(dedicated) == 0.25
    assert llama_device.server_options(dedicated) == {"num_cpus": 0, "num_gpus": 0.25}
    assert llama_device.gpu_holders(replace(dedicated, attention="local")) == 2
    assert llama_device.gpu_share(replace(GPU, gpus_per_worker=0.2)) == 0.2


def test_a_gpu_run_the_cluster_cannot_place_is_refused():
    with pytest.raises(ValueError, match="no GPU"):
        llama_device.check_gpus(GPU, 0.0)
    with pytest.raises(ValueError, match=r"gpus_per_worker=0.5 x 3 GPU holders = 1.5 GPUs.*has 1"):
        llama_device.check_gpus(replace(GPU, workers=3, gpus_per_worker=0.5), 1.0)
    llama_device.check_gpus(TrainConfig(), 0.0)  # the CPU needs none


def test_precision_and_placement_helpers_on_the_cpu():
    cpu = torch.device("cpu")
    batch = {"input_ids": torch.arange(4), "max_length_q": 4}
    assert llama_device.to_device(batch, cpu) is batch
    with llama_device.autocast(TrainConfig(), cpu):
        assert not torch.is_autocast_enabled("cpu")
    w = torch.randn(8, 8)
    with llama_device.autocast(replace(TrainConfig(), dtype="bfloat16"), cpu):
        assert (w @ w).dtype == torch.bfloat16  # matrix products in bf16, weights stay float32
    assert w.dtype == torch.float32
    llama_device.synchronize(cpu)
    assert llama_device.transport_used(None) is None


def test_agreement_tolerance_follows_the_dtype():
    assert llama_report.agree_rtol("float32") == llama_report.AGREE_RTOL == 1e-5
    assert llama_report.agree_rtol("bfloat16") == 2.0 ** -8 == torch.finfo(torch.bfloat16).eps / 2
    with pytest.raises(ValueError, match="dtype='float16'"):
        llama_report.agree_rtol("float16")
    a = [{"step": i, "loss": 5.0 - 0.1 * i} for i in range(12)]
    b = [dict(r, loss=r["loss"] * (1 + 3e-3)) for r in a]  # within one bf16 rounding, far beyond float32's
    assert not llama_report.loss_agreement(a, b)["agree"]
    got = llama_report.loss_agreement(a, b, llama_report.agree_rtol("bfloat16"))
    assert got["agree"] and got["rtol"] == 2.0 ** -8
    b[4]["loss"] = a[4]["loss"] * (1 + 5e-3)  # more than one bf16 rounding apart
    assert not llama_report.loss_agreement(a, b, llama_report.agree_rtol("bfloat16"))["agree"]
    for bad in (0, -1e-3, float("inf"), "1e-3", True):
        with pytest.raises(ValueError, match="rtol="):
            llama_report.loss_agreement(a, b, bad)


def _run(attention, losses, times, context=8192, workers=2):
    cfg = replace(GPU, attention=attention, context=context, workers=workers)
    from dataclasses import asdict
    return {"attention": attention, "workers": workers, "config": asdict(cfg),
            "tokens_per_step": workers * context, "wall_s": 30.0,
            "model": {"parameters": 1234}, "data": {"source": "stdlib", "documents": 3, "tokens": 99},
            "steps": [{"step": i, "loss": l, "step_time_s": t} for i, (l, t) in enumerate(zip(losses, times))]}


def test_train_summary_has_the_issue_keys():
    losses = [5.5 - 0.1 * i for i in range(12)]
    distca = _run("distca", [x * (1 + 1e-3) for x in losses], [9.0] + [0.5] * 10 + [2.0])
    local = _run("local", losses, [3.0] + [0.25] * 11)
    agreement = llama_report.loss_agreement(distca["steps"], local["steps"], 2.0 ** -8)
    s = llama_report.train_summary([distca, local], agreement, device="NVIDIA H100 80GB HBM3")
    assert s["train_loss_max_rel_diff_10_steps"] == pytest.approx(1e-3) and s["train_loss_agree"]
    # the median after the warm-up step: neither step 0 (9 s) nor the slow last step count
    assert s["train_step_time_s_distca"] == 0.5 and s["train_step_time_s_local"] == 0.25
    assert s["train_tokens_per_s_distca"] == 2 * 8192 / 0.5 and s["train_tokens_per_s_local"] == 2 * 8192 / 0.25
    assert (s["dtype"], s["transport"], s["device"]) == ("bfloat16", "nvshmem", "NVIDIA H100 80GB HBM3")
    assert len(s["train_losses_distca"]) == 12
    with pytest.raises(ValueError, match="same attention"):
        llama_report.train_summary([local, local], None, device="cpu")
    with pytest.raises(ValueError, match="no runs"):
        llama_report.train_summary([], None, device="cpu")


def test_train_summary_says_what_ran_and_how_the_first_step_differs():
    losses = [5.5 - 0.1 * i for i in range(4)]
    distca = _run("distca", [x * (1 + 2e-3) for x in losses], [1.0] * 4)
    local = _run("local", losses, [1.0] * 4)
    for i, (a, b) in enumerate(zip(distca["steps"], local["steps"])):
        a.update(grad_norm=2.0 * (1 + 4e-3), kernel="cudnn", nvshmem_init_status="STATUS_LIMITED_MPG",
                 transport_used="RoutedTransport/HeapLease" if i else "RoutedTransport/NvshmemHeap")
        b.update(grad_norm=2.0, kernel="cudnn", nvshmem_init_status=None, transport_used=None)
    s = llama_report.train_summary([distca, local], None, device="NVIDIA H200")
    assert s["train_transport_used_distca"] == ["RoutedTransport/HeapLease", "RoutedTransport/NvshmemHeap"]
    assert s["train_kernel_distca"] == s["train_kernel_local"] == ["cudnn"]
    assert s["train_nvshmem_init_status_distca"] == ["STATUS_LIMITED_MPG"]
    assert "train_transport_used_local" not in s and "train_nvshmem_init_status_local" not in s
    assert s["train_step0_loss_rel_diff"] == pytest.approx(2e-3)
    assert s["train_step0_grad_norm_rel_diff"] == pytest.approx(4e-3) and s["train_step0_step"] == 0
    del local["steps"][0]["grad_norm"]
    assert llama_report.train_summary([distca, local], None, device="cpu")["train_step0_grad_norm_rel_diff"] is None


def test_gpu_workers_get_the_sessions_environment_unless_set(monkeypatch):
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")
    assert llama_device.worker_env(GPU) == {"NVSHMEM_DISABLE_NVLS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "16"}
    assert llama_device.worker_env(TrainConfig()) == {}  # the CPU demo: nothing


def test_run_facts_name_the_kernel_and_no_nvshmem_on_the_cpu():
    facts = llama_device.run_facts(torch.device("cpu"))
    assert facts == {"kernel": "torch_cpu", "nvshmem_init_status": None}
