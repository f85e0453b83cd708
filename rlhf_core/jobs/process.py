"""The process of a stage job: ``python -m rlhf_core.jobs.<kind>``'s command line, its exit codes (2 and one line for
bad input, 1 and one line plus a traceback file for a failure), its lease, the signals and the orchestrator watch
that stop it, and its scratch folders.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import psutil

from rlhf_core import events
from rlhf_core.config import (
    ConfigError,
    PipelineConfig,
    load_config,
)
from rlhf_core.data.loading import DataError
from rlhf_core.errors import first_line, one_line
from rlhf_core.models.builders import ModelPathError
from rlhf_core.run_layout import open_store
from rlhf_core.storage import ArtifactError, redact
from rlhf_core.types import CheckpointRef

# Bad input: a config key, a data row, a model folder or a storage location the user must fix. A job exits with
# status 2 and one line (``exit_bad_input``), which the flow does not retry.
BAD_INPUT = (ConfigError, DataError, ModelPathError, ArtifactError)


def parse_args(kind: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m rlhf_core.jobs.{kind}",
        description=f"Run one {kind} stage of a preset alone. Overrides are dotted keys, e.g. "
        f"{kind}.train.max_steps=10.",
    )
    parser.add_argument("--config", required=True, help="YAML preset, e.g. deployments/configs/tiny.yaml")
    parser.add_argument("--stage", help=f"the stage instance to run (default: the preset's only {kind} stage)")
    parser.add_argument("--ref-out", help="also write the resulting CheckpointRef as JSON to this file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (YAML values)")
    return parser.parse_args(argv)


def stage_of_kind(cfg: PipelineConfig, kind: str, name: str | None) -> str:
    """The instance to run: ``name`` (checked to be of ``kind``), else the config's only instance of ``kind``."""
    if name is not None:
        if cfg.kind(name) != kind:
            raise ConfigError(
                f"stage '{name}' is of kind {cfg.kind(name)}, not {kind}: run it with "
                f"python -m rlhf_core.jobs.{cfg.kind(name)} --stage {name}"
            )
        return name
    names = [n for n, spec in cfg.stages.items() if spec.kind == kind]
    if len(names) != 1:
        found = ", ".join(names) or "none"
        raise ConfigError(f"give --stage: the config has {len(names)} stages of kind {kind} ({found})")
    return names[0]


ORCHESTRATOR_ENV = "RLHF_ORCHESTRATOR_PID"  # set by the launcher: the job stops when that process is gone


LOG_DIR_ENV = "RLHF_LOG_DIR"


