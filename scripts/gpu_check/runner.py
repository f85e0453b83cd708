"""GPU acceptance checks of the PPO roles and of what rollout and training exchange: the driver and its workers.

``CHECKS`` lists the checks in the order they run, each with the function its worker calls and its time limits.
``main`` parses the arguments and drives: it prints the environment's line, runs the checks in workers
(``run_worker``: one per check on the GPU, one for all on the dry run), passes on their records as they come, and
prints the summary last. ``worker`` is the other side: ``--worker NAME:SECONDS,...`` runs those checks in turn and
sends their records and a start/done event around each through the pipe the driver passed."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import (
    attention_padding,
    ds_checkpoint,
    hf_generate,
    packed_logprobs,
    pytest_gpu,
    train_step,
    weight_sync,
    zero_init,
)
from .common import PLANS, RESULTS, Ctx, emit, send_records_to

PACKAGE = Path(__file__).resolve().parent  # `python scripts/gpu_check` runs its __main__.py


def _test_hang(c: Ctx) -> None:
    """Test-only (GPU_CHECK_TEST_CHECKS=1): starts a child process, says its pid, then waits forever."""
    child = subprocess.Popen(["sleep", "600"])
    print(f"test_hang: child pid {child.pid}", file=sys.stderr, flush=True)
    time.sleep(600)


def _test_crash(c: Ctx) -> None:
    """Test-only (GPU_CHECK_TEST_CHECKS=1): the worker dies mid-check."""
    print("test_crash: the worker kills itself", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# name -> (what the worker runs, time limit in seconds on the GPU, on the dry run). The GPU limits sum to 440 s.
CHECKS: dict[str, tuple[Callable[[Ctx], None], float, float]] = {
    "train_actor": (train_step.run_actor, 70, 120),
    "train_critic": (train_step.run_critic, 70, 120),
    "zero_init": (zero_init.run, 30, 60),
    "weight_sync": (weight_sync.run, 45, 90),
    "attention": (attention_padding.run, 30, 60),
    "packing": (packed_logprobs.run, 30, 60),
    "hf_generate": (hf_generate.run, 25, 60),
    "ds_checkpoint": (ds_checkpoint.run, 55, 120),
    "pytest_gpu": (pytest_gpu.run, 85, 90),
}
TEST_CHECKS: dict[str, tuple[Callable[[Ctx], None], float, float]] = {
    "test_hang": (_test_hang, 10, 10),
    "test_crash": (_test_crash, 10, 10),
}
ALIASES = {"train": ["train_actor", "train_critic"], "ipc": ["weight_sync"]}
RECORD_FD_ENV = "GPU_CHECK_RECORD_FD"
LAUNCHED_ENV = "GPU_CHECK_LAUNCHED"  # the worker's launch, on time.monotonic()'s clock (one for all processes)


def known_checks() -> dict[str, tuple[Callable[[Ctx], None], float, float]]:
    return {**CHECKS, **(TEST_CHECKS if os.environ.get("GPU_CHECK_TEST_CHECKS") == "1" else {})}


def limit_of(name: str, dry: bool) -> float:
    """The check's time limit: ``GPU_CHECK_LIMIT_<NAME>`` if set, else its default for the GPU or the dry run."""
    key = f"GPU_CHECK_LIMIT_{name.upper()}"
    if not os.environ.get(key):
        return known_checks()[name][2 if dry else 1]
    try:
        return float(os.environ[key])
    except ValueError:
        raise SystemExit(f"gpu_check: {key}={os.environ[key]!r} is not a number of seconds") from None


# -- the worker -------------------------------------------------------------------------------------------------------
def worker(spec: str, dry: bool) -> int:
    """Run the checks of ``spec`` (``NAME:SECONDS,...``) in turn; a start and a done event around each, and the
    checks' records, go to the driver through the pipe it passed."""
    records = os.fdopen(int(os.environ[RECORD_FD_ENV]), "w", buffering=1)
    send_records_to(records)
    device = "cpu" if dry else "cuda"
    threads = max(1, min(4, os.cpu_count() or 1)) if dry else 8
    torch.set_num_threads(threads)
    plan = PLANS["dry" if dry else "gpu"]
    checks = known_checks()
    start = float(os.environ.get(LAUNCHED_ENV) or time.monotonic())  # the first check's limit runs from the launch
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for item in spec.split(","):
            name, _, limit = item.partition(":")
            print(json.dumps({"event": "start", "check": name}), file=records, flush=True)
            checks[name][0](Ctx(plan, device, Path(tmp) / name, threads, start + float(limit)))
            start = time.monotonic()
            print(json.dumps({"event": "done", "check": name}), file=records, flush=True)
    return 0


# -- the driver -------------------------------------------------------------------------------------------------------
EXIT_GRACE_S = 30  # a worker that has finished its checks but does not exit is killed after this


def _pump_records(fd: int, events: queue.Queue) -> None:
    with os.fdopen(fd, "r") as stream:
        for line in stream:
            with contextlib.suppress(json.JSONDecodeError):
                events.put(json.loads(line))
    events.put(None)


