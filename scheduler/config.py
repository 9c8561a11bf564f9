"""One validated configuration: :class:`PlanConfig` (the planner's settings) and :class:`JobConfig`
(a job: its plan, servers, transport, backend, timeouts, restarts, report bounds).

Both are frozen, keyword-only dataclasses checked once, in ``__post_init__``: every bad field is
named in one :class:`ConfigError` (a ``ValueError``), each message naming the field and its value.
Numpy integers, floats and strings are taken and stored as Python ``int``, ``float`` and ``str``.
Each default is written here once, as the field's default; the entry points take ``config=`` and
refer to them:

=========================================================  =====================  ==============
entry point                                                takes                  default mode
=========================================================  =====================  ==============
:func:`scheduler.plan_batch`                               ``PlanConfig``         ``"inplace"``
``DistCAClient.local``                                     either                 ``"inplace"``
``DistCAClient.connect`` (checks the job runs with it)     either                 (the job's)
``distca_server.launch``, ``distca up``                    ``JobConfig``          ``"dedicated"``
:class:`~scheduler.coordinator.Coordinator`,               ``JobConfig``          ``"dedicated"``
:class:`~scheduler.actor.SchedulerActor`
=========================================================  =====================  ==============

``PlanConfig()`` is in-place (a plan of a batch whose ranks serve it themselves); a
``JobConfig()``'s plan is dedicated (a job's servers are separate actors unless it says otherwise).
The ``distca up`` flags are these fields' names (``--min-shard`` sets ``min_shard``).

The other entry points still take their old keyword arguments for one release: each such call
warns (``DeprecationWarning`` naming the ``config=`` form) and builds the config from them
(:func:`legacy_fields`, :func:`legacy_job_config`). :func:`scheduler.plan_batch`'s keywords are
:class:`PlanConfig`'s fields, supported (no warning) beside ``config=``.

Pure Python: imports neither torch nor ray (the CLI loads it before either).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .time_cost import TILE_ROWS, TimeModel
from .checks import (MAX_SERVERS, MODES, TRANSPORTS, at_least, boolean, check_mode, check_transport,
                     finite_nonnegative, finite_positive, int_in_range, positive_int)

# A report is bounded before anything else looks at it: one client's documents and tokens per
# batch. Far above real batches (~10^2-10^4 documents, <= 1M tokens per rank), far below what
# pins the scheduler (10M one-token documents took minutes and 5.7 GB to plan).
MAX_REPORT_DOCS = 1 << 16
MAX_REPORT_TOKENS = 1 << 24
# min_shard when neither the caller nor a time model chooses one: a FlashAttention tile (DistCA §3).
DEFAULT_MIN_SHARD = TILE_ROWS
# The symmetric heap (transports shm and nvshmem): its default size (sparse on shm: only written
# pages use memory), and the alignment of segment starts in every transport buffer (any element
# size, and GPU vector loads; distca_server.transport.base.ALIGN).
DEFAULT_HEAP_BYTES = 1 << 30
HEAP_ALIGN = 256
# The longest a job's timeout, grace or start timeout may be: one week. Longer is no setting anyone
# means, and the runtime waits on multiples of them: 1e10 s is past threading's limit (TIMEOUT_MAX,
# about 9.2e9 s) and ends in an OverflowError, not a timeout.
MAX_SECONDS = 7 * 24 * 3600.0


def resolve_min_shard(min_shard: int | None, time_model: TimeModel | None) -> int:
    """The ``min_shard`` a plan uses, tokens: the one given, else with a time model its
    :meth:`~scheduler.time_cost.TimeModel.choose_min_shard`, else :data:`DEFAULT_MIN_SHARD`."""
    if min_shard is not None:
        return min_shard
    return DEFAULT_MIN_SHARD if time_model is None else time_model.choose_min_shard()


def _seconds(name: str, value) -> float:
    """A duration of a job: a finite number > 0 and at most :data:`MAX_SECONDS`."""
    value = finite_positive(name, value)
    if value > MAX_SECONDS:
        raise ValueError(f"{name} must be at most {MAX_SECONDS:g} seconds (one week), got {value!r}")
    return value


def _heap_bytes(name: str, value) -> int:
    value = positive_int(name, value)
    if value % HEAP_ALIGN:
        raise ValueError(f"{name} must be a multiple of {HEAP_ALIGN} bytes, got {value} "
                         f"({value % HEAP_ALIGN} over {value - value % HEAP_ALIGN})")
    return value


class ConfigError(ValueError):
    """Bad settings, all of them: ``problems`` holds one message per bad field (or pair of
    fields), each naming the field and its value; ``where`` what was being configured."""

    def __init__(self, where: str, problems):
        self.where, self.problems = where, tuple(problems)
        super().__init__(f"{where}: " + "; ".join(self.problems))

    def __reduce__(self):  # pickled across processes (Ray) with its fields, not its message
        return ConfigError, (self.where, self.problems)


def _meta(help: str, unit: str | None = None, choices: tuple | None = None) -> dict:
    return {"help": help, "unit": unit, "choices": choices}


def _optional(check):
    return lambda name, value: None if value is None else check(name, value)


def _named(check):  # a str check that names its own field (check_mode, check_transport)
    # stored as a plain str (a numpy str compares equal but is another type: see differences)
    return lambda name, value: str(check(value))


def _nonempty_str(name: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str, got {value!r}")
    return str(value)


def _attn_profile(name: str, value) -> str:
    """A folder whose tables load (:meth:`~scheduler.time_cost.TimeModel.from_dir`), stored as its
    absolute path: the scheduler that plans with it runs in another folder (and process)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a folder path (a non-empty str), got {value!r}")
    try:
        TimeModel.from_dir(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r}: {exc}") from None
    return str(Path(value).expanduser().resolve())


