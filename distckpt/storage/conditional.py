"""Object stores whose fsspec client has a native exclusive create (``pipe_file(mode="create")``:
GCS's ``ifGenerationMatch=0``, Azure's ``If-None-Match: *``), with the commit marker's rule.

A conditional request whose response was lost may be retried by the client and then answered
"exists" for its own success, so on any error the marker is read back: our bytes (they carry a
unique nonce) mean success, other bytes another writer. (S3's client names the lost race less
reliably, so s3.py keeps its own version of this, which also reads the error codes.)

This module never imports torch.distributed.
"""

from __future__ import annotations

import errno
import logging

from ..errors import CheckpointExistsError, StorageError
from .fsspec_fs import FsspecStorage, _join

log = logging.getLogger("distckpt")


class ConditionalCreateStorage(FsspecStorage):
    """An fsspec object store whose `pipe_file(..., mode="create")` fails with FileExistsError
    when the object exists."""

    def create_exclusive(self, path: str, data: bytes) -> None:
        target = _join(self.root, path)
        try:
            self._call("creating", target, "pipe_file", target, data, mode="create")
            return
        except StorageError as e:  # CheckpointExistsError: the store said the object exists
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
