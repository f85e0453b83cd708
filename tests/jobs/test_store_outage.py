"""Object-store outage: the S3 server (SeaweedFS, our own instance) stops in the middle of an upload, the stage job
fails within a bounded time, and once the server is back on the same ports and data the rerun completes, resuming
from the newest complete checkpoint only; a partially uploaded checkpoint or output is never read.

The failure is a worker's (the upload is rank 0's): one line naming the worker and the cause, the traceback in the
log folder. These two jobs are also the proof that a worker failure and a resume on S3 with credentials leak no
credential: everything they left (output, log and scratch folders, --ref-out files, every object of the run, their
Ray sessions) is searched for the store's key and secret (``search_for_credentials`` of tests/jobs/test_secrets.py,
which searches the refusals the same way)."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from rlhf_core.storage import MANIFEST_NAME, UPLOAD_PAUSE_ENV, ObjectStore
from tests.conftest import ROOT, TINY
from tests.jobs.test_secrets import files_under, ray_sessions, search_for_credentials
from tests.s3_server import SeaweedS3, identity_config

pytestmark = pytest.mark.slow

BUCKET = "outage"
# 1 worker x batch 16: 48 rows -> 3 steps; a checkpoint every save_steps steps (none after the last one).
JOB = ["sft.data.max_samples=48", "sft.train.keep_last=3", "sft.train.log_steps=1"]
PAUSE_S = "1.5"  # after each uploaded file: a checkpoint (5 files) or the export (6 files) takes seconds to upload
FAIL_WITHIN_S = 180  # from the outage to the job's exit
JOB_TIMEOUT_S = 420


@dataclass
class OwnS3:
    server: SeaweedS3
    endpoint_url: str
    key: str
    secret: str

    def options(self) -> dict:
        return {"key": self.key, "secret": self.secret, "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(
            **self.options(),
            skip_instance_cache=True,
            config_kwargs={"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}},
        )


@pytest.fixture
def own_s3(tmp_path) -> Iterator[OwnS3]:
    """A SeaweedFS server of this test alone (the session's one is never stopped), with a bucket."""
    tmp = tmp_path / "s3"
    tmp.mkdir()
    key, secret = "AK" + secrets.token_hex(8).upper(), secrets.token_urlsafe(24)
    server = SeaweedS3(stop_grace_s=5.0)
    try:
        endpoint = server.start(tmp, identity_config(tmp / "identities.json", key, secret), key=key, secret=secret)
        s3 = OwnS3(server, endpoint, key, secret)
        s3.fs().mkdir(BUCKET)
        yield s3
    finally:
        server.kill()  # its data is thrown away with tmp_path: no shutdown to wait for


def start_job(
    s3: OwnS3, run_uri: str, tmp: Path, name: str, pause: bool, overrides: list[str]
) -> tuple[subprocess.Popen, Path, Path]:
    """``python -m rlhf_core.jobs.sft`` in its own process group (its own local Ray); output to ``<name>.log``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_ADDRESS", "RLHF_"))}
    env.update(
        AWS_ACCESS_KEY_ID=s3.key,
        AWS_SECRET_ACCESS_KEY=s3.secret,
        AWS_ENDPOINT_URL=s3.endpoint_url,
        RLHF_WORK_DIR=str(tmp / "work"),
        RLHF_LOG_DIR=str(tmp / "logs"),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if pause:
        env[UPLOAD_PAUSE_ENV] = PAUSE_S
    log, ref_out = tmp / f"{name}.log", tmp / f"{name}.ref.json"
    cmd = [
        sys.executable,
        "-m",
        "rlhf_core.jobs.sft",
        "--config",
        str(TINY),
        "--ref-out",
        str(ref_out),
        f"run_uri={run_uri}",
        *JOB,
        *overrides,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, ref_out


def finish(proc: subprocess.Popen, log: Path, timeout_s: float) -> int:
    """The job's exit status; a job still running after timeout_s is killed (its whole group) and fails the test."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"job still running {timeout_s:.0f}s on; log tail:\n{tail(log)}")


def tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def listing(s3: OwnS3, prefix: str, fs=None) -> set[str]:
    """Every object under prefix (relative names); empty while the prefix does not exist."""
    fs = fs or s3.fs()
    fs.invalidate_cache()
    try:
        return {name[len(prefix) + 1 :] for name in fs.find(prefix) if name.startswith(prefix + "/")}
    except FileNotFoundError:
        return set()


def checkpoints(files: set[str]) -> dict[int, set[str]]:
    """{step: its files} of the checkpoint folders in a listing of ``<stage>/``."""
    out: dict[int, set[str]] = {}
    for name in files:
        if m := re.fullmatch(r"checkpoints/step_(\d+)/(.+)", name):
            out.setdefault(int(m.group(1)), set()).add(m.group(2))
    return out


def stop_when(s3: OwnS3, prefix: str, proc: subprocess.Popen, log: Path, seen: Callable[[set[str]], bool]) -> set[str]:
    """Poll the bucket until ``seen(listing)``, then stop the server at once (SIGKILL: an outage, not a shutdown);
    return that listing."""
    deadline, fs = time.monotonic() + JOB_TIMEOUT_S, s3.fs()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the job ended ({proc.returncode}) before the outage; log tail:\n{tail(log)}")
        files = listing(s3, prefix, fs)
        if seen(files):
            s3.server.kill()
            return files
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"never saw the upload to interrupt; log tail:\n{tail(log)}")


