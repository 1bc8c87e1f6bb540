"""Storage backends: whole-or-nothing files, an exclusive commit marker, uncached listings.

Paths handed to a backend are relative to the checkpoint root and use "/" separators. The
backends share one contract (tested by one suite, tests/test_storage_contract.py):

* :class:`LocalStorage` (local.py) — POSIX disk: temporary name, fsync, ``os.replace``,
  directory fsync; the marker is linked into place with ``os.link``, which fails if the name
  exists (the local counterpart of ``If-None-Match: *``).
* :class:`S3Storage` (s3.py) — S3 through s3fs: objects put whole (a single PUT, or a multipart
  upload completed only after every part succeeded and aborted otherwise); the marker put with
  ``If-None-Match: *`` and read back to tell a retried success from a real conflict. Large
  files are read as streamed ranged GETs into an unnamed local file that is then mapped
  (spill.py), or by the CRT client of s3torchconnector when asked (s3_crt.py).
* :class:`GcsStorage` (gcs.py) — Google Cloud Storage through gcsfs: the marker created with
  ``ifGenerationMatch=0`` and read back on any error, as on S3.
* :class:`AzureStorage` (azure.py) — Azure Blob through adlfs: the marker created with
  ``If-None-Match: *`` and read back on any error.
* :class:`FsspecStorage` (fsspec_fs.py) — any other fsspec filesystem (``memory://`` …).

This package never imports torch.distributed.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Any, Iterable, Protocol

import fsspec

from distckpt.errors import (
    ConfigError,
    NonAtomicStorageWarning,  # noqa: F401  (re-exported where it was defined)
    StorageError,
    shown,
)
from distckpt.storage.capabilities import Capabilities
from distckpt.storage.fsspec_fs import EXCLUSIVE_CREATE_PROTOCOLS, FsspecStorage
from distckpt.storage.local import LocalStorage


class Storage(Protocol):
    """What the protocol needs from a place to keep checkpoints."""

    url: str
    capabilities: Capabilities  # what this backend can do (capabilities.py)

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        """Write all chunks as `path`, atomically: afterwards it exists whole or not at all."""

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create `path` holding `data`; CheckpointExistsError if it already exists."""

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        """The whole file; MissingFileError (a FileNotFoundError) if absent; with `max_bytes`,
        StorageError(EFBIG) for a larger file, refused before it is read whole."""

    def read_buffer(self, path: str) -> bytes | bytearray | memoryview:
        """The whole file for parsing large payloads (local disk: mapped, not copied)."""

    def list_dir(self, path: str) -> list[str]:
        """Names directly under `path`, read fresh from storage; [] if it does not exist."""

    def list_files(self, path: str = "", start_after: str | None = None) -> dict[str, str]:
        """Every file under `path` (relative to it) with a version tag that changes whenever the
        file is replaced ("" where the backend gives none), read fresh in one listing: on an
        object store its pages, not one request per file. With `start_after`, only the files
        whose relative path sorts after it (an object store lists from there on)."""

    def list_names(self, path: str) -> list[str]:
        """Names directly under `path` in one shallow listing (an object store's delimiter
        listing: its pages hold one name per directory, not every file). Unlike list_dir it may
        name a directory that holds nothing any more."""

    def exists(self, path: str) -> bool: ...

    def check_root(self) -> None:
        """StorageError if the root can never hold a checkpoint as named (an object store's bucket
        or container does not exist): a load that finds nothing asks, so a typo in a bucket name
        is an error rather than a fresh start. A missing directory is fine (the first save makes it)."""

    def size(self, path: str) -> int | None:
        """The file's size in bytes, read fresh from storage; None if it does not exist."""

    def newest_mtime(self, path: str) -> float | None:
        """Newest modification time of anything under `path` (seconds since the epoch)."""

    def remove_file(self, path: str) -> None:
        """Remove one file; absent is fine."""

    def remove_tree(self, path: str) -> None:
        """Remove a directory and everything under it; absent is fine."""

    def collect_abandoned_uploads(self, grace_s: float, dry_run: bool = False) -> list[str]:
        """Abort uploads under the root that never completed and are older than `grace_s`;
        returns their paths (relative to the root). `dry_run`: only name them."""



