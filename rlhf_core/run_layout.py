"""The run folder: every path under a run's location (``run_uri``), named once, and the store that holds them.

    <run_uri>/
      config.yaml                 the resolved config (pipeline runs; credentials redacted)
      pipeline.json               the flow parameters, for ``rlhf resume``
      run_summary.json            the flow's summary: a row per stage with its key metrics (``SUMMARY_METRICS``)
      <stage>/                    the stage's committed output (``manifest.json`` last, ``rlhf_core.storage``)
        metrics.json              ``{"history": [...], "final": {...}}``
        curves.png                the training curves (``rlhf_core.curves``)
        checkpoints/step_<N>/     in-stage checkpoints (``trainer_state.json``, PPO: ``controller_state.json``)
        critic/                   PPO with a critic: the trained critic, beside the policy
        data.<jsonl|parquet>      generate/score: the stage's dataset (``rlhf_core.data.datasets``)
        reference_logprobs/       DPO/KTO with ``ref_logprobs: precompute``
      tensorboard/<stage>/, wandb/  experiment trackers' files (``rlhf_core.tracking``)
      _leases/<stage>.json        one writer per stage (``rlhf_core.lease``)
      _launches/<stage>-<ns>.json one record per launched stage job (``tasks.launch``)
      _prefect/results/<key>      Prefect task results (``tasks.stages``)

Paths here are relative to the run's root, as ``ObjectStore`` takes them. Folders whose names start with ``_`` or
``.`` are the run's bookkeeping, never stage outputs.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import STAGE_PREFIX, PipelineConfig
from rlhf_core.storage import NEXT_SUFFIX, ArtifactError, ObjectStore, check_location, storage_options_for
from rlhf_core.types import CheckpointRef

CONFIG = "config.yaml"
PARAMS = "pipeline.json"
SUMMARY = "run_summary.json"
METRICS = "metrics.json"
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
CONTROLLER_STATE = "controller_state.json"
REFERENCE_LOGPROBS = "reference_logprobs"
CRITIC = "critic"
TENSORBOARD = "tensorboard"
WANDB = "wandb"  # W&B names its folder itself, under the folder it is given (the run's root)
TRACKER_DIRS = (TENSORBOARD, WANDB)
LEASES = "_leases"
LAUNCHES = "_launches"
RESULTS = "_prefect/results"

# The key metrics of a stage, in the order the summaries show them (the in-process pipeline's printout, the flow's
# run_summary.json and markdown artifact); a stage shows those it has.
SUMMARY_METRICS = (
    "loss_start",
    "loss_end",
    "eval_loss",
    "eval_accuracy",
    "reward_mean",
    "reward_std",
    "steps",
    "resumed_from_step",
    "critic_loss",
    "gold_reward_before",
    "gold_reward_after",
    "rm_score_before",
    "rm_score_after",
    "kl_to_ref_after",
    "eval_margin",
    "gold_reward",
    "kl_to_ref",
    "responses",
    "rows_out",
    "score_mean",
)


def summary_metrics(metrics: dict) -> dict:
    """The ``SUMMARY_METRICS`` a stage's final metrics hold (None values left out), in that order."""
    return {k: metrics[k] for k in SUMMARY_METRICS if metrics.get(k) is not None}


# ---------------------------------------------------------------------------------------------------------------------
# Paths


def metrics(stage: str) -> str:
    return f"{stage}/{METRICS}"


def curves(stage: str) -> str:
    return f"{stage}/{CURVES}"


def checkpoints(stage: str) -> str:
    """The folder of the stage's in-stage checkpoints."""
    return f"{stage}/{CHECKPOINTS}"


def checkpoint(stage: str, step: int) -> str:
    """The checkpoint of ``step``; zero-padded, so that names sort by step."""
    return f"{checkpoints(stage)}/step_{step:08d}"


def critic(stage: str) -> str:
    return f"{stage}/{CRITIC}"


def dataset_file(fmt: str) -> str:
    """The name of a dataset stage's file inside its folder (``jsonl`` or ``parquet``)."""
    return f"data.{fmt}"


def reference_logprobs(stage: str) -> str:
    return f"{stage}/{REFERENCE_LOGPROBS}"


def tensorboard(stage: str) -> str:
    return f"{TENSORBOARD}/{stage}"


def lease(stage: str) -> str:
    return f"{LEASES}/{stage}.json"


def launch(stage: str, time_ns: int) -> str:
    return f"{LAUNCHES}/{stage}-{time_ns}.json"


def result(key: str) -> str:
    return f"{RESULTS}/{key}"


def is_stage_dir(name: str) -> bool:
    """Whether a top-level folder of the run can be a stage's output (not bookkeeping, not a half-written
    replacement ``<stage>.next``)."""
    return not name.startswith(("_", ".")) and not name.endswith(NEXT_SUFFIX)


# ---------------------------------------------------------------------------------------------------------------------
# The store and the stage outputs in it


def open_store(cfg: PipelineConfig, *, check: bool = False) -> ObjectStore:
    """The run's object store; a plain local ``run_uri`` is made absolute so that every worker writes to one place.
    ``check``: first refuse a location that is of an unsupported scheme, unreachable within a bounded time, not
    writable or an existing file (``storage.check_location``: StorageError, one line)."""
    s = cfg.storage
    uri = cfg.run_uri if "://" in cfg.run_uri else str(Path(cfg.run_uri).resolve())
    options = storage_options_for(uri, endpoint_url=s.endpoint_url, key=s.key, secret=s.secret, region=s.region)
    if check:
        check_location(uri, options)
    return ObjectStore(uri, options)


def committed_ref(store: ObjectStore, stage: str) -> CheckpointRef | None:
    """The stage's committed output (verified manifest) as a reference, whatever config made it; else None."""
    if not store.is_complete(stage):
        return None
    m = store.read_manifest(stage, verify=False)
    return CheckpointRef(store.uri(stage), stage, int(m.metrics.get("steps", 0)), m.config_hash, m.metrics)


def existing_output(store: ObjectStore, stage: str, config_hash: str) -> CheckpointRef | None:
    """The stage's committed output when it was made with the same config hash (then there is nothing to do)."""
    ref = committed_ref(store, stage)
    return ref if ref is not None and ref.config_hash == config_hash else None


def upstream_hash(store: ObjectStore, path: str, key: str) -> dict[str, str]:
    """{upstream stage: config hash} when ``path`` names an earlier stage (read from its manifest), else {}."""
    if not path.startswith(STAGE_PREFIX):
        return {}
    name = path[len(STAGE_PREFIX) :]
    try:
        return {name: store.read_manifest(name, verify=False).config_hash}
    except ArtifactError as e:
        raise ArtifactError(f"'{key}' = {path}: the {name} stage has no complete output ({e})") from None