@dataclass
class Outcome:
    at_outage: set[str]  # the listing of the watched folder (<run>/sft/ or <run>/sft.next/) that triggered the outage
    after_restart: set[str]  # the same listing once the store is back, before the rerun
    stage_after_restart: set[str]  # the listing of <run>/sft/ then
    down_at: datetime  # when the store went down (UTC)
    ref: dict  # the rerun's CheckpointRef (--ref-out)
    errors: list[str]  # the failed job's error lines (one)
    ray_before: set[Path]  # the Ray session folders before the first job


def outage_then_rerun(
    s3: OwnS3, tmp: Path, overrides: list[str], seen: Callable[[set[str]], bool], folder: str = "sft"
) -> Outcome:
    """Run the job with slow uploads, stop the store when ``seen`` (the listing of ``<run>/<folder>/``), check the job
    fails in bounded time, bring the store back and rerun without the pause."""
    run_uri = f"s3://{BUCKET}/runs/{tmp.name}"
    prefix = f"{BUCKET}/runs/{tmp.name}/{folder}"
    ray_before = ray_sessions()
    proc, log, _ = start_job(s3, run_uri, tmp, "first", True, overrides)
    at_outage = stop_when(s3, prefix, proc, log, seen)
    down, down_at = time.monotonic(), datetime.now(UTC)
    rc = finish(proc, log, FAIL_WITHIN_S)
    failed_after = time.monotonic() - down
    assert rc != 0, f"the job succeeded though the store went down mid-upload; log tail:\n{tail(log)}"
    error = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
    print(f"job failed {failed_after:.1f}s after the outage (exit {rc}): {error}")
    assert error, f"no one-line error; log tail:\n{tail(log)}"
    assert not list((tmp / "work").glob("rlhf-pipeline/*")), "the failed job left its scratch folders behind"

    assert s3.server.restart() == s3.endpoint_url
    after_restart, stage_after_restart = listing(s3, prefix), listing(s3, f"{BUCKET}/runs/{tmp.name}/sft")
    committed = {f for f in at_outage if f.endswith(MANIFEST_NAME)}
    assert committed <= after_restart, "manifests committed before the outage were lost by the restart"

    proc, log, ref_out = start_job(s3, run_uri, tmp, "rerun", False, overrides)
    rc = finish(proc, log, JOB_TIMEOUT_S)
    assert rc == 0, f"the rerun failed after the store came back; log tail:\n{tail(log)}"
    assert "[sft] done: " in log.read_text() and "already complete" not in log.read_text()
    lease = ObjectStore(run_uri, s3.options()).exists("_leases/sft.json")
    assert not lease, "the rerun did not give its lease back"
    ref = json.loads(ref_out.read_text())
    return Outcome(at_outage, after_restart, stage_after_restart, down_at, ref, error, ray_before)


def search_the_run(s3: OwnS3, tmp: Path, out: Outcome) -> dict[str, bytes]:
    """Search everything both jobs left for the store's key and secret: their output (``<name>.log``), log and
    scratch folders, --ref-out files, every object of the run (read while the store is up) and their Ray sessions.
    Returns what was searched (where: bytes), after checking it covers the objects, both outputs and the sessions."""
    fs, run = s3.fs(), f"{BUCKET}/runs/{tmp.name}"
    objects = {f"s3://{name}": fs.cat_file(name) for name in fs.find(run)}
    paths = [tmp / f"{name}{end}" for name in ("first", "rerun") for end in (".log", ".ref.json")]
    searched = search_for_credentials(
        {"key": s3.key, "secret": s3.secret}, objects, [*paths, tmp / "logs", tmp / "work"], out.ray_before
    )
    assert f"s3://{run}/sft/{MANIFEST_NAME}" in searched and len(objects) > 10, sorted(objects)
    assert {str(tmp / "first.log"), str(tmp / "rerun.log"), str(tmp / "rerun.ref.json")} <= searched.keys()
    assert any(where.startswith("/tmp/ray/session_") for where in searched), "no Ray session of the jobs searched"
    return searched


