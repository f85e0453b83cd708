"""One generic Prefect task that runs any stage instance of a preset, and the helpers the flow needs around it.

Every instance becomes a task run named after it (``sft``, ``sft_b``, ``ppo``...), launched through the same
``run_stage`` task, whose retry, timeout and cache policy stand here in ``STAGE_TASK_OPTIONS``. It returns only a
reference (URI, step, config hash, metrics).

Cache key: run name + stage name + the stage's config hash, which covers the stage's resolved config and the
config hashes of the upstream stages it reads, so changing one stage reruns it and everything after it and nothing
before. A cached result is trusted only while the stage's ``manifest.json`` is there, verifies and carries that
hash; otherwise the cached record is deleted before the lookup and the stage runs (resuming from its newest
in-stage checkpoint). Results live in the run's own location, ``<run_uri>/_prefect/results/<key>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.states import Completed

from rlhf_core import run_layout
from rlhf_core.config import STAGE_KINDS, PipelineConfig, load_config, stage_hash
from rlhf_core.run_layout import committed_ref, existing_output, open_store
from rlhf_core.timing import phase_rows
from tasks import progress
from tasks.launch import StageJobError, launch_stage
from tasks.live_curves import LiveCurves


@dataclass(frozen=True)
class RunSpec:
    """What every stage task needs: the run's name and location and the resolved config file (no secrets)."""

    run_name: str
    run_uri: str
    config_path: str


def expected_hash(cfg: PipelineConfig, stage: str, upstream: dict[str, dict]) -> str:
    """The config hash the job will compute: its section plus the hashes of the upstream outputs it reads."""
    spec = cfg.spec(stage)
    return stage_hash(spec.section, {name: upstream[name]["config_hash"] for name in spec.upstream_names()})


def stage_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    run: RunSpec = parameters["run"]
    stage: str = parameters["stage"]
    cfg = load_config(run.config_path)
    config_hash = expected_hash(cfg, stage, parameters["upstream"])
    key = f"rlhf-{run.run_name}-{stage}-{config_hash}"
    store = open_store(cfg)
    if existing_output(store, stage, config_hash) is None:
        store.delete(run_layout.result(key))  # a cached reference to an output that is gone or changed: drop it
    return key


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Retry crashes, timeouts and failed jobs, but not a job that refused its config or data (exit status 2)."""
    error = state.result(raise_on_failure=False)
    return not (isinstance(error, StageJobError) and error.bad_input)


# The policy of every stage task, in one place. The flow sets per run: the task's name (the instance), the result
# storage (inside the run's location) and the retry count (a flow parameter).
STAGE_TASK_OPTIONS: dict[str, Any] = dict(
    retries=2,
    retry_delay_seconds=[10, 60],
    retry_condition_fn=worth_retrying,
    timeout_seconds=6 * 3600,
    cache_key_fn=stage_cache_key,
    persist_result=True,
)


@task(name="stage", **STAGE_TASK_OPTIONS)
def run_stage(run: RunSpec, stage: str, upstream: dict[str, dict]) -> Any:
    """Run one stage instance as its job (``python -m rlhf_core.jobs.<kind> --stage <name>``); a stage whose output
    is committed for its config hash ends Cached without a launch, whether or not its task result was saved."""
    logger = get_run_logger()
    cfg = load_config(run.config_path)
    spec = cfg.spec(stage)
    missing = [name for name in spec.upstream_names() if name not in upstream]
    assert not missing, f"{stage} needs the references of {missing}"
    store = open_store(cfg)
    done = existing_output(store, stage, expected_hash(cfg, stage, upstream))
    if done is not None:  # committed and verified, but its task result was never saved (e.g. the machine died)
        logger.info(f"{stage}: {done.uri} is committed for this config; nothing to run")
        return Completed(name="Cached", data=done.to_dict(), message="output committed in the run's location")
    key = stage.replace("_", "-")
    context = TaskRunContext.get()
    attempt = context.task_run.run_count if context is not None else 1
    progress.publish({"event": "started", "stage": stage, "kind": spec.kind, "attempt": attempt})
    # Prefect types its sync-or-async calls as either; called from a sync task they return the id itself
    bar = cast(UUID, create_progress_artifact(progress=0.0, key=f"{key}-progress", description=f"{stage}: steps done"))
    live = LiveCurves(stage, spec.kind, key)

    def on_event(event: dict) -> None:  # the launcher's watcher thread
        if event["event"] == "step":
            update_progress_artifact(bar, 100.0 * event["step"] / event["total"])
            live.add(event)
        progress.publish(event)

    try:
        ref = launch_stage(stage, STAGE_KINDS[spec.kind].job, run.config_path, store, logger.info, on_event=on_event)
    except StageJobError:
        live.finish(store, failed=True)
        raise
    update_progress_artifact(bar, 100.0)
    live.finish(store)
    rows = [{"metric": k, "value": v} for k, v in ref["metrics"].items()]
    create_table_artifact(rows, key=f"{key}-metrics", description=f"{stage} ({spec.kind}) metrics ({ref['uri']})")
    phases = phase_rows(ref["metrics"])  # stages that time their steps (timing/<phase>_s_mean): one row per phase
    if phases:
        steps = int(ref["metrics"].get("timing/steps", 0))
        create_table_artifact(
            phases,
            key=f"{key}-timing",
            description=f"{stage} ({spec.kind}): seconds per step phase, mean and total over {steps} steps, and the "
            "share of the step (concurrent phases overlap)",
        )
    return ref


def stage_task(stage: str, kind: str, result_storage: Any, retries: int) -> Any:
    """The task for one instance: ``run_stage`` named after it."""
    return run_stage.with_options(
        name=stage,
        task_run_name=stage,
        description=STAGE_KINDS[kind].description,
        result_storage=result_storage,
        retries=retries,
    )


def existing_refs(cfg: PipelineConfig, names: list[str]) -> dict[str, dict]:
    """References of the given stages' committed outputs in the run (for a partial run), where they exist."""
    store = open_store(cfg)
    refs = {name: committed_ref(store, name) for name in names}
    return {name: ref.to_dict() for name, ref in refs.items() if ref is not None}
