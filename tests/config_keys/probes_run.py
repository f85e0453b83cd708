"""Probes of the run-level keys: where the run writes (run_uri, storage), the loop (the stage graph of the ``LOOP``
preset) and tracking (what the trackers write)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_core.config import PipelineConfig, stage_hash
from rlhf_core.run_layout import open_store
from tests.config_keys.harness import LOOP, Probe, outcome, probe

# ---------------------------------------------------------------------------------------------------------------------
# Where the run writes: run_uri and the storage section


def store_location(cfg: PipelineConfig, stage: str) -> tuple[str, dict]:
    """Where and how the run's object store writes (run_layout.open_store: root URI, fsspec storage options)."""
    store = open_store(cfg)
    return store.uri(stage), store.fs.storage_options


RUN_LEVEL: dict[str, Probe] = {
    "run_uri": probe("run_uri={tmp}/elsewhere", observe=store_location),
    "storage.endpoint_url": probe(
        "storage.endpoint_url=http://127.0.0.1:9", observe=store_location, base=("run_uri=s3://probe-bucket/run",)
    ),
    "storage.key": probe("storage.key=probe-key", observe=store_location, base=("run_uri=s3://probe-bucket/run",)),
    "storage.secret": probe(
        "storage.secret=probe-secret", observe=store_location, base=("run_uri=s3://probe-bucket/run",)
    ),
    "storage.region": probe(
        "storage.region=eu-probe-1", observe=store_location, base=("run_uri=s3://probe-bucket/run",)
    ),
}


# ---------------------------------------------------------------------------------------------------------------------
# The loop section: the stage graph the pipeline walks (on the LOOP preset)


def stage_graph(cfg: PipelineConfig, stage: str) -> dict:
    """The run's stage graph as the pipeline walks it (cfg.order()): each instance's kind, loop iteration (cfg.
    iterations), the stages it reads and its config hash."""
    return {
        name: {
            "kind": cfg.kind(name),
            "iteration": cfg.iterations.get(name),
            "upstream": cfg.spec(name).upstream_names(),
            "hash": stage_hash(cfg.stage(name)),
        }
        for name in cfg.order()
    }


LOOP_SECTION: dict[str, Probe] = {
    "loop.iterations": probe(
        "loop.iterations=3",
        observe=stage_graph,
        preset=LOOP,
        expect=lambda a, b: (
            set(b) - set(a) == {"generate_3", "score_3", "dpo_3", "sft_best_3"}
            and b["generate_3"]["upstream"] == ["dpo_2"]
            and b["generate_3"]["iteration"] == 3
        ),
    ),
    "loop.policy": probe(
        "loop.policy=builtin:small",
        observe=stage_graph,
        preset=LOOP,
        expect=lambda a, b: (
            (a["generate_1"]["upstream"], b["generate_1"]["upstream"]) == (["sft"], [])
            and a["generate_2"] == b["generate_2"]
        ),
    ),
    "loop.next_policy": probe(
        "loop.next_policy=sft_best",
        observe=stage_graph,
        preset=LOOP,
        expect=lambda a, b: (
            (a["dpo_2"]["upstream"], b["dpo_2"]["upstream"]) == (["dpo_1", "score_2"], ["score_2", "sft_best_1"])
        ),
    ),
    "loop.stages": probe(
        "loop.stages.extra={{kind: generate, model: {{name_or_path: 'loop:policy'}}, data: {{train_path: "
        "rlhf_core/assets/data/synthetic/prompts_eval.jsonl, input_key: prompt}}}}",
        observe=stage_graph,
        preset=LOOP,
        expect=lambda a, b: set(b) - set(a) == {"extra_1", "extra_2"} and b["extra_2"]["upstream"] == ["dpo_1"],
    ),
}


# ---------------------------------------------------------------------------------------------------------------------
# The tracking section: what the trackers write


