"""The RLHF pipeline flow: a preset's stage instances in dependency order (tiny/demo: SFT -> reward model -> critic
init -> critic warm-up -> PPO), each a cached, retryable task run named after the instance.

Parameters are one typed model (a form in the Prefect UI). The resolved config is saved with the run
(``<run_uri>/config.yaml``, credentials redacted, plus an artifact), and so are the flow parameters
(``<run_uri>/pipeline.json``, for ``rlhf resume``). A rerun with the same ``run_name`` skips every stage whose
output is complete for its config (its task ends Cached) and restarts a failed stage from its newest in-stage
checkpoint. Each run ends with a markdown summary artifact and ``<run_uri>/run_summary.json``.

    rlhf run tiny                                  # embedded default: temporary Prefect server, local Ray and folder
    python -m flows.rlhf_pipeline                  # the same with the tiny preset
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.filesystems import LocalFileSystem, RemoteFileSystem
from pydantic import BaseModel, Field

from flows.report import iteration_rows, stage_row, summary_markdown
from rlhf_core import run_layout
from rlhf_core.config import ConfigError, PipelineConfig, load_config, redact_url, to_yaml
from rlhf_core.run_layout import open_store
from tasks import progress
from tasks.launch import ROOT, kill_all_jobs, shared_ray
from tasks.stages import RunSpec, existing_refs, stage_task

PRESETS = ROOT / "deployments" / "configs"
SECRET_KEYS = ("storage.key", "storage.secret")


class PipelineParams(BaseModel):
    """What a pipeline run is: a preset, overrides and where it writes."""

    preset: str = Field(default="tiny", description="Preset name in deployments/configs/ (tiny, demo) or a YAML path.")
    overrides: list[str] = Field(default_factory=list, description="key=value overrides, e.g. ppo.train.max_steps=4")
    run_name: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Names the run; a rerun with the same name resumes it.",
    )
    run_uri: str | None = Field(
        default=None, description="Artifacts location (path, file://, s3://); default runs/<run_name>."
    )
    stages: list[str] | None = Field(
        default=None, description="Run only these stage instances (their inputs must exist)."
    )
    task_retries: int = Field(
        default=2, ge=0, description="Retries of a failed stage (each resumes from its checkpoint)."
    )
    shared_ray: bool = Field(
        default=True,
        description="One Ray for the run: the flow starts a local Ray head, every stage "
        "job joins it instead of starting its own Ray (seconds per stage; the workers are then "
        "the head's processes, not the job's), and the head stops with the run. False: each job "
        "starts its own Ray. Ignored when RAY_ADDRESS is set (the jobs join that cluster).",
    )


def preset_path(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml"):
        return path if path.is_absolute() else ROOT / path
    path = PRESETS / f"{preset}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise ConfigError(f"unknown preset {preset!r}: choose one of {names} or give a .yaml path")
    return path


def resolve(params: PipelineParams) -> tuple[PipelineConfig, str]:
    """The run's config (preset + overrides + run_uri) and its URI; credentials must come from the environment."""
    for item in params.overrides:
        if item.split("=", 1)[0].strip() in SECRET_KEYS:
            raise ConfigError(
                f"'{item.split('=', 1)[0]}' cannot be a flow parameter (parameters are stored by Prefect): set "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the worker's environment"
            )
        key, _, value = item.partition("=")
        if key.strip().endswith("remote_rm_url") and redact_url(value.strip()) != value.strip():
            raise ConfigError(
                f"'{key.strip()}': a reward server URL with credentials or a query string cannot be a flow parameter "
                "(parameters are stored by Prefect): put it in the preset file"
            )
        if item.split("=", 1)[0].strip() == "run_uri":  # the flow sets it last: an override would be lost
            raise ConfigError(
                f"'{item}': the run's location is the run_uri parameter (rlhf run --run-uri ...), not an override"
            )
    run_uri = params.run_uri or f"runs/{params.run_name}"
    if "://" not in run_uri and not Path(run_uri).is_absolute():
        run_uri = str(ROOT / run_uri)
    cfg = load_config(preset_path(params.preset), [*params.overrides, f"run_uri={run_uri}"])
    if cfg.storage.key or cfg.storage.secret:
        raise ConfigError(
            "the pipeline takes S3 credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY only: "
            "remove storage.key / storage.secret from the preset"
        )
    return cfg, run_uri


