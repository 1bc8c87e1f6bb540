"""Reading a committed file and verifying it against its manifest record, with one second read.

A checksum that does not match, or a read the client itself refused (botocore's
FlexibleChecksumError surfaces as EIO), may be a transfer corrupted on its way rather than a
damaged object: one byte flipped in a single S3 response made an intact newest step count as
damaged, and the load fell back to an older step (whose next save then replaced the good one).
So a file that fails is read once more, whole, before it counts as damaged. A file damaged at
rest fails both reads; the cost falls on the failure path only.

This module never imports torch.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Callable

from distckpt.errors import CorruptCheckpointError, MissingFileError, NotAFileError, StorageError
from distckpt.io import signing
from distckpt.io.checksums import verify_file

log = logging.getLogger("distckpt")

Release = Callable[[Any], Callable[[int, int], None]]  # buffer -> release(start, length)


def read_verified(storage: Any, path: str, record: dict[str, Any], where: str,
                  release: Release | None = None) -> Any:
    """The bytes of `path` (a buffer; maybe mapped), their size and checksum those of `record`.
    Raises CorruptCheckpointError when both reads fail to verify or something other than a file
    stands there (NotAFileError), the storage's own error when both reads fail (MissingFileError
    at once: a missing file stays missing)."""
    first: Exception | None = None  # the first read's failure, said only if the second read verifies
    for attempt in (1, 2):
        try:
            data = storage.read_buffer(path)
        except MissingFileError:
            raise
        except NotAFileError as e:  # a FIFO, a link ... where the file goes: it can never verify
            raise CorruptCheckpointError(str(e)) from e
        except StorageError as e:
            if attempt == 2 or e.errno != errno.EIO:
                raise
            first = e
            continue
        try:
            verify_read(storage, data, record, where, release)
        except CorruptCheckpointError as e:
            if attempt == 2:
                raise  # damage at rest: the caller says so (a fallback's warning), once
            first = e
            continue
        if first is not None:  # a transfer that failed, not damage: worth a line, as it may recur
            log.warning("%s: the first read failed (%s); the second verified, so it is not counted as damage",
                        where, first)
        return data
    raise AssertionError("unreachable")  # pragma: no cover


def verify_read(storage: Any, data: Any, record: dict[str, Any], where: str, release: Release | None = None) -> None:
    """The check every reader of a load runs on a file's bytes, however they were read (whole, or
    in ranges by the ranks together): xxh3, or the signed BLAKE3 digest instead where `storage`
    has a verify key (io/signing.py). CorruptCheckpointError / UntrustedCheckpointError."""
    verify_file(data, record, where, release(data) if release is not None else None, signing.verifies(storage))
