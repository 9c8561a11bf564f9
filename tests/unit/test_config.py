"""PlanConfig and JobConfig (scheduler/config.py): defaults written once, every bad field named in one
ValueError, frozen and keyword-only; the entry points take config= and warn on their old keywords;
the `distca up` flags are the fields; launch refuses a bad config before any Ray call."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest

from distca_cli import build_parser
from distca_cli.flags import ALIASES, config_from_args, flag
from distca_client import DistCAClient
from scheduler import CostModel, plan_batch
from scheduler.config import (JOB_FIELDS, PLAN_FIELDS, ConfigError, JobConfig, PlanConfig, differences,
                              legacy_fields, legacy_job_config)
from scheduler.coordinator import Coordinator

ROOT = Path(__file__).resolve().parents[2]
COST = CostModel(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype_bytes=8)


# ---- the dataclasses ------------------------------------------------------------------------------
def test_defaults_and_each_entry_points_mode():
    plan = PlanConfig()
    assert (plan.epsilon, plan.min_shard, plan.mode, plan.keep_activations, plan.partial_kv,
            plan.max_held_bytes_per_server, plan.max_kv_rows_per_server, plan.attn_profile) == (
        0.05, None, "inplace", True, False, None, None, None)
    assert plan.resolved_min_shard() == 128  # None: 128 tokens without an attention profile
    job = JobConfig()
    assert job.plan == dataclasses.replace(plan, mode="dedicated")  # a job's servers are apart by default
    assert (job.servers, job.transport, job.backend, job.timeout_s, job.failure_grace_s, job.start_timeout_s,
            job.server_restarts, job.scheduler_restarts) == (1, "torch_dist", "auto", 60.0, 1.0, 300.0, 0, -1)
    # the class attributes are the defaults the entry points refer to
    assert PlanConfig.epsilon == 0.05 and PlanConfig.min_shard is None and JobConfig.timeout_s == 60.0


def test_plan_batch_defaults_are_plan_configs():
    params = inspect.signature(plan_batch).parameters
    for name in PLAN_FIELDS:
        assert params[name].default == getattr(PlanConfig(), name), name


def test_entry_points_write_no_setting_defaults():
    """The old settings are gone from the signatures (they are deprecated keywords, defaults in the config)."""
    from distca_server.runtime.job import launch
    for fn in (launch, DistCAClient.local, DistCAClient.connect, Coordinator.__init__):
        names = set(inspect.signature(fn).parameters)
        assert "config" in names and not names & {"epsilon", "min_shard", "mode", "keep_activations"}, fn


def test_frozen_and_keyword_only():
    plan, job = PlanConfig(), JobConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.epsilon = 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.timeout_s = 1.0
    with pytest.raises(TypeError):
        PlanConfig(0.1)
    with pytest.raises(TypeError):
        JobConfig(PlanConfig())
    assert hash(plan) == hash(PlanConfig()) and job == JobConfig()


def test_every_bad_plan_field_is_named_in_one_error():
    with pytest.raises(ValueError) as info:
        PlanConfig(epsilon=-1.0, min_shard=0, mode="sideways", keep_activations=1, partial_kv="yes",
                   max_held_bytes_per_server=0, max_kv_rows_per_server=2.5)
    assert isinstance(info.value, ConfigError) and len(info.value.problems) == 7
    text = str(info.value)
    assert text.startswith("PlanConfig: ")
    for name, value in (("epsilon", "-1.0"), ("min_shard", "0"), ("mode", "'sideways'"), ("keep_activations", "1"),
                        ("partial_kv", "'yes'"), ("max_held_bytes_per_server", "0"), ("max_kv_rows_per_server", "2.5")):
        assert f"{name} must be" in text and f"got {value}" in text, name


def test_every_bad_job_field_is_named_in_one_error():
    bad = dict(servers=0, transport="tcp", backend="", timeout_s=0, failure_grace_s=float("nan"),
               start_timeout_s=-1, server_restarts=-2, scheduler_restarts=True, max_report_docs=0,
               max_report_tokens=None)
    with pytest.raises(ConfigError) as info:
        JobConfig(plan={"epsilon": 0.1}, **bad)
    assert len(info.value.problems) == len(bad) + 1
    for name in ("plan", *bad):
        assert any(p.startswith(f"{name} must be") for p in info.value.problems), name


def test_from_fields_names_plan_and_job_fields_together():
    with pytest.raises(ConfigError) as info:
        JobConfig.from_fields(epsilon=float("inf"), mode="x", timeout_s=-1, servers=0)
    assert [p.split(" ")[0] for p in info.value.problems] == ["epsilon", "mode", "servers", "timeout_s"]
    with pytest.raises(TypeError, match="'epsilonn'"):
        JobConfig.from_fields(epsilonn=0.1)
    cfg = JobConfig.from_fields(epsilon=0.1, timeout_s=5)
    assert cfg.plan.mode == "dedicated" and cfg.plan.epsilon == 0.1 and cfg.timeout_s == 5.0
    assert JobConfig.from_fields(plan=PlanConfig(), min_shard=8).plan == PlanConfig(min_shard=8)


def test_fields_that_only_make_sense_together():
    with pytest.raises(ConfigError, match=r"max_held_bytes_per_server=10 needs keep_activations=True"):
        PlanConfig(keep_activations=False, max_held_bytes_per_server=10)
    with pytest.raises(ConfigError, match=r"max_kv_rows_per_server=10 needs partial_kv=True"):
        PlanConfig(max_kv_rows_per_server=10)
    with pytest.raises(ConfigError) as info:  # a bad value is named once, not again as a combination
        PlanConfig(keep_activations=False, max_held_bytes_per_server=0)
    assert info.value.problems == ("max_held_bytes_per_server must be a positive int, got 0",)


def test_numpy_values_are_stored_as_python_numbers():
    plan = PlanConfig(epsilon=np.float32(0.25), min_shard=np.int64(16), max_held_bytes_per_server=np.int32(4096))
    assert type(plan.epsilon) is float and type(plan.min_shard) is int and type(plan.max_held_bytes_per_server) is int
    job = JobConfig(servers=np.int16(3), timeout_s=np.int64(5))
    assert type(job.servers) is int and type(job.timeout_s) is float


def test_dicts_round_trip_and_pack():
    job = JobConfig(servers=3, transport="shm", plan=PlanConfig(epsilon=0.2, partial_kv=True,
                                                                 max_kv_rows_per_server=1000))
    data = job.to_dict()
    assert JobConfig.from_dict(msgpack.unpackb(msgpack.packb(data))) == job
    assert json.loads(json.dumps(data))["plan"]["epsilon"] == 0.2
    assert PlanConfig.from_dict(job.plan.to_dict()) == job.plan


def test_differences_name_the_fields():
    a, b = JobConfig(servers=2), JobConfig(servers=3, plan=PlanConfig(mode="dedicated", epsilon=0.1))
    assert differences(a, b) == ["plan.epsilon: 0.05 != 0.1", "servers: 2 != 3"]
    assert differences(a, JobConfig(servers=2)) == []


def test_connect_compares_the_jobs_settings_without_loading_its_tables_here():
    from distca_server.runtime.ray_client import _check_settings
    job = JobConfig().to_dict()
    job["plan"]["attn_profile"] = "/nonexistent/distca-tables"  # a folder on the scheduler's node only
    cfg = {"keep_activations": False, "config": msgpack.unpackb(msgpack.packb(job))}
    for given, field in ((JobConfig(), "plan.attn_profile"), (JobConfig().plan, "attn_profile")):
        with pytest.raises(ValueError, match=f"another config .*{field}: None != '/nonexistent/distca-tables'"):
            _check_settings("j", cfg, None, given)
    _check_settings("j", {"keep_activations": False, "config": JobConfig().to_dict()}, None, JobConfig())  # equal


def test_errors_survive_pickling():
    import pickle
    err = pickle.loads(pickle.dumps(ConfigError("JobConfig", ["a", "b"])))
    assert isinstance(err, ValueError) and err.problems == ("a", "b") and str(err) == "JobConfig: a; b"


# ---- the entry points -----------------------------------------------------------------------------
def test_plan_batch_takes_a_config_or_keywords_not_both():
    lens = [[700, 60], [30]]
    by_config = plan_batch(lens, 2, cost=COST, config=PlanConfig(min_shard=16, epsilon=0.0))
    by_keywords = plan_batch(lens, 2, cost=COST, min_shard=16, epsilon=0.0)
    assert by_config.to_msgpack() == by_keywords.to_msgpack()
    with pytest.raises(ValueError, match=r"not both"):
        plan_batch(lens, 2, cost=COST, config=PlanConfig(), min_shard=16)
    with pytest.raises(ConfigError) as info:  # keywords: every bad one at once too
        plan_batch(lens, 2, cost=COST, epsilon=-1, min_shard=0)
    assert len(info.value.problems) == 2


def test_local_old_keywords_warn_with_the_form_that_builds_the_same_client():
    with pytest.warns(DeprecationWarning, match=r"DistCAClient\.local\(epsilon=\.\.\., min_shard=\.\.\.\) "
                                                r"is deprecated; pass config=PlanConfig\(epsilon=\.\.\., min_shard=\.\.\.\)"):
        old = DistCAClient.local(2, epsilon=0.1, min_shard=16)
    new = DistCAClient.local(2, config=PlanConfig(epsilon=0.1, min_shard=16))
    with old, new:
        assert old._runtime.plan == new._runtime.plan == PlanConfig(epsilon=0.1, min_shard=16)
    # job settings: the JobConfig form, spelling out what local's defaults imply (in-place, the servers)
    with pytest.warns(DeprecationWarning, match=r"pass config=JobConfig\(plan=PlanConfig\(min_shard=\.\.\., "
                                                r"mode='inplace'\), servers=3, backend=\.\.\., timeout_s=\.\.\.\)"):
        old = DistCAClient.local(3, min_shard=16, backend="reference", timeout_s=9)
    new = DistCAClient.local(config=JobConfig(plan=PlanConfig(min_shard=16, mode="inplace"), servers=3,
                                              backend="reference", timeout_s=9))
    with old, new:
        for attr in ("plan", "backend", "timeout_s", "num_servers", "num_ranks"):
            assert getattr(old._runtime, attr) == getattr(new._runtime, attr), attr
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new forms do not warn
        DistCAClient.local(2).close()


def test_local_refuses_config_with_old_keywords_and_mismatched_servers():
    with pytest.raises(TypeError, match="not both"):
        DistCAClient.local(2, config=PlanConfig(), epsilon=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'epsilonn'"):
        DistCAClient.local(2, epsilonn=0.1)
    with pytest.raises(ValueError, match=r"num_servers=2 != config\.servers=3"):
        DistCAClient.local(2, config=JobConfig(servers=3))
    with pytest.raises(ValueError, match=r"config must be a PlanConfig or JobConfig, got dict"):
        DistCAClient.local(2, config={"epsilon": 0.1})


def test_connect_warns_for_keep_activations_and_checks_its_arguments_before_ray():
    import ray
    if ray.is_initialized():
        pytest.skip("Ray is running in this process")
    from distca_server import DistCAError
    with pytest.warns(DeprecationWarning, match=r"DistCAClient\.connect\(keep_activations=\.\.\.\) is deprecated"):
        with pytest.raises(DistCAError, match="needs Ray"):
            DistCAClient.connect("nojob", 0, 1, keep_activations=True)
    with pytest.raises(ValueError) as info:
        DistCAClient.connect("nojob", 0, 1, config="x", timeout_s=0, max_batches=0)
    assert str(info.value).count(";") == 2 and not ray.is_initialized()


def test_coordinator_old_arguments_warn_and_make_the_same_config():
    with pytest.warns(DeprecationWarning, match=r"Coordinator\(mode=\.\.\., min_shard=\.\.\., partial_kv=\.\.\.\) is "
                                                r"deprecated; pass config=JobConfig\(plan=PlanConfig\("
                                                r"min_shard=\.\.\., mode=\.\.\., partial_kv=\.\.\.\)\)"):
        old = Coordinator("job", "inplace", min_shard=8, partial_kv=True)
    new = Coordinator("job", config=JobConfig(plan=PlanConfig(mode="inplace", min_shard=8, partial_kv=True)))
    assert old.config == new.config and (old.mode, old.min_shard, old.partial_kv) == ("inplace", 8, True)
    assert new.register_client(0, 1, {"incarnation": "a"})["config"] == new.config.to_dict()
    with pytest.raises(ConfigError, match=r"^Coordinator: epsilon must be .*; min_shard must be"):
        Coordinator("job", epsilon=-1, min_shard=0)


def test_scheduler_actor_and_launch_old_arguments_map_to_fields():
    from distca_server.runtime.job import _LAUNCH_LEGACY
    from scheduler.actor import LEGACY_ARGS
    given = legacy_fields("SchedulerActor", ("inplace", 0.1, 16, 5.0), {"coordinator_options": {
        "max_report_docs": 10, "transport": "shm"}}, positional=LEGACY_ARGS, accepted=LEGACY_ARGS)
    with pytest.warns(DeprecationWarning, match=r"SchedulerActor\(mode=\.\.\., epsilon=\.\.\., min_shard=\.\.\., "
                                                r"timeout_s=\.\.\., coordinator_options=\.\.\.\)"):
        cfg = legacy_job_config("SchedulerActor", None, given)
    assert cfg == JobConfig(plan=PlanConfig(mode="inplace", epsilon=0.1, min_shard=16), timeout_s=5.0,
                            max_report_docs=10, transport="shm")
    given = legacy_fields("launch", (), {"max_restarts": 3, "epsilon": 0.2}, accepted=_LAUNCH_LEGACY)
    with pytest.warns(DeprecationWarning, match=r"launch\(max_restarts=\.\.\., epsilon=\.\.\.\) is deprecated; pass "
                                                r"config=JobConfig\(plan=PlanConfig\(epsilon=\.\.\.\), "
                                                r"server_restarts=\.\.\.\)"):
        cfg = legacy_job_config("launch", None, given)
    assert cfg == JobConfig(plan=PlanConfig(mode="dedicated", epsilon=0.2), server_restarts=3)
    with pytest.raises(TypeError, match="extra positional"):
        legacy_fields("SchedulerActor", tuple(range(8)), positional=LEGACY_ARGS, accepted=LEGACY_ARGS)
    with pytest.raises(TypeError, match="multiple values for argument 'mode'"):
        legacy_fields("SchedulerActor", ("inplace",), {"mode": "dedicated"}, positional=LEGACY_ARGS,
                      accepted=LEGACY_ARGS)


_LAUNCH_PROBE = r"""
import json, warnings
import ray
from distca_server import launch
from scheduler.config import JobConfig
out = []
cases = [
    dict(epsilon=-1.0, mode="x", timeout_s=0),                        # old keywords, all bad
    dict(config=JobConfig(backend="no-such-kernel")),                  # no install knows it
    dict(config=JobConfig(transport="nvshmem", backend="nope")),      # no GPU here, and the backend
    dict(config={"servers": 2}),                                       # not a JobConfig
]
for kwargs in cases:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            launch(name="never", **kwargs)
            out.append(["started", []])
        except Exception as exc:
            out.append([type(exc).__name__ + ": " + str(exc), [str(w.message) for w in seen]])
