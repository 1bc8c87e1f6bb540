"""POSIX disk: tmp + flush + fsync + os.replace + directory fsync for every file."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import shutil
import stat
import sys
import uuid
from typing import Any, Iterable, Iterator

from distckpt.errors import CheckpointExistsError, ConfigError, MissingFileError, NotAFileError, StorageError, shown
from distckpt.storage.capabilities import LOCAL_DISK
from distckpt.storage.registry import LOCAL_PATH, BackendSpec, register_backend

READ_AHEAD_BYTES = 512 << 20  # asked of the kernel at once when a file is mapped for a load


class LocalStorage:
    capabilities = LOCAL_DISK

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
        self._refuse_writing_through_links(final)
        directory = os.path.dirname(final)
        tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            self._makedirs(directory)
            with open(tmp, "wb", buffering=0) as f:
                writeback = Writeback(f.fileno())
                for chunk in chunks:
                    for piece in _pieces(chunk):
                        _write_all(f, piece)
                        writeback.wrote(piece.nbytes)
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
        self._refuse_writing_through_links(final)
        directory = os.path.dirname(final)
        tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            self._makedirs(directory)
            with open(tmp, "wb", buffering=0) as f:
                _write_all(f, data)
                os.fsync(f.fileno())
            os.link(tmp, final)  # atomic, and fails if `final` exists: no second commit
            try:
                _fsync_dir(directory)
            except OSError:
                # Not durable, so not committed: take the marker back rather than report a
                # failure while a checkpoint is visible.
                _silently_remove(final)
                raise
        except FileExistsError as e:
            raise CheckpointExistsError(errno.EEXIST, f"{final} already exists: another writer created it first") from e
        except OSError as e:
            raise StorageError(e.errno, f"creating {final} failed: {e.strerror or e}") from e
        finally:
            _silently_remove(tmp)

    @contextlib.contextmanager
    def _reading(self, full: str) -> Iterator[Any]:
        """Open for reading with errors translated. Checkpoint files are regular files, never
        links: a link planted in a step directory could point anywhere, so none is followed
        (neither the file, O_NOFOLLOW, nor any directory between the root and it); and a FIFO,
        socket or device node standing there is refused before it is read (see _open_regular)."""
        self._refuse_linked_directories(full)
        try:
            with os.fdopen(_open_regular(full), "rb") as f:
                yield f
        except FileNotFoundError as e:
            raise _not_found(full) from e
        except NotADirectoryError as e:  # a stray file spelled like a step directory: that file does not exist
            raise MissingFileError(errno.ENOENT, f"{full} does not exist ({e.strerror}: a file stands in its path)") from e
        except NotAFileError:
            raise
        except OSError as e:
            if e.errno == errno.ELOOP:  # the link was swapped in after the look (O_NOFOLLOW refused it)
                raise _not_a_file(full, "a symbolic link") from e
            raise StorageError(e.errno, f"reading {full} failed: {e.strerror or e}") from e

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        with self._reading(self._abs(path)) as f:
            if max_bytes is not None:
                _check_size(os.fstat(f.fileno()).st_size, max_bytes, self._abs(path))
            return f.read()

    def _refuse_linked_directories(self, full: str) -> None:
        relative = os.path.relpath(os.path.dirname(full), self.root)
        if relative == ".":
            return
        current = self.root
        for part in relative.split(os.sep):
            current = os.path.join(current, part)
            if os.path.islink(current):
                raise NotAFileError(errno.ELOOP, f"{current} is a symbolic link to a directory; checkpoint "
                                    "directories never are, so it was not followed")

    def _refuse_writing_through_links(self, full: str) -> None:
        """The readers' rule for writers: no file is written or removed through a symbolic link
        between the root and it (a `step-N` or `ranks/` link to a directory elsewhere). Followed,
        a save wrote a whole step outside the root and reported success, and the readers, which
        never follow such links, could not load it."""
        try:
            self._refuse_linked_directories(full)
        except NotAFileError as e:
            raise StorageError(errno.ELOOP, f"{e.strerror}: nothing is written or removed through it. Remove the "
                               "link (its target is not touched) or give the manager another root") from e

    def read_buffer(self, path: str) -> memoryview | bytes:
        """The file mapped copy-on-write: no copy out of the page cache, and writes to tensors
        viewing it never reach the file. (A bytearray + readinto spent 0.09 s of 0.14 s per
        128 MiB zero-filling and faulting in the new buffer.)"""
        with self._reading(self._abs(path)) as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return b""
            if hasattr(os, "posix_fadvise"):  # the load reads it all: from a cold cache the disk
                # then reads ahead at its own pace (verify 256 MiB: 0.15 -> 0.13 s); bounded, so a
                # file larger than memory does not push out its own first pages before they are read
                os.posix_fadvise(f.fileno(), 0, min(size, READ_AHEAD_BYTES), os.POSIX_FADV_WILLNEED)
            return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY))

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except FileNotFoundError:
            return []
        except NotADirectoryError as e:  # a file where the root or its fence/ directory goes: no listing says which
            raise StorageError(e.errno, f"listing {self._abs(path)} failed: a file stands where a directory goes; "
                               "distckpt never makes one there: move it away (it is not read)") from e
        except OSError as e:
            raise StorageError(e.errno, f"listing {self._abs(path)} failed: {e.strerror or e}") from e

    def list_files(self, path: str = "", start_after: str | None = None) -> dict[str, str]:
        """No version tags: a file replaced within the clock's resolution can keep its inode
        number, size and mtime, and reading a small file here costs microseconds anyway."""
        top = self._abs(path)
        out: dict[str, str] = {}
        first = start_after.split("/", 1)[0] if start_after is not None else None  # top-level names before it hold nothing later
        pending = [top]
        while pending:
            directory = pending.pop()
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                raise StorageError(e.errno, f"listing {directory} failed: {e.strerror or e}") from e
            for entry in entries:
                if first is not None and directory == top and entry.name < first:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                else:
                    out[os.path.relpath(entry.path, top)] = ""
        if start_after is not None:
            out = {name: tag for name, tag in out.items() if name > start_after}
        return out

    def list_names(self, path: str) -> list[str]:
        return self.list_dir(path)

    def exists(self, path: str) -> bool:
        """Whether an entry stands at `path`: a symbolic link counts, even a dangling or looping
        one (os.path.exists follows it and said no, so a marker replaced by a link looked absent).
        A path that cannot be looked at (an unreadable directory on the way) is a StorageError, not
        an absence: a step whose directory could not be read looked removed, and was skipped."""
        try:
            os.lstat(self._abs(path))
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise StorageError(e.errno, f"looking for {self._abs(path)} failed: {e.strerror or e}") from e

    def check_root(self) -> None:
        """A missing directory is fine (the first save makes it); a root that is, or lies under, a
        symbolic link to nothing is not: a mount point missing on this node read as a fresh start,
        and the job trained from step 0 until its first save failed."""
        path = os.path.abspath(self.root)
        while True:
            if os.path.islink(path) and not os.path.exists(path):
                raise StorageError(errno.ENOENT, f"{self.url}: {path} is a symbolic link to {os.readlink(path)!r}, "
                                   "which does not exist (a volume not mounted on this node?): nothing can be "
                                   "loaded from or saved there; mount it, fix the link, or fix the URL")
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent

    def size(self, path: str) -> int | None:
        try:
            return os.stat(self._abs(path)).st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(e.errno, f"reading the size of {self._abs(path)} failed: {e.strerror or e}") from e

    def newest_mtime(self, path: str) -> float | None:
        newest = None
        for root, dirs, files in os.walk(self._abs(path)):
            for name in dirs + files:
                try:
                    t = os.stat(os.path.join(root, name)).st_mtime
                except FileNotFoundError:
                    continue
                newest = t if newest is None else max(newest, t)
        if newest is None and os.path.exists(self._abs(path)):
            newest = os.stat(self._abs(path)).st_mtime
        return newest

    def collect_abandoned_uploads(self, grace_s: float, dry_run: bool = False) -> list[str]:
        return []  # temporary files of dead writers live inside step directories, collected with them

    def remove_file(self, path: str) -> None:
        full = self._abs(path)
        self._refuse_writing_through_links(full)
        try:
            os.unlink(full)
            _fsync_dir(os.path.dirname(full))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(e.errno, f"removing {full} failed: {e.strerror or e}") from e

    def remove_tree(self, path: str) -> None:
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


# -- writing back while the file is still being written --------------------------------------
#
# A plain write + fsync leaves every page of the file dirty until the fsync, then writes it all
# while the writer waits: a 1 GiB save held 1,024 MiB of dirty + writeback pages at its peak,
# pressing on the page cache of the training job and of every other rank writing beside it.
# Starting the disk on each window as soon as it is written, and waiting for the window before it,
# keeps at most two windows in flight: the same save peaked at 32 MiB (python bench/dirty_pages.py).
# Time is the disk's either way (fresh-process saves of 256 MiB-1 GiB with and without it were
# within this VM's disk noise, e.g. 1 GiB 2.86 against 2.89 s, medians of 5). The final fsync is
# still what makes the file durable: the windows only start it early.

WRITEBACK_WINDOW_BYTES = 32 << 20
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4
# errors that mean "not on this file system" (a pipe, FUSE, an old kernel): the fsync alone then
_NOT_SUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOTSUP}


def _load_sync_file_range() -> Any:
    if not sys.platform.startswith("linux") or sys.maxsize <= 2**32:  # off64_t arguments as int64
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _load_sync_file_range()


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    """Linux's sync_file_range(2); OSError on failure, as the os module's calls raise."""
    if _SYNC_FILE_RANGE is None:
        raise OSError(errno.ENOSYS, "sync_file_range is not available")
    if _SYNC_FILE_RANGE(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Writeback:
    """Starts the disk on each window of a file as the window is written (see above)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = 0
        self.started = 0  # bytes handed to the disk so far
        self.waited = 0  # bytes known to be on the disk
        self.enabled = _SYNC_FILE_RANGE is not None

    def wrote(self, nbytes: int) -> None:
        self.written += nbytes
        if not self.enabled or self.written - self.started < WRITEBACK_WINDOW_BYTES:
            return
        try:
            sync_file_range(self.fd, self.started, self.written - self.started, _SYNC_FILE_RANGE_WRITE)
            if self.started > self.waited:  # the previous window: its writes have had a window's time
                sync_file_range(self.fd, self.waited, self.started - self.waited,
                                _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)
                self.waited = self.started
        except OSError as e:
            if e.errno not in _NOT_SUPPORTED:
                raise  # EIO, ENOSPC...: the write failed, and the save with it
            self.enabled = False
            return
        self.started = self.written


