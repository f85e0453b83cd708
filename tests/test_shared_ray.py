"""One Ray for a flow run's stage jobs (``tasks.launch.shared_ray``): a local head that the jobs join through
RAY_ADDRESS, stopped by pid afterwards, nothing started when RAY_ADDRESS is set or no stage uses Ray."""

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rlhf_core.config import load_config
from rlhf_core.jobs.stage_setup import ray_cpus
from tasks.launch import _HEADS, HEAD_ENV, ray_head, shared_ray
from tests.conftest import ROOT, TINY

JOB = """
import os, psutil, ray
from rlhf_core.distributed import launcher
assert launcher.init_ray(min_cpus=1) is True  # connected: the caller disconnects at the end
print("cpus", ray.cluster_resources()["CPU"])
print("gcs", ray.get_runtime_context().gcs_address)
print("children", len(psutil.Process().children(recursive=True)))  # no GCS or raylet of its own
launcher.shutdown_ray()
"""


def _cluster_pids(temp: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(temp in part for part in p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
@pytest.mark.extended  # make test proves a run's shared Ray on a real flow run (tests/flows/test_shared_cluster.py)
def test_stage_jobs_join_the_runs_ray_which_is_stopped_after(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(TINY, ["ppo.rollout.num_engines=2"])
    with shared_ray(cfg, cfg.order()) as address:
        assert address is not None and os.environ["RAY_ADDRESS"] == address
        assert all(os.environ[k] == v for k, v in HEAD_ENV.items())
        ((_, temp),) = _HEADS.values()
        assert _cluster_pids(str(temp))  # its GCS and raylet
        for _ in range(2):  # two stage jobs, one cluster
            out = subprocess.run(
                [sys.executable, "-c", JOB],
                cwd=ROOT,
                env=dict(os.environ),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
            got = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
            # the head's GCS (Ray names it by the machine's address; the port is the head's)
            assert got["gcs"].rsplit(":", 1)[1] == address.rsplit(":", 1)[1] and got["children"] == "0"
            # sized for the largest stage: the PPO roles and engines of this config (as its own Ray would be)
            assert float(got["cpus"]) >= max(os.cpu_count() or 1, ray_cpus(cfg.stage("ppo")))
    assert "RAY_ADDRESS" not in os.environ and not _HEADS
    assert not _cluster_pids(str(temp)) and not temp.exists()


def test_a_head_that_is_not_up_in_time_is_stopped_and_started_again(capfd):
    """A real ``ray start`` given 0.3 s: each of the two attempts is stopped with all it started (GCS, raylet), the
    second is made on new ports and a new temp dir, and the error names the cause and carries the start's log."""
    before = set(_cluster_pids("/tmp/rlhf-ray-"))
    match = r"the run's Ray head did not start \(not up in 0.3 s; "
    with pytest.raises(RuntimeError, match=match) as err, ray_head(timeout_s=0.3, attempts=2):
        pytest.fail("the head cannot be up in 0.3 s")
    assert "--head" in str(err.value)
    retried = capfd.readouterr().err
    assert "starting the run's Ray head again (2/2)" in retried
    temps = {part for line in (retried, str(err.value)) for part in line.split() if part.startswith("--temp-dir=")}
    assert len(temps) == 2  # a new temp dir (and new ports) for the second attempt
    assert not _HEADS and not set(_cluster_pids("/tmp/rlhf-ray-")) - before
    assert not any(Path(t.split("=", 1)[1]).exists() for t in temps)


def test_nothing_starts_with_a_cluster_given_or_without_ray_stages(monkeypatch):
    cfg = load_config(TINY)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with shared_ray(cfg, cfg.order()) as address:
        assert address is None and os.environ["RAY_ADDRESS"] == "127.0.0.1:1" and not _HEADS
    monkeypatch.delenv("RAY_ADDRESS")
    with shared_ray(cfg, ["critic_init"]) as address:  # a copy, no Ray
        assert address is None and "RAY_ADDRESS" not in os.environ and not _HEADS
