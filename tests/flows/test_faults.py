"""Faults users hit in production, on the real pipeline: ``rlhf run`` as its own process on the test's Prefect server,
each stage job with a Ray of its own (its processes are the job's, as on a machine of its own), and a run of two SFT
stages (``sft_chain``) killed at chosen moments:

- the machine dies (every process of the run at once, SIGSTOP then SIGKILL: nothing gets to react) while a
  checkpoint is being written, and right after a stage's manifest is committed;
- a stage job is killed with SIGKILL: the task retries;
- the orchestrator alone is killed and ``rlhf resume`` starts at once: never two writers of a stage.

After each, the run completes, finished stages are not relaunched, the interrupted stage resumes from its newest
complete checkpoint, and no scratch folder is left. Uploads are slowed (``RLHF_UPLOAD_PAUSE_S``) so that a kill
lands inside a checkpoint write. The faults strike sft_b: the tests whose subject is not sft_a's own run start from a
copy of its committed output (``sft_a_done``, made once), which the run finds complete and does not launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlhf_core.config import load_config
from rlhf_core.jobs import sft
from rlhf_core.run_layout import lease as lease_rel
from rlhf_core.storage import ObjectStore
from tasks._procs import head_guards
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

RLHF = str(Path(sys.executable).with_name("rlhf"))
# sft_b: 8 steps (128 rows / 16), a checkpoint after each; sft_a as in the preset
OVERRIDES = ["sft_b.train.save_steps=1", "sft_b.train.keep_last=8"]


@pytest.fixture(scope="module")
def sft_a_done(tmp_path_factory, shared_ray) -> Path:
    """sft_chain's first stage, trained once on the package's Ray: its committed output folder."""
    run_dir = tmp_path_factory.mktemp("sft-a") / "run"
    sft.run(
        load_config(ROOT / "deployments" / "configs" / "sft_chain.yaml", [f"run_uri={run_dir}", *OVERRIDES]), "sft_a"
    )
    return run_dir / "sft_a"


def seeded(run_dir: Path, sft_a_done: Path) -> Path:
    """A run folder holding the committed sft_a (the same config: found complete, Cached, not launched)."""
    shutil.copytree(sft_a_done, run_dir / "sft_a")
    return run_dir


def launches(run_dir: Path) -> list[dict]:
    files = sorted((run_dir / "_launches").glob("*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    return [json.loads(p.read_text()) for p in files]


def stages_launched(run_dir: Path) -> list[str]:
    return [r["stage"] for r in launches(run_dir)]


def states(run_dir: Path) -> dict[str, str]:
    summary = json.loads((run_dir / "run_summary.json").read_text())
    return {row["stage"]: row["state"] for row in summary["stages"]}


def stage_metrics(run_dir: Path, stage: str) -> dict:
    return ObjectStore(str(run_dir)).read_manifest(stage).metrics


def checkpoints(run_dir: Path, stage: str) -> tuple[list[int], list[int]]:
    """(committed steps, steps with files but no manifest) of the stage's in-stage checkpoints."""
    done, partial = [], []
    for d in sorted((run_dir / stage / "checkpoints").glob("step_*")):
        step = int(d.name.removeprefix("step_"))
        if (d / "manifest.json").is_file():
            done.append(step)
        elif any(p.is_file() for p in d.rglob("*")):
            partial.append(step)
    return done, partial


