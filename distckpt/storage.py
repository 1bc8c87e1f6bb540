"""Storage backends: whole-or-nothing files, an exclusive commit marker, uncached listings.

Paths handed to a backend are relative to the checkpoint root and use "/" separators. Two
backends share one contract (tested by one suite):

* :class:`LocalStorage` — POSIX disk. Each file is written to a temporary name in its final
  directory, flushed, fsynced, renamed with ``os.replace`` and its directory fsynced. The marker
  is linked into place with ``os.link``, which fails if the name exists (the local counterpart
  of ``If-None-Match: *``).
* :class:`FsspecStorage` — any fsspec filesystem (``memory://`` and friends). A file is sent with
  one ``pipe_file`` call, which object stores apply whole or not at all; the marker is created
  with exclusive mode where the filesystem supports it.

This module never imports torch.distributed.
"""

from __future__ import annotations

import errno
import os
import posixpath
import uuid
from typing import Any, Iterable, Protocol

import fsspec

from .errors import CheckpointExistsError, MissingFileError, StorageError


class Storage(Protocol):
    """What the protocol needs from a place to keep checkpoints."""

    url: str

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        """Write all chunks as `path`, atomically: afterwards it exists whole or not at all."""

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create `path` holding `data`; CheckpointExistsError if it already exists."""

    def read_bytes(self, path: str) -> bytes:
        """The whole file; FileNotFoundError (a StorageError) if absent."""

    def list_dir(self, path: str) -> list[str]:
        """Names directly under `path`, read fresh from storage; [] if it does not exist."""

    def exists(self, path: str) -> bool: ...

    def mtime(self, path: str) -> float | None:
        """Modification time (seconds since the epoch), or None where unknown."""

    def remove_file(self, path: str) -> None:
        """Remove one file; absent is fine."""

    def remove_tree(self, path: str) -> None:
        """Remove a directory and everything under it; absent is fine."""


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """A backend for a local path, ``file://`` URL, or any other fsspec URL."""
    if "://" not in url or url.startswith("file://"):
        path = url[len("file://"):] if url.startswith("file://") else url
        if storage_options:
            raise StorageError(f"storage_options were given for the local path {url!r}; they apply to remote URLs only")
        return LocalStorage(path)
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return FsspecStorage(fs, root, url)


def _join(root: str, path: str) -> str:
    return posixpath.join(root, path) if path else root


class LocalStorage:
    """POSIX disk with tmp + fsync + rename + directory fsync for every file."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        final = self._abs(path)
        directory = os.path.dirname(final)
        self._makedirs(directory)
        tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb", buffering=0) as f:
                for chunk in chunks:
                    _write_all(f, chunk)
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(directory)
        except OSError as e:
            _silently_remove(tmp)
            raise StorageError(e.errno, f"writing {final} failed: {e.strerror or e}") from e
        except BaseException:
            _silently_remove(tmp)
            raise

    def create_exclusive(self, path: str, data: bytes) -> None:
        final = self._abs(path)
        directory = os.path.dirname(final)
        tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb", buffering=0) as f:
                _write_all(f, data)
                os.fsync(f.fileno())
            os.link(tmp, final)  # atomic, and fails if `final` exists: no second commit
            _fsync_dir(directory)
        except FileExistsError as e:
            raise CheckpointExistsError(errno.EEXIST, f"{final} already exists: this step is already committed") from e
        except OSError as e:
            raise StorageError(e.errno, f"creating {final} failed: {e.strerror or e}") from e
        finally:
            _silently_remove(tmp)

    def read_bytes(self, path: str) -> bytes:
        full = self._abs(path)
        try:
            with open(full, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise _not_found(full) from e
        except OSError as e:
            raise StorageError(e.errno, f"reading {full} failed: {e.strerror or e}") from e

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(e.errno, f"listing {self._abs(path)} failed: {e.strerror or e}") from e

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def mtime(self, path: str) -> float | None:
        try:
            return os.stat(self._abs(path)).st_mtime
        except FileNotFoundError:
            return None

    def remove_file(self, path: str) -> None:
        full = self._abs(path)
        try:
            os.unlink(full)
            _fsync_dir(os.path.dirname(full))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(e.errno, f"removing {full} failed: {e.strerror or e}") from e

    def remove_tree(self, path: str) -> None:
        import shutil

        full = self._abs(path)
        try:
            shutil.rmtree(full)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(e.errno, f"removing {full} failed: {e.strerror or e}") from e

    def _makedirs(self, directory: str) -> None:
        missing = []
        d = directory
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        os.makedirs(directory, exist_ok=True)
        for created in reversed(missing):  # make each new directory entry durable
            _fsync_dir(os.path.dirname(created))


def _write_all(f: Any, chunk: memoryview | bytes) -> None:
    view = memoryview(chunk).cast("B")
    while view:
        n = f.write(view)
        view = view[n:]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _silently_remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # best effort: a leftover tmp file is ignored by readers and collected later


def _not_found(where: str) -> MissingFileError:
    return MissingFileError(errno.ENOENT, f"{where} does not exist")


class FsspecStorage:
    """Any fsspec filesystem; each file is sent whole with one call."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def __repr__(self) -> str:  # never the filesystem object: it may hold credentials
        return f"FsspecStorage({self.url!r})"

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        target = _join(self.root, path)
        data = b"".join(bytes(c) for c in chunks)
        try:
            self.fs.pipe_file(target, data)
        except OSError as e:
            raise StorageError(e.errno or errno.EIO, f"writing {target} failed: {e}") from e

    def create_exclusive(self, path: str, data: bytes) -> None:
        target = _join(self.root, path)
        try:
            with self.fs.open(target, "xb") as f:
                f.write(data)
        except FileExistsError as e:
            raise CheckpointExistsError(errno.EEXIST, f"{target} already exists: this step is already committed") from e
        except (ValueError, NotImplementedError):
            # No exclusive mode here: check then write (not atomic against a second writer).
            if self.fs.exists(target):
                raise CheckpointExistsError(errno.EEXIST, f"{target} already exists: this step is already committed")
            self.fs.pipe_file(target, data)
        except OSError as e:
            raise StorageError(e.errno or errno.EIO, f"creating {target} failed: {e}") from e

    def read_bytes(self, path: str) -> bytes:
        target = _join(self.root, path)
        try:
            return self.fs.cat_file(target)
        except FileNotFoundError as e:
            raise _not_found(target) from e
        except OSError as e:
            raise StorageError(e.errno or errno.EIO, f"reading {target} failed: {e}") from e

    def list_dir(self, path: str) -> list[str]:
        target = _join(self.root, path)
        try:
            self.fs.invalidate_cache(target)
            names = self.fs.ls(target, detail=False)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(e.errno or errno.EIO, f"listing {target} failed: {e}") from e
        return sorted({posixpath.basename(n.rstrip("/")) for n in names} - {""})

    def exists(self, path: str) -> bool:
        target = _join(self.root, path)
        self.fs.invalidate_cache(target)
        return bool(self.fs.exists(target))

    def mtime(self, path: str) -> float | None:
        try:
            modified = self.fs.modified(_join(self.root, path))
        except (FileNotFoundError, NotImplementedError, IsADirectoryError):
            return None
        return modified.timestamp() if modified is not None else None

    def remove_file(self, path: str) -> None:
        try:
            self.fs.rm_file(_join(self.root, path))
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(_join(self.root, path), recursive=True)
        except FileNotFoundError:
            pass
