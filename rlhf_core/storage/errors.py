"""The storage package's two exceptions, below both of its modules: a ``StorageError`` (the location) is an
``ArtifactError`` (the store), so that a caller catching the latter catches both.
"""

from __future__ import annotations


class ArtifactError(RuntimeError):
    """An artifact is missing, uncommitted or does not match its manifest."""


class StorageError(ArtifactError):
    """A storage location is unusable: unsupported scheme, unreachable, not writable, or an existing file."""
