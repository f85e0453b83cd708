"""The run-level checks, run by ``load_config`` after every value has its type: each stage section's own
``validate``, the trackers, and the stage graph (every ``stage:<name>`` names a stage; no cycle). Each error names
the key to change."""

from __future__ import annotations

import difflib

from rlhf_core.config.fields import ConfigError, check
from rlhf_core.config.pipeline import PipelineConfig, TrackingConfig, topological_order


def validate(cfg: PipelineConfig) -> None:
    if not cfg.run_uri.strip():
        raise ConfigError("'run_uri' is empty: give a local path, file://... or s3://bucket/prefix")
    _validate_tracking(cfg.tracking)
    for name, spec in cfg.stages.items():
        own_checks = getattr(spec.section, "validate", None)  # every built-in section has one; a plugin's may not
        if own_checks is not None:
            own_checks(name)
        for key, upstream in spec.upstream():
            if upstream not in cfg.stages:
                close = difflib.get_close_matches(upstream, [n for n in cfg.stages if n != name], n=1)
                hint = f"did you mean 'stage:{close[0]}'?" if close else f"stages: {', '.join(cfg.stages)}"
                raise ConfigError(f"'{key}' = stage:{upstream} names no stage of this config; {hint}")
    topological_order(cfg)  # refuses cycles


def _validate_tracking(t: TrackingConfig) -> None:
    """The trackers' values; whether their packages are installed is checked by the job (``tracking.check``)."""
    if t.mlflow is not None:
        uri = t.mlflow.tracking_uri
        check(uri is None or bool(uri.strip()), "tracking.mlflow.tracking_uri", uri, "give a URI or null")
        check(bool(t.mlflow.experiment.strip()), "tracking.mlflow.experiment", t.mlflow.experiment, "give a name")
    if t.wandb is not None:
        check(bool(t.wandb.project.strip()), "tracking.wandb.project", t.wandb.project, "give a project name")
    if t.run_name is not None:
        check(
            bool(t.run_name.strip()) and "/" not in t.run_name,
            "tracking.run_name",
            t.run_name,
            "give a non-empty name without '/' (or null for the run folder's name)",
        )