print(json.dumps({"initialized": ray.is_initialized(), "results": out}))
"""


def test_launch_refuses_a_bad_config_without_starting_ray():
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:1")  # were Ray reached, it would fail differently
    proc = subprocess.run([sys.executable, "-c", _LAUNCH_PROBE], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["initialized"] is False
    (legacy, warned), (backend, _), (both, _), (wrong, _) = got["results"]
    assert legacy.startswith("ConfigError: launch: ") and all(
        f"{n} must be" in legacy for n in ("epsilon", "mode", "timeout_s"))
    assert warned == ["launch(epsilon=..., mode=..., timeout_s=...) is deprecated; pass "
                      "config=JobConfig(plan=PlanConfig(epsilon=..., mode=...), timeout_s=...)"]
    assert backend.startswith("ConfigError: launch: backend must be 'auto' or one of")
    assert "'nope'" in both  # and, without nvshmem4py and a GPU here, the transport too
    assert wrong.startswith("TypeError: launch: config must be a JobConfig")


# ---- the CLI ---------------------------------------------------------------------------------------
def _up_actions():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {a.dest: a for a in sub.choices["up"]._actions}


def test_cli_flags_are_the_fields():
    actions = _up_actions()
    for name in PLAN_FIELDS + JOB_FIELDS:
        assert name in actions, name
        assert flag(name) in actions[name].option_strings, name
        assert set(actions[name].option_strings) <= {flag(name), f"--no-{flag(name)[2:]}", *ALIASES.get(name, ())}
    settings = {d for d, a in actions.items() if a.option_strings and d not in ("help", "name", "address")}
    assert settings == set(PLAN_FIELDS + JOB_FIELDS)


def test_cli_unset_flags_are_the_defaults_and_old_flags_work():
    parser = build_parser()
    assert config_from_args(parser.parse_args(["up"])) == JobConfig()
    new = parser.parse_args(["up", "--mode", "inplace", "--min-shard", "64", "--timeout-s", "30",
                             "--failure-grace-s", "2", "--start-timeout-s", "90", "--server-restarts", "3",
                             "--no-keep-activations", "--partial-kv", "--max-kv-rows-per-server", "4096",
                             "--transport", "shm", "--max-report-docs", "100"])
    old = parser.parse_args(["up", "--mode", "inplace", "--min-shard", "64", "--timeout", "30",
                             "--failure-grace", "2", "--start-timeout", "90", "--server-restarts", "3",
                             "--no-keep-activations", "--partial-kv", "--max-kv-rows-per-server", "4096",
                             "--transport", "shm", "--max-report-docs", "100"])
    want = JobConfig(plan=PlanConfig(mode="inplace", min_shard=64, keep_activations=False, partial_kv=True,
                                     max_kv_rows_per_server=4096),
                     timeout_s=30, failure_grace_s=2, start_timeout_s=90, server_restarts=3, transport="shm",
                     max_report_docs=100)
    assert config_from_args(new) == config_from_args(old) == want


def test_cli_help_shows_the_job_defaults():
    help_text = {a.dest: a.help for a in _up_actions().values()}
    assert help_text["mode"].endswith("(default: dedicated)")  # a job's, not PlanConfig's in-place
    assert "[seconds]" in help_text["timeout_s"] and help_text["timeout_s"].endswith("(default: 60.0)")


# ---- bounds, normal forms, paths -------------------------------------------------------------------
def test_int_fields_stop_at_int64_and_servers_at_max_servers():
    from scheduler.checks import INT64_MAX, MAX_SERVERS
    too_big = 2**70  # a multiple of 256 too: heap_bytes is refused for its size, not its alignment
    for cls, fields in ((PlanConfig, dict(min_shard=too_big, max_held_bytes_per_server=too_big,
                                          max_kv_rows_per_server=too_big)),
                        (JobConfig, dict(servers=MAX_SERVERS + 1, server_restarts=too_big,
                                         scheduler_restarts=too_big, max_report_docs=too_big,
                                         max_report_tokens=too_big, heap_bytes=too_big))):
        with pytest.raises(ConfigError) as info:
            cls(**fields, **({"partial_kv": True} if cls is PlanConfig else {}))
        assert len(info.value.problems) == len(fields)  # in field order, each naming field and value
        for (name, value), problem in zip(fields.items(), info.value.problems):
            assert problem.startswith(f"{name} must be") and problem.endswith(f"got {value}"), problem
    with pytest.raises(ConfigError, match=r"servers must be an int in \[1, 1048576\], got 1048577"):
        JobConfig(servers=MAX_SERVERS + 1)
    assert PlanConfig(min_shard=INT64_MAX).min_shard == INT64_MAX  # the bounds themselves are fine
    job = JobConfig(servers=MAX_SERVERS, server_restarts=INT64_MAX, max_report_tokens=INT64_MAX)
    assert (job.servers, job.server_restarts) == (MAX_SERVERS, INT64_MAX)


def test_durations_stop_at_a_week():
    from scheduler.config import MAX_SECONDS
    assert MAX_SECONDS == 604800
    fields = dict(timeout_s=1e10, failure_grace_s=MAX_SECONDS + 1, start_timeout_s=np.float64(1e300))
    with pytest.raises(ConfigError) as info:
        JobConfig(**fields)
    assert [p.split(" ")[0] for p in info.value.problems] == list(fields)
    assert all("must be at most 604800 seconds (one week)" in p for p in info.value.problems)
    job = JobConfig(timeout_s=MAX_SECONDS, failure_grace_s=MAX_SECONDS, start_timeout_s=MAX_SECONDS)
    assert job.timeout_s == MAX_SECONDS


def test_ints_past_floats_range_are_named_with_the_other_bad_fields():
    with pytest.raises(ConfigError) as info:
        JobConfig(timeout_s=10 ** 400, servers=0, failure_grace_s=2 ** 1024)
    assert [p.split(" ")[0] for p in info.value.problems] == ["servers", "timeout_s", "failure_grace_s"]
    assert "timeout_s must be a finite number > 0, got 1000" in str(info.value)
    with pytest.raises(ConfigError) as info:
        PlanConfig(epsilon=10 ** 400, mode="x")
    assert [p.split(" ")[0] for p in info.value.problems] == ["epsilon", "mode"]
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0"):
        plan_batch([[10]], 1, cost=CostModel(2, 2, 8, 2), epsilon=10 ** 400)


def test_other_finite_number_checks_refuse_huge_ints_too():
    from distca_sim.hardware import get_gpu
    from distca_sim.simulate import _check_epsilons
    from scheduler.profile import ProfileTable
    import dataclasses as dc
    with pytest.raises(ValueError, match="peak_flops must be a finite number > 0"):
        dc.replace(get_gpu("h200"), peak_flops=10 ** 400)
    with pytest.raises(ValueError, match="epsilons must be finite numbers >= 0"):
        _check_epsilons([0.0, 10 ** 400])
    with pytest.raises(ValueError, match="rate_flops_per_s must be a finite number > 0"):
        ProfileTable.from_flops(10 ** 400, 0.0, [1, 2], [1, 2], CostModel(2, 2, 8, 2))


def test_relative_and_home_attn_profiles_are_stored_absolute(tmp_path, monkeypatch):
    import shutil
    shipped = ROOT / "distca_sim" / "data" / "profiles" / "h200" / "llama3-8b-tp8"
    monkeypatch.chdir(shipped.parent)
    plan = PlanConfig(attn_profile="llama3-8b-tp8")
    assert plan.attn_profile == str(shipped.resolve())
    job = config_from_args(build_parser().parse_args(["up", "--attn-profile", "./llama3-8b-tp8"]))
    assert job.plan.attn_profile == str(shipped.resolve())
    monkeypatch.chdir(tmp_path)  # the scheduler plans elsewhere: the path still names the folder
    assert plan.time_model() is not None and plan.resolved_min_shard() == 256
    assert PlanConfig.from_dict(plan.to_dict()) == plan
    shutil.copytree(shipped, tmp_path / "prof")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    shutil.move(tmp_path / "prof", tmp_path / "home" / "prof")
    assert PlanConfig(attn_profile="~/prof").attn_profile == str((tmp_path / "home" / "prof").resolve())


def test_from_fields_names_a_plan_that_is_no_plan_config():
    with pytest.raises(ConfigError) as info:
        JobConfig.from_fields(plan="x", epsilon=-1, servers=0)
    assert [p.split(" ")[0] for p in info.value.problems] == ["epsilon", "plan", "servers"]
    assert "plan must be a PlanConfig, got str 'x'" in info.value.problems
    with pytest.raises(ConfigError, match="plan must be a PlanConfig, got dict"):
        JobConfig.from_fields(plan={"epsilon": 0.1})


def test_numpy_strings_are_stored_as_str():
    plan = PlanConfig(mode=np.str_("dedicated"))
    job = JobConfig(plan=plan, transport=np.str_("shm"), backend=np.str_("reference"))
    assert type(plan.mode) is str and type(job.transport) is str and type(job.backend) is str
    assert differences(plan, PlanConfig(mode="dedicated")) == []
    assert differences(job, JobConfig(transport="shm", backend="reference")) == []


def test_too_many_deprecated_positional_arguments_counts_the_extra_ones():
    with pytest.raises(TypeError) as info:
        Coordinator("j", "inplace", 0.1, 256, 30.0, 1.0, "auto", 10, 10, 5)
    assert str(info.value).startswith("Coordinator() got 1 extra positional argument: it takes at most 8 "
                                      "deprecated ones (mode, epsilon,")
    assert str(info.value).endswith(", 9 were given")
    with pytest.raises(TypeError, match=r"got 3 extra positional arguments: .* at most 2 .*, 5 were given"):
        legacy_fields("f", (1, 2, 3, 4, 5), positional=("a", "b"), accepted=("a", "b"))