def _restarts(name: str, value) -> int:
    return at_least(name, value, -1)


def _servers(name: str, value) -> int:
    # positive_int words a non-int or one below 1; int_in_range, more than a plan may have
    return int_in_range(name, positive_int(name, value), 1, MAX_SERVERS)


def _run_checks(obj, checks) -> tuple[list[str], set[str]]:
    """Run ``check(name, value)`` for every field; store what each returns (the normalised value).
    Returns the messages of those that raise, and their names."""
    problems, bad = [], set()
    for name, check in checks:
        try:
            object.__setattr__(obj, name, check(name, getattr(obj, name)))
        except ValueError as exc:
            problems.append(str(exc))
            bad.add(name)
    return problems, bad


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """The planner's settings (see :func:`scheduler.plan_batch`).

    ``min_shard`` None (the default) is resolved where the plan is made
    (:meth:`resolved_min_shard`): 128 tokens, or with ``attn_profile`` the table's choice.
    ``attn_profile`` is stored as the folder's absolute path (``~`` expanded, resolved where the
    config is made).

    Raises:
        ConfigError: every bad field at once: ``epsilon`` not a finite number >= 0; ``min_shard``,
            ``max_held_bytes_per_server`` or ``max_kv_rows_per_server`` not a positive int, or one
            past :data:`~scheduler.checks.INT64_MAX` (each may be None); ``attn_profile`` not a
            folder holding valid forward and backward tables;
            ``mode`` not in :data:`~scheduler.checks.MODES`; ``keep_activations`` or ``partial_kv``
            not a bool; a ``max_held_bytes_per_server`` without ``keep_activations``, or a
            ``max_kv_rows_per_server`` without ``partial_kv``.
    """

    epsilon: float = field(default=0.05, metadata=_meta(
        "imbalance tolerance ε: the planner aims for every server within (1 + ε) · max(mean, lower "
        "bound) of the batch's attention work", "fraction of the mean (0.05 = 5 %)"))
    min_shard: int | None = field(default=None, metadata=_meta(
        "smallest shard of a split document; documents with ceil(l / 2) < 2 · min_shard stay whole "
        "(a FlashAttention tile is 128 rows). None: 128, or with attn_profile the smallest tile "
        "multiple that runs at 0.65 of the table's best throughput (TimeModel.choose_min_shard)",
        "tokens"))
    mode: str = field(default="inplace", metadata=_meta(
        "where attention servers run: inplace (server i is client rank i) or dedicated (separate "
        "processes; every row moves)", choices=MODES))
    keep_activations: bool = field(default=True, metadata=_meta(
        "servers keep each layer's Q, K, V, O and LSE rows from its forward round until its backward "
        "round, which then sends dO only; False: stateless servers, every backward round resends all"))
    partial_kv: bool = field(default=False, metadata=_meta(
        "the planner may also split a query shard's keys over servers where that balances better "
        "(full causal attention only)"))
    max_held_bytes_per_server: int | None = field(default=None, metadata=_meta(
        "with keep_activations, the most bytes of kept activations one layer of one batch may leave "
        "on any server (None: no cap)", "bytes"))
    max_kv_rows_per_server: int | None = field(default=None, metadata=_meta(
        "with partial_kv, the most KV rows a server should receive; key blocks move off servers "
        "above it (None: no limit)", "tokens (KV rows)"))
    attn_profile: str | None = field(default=None, metadata=_meta(
        "a folder holding forward.json and backward.json, the measured latency of one CA-task over "
        "(query rows, key rows) (ProfileTable JSON, bench/gpu_kernels.py): the planner balances "
        "predicted seconds instead of FLOPs (DistCA §4.2): it aims at the level (the whole documents' "
        "seconds per server) and epsilon, in seconds, bounds what it accepts. The folder must be "
        "readable where plans are made (the scheduler); a relative path is made absolute where the "
        "config is made. None: balance FLOPs", "path"))

    def __post_init__(self):
        problems, bad = _run_checks(self, (
            ("epsilon", finite_nonnegative), ("min_shard", _optional(positive_int)), ("mode", _named(check_mode)),
            ("keep_activations", boolean), ("partial_kv", boolean),
            ("max_held_bytes_per_server", _optional(positive_int)),
            ("max_kv_rows_per_server", _optional(positive_int)),
            ("attn_profile", _optional(_attn_profile))))
        if (self.max_held_bytes_per_server is not None and self.keep_activations is False
                and "max_held_bytes_per_server" not in bad):
            problems.append(f"max_held_bytes_per_server={self.max_held_bytes_per_server!r} needs "
                            f"keep_activations=True (stateless servers hold nothing between rounds)")
        if (self.max_kv_rows_per_server is not None and self.partial_kv is False
                and "max_kv_rows_per_server" not in bad):
            problems.append(f"max_kv_rows_per_server={self.max_kv_rows_per_server!r} needs partial_kv=True "
                            f"(only key splits move KV rows off a server)")
        if problems:
            raise ConfigError("PlanConfig", problems)

    def to_dict(self) -> dict:
        """The fields as a plain dict (msgpack- and JSON-safe)."""
        return dataclasses.asdict(self)

    def time_model(self) -> TimeModel | None:
        """The :class:`~scheduler.time_cost.TimeModel` of ``attn_profile`` (loaded once per folder),
        or None.

        Raises:
            ValueError: the folder no longer holds valid tables (the message names it).
        """
        return None if self.attn_profile is None else TimeModel.from_dir(self.attn_profile)

    def resolved_min_shard(self, time_model: TimeModel | None = None) -> int:
        """:func:`resolve_min_shard` of ``min_shard`` and the time model (the one given, else
        :meth:`time_model`)."""
        if time_model is None and self.min_shard is None:
            time_model = self.time_model()
        return resolve_min_shard(self.min_shard, time_model)

    @classmethod
    def from_dict(cls, data: dict) -> "PlanConfig":
        """The config :meth:`to_dict` gave.

        Raises:
            ConfigError: a bad value; TypeError: an unknown field.
        """
        return cls(**data)


