"""A config as plain data: ``to_dict``/``to_yaml`` with credentials redacted, and ``describe``, the rows of
``python -m rlhf_core.config``."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from typing import Any

import yaml

from rlhf_core.config.fields import MISSING, is_section, join_key
from rlhf_core.config.kinds import STAGE_KINDS, StageKind
from rlhf_core.config.pipeline import PipelineConfig
from rlhf_core.config.redact import redact_tracking_uri, redact_url

_SECRETS = {"key", "secret"}


def to_dict(cfg: Any, redact: bool = True) -> dict:
    """Plain dict of a config (loadable again); credentials are replaced by '***' unless redact=False (storage keys,
    and the user:password@ and query string of a remote reward server's URL)."""
    if not isinstance(cfg, PipelineConfig):
        return dataclasses.asdict(cfg)
    out = {"run_uri": cfg.run_uri, "storage": dataclasses.asdict(cfg.storage)}
    out["stages"] = {name: {"kind": s.kind, **dataclasses.asdict(s.section)} for name, s in cfg.stages.items()}
    out["tracking"] = dataclasses.asdict(cfg.tracking)
    if redact:
        if out["tracking"]["mlflow"] and out["tracking"]["mlflow"]["tracking_uri"]:
            out["tracking"]["mlflow"]["tracking_uri"] = redact_tracking_uri(out["tracking"]["mlflow"]["tracking_uri"])
        for k in _SECRETS:
            if out["storage"].get(k):
                out["storage"][k] = "***"
        for section in out["stages"].values():
            if section.get("remote_rm_url"):
                section["remote_rm_url"] = redact_url(section["remote_rm_url"])
    return out


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe(
    cls: type, prefix: str = "", defaults: Any = None, kinds: Iterable[StageKind] | None = None
) -> list[tuple[str, str, str]]:
    """(key, default, help) rows for documentation and ``--help``. For ``PipelineConfig`` the stage keys are listed
    once per kind, under the kind's name (an instance ``<name>`` of that kind takes the same keys), for ``kinds``
    (default: every kind, the installed plugins' too). ``defaults``: the section's own default instance, whose values
    win over the class's (``DPOConfig.optim`` has lr 5e-7)."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = join_key(prefix, f.name)
        if f.metadata.get("internal"):
            continue
        if cls is PipelineConfig and f.name == "stages":
            for kind in STAGE_KINDS.values() if kinds is None else kinds:
                rows.append((f"{kind.name}.kind", repr(kind.name), f"Stage kind: {kind.description}"))
                rows += describe(kind.section, kind.name)
            continue
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if is_section(a)]
        target = tp if is_section(tp) else (inner[0] if inner else None)
        if target is not None:
            own = getattr(defaults, f.name, None) if defaults is not None else None
            if own is None and f.default_factory is not MISSING:  # type: ignore[misc]
                own = f.default_factory()  # type: ignore[misc]
            rows += describe(target, key, own if dataclasses.is_dataclass(own) else None)
            continue
        if defaults is not None:
            default = repr(getattr(defaults, f.name))
        elif f.default is not MISSING:
            default = repr(f.default)
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append((key, default, f.metadata.get("help", "")))
    return rows
