"""pytest plugin: a session-scoped SeaweedFS S3 server with credentials and a bucket.

Register with ``pytest_plugins = ["tests.conftest_s3"]`` in tests/conftest.py (or ``-p tests.conftest_s3``).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.s3_server import SeaweedS3, identity_config


@dataclass
class S3ServerInfo:
    endpoint_url: str
    key: str
    secret: str
    bucket: str
    server: SeaweedS3

    def __repr__(self) -> str:  # keep the secret out of test output
        return f"S3ServerInfo(endpoint_url={self.endpoint_url!r}, bucket={self.bucket!r})"


def s3_storage_options(server: S3ServerInfo) -> dict:
    """s3fs storage options for the test server."""
    return {"key": server.key, "secret": server.secret, "client_kwargs": {"endpoint_url": server.endpoint_url}}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3ServerInfo]:
    """A running SeaweedFS S3 server with one admin identity and a created bucket."""
    import s3fs

    tmp = tmp_path_factory.mktemp("seaweedfs")
    key, secret = "AK" + secrets.token_hex(8).upper(), secrets.token_urlsafe(24)
    cfg = identity_config(tmp / "s3-identities.json", key, secret)
    server = SeaweedS3(stop_grace_s=5.0)
    try:
        endpoint = server.start(tmp, cfg, key=key, secret=secret)
        bucket = "test-bucket"
        fs = s3fs.S3FileSystem(
            key=key, secret=secret, client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
        )
        fs.mkdir(bucket)
        yield S3ServerInfo(endpoint_url=endpoint, key=key, secret=secret, bucket=bucket, server=server)
    finally:
        server.stop()