def _job_plan() -> PlanConfig:
    """A job's default plan: dedicated servers (``distca up`` and ``launch`` without ``mode``)."""
    return PlanConfig(mode="dedicated")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A job's settings: its :class:`PlanConfig` and what ``distca_server.launch`` starts.

    Raises:
        ConfigError: every bad field at once: ``plan`` not a :class:`PlanConfig`; ``servers`` not
            an int in [1, :data:`~scheduler.checks.MAX_SERVERS`]; ``max_report_docs`` or
            ``max_report_tokens`` not a positive int; ``transport`` not in
            :data:`~scheduler.checks.TRANSPORTS`; ``backend`` not a non-empty str (whether this
            install can run it is checked where it runs); ``timeout_s``, ``failure_grace_s`` or
            ``start_timeout_s`` not a finite number in (0, :data:`MAX_SECONDS`] (one week);
            ``server_restarts`` or ``scheduler_restarts`` not an int >= -1; ``heap_bytes`` not a
            positive int multiple of :data:`HEAP_ALIGN` (256 bytes). No int field may pass
            :data:`~scheduler.checks.INT64_MAX`.
    """

    plan: PlanConfig = field(default_factory=_job_plan, metadata=_meta(
        "the planner's settings (a PlanConfig; a job's default is dedicated mode)"))
    servers: int = field(default=1, metadata=_meta(
        "dedicated attention servers, dedicated mode only: in inplace mode every client rank serves its "
        "share (launch ignores servers there; distca up refuses --servers)"))
    transport: str = field(default="torch_dist", metadata=_meta(
        "how group epochs move tensors: torch_dist (gloo on CPU, NCCL on GPU), shm (shared memory: "
        "CPU tensors, one node) or nvshmem (CUDA tensors)", choices=TRANSPORTS))
    backend: str = field(default="auto", metadata=_meta(
        "attention kernel backend on the servers: auto (the fastest that runs) or a name from "
        "distca_server.kernels.BACKENDS"))
    timeout_s: float = field(default=60.0, metadata=_meta(
        "how long any wait of the job lasts before participants get DistCAError (at most a week)", "seconds"))
    failure_grace_s: float = field(default=1.0, metadata=_meta(
        "after a failure, how long the scheduler waits for the other members to check in before "
        "naming the silent ones lost (at most a week)", "seconds"))
    start_timeout_s: float = field(default=300.0, metadata=_meta(
        "how long the job's actors may take to start (e.g. waiting for GPUs; at most a week)", "seconds"))
    server_restarts: int = field(default=0, metadata=_meta(
        "how often Ray restarts a dead attention server (-1: always); a restarted server rejoins"))
    scheduler_restarts: int = field(default=-1, metadata=_meta(
        "how often Ray restarts a dead scheduler (-1: always); it rebuilds its state from the "
        "participants re-registering"))
    max_report_docs: int = field(default=MAX_REPORT_DOCS, metadata=_meta(
        "the most documents one client may report for one batch", "documents"))
    max_report_tokens: int = field(default=MAX_REPORT_TOKENS, metadata=_meta(
        "the most tokens one client may report for one batch", "tokens"))
    heap_bytes: int = field(default=DEFAULT_HEAP_BYTES, metadata=_meta(
        "symmetric heap per participant of the shm and nvshmem transports (arena for the exchange's "
        "tables and buffers; nvshmem reserves it on the GPU once per process, shm as a sparse file); "
        "a multiple of 256. World rank 0's value is used by the whole group", "bytes"))
    cuda_graphs: bool = field(default=False, metadata=_meta(
        "DistCAClient.local over an in-process heap (transport shm or nvshmem) on CUDA: capture each "
        "batch shape's rounds (stateless or kept-activation plans) once, after 2 eager rounds, "
        "as CUDA graphs and replay them in every later layer and step (distca_server.runtime.graphed); "
        "elsewhere it does nothing"))

    def __post_init__(self):
        problems = [] if isinstance(self.plan, PlanConfig) else [
            f"plan must be a PlanConfig, got {type(self.plan).__name__} {self.plan!r}"]
        problems += _run_checks(self, (
            ("servers", _servers), ("transport", _named(check_transport)), ("backend", _nonempty_str),
            ("timeout_s", _seconds), ("failure_grace_s", _seconds), ("start_timeout_s", _seconds),
            ("server_restarts", _restarts), ("scheduler_restarts", _restarts), ("max_report_docs", positive_int),
            ("max_report_tokens", positive_int), ("heap_bytes", _heap_bytes), ("cuda_graphs", boolean)))[0]
        if problems:
            raise ConfigError("JobConfig", problems)

    @classmethod
    def from_fields(cls, plan: PlanConfig | None = None, **values) -> "JobConfig":
        """A config from flat field names: :class:`PlanConfig`'s and :class:`JobConfig`'s side
        by side (``epsilon=0.1, timeout_s=30``), every other field its default.

        Args:
            plan: the plan whose fields the plan values replace (default: a job's, dedicated).
            values: fields by name.

        Raises:
            ConfigError: every bad value, of both classes, at once (a ``plan`` that is not a
                :class:`PlanConfig` among them).
            TypeError: a name that is no field.
        """
        unknown = [k for k in values if k not in PLAN_FIELDS and k not in JOB_FIELDS]
        if unknown:
            raise TypeError(f"JobConfig and PlanConfig have no field {', '.join(map(repr, unknown))}")
        base = _job_plan() if plan is None else plan
        # A base that is no PlanConfig: the plan values are checked on a job's default plan, and
        # JobConfig names the bad base itself below.
        checked = base if isinstance(base, PlanConfig) else _job_plan()
        problems = []
        try:
            new_plan = dataclasses.replace(checked, **{k: v for k, v in values.items() if k in PLAN_FIELDS})
        except ConfigError as exc:
            problems += exc.problems
            new_plan = checked
        try:
            job = cls(plan=new_plan if base is checked else base, **{k: v for k, v in values.items() if k in JOB_FIELDS})
        except ConfigError as exc:
            problems += exc.problems
        if problems:
            raise ConfigError("JobConfig", problems)
        return job

    def to_dict(self) -> dict:
        """The fields as a plain dict, ``plan`` a nested dict (msgpack- and JSON-safe)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "JobConfig":
        """The config :meth:`to_dict` gave.

        Raises:
            ConfigError: a bad value; TypeError: an unknown field.
        """
        data = dict(data)
        plan = data.pop("plan", None)
        return cls(**data) if plan is None else cls(plan=PlanConfig.from_dict(plan), **data)


PLAN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PlanConfig))
JOB_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(JobConfig) if f.name != "plan")