def main(kind: str, run: Callable[[PipelineConfig, str], CheckpointRef], argv: list[str] | None = None) -> None:
    """``python -m rlhf_core.jobs.<kind> [--stage NAME]``: the stage under its lease (``rlhf_core.lease``: one
    writer per stage), its scratch folders removed on every way out.

    Bad input (config, data, model folders, storage) exits with status 2 and one line naming the file and row, the
    key or the location. Any other error exits with status 1 and one line naming the stage, the worker role and the
    cause, the full traceback going to the job's log file (``RLHF_LOG_DIR``, default ``.rlhf/logs``). Credentials
    are redacted from both. The result also goes out as a ``result`` event (``rlhf_core.events``) for the launcher.
    """
    from rlhf_core.lease import Lease

    args = parse_args(kind, argv)
    stage, secrets = args.stage or kind, env_secrets()
    previous = _stop_on_sigterm()
    watch = _watch_orchestrator(stage)
    try:
        cfg = load_config(args.config, args.overrides)
        secrets += [cfg.storage.key, cfg.storage.secret]
        stage = stage_of_kind(cfg, kind, args.stage)
        lease = Lease(open_store(cfg, check=True), stage, on_lost=lambda why: _stop_self(stage, why))
        with lease:
            ref = run(cfg, stage)
    except BAD_INPUT as e:
        exit_bad_input(e, secrets)
    except Exception as e:  # noqa: BLE001 - a failure inside the job or its workers: one line, traceback to the log
        log = _write_traceback(stage, e, secrets)
        print(f"error: [{stage}] {redact(describe_failure(e), secrets)} (traceback: {log})", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        watch.set()
        remove_scratch()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    events.result(stage, ref.to_dict())
    if args.ref_out:
        Path(args.ref_out).write_text(json.dumps(ref.to_dict()))
    print(f"[{stage}] done: {ref.uri} (step {ref.step}, config {ref.config_hash})")
    for key, value in ref.metrics.items():
        print(f"[{stage}]   {key}: {value}")


def env_secrets() -> list[str | None]:
    """The credentials in the environment, redacted from every error line and traceback a job writes."""
    return [os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]


def exit_bad_input(error: BaseException, secrets: list[str | None]) -> NoReturn:
    """Exit with status 2 and the ``BAD_INPUT`` error as one line on stderr, ``secrets`` redacted."""
    print(f"error: {redact(one_line(str(error)), secrets)}", file=sys.stderr)
    raise SystemExit(2) from None


def describe_failure(error: BaseException) -> str:
    """``<role> rank <r> failed: <Type>: <first line>`` for an error from a Ray worker, else ``<Type>: <line>``."""
    if "ray" in sys.modules:
        from rlhf_core.distributed.launcher import describe_worker_error

        described = describe_worker_error(error)
        if described is not None:
            return described
    return first_line(error, limit=None)


def _write_traceback(stage: str, error: BaseException, secrets: list[str | None]) -> str:
    import traceback

    folder = Path(os.environ.get(LOG_DIR_ENV) or ".rlhf/logs").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text(redact("".join(traceback.format_exception(error)), secrets))
    return str(path)


def _stop_on_sigterm() -> Any:
    """SIGTERM (the launcher's stop, a lost lease) unwinds the job like an error, so scratch folders and the lease
    go with it. Returns the previous handler (None off the main thread, where nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def _stop_self(stage: str, why: str, grace_s: float = 30.0) -> None:
    """Stop this job: SIGTERM to itself (unwinding), then SIGKILL to its process group if it is still there."""

    def force() -> None:
        time.sleep(grace_s)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        if os.getpgrp() == os.getpid():  # a session of its own (the launcher's jobs): its whole group
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=force, daemon=True).start()
    with contextlib.suppress(OSError):  # the orchestrator that read this output may be gone (a broken pipe)
        print(f"error: [{stage}] stopping: {why}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _watch_orchestrator(stage: str, poll_s: float = 1.0) -> threading.Event:
    """When the launcher's process (``RLHF_ORCHESTRATOR_PID``) dies, stop: no job writes on unseen. Returns the
    event that ends the watch."""
    done = threading.Event()
    value = os.environ.pop(ORCHESTRATOR_ENV, None)  # for this process only, not for what it starts
    if not value:
        return done
    pid = int(value)

    def watch() -> None:
        while not done.wait(poll_s):
            if os.getppid() != pid:  # reparented: the orchestrator is gone
                _stop_self(stage, f"the orchestrator (pid {pid}) is gone, so nobody watches this job")
                return

    threading.Thread(target=watch, daemon=True, name="orchestrator-watch").start()
    return done


_SCRATCH: list[str] = []  # this process's scratch folders, removed by remove_scratch


_SCRATCH_NAME = re.compile(r"^.+-(\d+)-[a-z0-9_]{8}$")  # <stage>-<pid>-<mkdtemp suffix>


def scratch_root() -> Path:
    return Path(os.environ.get("RLHF_WORK_DIR") or tempfile.gettempdir()) / "rlhf-pipeline"


def work_dir(stage: str) -> str:
    """Local scratch directory for downloads and staging (under RLHF_WORK_DIR, else the system temp dir), removed
    when the job ends (``remove_scratch``); the folders of jobs that were killed are reclaimed here first."""
    root = scratch_root()
    root.mkdir(parents=True, exist_ok=True)
    reclaim_scratch(root)
    path = tempfile.mkdtemp(prefix=f"{stage}-{os.getpid()}-", dir=root)
    _SCRATCH.append(path)
    return path


def reclaim_scratch(root: Path) -> list[str]:
    """Remove the scratch folders whose job process is gone (named ``<stage>-<pid>-...``); returns their names."""
    gone = []
    for entry in root.iterdir():
        m = _SCRATCH_NAME.match(entry.name)
        if m and entry.is_dir() and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


def remove_scratch() -> None:
    while _SCRATCH:
        shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)


def fail_after_step() -> int | None:
    value = os.environ.get("RLHF_FAIL_AFTER_STEP")
    return int(value) if value else None
