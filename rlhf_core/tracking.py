"""Experiment trackers: every logged step of a stage also goes to TensorBoard, MLflow and/or Weights & Biases.

The run-level ``tracking:`` section (``config.TrackingConfig``; not part of any stage's config hash, so turning a
tracker on reruns nothing) picks them; all are off by default. Each stage is one tracker run, named
``<run_name>/<stage>`` (``run_name`` defaults to the last folder of ``run_uri``):

- TensorBoard: event files under ``<run_uri>/tensorboard/<stage>/``, so ``tensorboard --logdir <run_uri>`` shows one
  run per stage, the scalar tags the metric names (``loss``, ``reward``, ``kl``...) at the global step.
- MLflow: one run per stage in ``tracking.mlflow.experiment``, its params the stage's resolved section (secrets
  redacted), status FINISHED or FAILED.
- W&B: one run per stage; ``offline`` writes it under ``<run_uri>/wandb/`` (``wandb sync`` uploads it), ``online``
  streams it, the key read from ``WANDB_API_KEY`` only.

Files go straight into a local run folder; for an object store (``s3://``, ``memory://``) they are written in a
scratch folder and copied into the store at each flush and at the end. The job's driver resolves a ``TrackingSpec``
(plain data, it travels to Ray workers); whoever calls ``events.step`` (the supervised trainer's rank 0, the PPO
controller) opens a ``Tracker`` from it and logs the same metrics. A tracker that fails (a server gone mid-run) is
dropped with one warning: tracking never stops training. The packages are imported only inside the loggers;
``check`` refuses a tracker whose package is missing before any worker starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlhf_core import curves, run_layout
from rlhf_core.config import ConfigError, PipelineConfig, TrackingConfig, flatten, redact_tracking_uri, to_dict
from rlhf_core.errors import one_line
from rlhf_core.storage import ObjectStore, redact

# config key -> (module imported, pip package)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb"),
}
WANDB_KEY_ENV = "WANDB_API_KEY"
FLUSH_S = 30.0  # files reach an object store at most this long after a step (and at the end of the stage)


@dataclass
class TrackingSpec:
    """What one stage's trackers need, resolved by the job's driver."""

    config: TrackingConfig
    stage: str
    kind: str
    run_uri: str
    storage_options: dict = field(repr=False)
    run_name: str  # <run_name>/<stage>
    params: dict  # the stage's resolved section, flattened, secrets redacted


def enabled(t: TrackingConfig) -> list[str]:
    """The config keys of the trackers that are on, in ``PACKAGES`` order."""
    on = {"tensorboard": t.tensorboard, "mlflow": t.mlflow is not None, "wandb": t.wandb is not None}
    return [key for key in PACKAGES if on[key]]


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def check(t: TrackingConfig) -> None:
    """Refuse, before any worker starts, a tracker whose package is not installed or that lacks its credentials."""
    for key in enabled(t):
        module, package = PACKAGES[key]
        if not _installed(module):
            value = "true" if key == "tensorboard" else "null"
            raise ConfigError(
                f"'tracking.{key}' is set but the {package} package is not installed: "
                f"pip install {package}, or set tracking.{key}={value}"
            )
    if t.wandb is not None and t.wandb.mode == "online" and not os.environ.get(WANDB_KEY_ENV):
        raise ConfigError(
            f"'tracking.wandb.mode' = online needs {WANDB_KEY_ENV} in the environment (the key is "
            "never read from the config): export it, or set tracking.wandb.mode=offline"
        )


def spec_for(cfg: PipelineConfig, stage: str, store: ObjectStore) -> TrackingSpec | None:
    """The stage's ``TrackingSpec``; None when no tracker is on."""
    t = cfg.tracking
    if not enabled(t):
        return None
    check(t)
    run_name = t.run_name or cfg.run_uri.rstrip("/").rsplit("/", 1)[-1] or "run"
    section = to_dict(cfg)["stages"][stage]  # remote_rm_url without credentials
    secrets = [cfg.storage.key, cfg.storage.secret, *_env_secrets()]
    params = {k: redact(str(v), secrets) for k, v in flatten(section).items()}
    return TrackingSpec(
        t, stage, cfg.kind(stage), store.root_uri, store.fs.storage_options, f"{run_name}/{stage}", params
    )


def _env_secrets() -> list[str | None]:
    names = (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        WANDB_KEY_ENV,
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
    )
    return [os.environ.get(k) for k in names]


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a step's metrics (bools, lists and NaN left out)."""
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and not isinstance(v, (list, dict)):
            v = v.item()
        if curves.is_number(v):
            out[k] = float(v)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The loggers: one per tracker, each importing its package itself