@pytest.fixture
def env(prefect_server, tmp_path):
    """The environment of the run's processes: the test's Prefect server and Ray, a scratch root of its own."""
    work = tmp_path / "scratch"
    work.mkdir()
    env = {**os.environ, "RLHF_WORK_DIR": str(work), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("RAY_ADDRESS", None)  # each run starts its own Ray head (shared_ray), which dies with the machine
    return env


def start(args: list[str], env: dict, log: Path, **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [RLHF, *args],
        cwd=ROOT,
        env={**env, **extra_env},
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def run_chain(run_dir: Path, env: dict, log: Path, **extra_env: str) -> subprocess.Popen:
    return start(
        ["run", "sft_chain", *OVERRIDES, "--run-name", run_dir.parent.name, "--run-uri", str(run_dir)],
        env,
        log,
        **extra_env,
    )


def start_resume(run_dir: Path, env: dict, log: Path) -> subprocess.Popen:
    return start(["resume", run_dir.parent.name, "--run-uri", str(run_dir)], env, log)


def resume(run_dir: Path, env: dict, log: Path) -> int:
    return start_resume(run_dir, env, log).wait(timeout=600)


def wait_for(what, proc: subprocess.Popen, log: Path, timeout_s: float = 300, poll_s: float = 0.05):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = what()
        if found:
            return found
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) first:\n{log.read_text()[-4000:]}"
        time.sleep(poll_s)
    raise AssertionError(f"timed out:\n{log.read_text()[-4000:]}")


def newest_committed(run_dir: Path, stage: str) -> int:
    return max(checkpoints(run_dir, stage)[0])


def at_sft_b_first_checkpoint(run_dir: Path, env: dict, log: Path) -> tuple[subprocess.Popen, int]:
    """The chain running (uploads slowed a little) until sft_b has committed a checkpoint: (orchestrator, sft_b's
    job pid)."""
    proc = run_chain(run_dir, env, log, RLHF_UPLOAD_PAUSE_S="0.2")
    wait_for(lambda: checkpoints(run_dir, "sft_b")[0], proc, log)
    return proc, next(r["pid"] for r in launches(run_dir) if r["stage"] == "sft_b")


def lose_machine(proc: subprocess.Popen) -> None:
    """Every process of the run stops at once (SIGSTOP: none reacts), then dies (SIGKILL)."""
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
    proc.wait(timeout=30)


def assert_no_scratch(env: dict) -> None:
    left = sorted(p.name for p in (Path(env["RLHF_WORK_DIR"]) / "rlhf-pipeline").glob("*"))
    assert not left, f"scratch folders left behind: {left}"


# make test: a partial checkpoint is never read (tests/jobs/test_store_outage.py)
@pytest.mark.extended
def test_machine_loss_during_a_checkpoint_write_resumes_from_the_newest_complete_one(env, tmp_path, sft_a_done):
    run_dir, log = seeded(tmp_path / "ckpt" / "run", sft_a_done), tmp_path / "run.log"
    proc = run_chain(run_dir, env, log, RLHF_UPLOAD_PAUSE_S="0.5")

    def mid_write():
        done, partial = checkpoints(run_dir, "sft_b")
        return (done, partial) if done and partial else None

    done, partial = wait_for(mid_write, proc, log)
    lose_machine(proc)
    assert max(partial) > max(done)  # the kill fell inside the write of a newer checkpoint

    assert resume(run_dir, env, log) == 0, log.read_text()[-4000:]
    assert states(run_dir) == {"sft_a": "Cached", "sft_b": "Completed"}
    assert stages_launched(run_dir) == ["sft_b", "sft_b"]  # sft_a is not launched
    assert stage_metrics(run_dir, "sft_b")["resumed_from_step"] == max(done)  # the partial one was not read
    assert_no_scratch(env)  # the killed job's scratch was reclaimed by the next job


# make test proves a machine loss (above), finished stages not relaunched (test_pipeline's resume)
@pytest.mark.extended
def test_machine_loss_right_after_a_manifest_commit_does_not_relaunch_the_stage(env, tmp_path):
    run_dir, log = tmp_path / "commit" / "run", tmp_path / "run.log"
    proc = run_chain(run_dir, env, log)
    wait_for(lambda: (run_dir / "sft_a" / "manifest.json").is_file(), proc, log, poll_s=0.01)
    lose_machine(proc)
    # Whether or not the task had saved its result before the machine died, the committed stage is finished:
    # drop the saved results to be sure that only the manifest says so.
    for record in (run_dir / "_prefect" / "results").glob("*"):
        record.unlink()

    assert resume(run_dir, env, log) == 0, log.read_text()[-4000:]
    assert states(run_dir) == {"sft_a": "Cached", "sft_b": "Completed"}
    assert stages_launched(run_dir) == ["sft_a", "sft_b"]
    assert_no_scratch(env)


# make test: a failed run resumed without relaunching its finished stages (test_pipeline.py), a partial checkpoint
# never read (tests/jobs/test_store_outage.py), PPO's exact resume (tests/jobs/test_ppo.py)
@pytest.mark.extended
def test_a_killed_job_is_retried_then_a_killed_orchestrator_is_resumed_at_once_never_with_two_writers(
    env, tmp_path, sft_a_done
):
    """One run, two faults. The job is killed with SIGKILL after sft_b's first checkpoint: the task retries and the
    retry resumes from it. Then the orchestrator alone is killed once that retry has committed a newer checkpoint:
    the retry stops itself (its launcher is gone), and an ``rlhf resume`` started at once never has a second writer
    of sft_b while the old one lives; it resumes from the newest checkpoint and completes."""
    run_dir, log = seeded(tmp_path / "faults" / "run", sft_a_done), tmp_path / "run.log"
    proc, first = at_sft_b_first_checkpoint(run_dir, env, log)
    os.kill(first, signal.SIGKILL)

    # The task's retry: a second launch that takes the lease over (the killed job's process is gone) and resumes.
    # Once it has committed a checkpoint of its own, the orchestrator is killed. (The killed job's trainer may still
    # commit a checkpoint or two in the seconds before Ray stops it: only a checkpoint after the takeover counts.)
    retry = wait_for(lambda: launches(run_dir)[1:2], proc, log)[0]
    old, lease = retry["pid"], run_dir / lease_rel("sft_b")
    wait_for(lambda: _holder(lease) == old, proc, log)
    taken_at = newest_committed(run_dir, "sft_b")
    wait_for(lambda: newest_committed(run_dir, "sft_b") > taken_at, proc, log)
    # the run's Ray head (shared_ray) runs under a guard process in a session of its own, as the jobs do
    (head,) = [p.pid for p in head_guards(proc.pid)]
    os.kill(proc.pid, signal.SIGKILL)  # the orchestrator only: its job and its Ray head live on in their sessions
    proc.wait(timeout=30)

    second = start_resume(run_dir, env, log)
    old_gone_after, started = None, time.time()
    while second.poll() is None and time.time() - started < 600:
        alive = _running(old)
        if old_gone_after is None and not alive:
            old_gone_after = time.time() - started
        holder = _holder(lease)
        assert not (alive and holder is not None and holder != old), "two writers of sft_b at once"
        time.sleep(0.05)
    assert second.wait(timeout=60) == 0, log.read_text()[-4000:]
    assert old_gone_after is not None and old_gone_after < 40  # the job stopped once its orchestrator was gone
    assert states(run_dir) == {"sft_a": "Cached", "sft_b": "Completed"}
    assert stages_launched(run_dir) == ["sft_b", "sft_b", "sft_b"]  # the job, the task's retry, the resumed run's
    assert stage_metrics(run_dir, "sft_b")["resumed_from_step"] > taken_at
    assert not lease.exists()  # given back
    # nothing of the killed or stopped jobs, nor of the killed orchestrator's Ray head (its guard stopped it)
    stray = [p.pid for p in psutil.process_iter() if _session(p) in (first, old, head)]
    assert not stray, f"processes of the killed or stopped jobs or of their Ray are still there: {stray}"
    assert_no_scratch(env)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _holder(lease: Path) -> int | None:
    try:
        return int(json.loads(lease.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _session(p: psutil.Process) -> int | None:
    try:
        return os.getsid(p.pid)
    except OSError:
        return None
