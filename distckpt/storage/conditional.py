"""Object stores whose fsspec client has a native exclusive create (``pipe_file(mode="create")``:
GCS's ``ifGenerationMatch=0``, Azure's ``If-None-Match: *``), with the commit marker's rule, and
large files read as ranged requests into a mapped download file (spill.py), as on S3.

A conditional request whose response was lost may be retried by the client and then answered
"exists" for its own success, so on any error the marker is read back: our bytes (they carry a
unique nonce) mean success, other bytes another writer. (S3's client names the lost race less
reliably: s3.py also reads the error codes.)

This module never imports torch.distributed.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from distckpt.errors import CheckpointExistsError, ConfigError, MissingFileError, StorageError
from distckpt.storage.capabilities import Capabilities
from distckpt.storage.clients import shared_client
from distckpt.storage.fsspec_fs import FsspecStorage, _join
from distckpt.storage.spill import SMALL_READ_BYTES, SpillError, check_spill_dir, default_spill_dir, download_mapped, write_at

RANGE_BYTES = 8 * 2**20  # one ranged request at a time: what a download holds in memory

log = logging.getLogger("distckpt")


class ConditionalCreateStorage(FsspecStorage):
    """An fsspec object store whose `pipe_file(..., mode="create")` fails with FileExistsError
    when the object exists."""

    spill_dir: str | None = None
    # The marker by the store's precondition; files put whole (S3 streams its parts: s3.py).
    CAPABILITIES = Capabilities(exclusive_create=True, streamed_writes=False, renames_into_place=False,
                                ranged_reads=True, keeps_empty_directories=False)
    client_name = ""  # the fsspec class `make_client` builds, for messages

    def __init__(self, fs: Any, root: str, url: str) -> None:
        super().__init__(fs, root, url)
        self.capabilities = self.CAPABILITIES

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> "ConditionalCreateStorage":
        """A backend for `url` (open_storage registered its credentials for redaction): `spill_dir` taken out
        and checked, the rest given to the client (ConfigError if it refuses them)."""
        options = dict(storage_options)
        spill_dir = check_spill_dir(options.pop("spill_dir", default_spill_dir()))
        options.setdefault("skip_instance_cache", True)  # shared by distckpt's rule, not fsspec's (clients.py)
        try:
            fs = shared_client(cls.__name__, options, lambda: cls.make_client(options))
        except (ValueError, TypeError) as e:  # the client's own check of its options
            raise ConfigError(f"storage_options for {url} were refused by {cls.client_name}: {e}") from e
        storage = cls(fs, url.split("://", 1)[1].rstrip("/"), url)
        storage.spill_dir = spill_dir
        return storage

    @staticmethod
    def make_client(options: dict[str, Any]) -> Any:
        raise NotImplementedError

    def read_buffer(self, path: str) -> bytes | bytearray | memoryview:
        """A small file in one request; a larger one downloaded into a local file that is mapped
        (`_download`: a backend's ranged requests). Without a `spill_dir`, or when the local disk
        refuses the file, it is held in memory (`_read_in_memory`)."""
        target = _join(self.root, path)
        size = self.size(path)
        if size is None:
            raise MissingFileError(errno.ENOENT, f"{self.public(target)} does not exist")
        if size < SMALL_READ_BYTES:
            return self.read_bytes(path)
        if self.spill_dir is not None:
            try:
                return self._reading(target, download_mapped, self.spill_dir, size,
                                     lambda fd: self._download(target, size, fd))
            except SpillError as e:
                log.warning("%s: downloading into %s failed (%s); holding the file in memory instead "
                            "(storage option spill_dir)", self.public(target), self.spill_dir, e)
        return self._read_in_memory(path, target, size)

    def _reading(self, target: str, run: Any, *args: Any) -> Any:
        """`run(*args)`, with what the client raises outside `_call` as StorageError (a backend
        whose client raises its own classes extends this)."""
        return run(*args)

    def _read_in_memory(self, path: str, target: str, size: int) -> bytes | bytearray | memoryview:
        return self.read_bytes(path)

    def _download(self, target: str, size: int, fd: int) -> None:
        for start in range(0, size, RANGE_BYTES):
            end = min(size, start + RANGE_BYTES)
            piece = self._call("reading", target, "cat_file", target, start=start, end=end, size=end - start)
            if len(piece) != end - start:
                raise StorageError(errno.EIO, f"reading {self.public(target)}: short read, {len(piece)} of "
                                   f"{end - start} bytes at {start}")
            write_at(fd, piece, start)

    def read_range(self, path: str, start: int, end: int, put: Any) -> None:
        """Bytes [start, end) of `path`, handed to `put(offset, data)` as they arrive (a
        cooperative load's part: protocol/cooperative.py). Short reads are errors."""
        target = _join(self.root, path)
        for first in range(start, end, RANGE_BYTES):
            last = min(end, first + RANGE_BYTES)
            piece = self._call("reading", target, "cat_file", target, start=first, end=last, size=last - first)
            if len(piece) != last - first:
                raise StorageError(errno.EIO, f"reading {self.public(target)}: short read, {len(piece)} of "
                                   f"{last - first} bytes at {first}")
            put(first, piece)

    container_word = "bucket"  # what the store calls the URL's first component, for messages

    def check_root(self) -> None:
        bucket = self.root.split("/", 1)[0]
        self.fs.invalidate_cache(bucket)
        if not self._call("checking", bucket, "exists", bucket):
            raise StorageError(errno.ENOENT, f"{self.url}: the {self.container_word} {bucket!r} does not exist (or "
                               "these credentials cannot see it): nothing can be loaded from or saved there; "
                               f"create it, or fix the URL")

    def create_exclusive(self, path: str, data: bytes) -> None:
        target = _join(self.root, path)
        try:
            self._call("creating", target, "pipe_file", target, data, mode="create")
            return
        except StorageError as e:
            first_error = e
        current = self._read_back(path)
        if current == data:
            log.info("%s: the conditional write was applied by an earlier attempt of this request",
                     self.public(target))
            return
        if current is not None or self._lost_the_race(first_error):
            raise CheckpointExistsError(errno.EEXIST, f"{self.public(target)} already exists: another "
                                        "writer committed this step") from first_error
        raise first_error

    def _lost_the_race(self, e: StorageError) -> bool:
        """Whether the failed create says the object exists (the client's FileExistsError)."""
        return isinstance(e, CheckpointExistsError)

    def _read_back(self, path: str) -> bytes | None:
        self.fs.invalidate_cache(_join(self.root, path))
        try:
            return self.read_bytes(path)
        except FileNotFoundError:
            return None