def result_storage(cfg: PipelineConfig) -> Any:
    """Prefect result storage inside the run's own location (a saved block: Prefect requires one)."""
    base = open_store(cfg).uri(run_layout.RESULTS)
    name = "rlhf-results-" + hashlib.sha256(base.encode()).hexdigest()[:12]
    if "://" in base and not base.startswith("file://"):
        endpoint = cfg.storage.endpoint_url
        settings = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
        block = RemoteFileSystem(basepath=base, settings=settings)  # keys come from the environment, never stored
    else:
        block = LocalFileSystem(basepath=base.removeprefix("file://"))
    block.save(name, overwrite=True)
    return block


def _kill_jobs(flow, flow_run, state) -> None:  # Prefect hook signature
    kill_all_jobs()


@flow(name="rlhf-pipeline", log_prints=True, on_cancellation=[_kill_jobs], on_crashed=[_kill_jobs])
def rlhf_pipeline(params: PipelineParams = PipelineParams()) -> dict:  # noqa: B008 (the UI form's defaults)
    logger = get_run_logger()
    cfg, run_uri = resolve(params)
    store = open_store(cfg)
    store.write_text(run_layout.CONFIG, to_yaml(cfg))
    store.write_json(run_layout.PARAMS, params.model_dump())
    create_markdown_artifact(f"```yaml\n{to_yaml(cfg)}```", key="resolved-config", description=f"config of {run_uri}")
    run = RunSpec(params.run_name, run_uri, _local_config(cfg, params.run_name))
    storage = result_storage(cfg)

    order = cfg.order()
    if params.stages is not None:
        unknown = [s for s in params.stages if s not in order]
        if unknown:
            raise ConfigError(f"unknown stage(s) {unknown} in 'stages': this preset has {', '.join(order)}")
    wanted = [s for s in order if params.stages is None or s in params.stages]
    refs: dict[str, dict] = existing_refs(cfg, [s for s in order if s not in wanted]) if params.stages else {}
    rows: list[dict] = []
    failure: BaseException | None = None
    with shared_ray(cfg, wanted) if params.shared_ray else contextlib.nullcontext() as address:
        if address:
            logger.info(f"the stage jobs join the run's Ray at {address}")
        for stage in wanted:
            started = time.time()
            task = stage_task(stage, cfg.kind(stage), storage, params.task_retries)
            state = task(run, stage, dict(refs), return_state=True)
            duration_s = time.time() - started
            ref = state.result() if state.is_completed() else None
            if ref is not None:
                refs[stage] = ref
            row = stage_row(stage, cfg.kind(stage), state, duration_s, ref)
            rows.append(row)
            progress.publish(
                {
                    "event": "finished",
                    "stage": stage,
                    "kind": row["kind"],
                    "state": state.name,
                    "duration_s": row["duration_s"],
                    "metrics": ref["metrics"] if ref is not None else {},
                }
            )
            logger.info(f"{stage}: {state.name} in {row['duration_s']} s")
            if not state.is_completed():
                failure = state.result(raise_on_failure=False)
                break
    summary = {
        "run_name": params.run_name,
        "run_uri": run_uri,
        "stages": rows,
        "state": "Failed" if failure else "Completed",
    }
    if cfg.iterations:
        summary["iterations"] = iteration_rows(cfg, refs)
        create_table_artifact(
            summary["iterations"],
            key="gold-per-iteration",
            description=f"{params.run_name}: gold reward (and KL to the reference) per loop iteration; iteration 0 = "
            "the stages before the loop",
        )
    store.write_json(run_layout.SUMMARY, summary)
    create_markdown_artifact(summary_markdown(summary), key="run-summary", description=f"{params.run_name}")
    if failure is not None:
        raise failure if isinstance(failure, BaseException) else RuntimeError(str(failure))
    return summary


def _local_config(cfg: PipelineConfig, run_name: str) -> str:
    """The resolved config as a local YAML file for the stage jobs (credentials stay in the environment)."""
    folder = ROOT / ".rlhf" / "configs"
    folder.mkdir(parents=True, exist_ok=True)
    text = to_yaml(cfg)
    path = folder / f"{run_name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    path.write_text(text.replace("'***'", "null"))
    return str(path)


if __name__ == "__main__":
    print(json.dumps(rlhf_pipeline(), indent=2))