def trackers_written(cfg: PipelineConfig, stage: str) -> Any:
    """rlhf_core.tracking: the sft stage's trackers opened as its rank 0 opens them, one step logged, closed; what
    each wrote, read back (TensorBoard folders, MLflow runs, the W&B offline run record), the run folder's name
    written as <run>."""
    from rlhf_core import tracking
    from tests.test_tracking import wandb_records

    def run() -> dict:
        store = open_store(cfg)
        with tracking.Tracker(tracking.spec_for(cfg, "sft", store)) as tracker:
            tracker.log(1, {"loss": 1.0})
        root = Path(store.root_uri)
        folder = root.name

        def plain(name: str) -> str:
            return name.replace(folder, "<run>")

        out: dict[str, Any] = {"tensorboard": sorted(p.name for p in (root / "tensorboard").glob("*"))}
        if cfg.tracking.mlflow is not None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=cfg.tracking.mlflow.tracking_uri)
            exp = client.get_experiment_by_name(cfg.tracking.mlflow.experiment)
            runs = client.search_runs([exp.experiment_id]) if exp is not None else []
            mine = [r for r in runs if r.data.tags.get("rlhf.run_uri") == store.root_uri]
            out["mlflow"] = (
                cfg.tracking.mlflow.tracking_uri.rsplit("/", 1)[-1],
                exp.name if exp else None,
                [(plain(r.info.run_name), r.info.status, r.data.metrics) for r in mine],
            )
        for run_file in (root / "wandb").glob("offline-run-*/run-*.wandb"):
            for record in wandb_records(run_file):
                if record.HasField("run"):
                    r = record.run
                    out["wandb"] = (r.project, r.entity, plain(r.display_name))
        return out

    return outcome(run)


TRACKING: dict[str, Probe] = {
    "tracking.tensorboard": probe(
        "tracking.tensorboard=true",
        observe=trackers_written,
        expect=lambda a, b: (a["tensorboard"], b["tensorboard"]) == ([], ["sft"]),
    ),
    "tracking.mlflow.tracking_uri": probe(
        "tracking.mlflow.tracking_uri=sqlite:///{tmp}/mlflow-b.db",
        observe=trackers_written,
        base=("tracking.mlflow.tracking_uri=sqlite:///{tmp}/mlflow-a.db",),
        expect=lambda a, b: (a["mlflow"][0], b["mlflow"][0]) == ("mlflow-a.db", "mlflow-b.db"),
    ),
    "tracking.mlflow.experiment": probe(
        "tracking.mlflow.experiment=probe-b",
        observe=trackers_written,
        base=("tracking.mlflow.tracking_uri=sqlite:///{tmp}/mlflow-a.db",),
        expect=lambda a, b: b["mlflow"][1:] == ("probe-b", [("<run>/sft", "FINISHED", {"loss": 1.0})]),
    ),
    "tracking.run_name": probe(
        "tracking.run_name=probe",
        observe=trackers_written,
        base=("tracking.tensorboard=true", "tracking.mlflow.tracking_uri=sqlite:///{tmp}/mlflow-a.db"),
        expect=lambda a, b: (a["mlflow"][2][0][0], b["mlflow"][2][0][0]) == ("<run>/sft", "probe/sft"),
    ),
    "tracking.wandb.project": probe(
        "tracking.wandb.project=probe-b",
        observe=trackers_written,
        base=("tracking.wandb.project=probe-a",),
        expect=lambda a, b: (a["wandb"], b["wandb"]) == (("probe-a", "", "<run>/sft"), ("probe-b", "", "<run>/sft")),
    ),
    "tracking.wandb.entity": probe(
        "tracking.wandb.entity=probe-team",
        observe=trackers_written,
        base=("tracking.wandb.project=probe-a",),
        expect=lambda a, b: b["wandb"] == ("probe-a", "probe-team", "<run>/sft"),
    ),
    "tracking.wandb.mode": probe(  # online needs WANDB_API_KEY, which the tests never have: refused before any run
        "tracking.wandb.mode=online",
        observe=trackers_written,
        base=("tracking.wandb.project=probe-a",),
        expect=lambda a, b: "wandb" in a and b == ("raised", "ConfigError"),
    ),
}