def differences(want, have) -> list[str]:
    """``"<field>: <want> != <have>"`` for every field where two configs of the same
    class differ (a :class:`JobConfig`'s plan fields as ``plan.<field>``). Either may be given as
    its :meth:`~JobConfig.to_dict` dict: a job's settings compare without being rebuilt here
    (rebuilding checks that ``attn_profile`` loads on this node, where only the scheduler needs
    it)."""
    want = want if isinstance(want, dict) else want.to_dict()
    have = have if isinstance(have, dict) else have.to_dict()
    out = []
    for name, a in want.items():
        b = have.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{name}.{d}" for d in differences(a, b)]
        elif a != b or type(a) is not type(b):
            out.append(f"{name}: {a!r} != {b!r}")
    return out


# ---- the old keyword arguments, for one release ------------------------------------------------

RENAMED = {"max_restarts": "server_restarts"}  # launch's old keyword -> the JobConfig field
_OWN_PACKAGES = frozenset({"scheduler", "distca_server", "distca_client", "distca_cli"})


def legacy_fields(entry: str, args: tuple = (), kwargs: dict | None = None, *,
                  positional: tuple[str, ...] = (), accepted=()) -> dict:
    """The deprecated arguments an entry point was called with, by their old names, in order.

    Args:
        entry: the entry point, for messages (``"launch"``).
        args: the deprecated positional arguments, in the order of ``positional``.
        kwargs: the deprecated keyword arguments.
        positional: the old names of the positional ones.
        accepted: every old name the entry point takes.

    Raises:
        TypeError: more positional arguments than ``positional`` names, an argument given twice,
            or a name ``accepted`` lacks (as Python's own call errors).
    """
    kwargs = kwargs or {}
    if len(args) > len(positional):
        extra = len(args) - len(positional)
        raise TypeError(f"{entry}() got {extra} extra positional argument{'s' if extra > 1 else ''}: it "
                        f"takes at most {len(positional)} deprecated ones ({', '.join(positional)}), "
                        f"{len(args)} were given")
    given = dict(zip(positional, args))
    for name, value in kwargs.items():
        if name in given:
            raise TypeError(f"{entry}() got multiple values for argument {name!r}")
        if name not in accepted:
            raise TypeError(f"{entry}() got an unexpected keyword argument {name!r}")
        given[name] = value
    return given