def test_outage_mid_checkpoint_resumes_from_the_newest_complete_one(own_s3, tmp_path):
    """The store dies while checkpoint step 2 is half uploaded (step 1 committed): the rerun resumes from step 1,
    never reading step 2's files, and writes step 2 over again, complete."""

    def step2_half_uploaded(files: set[str]) -> bool:
        ckpts = checkpoints(files)
        return MANIFEST_NAME in ckpts.get(1, set()) and bool(ckpts.get(2)) and MANIFEST_NAME not in ckpts[2]

    out = outage_then_rerun(own_s3, tmp_path, ["sft.train.save_steps=1"], step2_half_uploaded)
    ref, partial = out.ref, checkpoints(out.after_restart)[2]
    assert MANIFEST_NAME not in partial, "step 2 was committed after all: the outage came too late"

    assert ref["metrics"]["resumed_from_step"] == 1  # the newest complete checkpoint, not the partial step 2
    assert ref["step"] == ref["metrics"]["steps"] == 3
    store = ObjectStore(f"s3://{BUCKET}/runs/{tmp_path.name}", own_s3.options())
    final = store.read_manifest("sft", verify=True)  # every file's sha256 checked on the server
    assert final.metrics["resumed_from_step"] == 1 and final.config_hash == ref["config_hash"]
    # The rerun trained step 2 again and wrote its checkpoint over the partial one: committed, every file of the
    # new save (a superset of what the partial upload had put there), made after the outage.
    ckpt2 = store.read_manifest("sft/checkpoints/step_00000002", verify=True)
    assert ckpt2.extra["step"] == 2 and partial <= set(ckpt2.files)
    assert datetime.fromisoformat(ckpt2.created_at) > out.down_at
    assert store.read_manifest("sft/checkpoints/step_00000001", verify=True).extra["step"] == 1

    # A worker's failure: one line naming the worker and the cause, the traceback in the log folder.
    (error,) = out.errors
    assert error.startswith("error: [sft] SFTTrainer rank 0 failed: "), error
    (traceback,) = files_under(tmp_path / "logs")
    assert f"{traceback.name})" in error and "Traceback" in traceback.read_text()
    # No credential in anything the two jobs left.
    assert str(traceback) in search_the_run(own_s3, tmp_path, out)


@pytest.mark.extended  # make test keeps the outage mid checkpoint (above)
def test_outage_mid_export_reruns_to_a_verified_output(own_s3, tmp_path):
    """The store dies while the stage's own output is half uploaded (beside the stage, in ``sft.next/``): no
    manifest was written, the rerun does not take it for a finished stage, resumes from the last checkpoint and
    commits a complete, verified output."""

    def export_half_uploaded(files: set[str]) -> bool:
        exported = {f for f in files if "/" not in f}
        return bool(exported) and MANIFEST_NAME not in exported

    out = outage_then_rerun(own_s3, tmp_path, ["sft.train.save_steps=2"], export_half_uploaded, folder="sft.next")
    ref, after_restart = out.ref, out.after_restart
    assert MANIFEST_NAME not in after_restart, "the output was committed after all: the outage came too late"
    assert MANIFEST_NAME not in out.stage_after_restart
    ckpts = checkpoints(out.stage_after_restart)
    assert ckpts and all(MANIFEST_NAME in files for files in ckpts.values())

    assert ref["metrics"]["resumed_from_step"] == 2 and ref["step"] == 3
    store = ObjectStore(f"s3://{BUCKET}/runs/{tmp_path.name}", own_s3.options())
    final = store.read_manifest("sft", verify=True)
    assert final.metrics["resumed_from_step"] == 2 and final.config_hash == ref["config_hash"]
    half = {f for f in after_restart if "/" not in f}
    assert half <= set(final.files)  # every half-uploaded file was written again and is checked by the manifest
    assert not store.exists("sft.next")  # the new output was swapped in, nothing left beside
    search_the_run(own_s3, tmp_path, out)
