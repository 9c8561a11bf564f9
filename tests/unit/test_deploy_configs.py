"""deploy/*.yaml: each passes Ray's own cluster-config validator and keeps distca's deployment rules
(GPU workers, pinned metrics port, token auth on, dashboard on loopback, ``distca up`` on the head).
No cloud is contacted: ``prepare_config`` only merges the provider's defaults file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("jsonschema")  # Ray's validator needs it
util = pytest.importorskip("ray.autoscaler._private.util")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIGS = ("aws.yaml", "gcp.yaml", "local.yaml")


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _prepared(name: str) -> dict:
    config = util.prepare_config(_load(name))
    util.validate_config(config)
    return config


def test_every_yaml_in_deploy_is_checked():
    assert sorted(p.name for p in DEPLOY.glob("*.yaml")) == sorted(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_validator_accepts(name):
    config = _prepared(name)
    assert config["head_node_type"] in config["available_node_types"]


def test_validator_is_not_vacuous():
    config = _load("aws.yaml")
    config["available_node_types"]["gpu_worker"]["max_workerz"] = 2
    with pytest.raises(Exception, match="max_workerz"):
        util.validate_config(util.prepare_config(config))


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_starts_with_token_auth_pinned_metrics_and_loopback_dashboard(name):
    config = _prepared(name)
    head = " ".join(config["head_start_ray_commands"])
    worker = " ".join(config["worker_start_ray_commands"])
    text = (DEPLOY / name).read_text()
    assert "disabled" not in re.findall(r"RAY_AUTH_MODE=(\w+)", text), "token auth must stay on"
    for start in (head, worker):
        assert re.search(r"RAY_AUTH_MODE=token ray start", start), start
        assert re.search(r"--metrics-export-port=\d+", start), start
    assert "--dashboard-host=127.0.0.1" in head
    assert "0.0.0.0" not in text
    # The token travels to every node; distca's job starts on the head after Ray.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert re.search(r"RAY_AUTH_MODE=token distca up\b", config["head_start_ray_commands"][-1])


@pytest.mark.parametrize("name", CONFIGS)
def test_setup_installs_distca_with_gpu_extra(name):
    setup = " ".join(_prepared(name)["setup_commands"])
    assert re.search(r'pip install [^;&]*distca\[gpu[\],]', setup), setup


def test_aws_gpu_workers_cpu_head():
    types = _prepared("aws.yaml")["available_node_types"]
    assert types["head"]["node_config"]["InstanceType"].startswith("m5.")
    assert types["gpu_worker"]["node_config"]["InstanceType"] == "p5.48xlarge"
    assert types["gpu_worker"]["min_workers"] >= 1


def test_gcp_a3_with_accelerators_and_terminate_on_maintenance():
    worker = _prepared("gcp.yaml")["available_node_types"]["gpu_worker"]
    node = worker["node_config"]
    assert node["machineType"] == "a3-highgpu-8g"
    assert node["guestAccelerators"] == [{"acceleratorType": "nvidia-h100-80gb", "acceleratorCount": 8}]
    assert {"onHostMaintenance": "TERMINATE"} in node["scheduling"]
    assert worker["resources"]["GPU"] == 8


def test_local_provider_keeps_every_worker_host():
    config = _prepared("local.yaml")
    assert config["provider"]["type"] == "local"
    (node_type,) = config["available_node_types"].values()
    assert node_type["min_workers"] == len(config["provider"]["worker_ips"]) >= 1