def _as_fields(entry: str, given: dict) -> dict:
    """Old names -> field names: ``coordinator_options`` opened, ``max_restarts`` renamed."""
    out = {}
    for name, value in given.items():
        items = dict(value or {}).items() if name == "coordinator_options" else ((name, value),)
        for key, val in items:
            key = RENAMED.get(key, key)
            if key in out:
                raise TypeError(f"{entry}() got {key!r} twice (also in coordinator_options)")
            out[key] = val
    return out


def render(fields, implied: dict | None = None, kind: str = "JobConfig") -> str:
    """``JobConfig(plan=PlanConfig(epsilon=...), timeout_s=...)``: the new form of a call that set
    ``fields`` (shown as ``...``) and relies on ``implied`` (shown with their values)."""
    implied = implied or {}
    names = set(fields) | set(implied)

    def args(order):
        return ", ".join(f"{k}={implied[k]!r}" if k in implied else f"{k}=..." for k in order if k in names)
    if kind == "PlanConfig":
        return f"PlanConfig({args(PLAN_FIELDS)})"
    parts = [f"plan=PlanConfig({args(PLAN_FIELDS)})"] if names & set(PLAN_FIELDS) else []
    if names & set(JOB_FIELDS):
        parts.append(args(JOB_FIELDS))
    return f"JobConfig({', '.join(parts)})"


