"""Storage backends: whole-or-nothing files, an exclusive commit marker, uncached listings.

A checkpoint root is a local path or a URL, and one backend opens it, chosen by the URL's scheme
from the registry (registry.py, which says how to add a backend in one module):

* ``local`` (local.py) — a path without a scheme, or ``file://``: POSIX disk, temporary name,
  fsync, ``os.replace``, directory fsync; the marker is linked into place with ``os.link``, which
  fails if the name exists (the local counterpart of ``If-None-Match: *``). A path is taken
  literally, whatever characters it holds (``::``, ``[``, ``?``, ``#``, ``%``, spaces ...).
* ``s3`` (s3.py) — ``s3://`` through s3fs: objects put whole (a single PUT, or a multipart upload
  completed only after every part succeeded and aborted otherwise); the marker put with
  ``If-None-Match: *`` and read back to tell a retried success from a real conflict. Large files
  are read as streamed ranged GETs into an unnamed local file that is then mapped (spill.py).
* ``s3-crt`` (s3_crt.py) — the same, with payload reads through the CRT client of
  s3torchconnector (``storage_options={"client": "crt"}``).
* ``gcs`` (gcs.py) — ``gs://`` through gcsfs: the marker created with ``ifGenerationMatch=0`` and
  read back on any error, as on S3.
* ``azure`` (azure.py) — ``az://`` / ``abfs://`` through adlfs: the marker created with
  ``If-None-Match: *`` and read back on any error.
* ``memory`` (memory.py) — fsspec's in-process ``memory://`` file system.
* ``fsspec`` (fsspec_fs.py) — any other fsspec file system, warned about when its marker is not
  created exclusively.

A URL is checked before any backend sees it (`normalize_url`): what would silently land
somewhere else is a ConfigError. fsspec's chains (``simplecache::s3://...``) are refused: a cache
in front of a store answers listings from the cache.

This package never imports torch.distributed.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import fsspec

from distckpt.errors import ConfigError, NonAtomicStorageWarning, shown, warn
from distckpt.storage.base import Storage
from distckpt.storage.capabilities import Capabilities
from distckpt.storage.fsspec_fs import FsspecStorage
from distckpt.storage.jitter import keep_jitter_private
from distckpt.storage.local import LocalStorage
from distckpt.storage.redact import protect_credentials
from distckpt.storage.registry import (
    LOCAL_PATH,
    BackendSpec,
    backend_for,
    backends,
    register_backend,
    registered_schemes,
    unregister_backend,
)

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):(//|:)?(.*)", re.DOTALL)
# What fsspec reads as a pattern in a path: a deletion of "run[1]" removed "run1" instead.
_GLOB_MAGIC = re.compile(r"[*?\[]")
log = logging.getLogger("distckpt")


# fsspec file systems that cannot hold a root: a save would fail deep inside with an error about
# something else (zip://x opened the current directory as a zip file: IsADirectoryError).
READ_ONLY_SCHEMES = {
    **dict.fromkeys(("zip", "tar", "libarchive"), "reads an archive file (open with fo=...), it writes none"),
    **dict.fromkeys(("http", "https"), "only reads over HTTP"),
    **dict.fromkeys(("github", "git", "reference", "data"), "is read-only"),
}


def scheme_of(url: str) -> str:
    """The scheme of a URL `normalize_url` returned; LOCAL_PATH ("") for a plain path."""
    match = _SCHEME.fullmatch(url)
    return match.group(1) if match is not None and len(match.group(1)) > 1 and match.group(2) == "//" else LOCAL_PATH


def normalize_url(url: Any) -> str:
    """The checkpoint root as a string, checked: a local path, ``file://`` URL or a URL one backend
    opens.

    A string without a scheme is a local path, taken literally whatever characters it holds.
    Raises ConfigError for what would silently land somewhere else: ``s3:/bucket`` (a local
    directory named "s3:"), ``S3://`` (schemes are lower case), an unknown scheme, a bucket-less
    ``s3://``, ``file://host/...``, a NUL byte, an fsspec chain (``simplecache::s3://...``), and
    in a remote URL the characters fsspec reads as a pattern (``*``, ``?``, ``[``).
    """
    url = _as_text(url)
    match = _SCHEME.fullmatch(url)
    if match is None or len(match.group(1)) == 1:  # no scheme, or a Windows drive letter
        return url
    scheme, separator, rest = match.groups()
    if separator == ":":
        raise _chain_refused(url)
    if not separator:
        raise ConfigError(f"url={shown(url)}: looks like a URL without '//' ({scheme}://{rest.lstrip('/')}?); "
                          f"a local path must not start with a scheme (write ./{url} for a local directory of that name)")
    if scheme != scheme.lower():
        raise ConfigError(f"url={shown(url)}: URL schemes are lower case: use {scheme.lower()}://{rest}")
    if _is_local(scheme):
        return _file_url(url, rest)
    _check_remote_path(url, scheme, rest)
    return url


def _as_text(url: Any) -> str:
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():  # "   " made a directory named by spaces
        raise ConfigError(f"url={shown(url)}: must be a local path (str or pathlib.Path) or an fsspec URL "
                          "such as s3://bucket/prefix")
    if "\x00" in url:
        raise ConfigError(f"url={shown(url)}: contains a NUL byte")
    return url


def _is_local(scheme: str) -> bool:
    return backend_for(scheme, {}) is backend_for(LOCAL_PATH, {})


def _chain_refused(url: str) -> ConfigError:
    return ConfigError(f"url={shown(url)}: reads as an fsspec chain ('::' joins file systems, as in "
                       "simplecache::s3://...), which distckpt does not open: a cache in front of a store answers "
                       "listings from the cache. Give the store's own URL (s3://bucket/prefix); for a local "
                       f"directory with '::' in its name write its absolute path or ./{url}")


def _file_url(url: str, rest: str) -> str:
    host, _, path = rest.partition("/")
    if host not in ("", "localhost"):
        raise ConfigError(f"url={shown(url)}: file:// URLs name a local absolute path (file:///abs/path or "
                          f"file://localhost/abs/path), not the host {host!r}")
    if not path.strip("/ "):  # file:// and file:/// are the file system's root, never a run's directory
        raise ConfigError(f"url={shown(url)}: names no directory (it would be the file system's root); "
                          "use file:///abs/path/to/run")
    return "file:///" + path  # the path is literal: no percent-decoding, '::' and '?' are characters


def _check_remote_path(url: str, scheme: str, rest: str) -> None:
    spec = backend_for(scheme, {})
    if spec.container and not rest.split("/", 1)[0]:
        raise ConfigError(f"url={shown(url)}: names no {spec.container}; use {scheme}://{spec.container}/prefix")
    if not rest.strip("/ "):  # memory:// is the whole file system: every run's steps beside each other
        raise ConfigError(f"url={shown(url)}: names no directory; use {scheme}://<path of this run>")
    if "::" in rest:
        raise _chain_refused(url)
    magic = sorted(set(_GLOB_MAGIC.findall(rest)))
    if magic:
        raise ConfigError(f"url={shown(url)}: holds {', '.join(map(repr, magic))}, which fsspec reads as a pattern "
                          "(a deletion under it would match other paths); name the prefix without them")
    if spec.is_fallback and scheme in READ_ONLY_SCHEMES:
        raise ConfigError(f"url={shown(url)}: fsspec's {shown(scheme)} file system {READ_ONLY_SCHEMES[scheme]}; a checkpoint "
                          f"root must be a writable directory (a local path, {_writable_schemes()}, ...)")
    if "//" in rest.rstrip("/"):
        # An empty path segment: some stores fold "a//b" into "a/b" when writing and not when
        # listing (SeaweedFS: a save committed, and every load after it found nothing and started over).
        cleaned = "/".join(part for part in rest.split("/") if part)
        raise ConfigError(f"url={shown(url)}: has an empty path segment ('//'), which object stores treat "
                          f"differently when writing and when listing; use {scheme}://{cleaned}")
    if spec.is_fallback:
        _check_fsspec_knows(url, scheme)


def _writable_schemes() -> str:
    return ", ".join(f"{s}://" for s in sorted(registered_schemes() - {LOCAL_PATH}))


def _check_fsspec_knows(url: str, scheme: str) -> None:
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError as e:
        raise ConfigError(f"url={shown(url)}: unknown scheme {shown(scheme)} (distckpt opens {_writable_schemes()} and "
                          f"fsspec's {', '.join(sorted(fsspec.available_protocols())[:12])}, ...)") from e
    except ImportError as e:
        raise ConfigError(f"url={shown(url)}: the {shown(scheme)} filesystem needs a package that is not installed: {e}") from e


def local_path_of(url: Any) -> str | None:
    """The local path that a plain path or a ``file://`` URL names, taken literally (ConfigError as
    `normalize_url` for a malformed one); None for a URL another backend opens."""
    url = normalize_url(url)
    scheme = scheme_of(url)
    if not _is_local(scheme):
        return None
    return url[len(scheme) + len("://"):] if scheme != LOCAL_PATH else url


def open_storage(url: Any, storage_options: dict[str, Any] | None = None) -> Storage:
    """The backend for a local path, ``file://`` URL, ``s3://`` URL, or any other URL a registered
    backend (or fsspec) opens; ConfigError for a malformed URL or a client library not installed."""
    url = normalize_url(url)
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ConfigError(f"storage_options={shown(storage_options)}: must be a dict of fsspec options or None")
    options = dict(storage_options or {})
    spec = backend_for(scheme_of(url), options)
    keep_jitter_private(spec.jitter_modules)  # before the client exists: its threads draw from then on
    if spec.secret_env or spec.secret_options:
        protect_credentials(options)  # before the client exists: it may log them at DEBUG
    try:
        storage = spec.open(url, options)
    except ImportError as e:
        package = (e.name or "").partition(".")[0]
        if package not in spec.client_packages:
            raise
        raise ConfigError(f"url={shown(url)}: the {spec.name} backend needs {package}, which is not installed here: "
                          f"{spec.install_hint}") from e
    if not spec.exclusive_create:
        _warn_not_exclusive(storage, url)
    return storage


def _warn_not_exclusive(storage: Storage, url: str) -> None:
    fs = getattr(storage, "fs", None)
    protocol = getattr(fs, "protocol", "?")
    protocols = {protocol} if isinstance(protocol, str) else set(protocol)
    message = (f"{url}: the fsspec backend {type(fs).__name__} ({'/'.join(sorted(protocols))}) is not known to create "
               "files exclusively; distckpt writes COMMITTED check-then-write there, so two writers of one "
               "step could both commit. Run one writer per root (local disk and s3:// commit exclusively).")
    warn(message, NonAtomicStorageWarning)


__all__ = ["BackendSpec", "Capabilities", "FsspecStorage", "LocalStorage", "NonAtomicStorageWarning", "Storage",
           "backends", "local_path_of", "normalize_url", "open_storage", "register_backend", "unregister_backend"]


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