class _TensorBoard:
    key = "tensorboard"

    def __init__(self, spec: TrackingSpec, local_root: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.rel = run_layout.tensorboard(spec.stage)
        self.dir = local_root / self.rel
        self.writer = SummaryWriter(log_dir=str(self.dir), flush_secs=int(FLUSH_S))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()

    def abandon(self) -> None:
        self.writer.close()


class _MLflow:
    key = "mlflow"

    def __init__(self, spec: TrackingSpec, local_root: Path):
        # A server that is down must not hold training for minutes: MLflow's default is 7 retries with backoff.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        c = spec.config.mlflow
        assert c is not None
        self.client = MlflowClient(tracking_uri=c.tracking_uri)
        experiment = self.client.get_experiment_by_name(c.experiment)
        exp_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(c.experiment)
        tags = {"rlhf.stage": spec.stage, "rlhf.kind": spec.kind, "rlhf.run_uri": spec.run_uri}
        self.run_id = self.client.create_run(exp_id, run_name=spec.run_name, tags=tags).info.run_id
        params = [Param(k, v[:6000]) for k, v in spec.params.items()]  # MLflow's limit on a param value
        for lo in range(0, len(params), 100):  # at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[lo : lo + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for lo in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[lo : lo + 1000])

    def flush(self) -> None:
        pass

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")

    def abandon(self) -> None:
        pass


def _mlflow_name(name: str) -> str:
    # MLflow allows letters, digits, _ - . space : / in metric names
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in name)


class _Wandb:
    key = "wandb"

    def __init__(self, spec: TrackingSpec, local_root: Path):
        import wandb

        c = spec.config.wandb
        assert c is not None
        local_root.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        self.run = wandb.init(
            project=c.project,
            entity=c.entity,
            mode=c.mode,
            name=spec.run_name,
            group=spec.run_name.split("/")[0],
            job_type=spec.kind,
            dir=str(local_root),
            config=spec.params,
            reinit="create_new",
            settings=settings,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def flush(self) -> None:
        pass

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)

    def abandon(self) -> None:
        self.run.finish(exit_code=1)


LOGGERS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _Wandb}


# ---------------------------------------------------------------------------------------------------------------------
# The stage's trackers together


class Tracker:
    """The trackers of one stage: ``log`` each logged step, then ``close`` (or use it as a context manager, which
    closes it as failed when the stage raises). A tracker that raises is dropped with one warning."""

    def __init__(self, spec: TrackingSpec | None):
        self.spec = spec
        self.loggers: list[Any] = []
        self.store: ObjectStore | None = None
        self.scratch: Path | None = None
        self.last_flush = time.monotonic()
        if spec is None:
            return
        self.store = ObjectStore(spec.run_uri, spec.storage_options)
        local = self.store.local_root
        if local is None:  # an object store: write here, copy at each flush
            self.scratch = Path(tempfile.mkdtemp(prefix=f"tracking-{spec.stage}-"))
        self.local_root = local if local is not None else self.scratch
        for key in enabled(spec.config):
            self._guard(key, "opening", lambda key=key: self.loggers.append(LOGGERS[key](spec, self.local_root)))

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(failed=exc_type is not None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.loggers:
            return
        values = numeric(metrics)
        for logger in list(self.loggers):
            self._guard(logger.key, "logging", lambda logger=logger: logger.log(int(step), values), logger)
        if time.monotonic() - self.last_flush >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        for logger in list(self.loggers):
            self._guard(logger.key, "flushing", logger.flush, logger)
        self._copy_to_store()
        self.last_flush = time.monotonic()

    def close(self, failed: bool = False) -> None:
        """Close every tracker (MLflow status FAILED / W&B exit code 1 when ``failed``) and copy the files out."""
        while self.loggers:
            logger = self.loggers.pop(0)
            self._guard(logger.key, "closing", lambda logger=logger: logger.close(failed))
        self._copy_to_store()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def _copy_to_store(self) -> None:
        scratch, store = self.scratch, self.store
        if scratch is None or store is None:
            return
        for rel in run_layout.TRACKER_DIRS:
            if (scratch / rel).is_dir():
                self._guard(rel, "copying files", lambda rel=rel: store.upload_files(scratch / rel, rel))

    def _guard(self, key: str, action: str, fn: Any, logger: Any = None) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a tracker must never stop training
            assert self.spec is not None
            if logger is not None and logger in self.loggers:
                self.loggers.remove(logger)
                with contextlib.suppress(Exception):  # it has failed already; it is dropped either way
                    logger.abandon()
            text = self.redact(one_line(f"{type(e).__name__}: {e}"))
            warnings.warn(
                f"[{self.spec.stage}] tracking.{key}: {action} failed ({text[:300]}); the stage goes on without it",
                RuntimeWarning,
                stacklevel=3,
            )

    def redact(self, text: str) -> str:
        """``text`` without the MLflow URI's user:password and the keys in the environment."""
        assert self.spec is not None
        secrets: list[str | None] = [*_env_secrets()]
        m = self.spec.config.mlflow
        if m is not None and m.tracking_uri:
            text = text.replace(m.tracking_uri, redact_tracking_uri(m.tracking_uri))
            try:
                parts = urlsplit(m.tracking_uri)
                secrets += [parts.password, parts.username]
            except ValueError:
                pass
        return redact(text, secrets)