def _pieces(chunk: memoryview | bytes) -> Iterator[memoryview]:
    """A chunk in windows, so that the disk starts on a large tensor before it is all written."""
    view = memoryview(chunk).cast("B")
    for start in range(0, view.nbytes, WRITEBACK_WINDOW_BYTES):
        yield view[start:start + WRITEBACK_WINDOW_BYTES]


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


# -- only regular files are read ---------------------------------------------------------------
#
# open() of a FIFO for reading waits for a writer, forever: a FIFO planted where a payload file,
# a manifest, a marker or a lease goes hung every load and every command that read it. A device
# node may read without end (/dev/zero), a socket cannot be opened at all. So the entry is looked
# at (lstat) before it is opened, and opened without waiting (O_NONBLOCK) and looked at again on
# the open descriptor (fstat): something swapped in between the two looks is refused too.

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))
_ERRNO_OF_KIND = {"a directory": errno.EISDIR, "a symbolic link": errno.ELOOP}


def file_kind(mode: int) -> str:
    """What a file of `mode` (st_mode) is, for a message: "a FIFO (named pipe)", "a directory" ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_a_file(full: str, kind: str) -> NotAFileError:
    if kind == "a symbolic link":
        return NotAFileError(errno.ELOOP, f"{full} is a symbolic link; checkpoint files never are, so it was not followed")
    return NotAFileError(_ERRNO_OF_KIND.get(kind, errno.ENXIO),
                         f"{full} is {kind}, not a regular file: checkpoint files are always regular files, so "
                         "it was not opened (the file is damaged: remove it, or restore the file)")


def _open_regular(full: str) -> int:
    """A descriptor of the regular file at `full` (not followed if a link), opened without
    waiting; NotAFileError, before any read, for anything else standing there."""
    mode = os.lstat(full).st_mode  # FileNotFoundError / NotADirectoryError: the caller's to say
    if not stat.S_ISREG(mode):
        raise _not_a_file(full, file_kind(mode))
    # O_NONBLOCK: a FIFO swapped in after the look opens at once instead of waiting for a writer
    # (on a regular file the flag changes nothing); the descriptor is looked at again below.
    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_a_file(full, file_kind(mode))
    except BaseException:
        os.close(fd)
        raise
    return fd




def _check_size(size: int, max_bytes: int, where: str) -> None:
    if size > max_bytes:
        raise StorageError(errno.EFBIG, f"{where} is {size:,} bytes, more than the {max_bytes:,} such a file "
                           "may hold; it was not read")


def open_local(url: str, options: dict[str, Any]) -> LocalStorage:
    """A path, or a file:// URL, taken literally: '::', '[', '?', '#', '%' are characters of a name."""
    if options:
        raise ConfigError(f"storage_options were given for the local path {shown(url)}; they apply to remote URLs only")
    return LocalStorage(url[len("file://"):] if url.startswith("file://") else url)


SPEC = register_backend(BackendSpec(
    name="local", schemes=(LOCAL_PATH, "file"), open=open_local, exclusive_create=True, container=None,
    client_packages=(), install_hint="", jitter_modules=(), secret_env=(), secret_options=(), credential_env_prefixes=(),
    selected_by=()))
