"""A large object downloaded into an unnamed local file and mapped, instead of held in memory.

A load verifies every byte before anything is restored (nothing half-restored), so the whole
file must be at hand before the first tensor is copied. Held in a bytearray, an S3 load of a
1 GiB file cost 1 GiB of extra memory on top of the state it restores into. Written into an
unnamed file (O_TMPFILE: nothing is left behind, even after SIGKILL) and mapped copy-on-write,
the download holds only the reads in flight (`concurrency` x `range_bytes`) in memory, and the
load then works as on local disk: pages verified and restored piece by piece, each let go of
once used (storage.release_pages).

This module never imports torch.distributed.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from typing import Callable

from distckpt.errors import ConfigError, shown

SMALL_READ_BYTES = 4 * 2**20  # read in one request into memory; larger files go to a download file


class SpillError(OSError):
    """Writing the local file failed (full disk, read-only place …), not the object store."""


def check_spill_dir(value: object) -> str | None:
    """The `spill_dir` storage option: a writable directory, or None/False/"" to keep downloads
    in memory. Default: the system's temporary directory."""
    if value is None or value is False or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"spill_dir={shown(value)}: must be a directory path (or None to keep S3 "
                          "downloads in memory)")
    path = os.fspath(value)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"spill_dir={shown(path)} is not a writable directory; pass an existing one "
                          "(local disk with room for the largest checkpoint file), or None to keep "
                          "S3 downloads in memory")
    return path


def default_spill_dir() -> str:
    return tempfile.gettempdir()


def download_mapped(directory: str, size: int, fill: Callable[[int], None]) -> memoryview:
    """A read-only view of `size` bytes that `fill(fd)` writes into an unnamed file of
    `directory` (with os.pwrite, in any order). SpillError if the local file cannot be made or
    written; whatever `fill` raises otherwise passes through."""
    try:
        f = tempfile.TemporaryFile(dir=directory)
    except OSError as e:
        raise SpillError(e.errno or errno.EIO, f"creating a download file in {directory}: {e}") from e
    with f:
        fd = f.fileno()
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size)
        except OSError as e:
            raise SpillError(e.errno or errno.EIO, f"reserving {size} bytes in {directory}: {e}") from e
        fill(fd)
        return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY))


def _reserve(fd: int, size: int) -> None:
    """Reserve the blocks now, so a full disk fails here and not later as SIGBUS on a page of
    the mapping (file systems without fallocate rely on the writes' own ENOSPC)."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def write_at(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """All of `data` at `offset` of the download file (SpillError if the disk refuses)."""
    view = memoryview(data).cast("B")
    try:
        while view:
            done = os.pwrite(fd, view, offset)
            view, offset = view[done:], offset + done
    except OSError as e:
        raise SpillError(e.errno or errno.EIO, f"writing the download file: {e}") from e
