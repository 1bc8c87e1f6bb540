"""Any fsspec filesystem: each file is sent whole with one call. The base of the object-store
backends, and the fallback backend for every scheme no other backend claims (ftp://, sftp:// …).

Every filesystem call goes through `_call`, the one place where errors become StorageError
(FileNotFoundError becomes MissingFileError) and where a subclass bounds the call's duration.
"""

from __future__ import annotations

import errno
import posixpath
from typing import Any, Iterable

from distckpt.errors import CheckpointExistsError, ConfigError, MissingFileError, StorageError, shown
from distckpt.storage.capabilities import Capabilities
from distckpt.storage.registry import BackendSpec, is_client_error, register_backend


def _join(root: str, path: str) -> str:
    return posixpath.join(root, path) if path else root


def version_tag(info: dict[str, Any]) -> str:
    """The object's ETag: a new one for every new version (S3: the content's MD5 for a plain
    PUT). Modification times are not used: two versions written within the clock's resolution
    would look alike. "" where the store gives no ETag."""
    etag = info.get("ETag") or info.get("etag")
    return str(etag) if etag else ""


class FsspecStorage:
    """Any fsspec filesystem; each file is sent whole with one call."""

    def __init__(self, fs: Any, root: str, url: str, exclusive_create: bool = False) -> None:
        """`exclusive_create`: whether this filesystem's open(..., "xb") is a real exclusive create
        (its backend's spec says so; the contract suite checks it); otherwise the marker is
        checked, then written."""
        self.fs = fs
        self.capabilities = Capabilities(
            exclusive_create=exclusive_create, streamed_writes=False,
            renames_into_place=False, ranged_reads=False,
            keeps_empty_directories=False)  # a "directory" is a prefix of the files under it
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")

    def __repr__(self) -> str:  # never the filesystem object: it may hold credentials
        return f"{type(self).__name__}({self.url!r})"

    def public(self, target: str) -> str:
        """A path as the user wrote it (with its scheme), for messages."""
        return self.url + target[len(self.root):]

    def _call(self, what: str, target: str, method: str, *args: Any, size: int = 0, **kwargs: Any) -> Any:
        try:
            return getattr(self.fs, method)(*args, **kwargs)
        except FileNotFoundError as e:
            raise MissingFileError(errno.ENOENT, f"{self.public(target)} does not exist") from e
        except FileExistsError as e:  # an exclusive create lost: kept distinct, never flattened
            raise CheckpointExistsError(errno.EEXIST, f"{self.public(target)} already exists") from e
        except OSError as e:
            raise StorageError(e.errno or errno.EIO, f"{what} {self.public(target)} failed: "
                               f"{type(e).__name__}: {e}") from e
        except Exception as e:
            if not is_client_error(e):
                raise  # a defect, not the store's answer
            # a client's own error class that its fsspec layer lets through (gcsfs's HttpError
            # for a 416, an Azure HttpResponseError): the store's answer all the same
            raise StorageError(errno.EIO, f"{what} {self.public(target)} failed: {type(e).__name__}: {e}") from e

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        target = _join(self.root, path)
        data = b"".join(chunks)  # bytes-like chunks joined with one copy
        self._call("writing", target, "pipe_file", target, data, size=len(data))

    def create_exclusive(self, path: str, data: bytes) -> None:
        target = _join(self.root, path)
        try:
            with self.fs.open(target, "xb") as f:
                f.write(data)
        except FileExistsError as e:
            raise CheckpointExistsError(errno.EEXIST, f"{self.public(target)} already exists: another writer created it first") from e
        except (ValueError, NotImplementedError):
            # No exclusive mode here: check then write (not atomic against a second writer;
            # said at construction with a NonAtomicStorageWarning).
            if self.exists(path):
                raise CheckpointExistsError(errno.EEXIST, f"{self.public(target)} already exists: another writer created it first") from None
            self._call("creating", target, "pipe_file", target, data)
        except OSError as e:
            raise StorageError(e.errno or errno.EIO, f"creating {self.public(target)} failed: {e}") from e

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        """The whole file; with `max_bytes`, only a file no larger (StorageError EFBIG), and
        never more than max_bytes + 1 bytes are fetched."""
        target = _join(self.root, path)
        if max_bytes is None:
            return self._call("reading", target, "cat_file", target)
        try:
            data = self._call("reading", target, "cat_file", target, start=0, end=max_bytes + 1)
        except MissingFileError:
            raise
        except StorageError:
            # S3, GCS and Azure answer a ranged GET of an empty object with 416 (InvalidRange),
            # each in its own words: an empty file is b"", anything else the error it was
            if self._call("reading", target, "size", target) != 0:
                raise
            data = b""
        if len(data) > max_bytes:
            raise StorageError(errno.EFBIG, f"{self.public(target)} is more than the {max_bytes:,} bytes such a "
                               "file may hold; it was not read")
        return data

    def read_buffer(self, path: str) -> bytes | bytearray | memoryview:
        return self.read_bytes(path)

    def list_dir(self, path: str) -> list[str]:
        target = _join(self.root, path)
        self.fs.invalidate_cache(target)
        try:
            names = self._call("listing", target, "ls", target, detail=False)
        except MissingFileError:
            return []
        return sorted({posixpath.basename(n.rstrip("/")) for n in names} - {""})

    def list_files(self, path: str = "", start_after: str | None = None) -> dict[str, str]:
        target = _join(self.root, path)
        self.fs.invalidate_cache(target)
        try:
            found = self._call("listing", target, "find", target, detail=True)
        except MissingFileError:
            return {}
        prefix = target.rstrip("/") + "/"
        return {name[len(prefix):]: version_tag(info) for name, info in found.items()
                if name.startswith(prefix) and info.get("type", "file") == "file"
                and (start_after is None or name[len(prefix):] > start_after)}

    def list_names(self, path: str) -> list[str]:
        return FsspecStorage.list_dir(self, path)

    def exists(self, path: str) -> bool:
        target = _join(self.root, path)
        self.fs.invalidate_cache(target)
        return bool(self._call("checking", target, "exists", target))

    def check_root(self) -> None:
        """Nothing to check on a filesystem of directories (object stores: conditional.py)."""

    def size(self, path: str) -> int | None:
        target = _join(self.root, path)
        self.fs.invalidate_cache(target)
        try:
            return int(self._call("reading the size of", target, "size", target))
        except MissingFileError:
            return None

    def newest_mtime(self, path: str) -> float | None:
        target = _join(self.root, path)
        self.fs.invalidate_cache(target)
        newest = None
        for name in self._call("listing", target, "find", target):
            try:
                t = self._call("reading the time of", name, "modified", name).timestamp()
            except (StorageError, NotImplementedError, IsADirectoryError, ValueError):
                continue
            newest = t if newest is None else max(newest, t)
        return newest

    def collect_abandoned_uploads(self, grace_s: float, dry_run: bool = False) -> list[str]:
        return []  # one-call writes leave nothing behind

    def remove_file(self, path: str) -> None:
        target = _join(self.root, path)
        try:
            self._call("removing", target, "rm_file", target)
        except MissingFileError:
            pass

    def remove_tree(self, path: str) -> None:
        target = _join(self.root, path)
        try:
            self._call("removing", target, "rm", target, recursive=True)
        except MissingFileError:
            pass


def open_fsspec(url: str, options: dict[str, Any], exclusive_create: bool = False) -> FsspecStorage:
    """An FsspecStorage for `url` through fsspec's own URL parsing (`url` is checked first: no
    chains, no patterns)."""
    import fsspec.core

    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (TypeError, ValueError) as e:  # an option the file system does not take
        raise ConfigError(f"url={shown(url)}: fsspec could not make its file system with storage_options="
                          f"{sorted(options)}: {type(e).__name__}: {e}") from e
    except OSError as e:  # ftp://host connects at once: an unknown or unreachable host
        raise StorageError(e.errno, f"{url}: opening the file system failed ({type(e).__name__}: {e}); check "
                           "the host and that it is reachable from here") from e
    return FsspecStorage(fs, root, url, exclusive_create=exclusive_create)


# Every scheme no other backend claims, through fsspec; its marker is checked, then written (a
# NonAtomicStorageWarning says so when a root is opened).
SPEC = register_backend(BackendSpec(
    name="fsspec", schemes=(), open=open_fsspec, exclusive_create=False, container=None,
    client_packages=(), install_hint="",
    jitter_modules=(), secret_env=(), secret_options=(), credential_env_prefixes=("FSSPEC_",), selected_by=()))
