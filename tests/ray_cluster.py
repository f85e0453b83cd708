"""Real Ray clusters started by the tests on loopback (`ray start`), and stopped by pid, never with `ray stop`
(which would stop every Ray on the machine).

Each node is one `ray start --block` process with its own --temp-dir, free ports and resources; the environment of
the cluster and of the drivers that join it has RAY_AUTH_MODE=disabled (Ray's token authentication otherwise
refuses a second raylet) and the node IP 127.0.0.1 (otherwise the head advertises the machine's interface address).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rlhf_core.ports import free_port

RAY = str(Path(sys.executable).with_name("ray"))


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def cluster_env(drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for the cluster's processes and the drivers that join it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *drop)}
    env.update(
        RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    return env


def start_raylet(
    temp_dir: Path, cpus: int, resources: dict[str, float], head_port: int, head: bool, env: dict[str, str]
) -> subprocess.Popen:
    ports = [
        f"--{name}={free_port()}"
        for name in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
        )
    ]
    if head:
        where = [
            "--head",
            f"--port={head_port}",
            f"--dashboard-port={free_port()}",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
        ]
    else:
        where = [f"--address=127.0.0.1:{head_port}"]
    cmd = [
        RAY,
        "start",
        "--block",
        *where,
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={cpus}",
        "--num-gpus=0",
        f"--resources={json.dumps(resources)}",
        f"--temp-dir={temp_dir}",
        "--object-store-memory=200000000",
        "--disable-usage-stats",
        *ports,
    ]
    with open(temp_dir / "raylet.out", "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def pids_under(dirs: list[Path]) -> list[int]:
    """Processes whose command line names one of ``dirs`` (raylets, GCS, workers of that cluster only)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(str(d) in cmdline for d in dirs):
            found.append(int(proc.name))
    return found


def stop(procs: list[subprocess.Popen], dirs: list[Path]) -> None:
    """SIGTERM the `ray start --block` process groups, then SIGKILL whatever of this cluster is left, by pid."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 5  # a throwaway cluster: no need to wait for a graceful shutdown
    while time.time() < deadline and (any(p.poll() is None for p in procs) or pids_under(dirs)):
        time.sleep(0.5)
    for pid in pids_under(dirs) + [p.pid for p in procs if p.poll() is None]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait(10)


def status(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, "status", f"--address={address}"], env=env, capture_output=True, text=True)


@contextlib.contextmanager
def local_cluster(
    nodes: list[tuple[int, dict[str, float]]], env: dict[str, str], timeout_s: float = 90
) -> Iterator[tuple[str, list[Path]]]:
    """A cluster of ``nodes`` ((CPUs, custom resources) each; the first is the head) on this machine. Yields its
    address and each node's temp dir; a node is up when ``ray status`` lists its first custom resource (or, for a
    head-only cluster, when the GCS answers)."""
    dirs = [Path(tempfile.mkdtemp(prefix=f"rn-{i}-", dir="/tmp")) for i in range(len(nodes))]
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs = [start_raylet(dirs[0], nodes[0][0], nodes[0][1], port, True, env)]
    try:
        deadline = time.time() + timeout_s
        while not listening(port):  # the GCS is up: other raylets may join
            assert time.time() < deadline and procs[0].poll() is None, (dirs[0] / "raylet.out").read_text()
            time.sleep(0.5)
        for d, (cpus, resources) in zip(dirs[1:], nodes[1:]):
            procs.append(start_raylet(d, cpus, resources, port, False, env))
        names = [next(iter(res)) for _, res in nodes if res]
        while not all(name in (out := status(address, env)).stdout for name in names):
            assert time.time() < deadline and all(p.poll() is None for p in procs), out.stdout + out.stderr
            time.sleep(1)
        yield address, dirs
    finally:
        stop(procs, dirs)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
