"""Storage backends: whole-or-nothing files, an exclusive commit marker, uncached listings.

Paths handed to a backend are relative to the checkpoint root and use "/" separators. The
backends share one contract (tested by one suite, tests/test_storage_contract.py):

* :class:`LocalStorage` (local.py) — POSIX disk: temporary name, fsync, ``os.replace``,
  directory fsync; the marker is linked into place with ``os.link``, which fails if the name
  exists (the local counterpart of ``If-None-Match: *``).
* :class:`S3Storage` (s3.py) — S3 through s3fs: objects put whole (a single PUT, or a multipart
  upload completed only after every part succeeded and aborted otherwise); the marker put with
  ``If-None-Match: *`` and read back to tell a retried success from a real conflict.
* :class:`FsspecStorage` (fsspec_fs.py) — any other fsspec filesystem (``memory://`` …).

This package never imports torch.distributed.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import fsspec

from ..errors import StorageError
from .fsspec_fs import FsspecStorage
from .local import LocalStorage


class Storage(Protocol):
    """What the protocol needs from a place to keep checkpoints."""

    url: str

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        """Write all chunks as `path`, atomically: afterwards it exists whole or not at all."""

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create `path` holding `data`; CheckpointExistsError if it already exists."""

    def read_bytes(self, path: str) -> bytes:
        """The whole file; MissingFileError (a FileNotFoundError) if absent."""

    def read_buffer(self, path: str) -> bytes | bytearray | memoryview:
        """The whole file for parsing large payloads (local disk: mapped, not copied)."""

    def list_dir(self, path: str) -> list[str]:
        """Names directly under `path`, read fresh from storage; [] if it does not exist."""

    def exists(self, path: str) -> bool: ...

    def newest_mtime(self, path: str) -> float | None:
        """Newest modification time of anything under `path` (seconds since the epoch)."""

    def remove_file(self, path: str) -> None:
        """Remove one file; absent is fine."""

    def remove_tree(self, path: str) -> None:
        """Remove a directory and everything under it; absent is fine."""

    def collect_abandoned_uploads(self, grace_s: float) -> int:
        """Abort uploads that never completed and are older than `grace_s`; returns how many."""


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """A backend for a local path, ``file://`` URL, ``s3://`` URL, or any other fsspec URL."""
    if "://" not in url or url.startswith("file://"):
        path = url[len("file://"):] if url.startswith("file://") else url
        if storage_options:
            raise StorageError(f"storage_options were given for the local path {url!r}; they apply to remote URLs only")
        return LocalStorage(path)
    if url.startswith(("s3://", "s3a://")):
        from .s3 import S3Storage

        return S3Storage.from_url(url, storage_options or {})
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return FsspecStorage(fs, root, url)


__all__ = ["FsspecStorage", "LocalStorage", "Storage", "open_storage"]
