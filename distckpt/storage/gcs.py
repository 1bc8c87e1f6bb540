"""Google Cloud Storage through gcsfs (``pip install 'distckpt[gcs]'``), ``gs://bucket/prefix``.

* A file is put whole: gcsfs sends one request below 50 MiB, else a resumable upload whose
  object exists only once its last chunk is finalized (on a failure gcsfs deletes the session).
  The file's chunks are joined first, so a write holds one copy of the file in memory (the S3
  backend streams parts instead; streamed GCS uploads are not built).
* The commit marker is created with ``ifGenerationMatch=0``, GCS's native exclusive create (HTTP
  412 when the object exists). As on S3, a conditional request whose response was lost may be
  retried and answered 412 for its own success, so on any error the marker is read back: our
  bytes (they carry a unique nonce) mean success, other bytes another writer.
* Listings bypass gcsfs's listing cache (FsspecStorage invalidates before each).
* Credentials: gcsfs's own (``token=`` in `storage_options`, application default credentials,
  ``GOOGLE_APPLICATION_CREDENTIALS``); ``endpoint_url`` points it at an emulator.

This module never imports torch.distributed.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from ..errors import CheckpointExistsError, StorageError
from .fsspec_fs import FsspecStorage, _join

log = logging.getLogger("distckpt")


class GcsStorage(FsspecStorage):
    """Checkpoints under gs://bucket/prefix."""

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> "GcsStorage":
        # The plain client: gcsfs's default class (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT) asks a gRPC
        # control plane for each bucket's type first, which an emulator or a firewall answers
        # only after its 60 s timeout. Zonal buckets are not supported through it.
        from gcsfs.core import GCSFileSystem

        options = dict(storage_options)
        options.setdefault("skip_instance_cache", True)  # one owned client per manager
        fs = GCSFileSystem(**options)
        root = url.split("://", 1)[1].rstrip("/")
        return cls(fs, root, url)

    def create_exclusive(self, path: str, data: bytes) -> None:
        target = _join(self.root, path)
        try:
            self._call("creating", target, "pipe_file", target, data, mode="create")
            return
        except CheckpointExistsError as e:  # gcsfs turns the 412 into FileExistsError
            first_error: StorageError = e
        except StorageError as e:
            first_error = e
        current = self._read_back(path)
        if current == data:
            log.info("%s: the conditional write was applied by an earlier attempt of this request",
                     self.public(target))
            return
        if current is not None or isinstance(first_error, CheckpointExistsError):
            raise CheckpointExistsError(errno.EEXIST, f"{self.public(target)} already exists: another "
                                        "writer committed this step") from first_error
        raise first_error

    def _read_back(self, path: str) -> bytes | None:
        self.fs.invalidate_cache(_join(self.root, path))
        try:
            return self.read_bytes(path)
        except FileNotFoundError:
            return None