_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):(//)?(.*)", re.DOTALL)
log = logging.getLogger("distckpt")


# fsspec file systems that cannot hold a root: a save would fail deep inside with an error about
# something else (zip://x opened the current directory as a zip file: IsADirectoryError).
READ_ONLY_SCHEMES = {
    **dict.fromkeys(("zip", "tar", "libarchive"), "reads an archive file (open with fo=...), it writes none"),
    **dict.fromkeys(("http", "https"), "only reads over HTTP"),
    **dict.fromkeys(("github", "git", "reference", "data"), "is read-only"),
}


def normalize_url(url: Any) -> str:
    """The checkpoint root as a string, checked: a local path, ``file://`` URL or fsspec URL.

    Raises ConfigError for what would silently land somewhere else: ``s3:/bucket`` (a local
    directory named "s3:"), ``S3://`` (schemes are lower case), an unknown scheme, a bucket-less
    ``s3://``, ``file://host/...``, a NUL byte.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():  # "   " made a directory named by spaces
        raise ConfigError(f"url={shown(url)}: must be a local path (str or pathlib.Path) or an fsspec URL "
                          "such as s3://bucket/prefix")
    if "\x00" in url:
        raise ConfigError(f"url={shown(url)}: contains a NUL byte")
    if "::" in url:
        return url  # an fsspec chain (simplecache::s3://...): fsspec parses and checks it
    match = _SCHEME.fullmatch(url)
    if match is None or len(match.group(1)) == 1:  # no scheme, or a Windows drive letter
        return url
    scheme, slashes, rest = match.groups()
    if not slashes:
        raise ConfigError(f"url={shown(url)}: looks like a URL without '//' ({scheme}://{rest.lstrip('/')}?); "
                          "a local path must not start with a scheme")
    if scheme != scheme.lower():
        raise ConfigError(f"url={shown(url)}: URL schemes are lower case: use {scheme.lower()}://{rest}")
    if scheme == "file":
        host, _, path = rest.partition("/")
        if host not in ("", "localhost"):
            raise ConfigError(f"url={shown(url)}: file:// URLs name a local absolute path (file:///abs/path or "
                              f"file://localhost/abs/path), not the host {host!r}")
        if not path.strip("/ "):  # file:// and file:/// are the file system's root, never a run's directory
            raise ConfigError(f"url={shown(url)}: names no directory (it would be the file system's root); "
                              "use file:///abs/path/to/run")
        return "file:///" + path
    if scheme in ("s3", "s3a") and not rest.split("/", 1)[0]:
        raise ConfigError(f"url={shown(url)}: names no bucket; use s3://bucket/prefix")
    if not rest.strip("/ "):  # memory:// is the whole file system: every run's steps beside each other
        raise ConfigError(f"url={shown(url)}: names no directory; use {scheme}://<path of this run>")
    if scheme in READ_ONLY_SCHEMES:
        raise ConfigError(f"url={shown(url)}: fsspec's {shown(scheme)} file system {READ_ONLY_SCHEMES[scheme]}; a checkpoint "
                          "root must be a writable directory (a local path, s3://, gs://, az://, ...)")
    if "//" in rest.rstrip("/"):
        # An empty path segment: some stores fold "a//b" into "a/b" when writing and not when
        # listing (SeaweedFS: a save committed, and every load after it found nothing and started over).
        cleaned = "/".join(part for part in rest.split("/") if part)
        raise ConfigError(f"url={shown(url)}: has an empty path segment ('//'), which object stores treat "
                          f"differently when writing and when listing; use {scheme}://{cleaned}")
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError as e:
        raise ConfigError(f"url={shown(url)}: unknown scheme {shown(scheme)} (fsspec knows "
                          f"{', '.join(sorted(fsspec.available_protocols())[:12])}, ...)") from e
    except ImportError as e:
        raise ConfigError(f"url={shown(url)}: the {shown(scheme)} filesystem needs a package that is not installed: {e}") from e
    return url


def _open_local(url: str, options: dict[str, Any]) -> Storage:
    if options:
        raise ConfigError(f"storage_options were given for the local path {shown(url)}; they apply to remote URLs only")
    return LocalStorage(url[len("file://"):] if url.startswith("file://") else url)


def _open_s3(url: str, options: dict[str, Any]) -> Storage:
    from distckpt.storage.s3 import S3Storage  # s3fs is an optional dependency

    return S3Storage.from_url(url, options)


def _open_gcs(url: str, options: dict[str, Any]) -> Storage:
    from distckpt.storage.gcs import GcsStorage  # gcsfs is an optional dependency

    return GcsStorage.from_url(url, options)


def _open_azure(url: str, options: dict[str, Any]) -> Storage:
    from distckpt.storage.azure import AzureStorage  # adlfs is an optional dependency

    return AzureStorage.from_url(url, options)


def _open_fsspec(url: str, options: dict[str, Any]) -> Storage:
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (TypeError, ValueError) as e:  # an option the file system does not take
        raise ConfigError(f"url={shown(url)}: fsspec could not make its file system with storage_options="
                          f"{sorted(options)}: {type(e).__name__}: {e}") from e
    except OSError as e:  # ftp://host connects at once: an unknown or unreachable host
        raise StorageError(e.errno, f"{url}: opening the file system failed ({type(e).__name__}: {e}); check "
                           "the host and that it is reachable from here") from e
    storage = FsspecStorage(fs, root, url)
    if not storage.capabilities.exclusive_create:
        _warn_not_exclusive(fs, url)
    return storage


# scheme -> backend. A new backend is one module plus one line here (and a parameter of the
# contract suite, tests/test_storage_contract.py); any other scheme goes through fsspec.
BACKENDS: dict[str, Any] = {"": _open_local, "file": _open_local, "s3": _open_s3, "s3a": _open_s3,
                            "gs": _open_gcs, "gcs": _open_gcs, "az": _open_azure, "abfs": _open_azure,
                            "abfss": _open_azure}


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """A backend for a local path, ``file://`` URL, ``s3://`` URL, or any other fsspec URL."""
    url = normalize_url(url)
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ConfigError(f"storage_options={shown(storage_options)}: must be a dict of fsspec options or None")
    scheme = url.split("://", 1)[0] if "://" in url and "::" not in url else ""
    if "::" in url:
        return _open_fsspec(url, storage_options or {})
    opener = BACKENDS.get(scheme, _open_fsspec)
    return opener(url, storage_options or {})  # type: ignore[no-any-return]


def _warn_not_exclusive(fs: Any, url: str) -> None:
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    message = (f"{url}: the fsspec backend {type(fs).__name__} ({'/'.join(sorted(protocols))}) is not known to create "
               "files exclusively; distckpt writes COMMITTED check-then-write there, so two writers of one "
               "step could both commit. Run one writer per root (local disk and s3:// commit exclusively).")
    log.warning(message)
    warnings.warn(message, NonAtomicStorageWarning, stacklevel=3)


__all__ = ["Capabilities", "EXCLUSIVE_CREATE_PROTOCOLS", "FsspecStorage", "LocalStorage", "NonAtomicStorageWarning", "Storage", "normalize_url", "open_storage"]


def is_mapped(buffer: Any) -> bool:
    """Whether `buffer` views a file mapping (read_buffer's on local disk)."""
    import mmap

    return isinstance(getattr(buffer, "obj", None), mmap.mmap)


def release_pages(buffer: Any, start: int = 0, length: int | None = None) -> None:
    """Let the kernel drop the pages of a file mapping (read_buffer's) from this process: they are
    faulted in again from the file if read later. A no-op for other buffers. Only for buffers
    nothing has written to (a private mapping's written pages would be lost)."""
    import mmap

    if not is_mapped(buffer) or not hasattr(mmap, "MADV_DONTNEED") or len(buffer.obj) == 0:
        return
    obj: mmap.mmap = buffer.obj
    end = len(obj) if length is None else min(len(obj), start + length)
    first = start - start % mmap.PAGESIZE
    if end > first:
        obj.madvise(mmap.MADV_DONTNEED, first, end - first)