def warn_deprecated(entry: str, old_names, new_form: str) -> None:
    """``DeprecationWarning``: ``"<entry>(a=..., b=...) is deprecated; pass <new_form>"``,
    attributed to the first caller outside distca's packages (so Python's default filters show
    it when that caller is a script)."""
    frame, level = sys._getframe(), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in _OWN_PACKAGES:
        frame, level = frame.f_back, level + 1
    warnings.warn(f"{entry}({', '.join(f'{n}=...' for n in old_names)}) is deprecated; pass {new_form}",
                  DeprecationWarning, stacklevel=level)


def legacy_job_config(entry: str, config, given: dict) -> JobConfig:
    """The :class:`JobConfig` of an entry point called with ``config`` or with deprecated
    arguments ``given`` (from :func:`legacy_fields`; they warn), or ``JobConfig()``.

    Args:
        entry: the entry point, for messages.
        config: what the caller passed as ``config=`` (None: not passed).
        given: the deprecated arguments by old name (their values replace the defaults).

    Raises:
        ConfigError: every bad value at once, prefixed with ``entry``.
        TypeError: ``config`` together with deprecated arguments, a ``config`` that is not a
            :class:`JobConfig`, or an unknown name.
    """
    if not given:
        if config is None:
            return JobConfig()
        if not isinstance(config, JobConfig):
            raise TypeError(f"{entry}: config must be a JobConfig, got {type(config).__name__}")
        return config
    if config is not None:
        raise TypeError(f"{entry}: pass config= or the deprecated arguments ({', '.join(given)}), not both")
    values = _as_fields(entry, given)
    warn_deprecated(entry, list(given), "config=" + render(values))
    try:
        return JobConfig.from_fields(**values)
    except ConfigError as exc:
        raise ConfigError(entry, exc.problems) from None


__all__ = ["ConfigError", "DEFAULT_HEAP_BYTES", "DEFAULT_MIN_SHARD", "resolve_min_shard", "HEAP_ALIGN", "JOB_FIELDS", "JobConfig", "MAX_REPORT_DOCS", "MAX_REPORT_TOKENS", "MAX_SECONDS", "PLAN_FIELDS",
           "PlanConfig", "differences", "legacy_fields", "legacy_job_config", "render", "warn_deprecated"]
