"""fsspec-based artifact/checkpoint store with manifest-last commits, and where a store may live.

An artifact directory counts as complete only when its ``manifest.json`` exists and every file it lists is present
with the recorded size and sha256 (``ObjectStore``, ``Manifest``). A store's root is a local path, ``file://``,
``memory://`` or ``s3://``; ``check_location`` refuses one a run cannot use with one ``StorageError`` line.

The package, in reading order: ``errors`` (``ArtifactError`` and its subclass ``StorageError``), ``location`` (the
supported schemes, s3fs options and credentials, ``redact``, ``check_location`` and its probes) and ``store``
(``ObjectStore``, ``Manifest``, the manifest-last commit and the ``<rel>.next`` swap). Import from the package.
"""

from __future__ import annotations

from rlhf_core.storage.errors import ArtifactError, StorageError
from rlhf_core.storage.location import (
    PROBE_DIR,
    S3_CONFIG_KWARGS,
    check_location,
    redact,
    storage_options_for,
    unsupported_scheme,
)
from rlhf_core.storage.store import (
    MANIFEST_NAME,
    NEXT_SUFFIX,
    UPLOAD_PAUSE_ENV,
    Manifest,
    ObjectStore,
    next_rel,
    sha256_file,
)

__all__ = [
    "MANIFEST_NAME",
    "NEXT_SUFFIX",
    "PROBE_DIR",
    "S3_CONFIG_KWARGS",
    "UPLOAD_PAUSE_ENV",
    "ArtifactError",
    "Manifest",
    "ObjectStore",
    "StorageError",
    "check_location",
    "next_rel",
    "redact",
    "sha256_file",
    "storage_options_for",
    "unsupported_scheme",
]