def _pump_log(stream: Any, tail: collections.deque) -> None:
    """The worker's stdout and stderr, passed on to this process's stderr; the last lines kept for a crash report."""
    for raw in iter(stream.readline, b""):
        sys.stderr.buffer.write(raw)
        sys.stderr.flush()
        if line := raw.decode("utf-8", "replace").strip():
            tail.append(line)


def _kill_group(proc: subprocess.Popen) -> None:
    """The worker and everything it started (its process group: spawned receivers, pytest and its children)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _exit_text(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    return f"exit status {rc}"


def run_worker(
    group: list[str], limits: dict[str, float], dry: bool, end: float, report: Callable[[dict], None]
) -> list[str]:
    """Run the checks of ``group`` in one worker; returns those that ran to their end or failed (the others are
    left for the next worker). A check's limit counts from its start event (the first one's from the worker's
    launch, its imports included) and is cut to what is left until ``end``."""
    from rlhf_core.ports import free_port

    def limit(name: str) -> float:
        return max(1.0, min(limits[name], end - time.monotonic()))

    spec = ",".join(f"{name}:{limit(name):g}" for name in group)
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PYTHONFAULTHANDLER="1", MASTER_PORT=str(free_port()))
    env.update({RECORD_FD_ENV: str(write_fd), LAUNCHED_ENV: repr(time.monotonic())})
    proc = subprocess.Popen(
        [sys.executable, str(PACKAGE), "--worker", spec, *(["--dry-run"] if dry else [])],
        env=env,
        pass_fds=(write_fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as a whole
    )
    os.close(write_fd)
    events: queue.Queue = queue.Queue()
    tail: collections.deque = collections.deque(maxlen=20)
    log = threading.Thread(target=_pump_log, args=(proc.stdout, tail), daemon=True)
    log.start()
    threading.Thread(target=_pump_records, args=(read_fd, events), daemon=True).start()
    ended: list[str] = []
    current: str | None = group[0]
    current_limit = limit(group[0])
    deadline = time.monotonic() + current_limit
    started = False
    while True:
        try:
            item = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            _kill_group(proc)
            if current is None:
                print(f"gpu_check: a worker did not exit {EXIT_GRACE_S} s after its checks; killed", file=sys.stderr)
                return ended
            report({"check": current, "ok": False, "error": f"timed out after {current_limit:g} s"})
            return [*ended, current]
        if item is None:  # the worker has exited (or closed the pipe): a check still running has crashed
            try:
                rc = proc.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = proc.returncode
            log.join(timeout=5)
            if current is None:
                return ended
            last = tail[-1] if tail else "no output"
            report({"check": current, "ok": False, "error": f"crashed ({_exit_text(rc)}): {last[-300:]}"})
            return [*ended, current]
        if item.get("event") == "start":
            current = item["check"]
            if started:  # the first check's limit runs from the launch
                current_limit = limit(current)
                deadline = time.monotonic() + current_limit
            started = True
        elif item.get("event") == "done":
            ended.append(item["check"])
            current = None
            deadline = time.monotonic() + EXIT_GRACE_S
        else:
            report(item)


def environment(device: str) -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {"check": "environment", "ok": True, "python": sys.version.split()[0]}
    env.update(torch=torch.__version__, cuda=torch.version.cuda, device=device)
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    for dist in ("deepspeed", "transformers", "rlhf-pipeline"):
        with contextlib.suppress(md.PackageNotFoundError):
            env[dist] = md.version(dist)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, gloo, fp32")
    parser.add_argument(
        "--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join([*CHECKS, *ALIASES])}"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.dry_run)
    checks = known_checks()
    wanted = [c for c in args.only.split(",") if c]
    unknown = sorted(set(wanted) - set(checks) - set(ALIASES))
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join([*CHECKS, *ALIASES])}")
    only = list(dict.fromkeys(n for c in wanted for n in ALIASES.get(c, [c])))
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"summary": "no CUDA device visible; use --dry-run on CPU", "ok": False}), flush=True)
        return 1
    os.environ["RLHF_DEVICE"] = device
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    start = time.monotonic()
    end = start + float(os.environ.get("GPU_CHECK_TIMEOUT") or 450)
    limits = {name: limit_of(name, args.dry_run) for name in only}
    emit(environment(device))
    pending = list(only)
    while pending:
        if end - time.monotonic() < 1:
            for name in pending:
                emit({"check": name, "ok": False, "error": "not started: GPU_CHECK_TIMEOUT was spent"})
            break
        # the dry run: one worker for all (imports once); the GPU: one per check (its own CUDA context)
        group = pending if args.dry_run else pending[:1]
        ended = run_worker(group, limits, args.dry_run, end, emit)
        pending = [name for name in pending if name not in ended]
    failed = [r["check"] for r in RESULTS if r.get("ok") is False]
    summary = {
        "summary": "gpu_check dry run (CPU)" if args.dry_run else "gpu_check",
        "ok": not failed,
        "passed": [r["check"] for r in RESULTS if r.get("ok") is True and r["check"] != "environment"],
        "failed": failed,
        "skipped": [r["check"] for r in RESULTS if r.get("ok") is None],
        "seconds": round(time.monotonic() - start, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0 if not failed else 1
