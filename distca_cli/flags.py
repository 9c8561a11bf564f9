"""The ``distca up`` flags of a job's settings, generated from :class:`~scheduler.config.JobConfig`'s
and :class:`~scheduler.config.PlanConfig`'s fields: a flag is its field's name with dashes
(``--min-shard`` sets ``min_shard``, ``--timeout-s`` sets ``timeout_s``), its help the field's, and
an unset flag leaves the field's default, so each default is written once, in the dataclass.

Flags of earlier releases stay as aliases (:data:`ALIASES`). Imports neither torch nor ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from scheduler.config import JOB_FIELDS, PLAN_FIELDS, JobConfig, PlanConfig

__all__ = ["ALIASES", "add_config_flags", "config_from_args", "flag"]

# field -> the flags it had before the flags were generated (they keep working)
ALIASES = {"timeout_s": ("--timeout",), "failure_grace_s": ("--failure-grace",),
           "start_timeout_s": ("--start-timeout",)}


def flag(name: str) -> str:
    """The flag of field ``name``: ``min_shard`` -> ``--min-shard``."""
    return "--" + name.replace("_", "-")


def _fields():
    for cls, names in ((PlanConfig, PLAN_FIELDS), (JobConfig, JOB_FIELDS)):
        hints = typing.get_type_hints(cls)
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for name in names:
            yield by_name[name], hints[name]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`JobConfig` and :class:`PlanConfig` field to ``parser`` (``dest``
    the field's name, default None: unset). A bool field gets ``--x`` / ``--no-x``; an optional
    one (``int | None``) takes its value type."""
    job = JobConfig()  # the defaults `distca up` gets: a job's (its plan is dedicated)
    for f, hint in _fields():
        meta = f.metadata
        kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
        kind = kinds[0]
        default = getattr(job.plan if f.name in PLAN_FIELDS else job, f.name)
        unit = f" [{meta['unit']}]" if meta.get("unit") else ""
        help = f"{meta['help']}{unit} (default: {default})".replace("%", "%%")
        options = dict(dest=f.name, default=None, help=help)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:  # choices shown, not enforced by argparse: the config names a bad value in one line
            options["type"] = kind
            choices = meta.get("choices")
            options["metavar"] = "{" + ",".join(choices) + "}" if choices else kind.__name__.upper()
        parser.add_argument(flag(f.name), *ALIASES.get(f.name, ()), **options)


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The :class:`JobConfig` the parsed flags describe (unset flags: the fields' defaults).

    Raises:
        ConfigError: every bad value at once (a ``ValueError``), named by field.
    """
    values = {name: getattr(args, name) for name in PLAN_FIELDS + JOB_FIELDS if getattr(args, name, None) is not None}
    return JobConfig.from_fields(**values)
