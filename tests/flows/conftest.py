"""A real Prefect server (SQLite) on loopback, a process work pool and a worker, for the whole session; and one Ray
cluster that the stage jobs of in-process flow runs join through RAY_ADDRESS (a job that starts its own Ray spends
about 8 s on it here; the flow tests launch about 20 jobs)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlhf_core.ports import free_port
from tasks._procs import kill_tree
from tasks.launch import environ
from tests.ray_cluster import cluster_env, local_cluster

BIN = Path(sys.executable).parent


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"prefect server did not answer in {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="package", autouse=True)
def shared_ray():
    """A head-only Ray cluster for the session (8 logical CPUs: the roles share the 2 cores), its address in this
    process's environment for the jobs that the flows launch. The process worker's deployed runs do not get it
    (``work_pool``): they start their own Ray, so that the cancellation test sees Ray's processes in the job's tree.
    Package scope: the tests after this folder's see no RAY_ADDRESS."""
    env = cluster_env()
    with local_cluster([(8, {})], env) as (address, _), environ(RAY_ADDRESS=address, RAY_AUTH_MODE="disabled"):
        yield address


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """Starts `prefect server start` with its own PREFECT_HOME and points this process's client at it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": url,
        "PREFECT_UI_API_URL": url,  # the UI's own API calls (else 127.0.0.1:4200)
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
    }
    log = home / "server.log"
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_healthy(url, proc, log)
        from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

        saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED")}
        os.environ.update({k: env[k] for k in saved})  # for the job subprocesses
        with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_HOME: str(home)}):
            yield {"url": url, "ui": url.removesuffix("/api"), "env": env, "home": home}
            from prefect.logging.handlers import APILogHandler

            APILogHandler().flush()  # send the last run logs while the server is still there
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        kill_tree(proc.pid, grace_s=5)


@pytest.fixture(scope="session")
def work_pool(prefect_server):
    """A process work pool and a worker polling it."""
    env = prefect_server["env"]
    pool = "rlhf-test"
    subprocess.run(
        [str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    log = prefect_server["home"] / "worker.log"
    worker_env = {**env, "PREFECT_WORKER_QUERY_SECONDS": "2"}  # picks deployed runs up within 2 s (default 10)
    worker_env.pop("RAY_ADDRESS", None)  # deployed runs start their own Ray (see shared_ray)
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--limit", "2"],
        env=worker_env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    time.sleep(3)
    if worker.poll() is not None:
        raise RuntimeError(f"prefect worker exited:\n{log.read_text()[-3000:]}")
    yield {"pool": pool, "worker_log": log}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGTERM)
    kill_tree(worker.pid, grace_s=5)
