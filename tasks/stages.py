"""One Prefect task per stage. Each launches its job and returns only a reference (URI, step, config hash, metrics).

Cache key: run name + stage + the stage's config hash, which covers the stage's resolved config and the config
hashes of the upstream stages it reads, so changing one stage reruns it and everything after it and nothing
before. A cached result is trusted only while the stage's ``manifest.json`` is there, verifies and carries that
hash; otherwise the cached record is deleted before the lookup and the stage runs (resuming from its newest
in-stage checkpoint). Results live in the run's own location, ``<run_uri>/_prefect/results/<key>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.context import TaskRunContext

from rlhf_core.config import ModelConfig, PipelineConfig, load_config, stage_hash
from rlhf_core.jobs.common import STAGE_PREFIX, existing_output, open_store
from tasks._launch import StageJobError, launch_stage

RESULTS = "_prefect/results"  # under the run's location; flows.rlhf_pipeline.result_storage points there
RETRY_DELAYS = [10, 60]
STAGE_TIMEOUT_S = 6 * 3600


@dataclass(frozen=True)
class RunSpec:
    """What every stage task needs: the run's name and location and the resolved config file (no secrets)."""

    run_name: str
    run_uri: str
    config_path: str


def upstream_stages(section: Any) -> list[str]:
    """Stages named by ``stage:<name>`` in a section's model paths (a PPO reference defaults to the actor)."""
    names = []
    for value in vars(section).values():
        if isinstance(value, ModelConfig) and value.name_or_path.startswith(STAGE_PREFIX):
            names.append(value.name_or_path[len(STAGE_PREFIX) :])
    return sorted(set(names))


def expected_hash(cfg: PipelineConfig, stage: str, upstream: dict[str, dict]) -> str:
    """The config hash the job will compute: its section plus the hashes of the upstream outputs it reads."""
    section = cfg.stage(stage)
    return stage_hash(section, {name: upstream[name]["config_hash"] for name in upstream_stages(section)})


def cache_key_for(stage: str):
    def stage_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
        run: RunSpec = parameters["run"]
        cfg = load_config(run.config_path)
        config_hash = expected_hash(cfg, stage, parameters["upstream"])
        key = f"rlhf-{run.run_name}-{stage}-{config_hash}"
        store = open_store(cfg)
        if existing_output(store, stage, config_hash) is None:
            store.delete(f"{RESULTS}/{key}")  # a cached reference to an output that is gone or changed: drop it
        return key

    return stage_cache_key


def _run_stage(run: RunSpec, stage: str, upstream: dict[str, dict]) -> dict:
    logger = get_run_logger()
    cfg = load_config(run.config_path)
    missing = [name for name in upstream_stages(cfg.stage(stage)) if name not in upstream]
    assert not missing, f"{stage} needs the references of {missing}"
    key = stage.replace("_", "-")
    progress = create_progress_artifact(progress=0.0, key=f"{key}-progress", description=f"{stage}: steps done")
    ref = launch_stage(
        stage, run.config_path, open_store(cfg), logger.info,
        on_step=lambda done, total: update_progress_artifact(progress, 100.0 * done / total),
    )  # fmt: skip
    update_progress_artifact(progress, 100.0)
    rows = [{"metric": k, "value": v} for k, v in ref["metrics"].items()]
    create_table_artifact(rows, key=f"{key}-metrics", description=f"{stage} metrics ({ref['uri']})")
    return ref


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Retry crashes, timeouts and failed jobs, but not a job that refused its config or data (exit status 2)."""
    error = state.result(raise_on_failure=False)
    return not (isinstance(error, StageJobError) and error.bad_input)


def _options(stage: str) -> dict:
    return dict(
        name=stage.replace("_", "-"), retries=2, retry_delay_seconds=RETRY_DELAYS, timeout_seconds=STAGE_TIMEOUT_S,
        cache_key_fn=cache_key_for(stage), persist_result=True, retry_condition_fn=worth_retrying,
    )  # fmt: skip


@task(**_options("sft"))
def train_sft(run: RunSpec, upstream: dict[str, dict]) -> dict:
    """Supervised fine-tuning of the base model."""
    return _run_stage(run, "sft", upstream)


@task(**_options("reward_model"))
def train_reward_model(run: RunSpec, upstream: dict[str, dict]) -> dict:
    """Reward model on preference pairs, from the SFT model."""
    return _run_stage(run, "reward_model", upstream)


@task(**_options("critic_init"))
def init_critic_from_rm(run: RunSpec, upstream: dict[str, dict]) -> dict:
    """Critic = copy of the reward model."""
    return _run_stage(run, "critic_init", upstream)


@task(**_options("critic_warmup"))
def warm_up_critic(run: RunSpec, upstream: dict[str, dict]) -> dict:
    """PPO loop with the actor frozen: trains the critic only."""
    return _run_stage(run, "critic_warmup", upstream)


@task(**_options("ppo"))
def train_ppo(run: RunSpec, upstream: dict[str, dict]) -> dict:
    """Ray-distributed PPO."""
    return _run_stage(run, "ppo", upstream)


STAGE_TASKS = {
    "sft": train_sft,
    "reward_model": train_reward_model,
    "critic_init": init_critic_from_rm,
    "critic_warmup": warm_up_critic,
    "ppo": train_ppo,
}
