"""The writer process (writer="process"): payload files serialised, checksummed and written by a
process of their own, so that their CPU never holds the training process's GIL.

One writer process per rank, started with the manager (it imports torch meanwhile). The async
save's writer thread stays in the training process and keeps everything that decides the
outcome — the exchanges, the reports, the manifest, the fencing checks, the marker — and hands
each payload file to the process: which staged tensors (segment, offset, dtype, shape) in shared
memory (io/shared_staging.py) and the tree's JSON; the process writes the same bytes the thread
would (the same safetensors_chunks over views of the same memory) and answers with the file's
size and checksum. The writer thread only waits on a socket meanwhile.

Why a new interpreter (subprocess of `python -m distckpt.protocol.writer_child`), not a fork:
the training process has CUDA contexts and threads (gloo, the hash helpers, the writer thread);
a forked child inherits locks those threads held at the fork and a CUDA context it cannot use,
and may deadlock or crash. Not multiprocessing's spawn either: it re-imports the user's
`__main__`, and a training script without an `if __name__ == "__main__"` guard would train again.

Its death: the socket's end tells the writer thread at once (a SIGKILLed writer is an
AsyncSaveError on every rank, through the save's ordinary outcome; nothing is committed, the
previous checkpoint is untouched), and the next save starts a new process. The trainer's death:
the process reads EOF on the socket, and a watchdog thread checks its parent every half second,
so it never outlives the trainer (writer_child.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from distckpt.errors import AsyncSaveError, ConfigError, StorageError
from distckpt.io import signing
from distckpt.io.safetensors_format import EncodedTree, _aligned_order
from distckpt.io.shared_staging import SharedAllocation, SharedArena, SharedStagingPool, tensor_spec
from distckpt.io.staging import PIECE_BYTES, StagingPool, tensor_pieces
from distckpt.protocol.bounded_staging import BoundedStagingPool
from distckpt.storage import Storage

log = logging.getLogger("distckpt")

INLINE = -2  # a request's segment number for a tensor whose bytes follow on the socket


def check_storage(storage: Storage) -> None:
    """The storage a writer process can open from a pickle (it holds no live connection, only
    how to open one): refused by name where the bytes would land in another process's memory.
    The shared staging needs Linux's memfd_create (an anonymous segment the kernel frees with the
    last process holding it); elsewhere writer='process' is refused."""
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        raise ConfigError("writer='process' needs Linux (anonymous shared memory through memfd_create, passed to "
                          "the writer process over a Unix socket); use writer='thread' on this system")
    if storage.url.startswith("memory://"):
        raise ConfigError(f"writer='process' with {storage.url}: memory:// is this process's own memory, which "
                          "the writer process cannot write into; use a local path or an object store, or "
                          "writer='thread'")
    try:
        pickle.dumps(storage)
    except Exception as e:
        raise ConfigError(f"writer='process' with {storage.url}: its storage cannot be handed to the writer "
                          f"process ({type(e).__name__}: {e}); use writer='thread'") from e


class SharedBoundedStagingPool(SharedAllocation, BoundedStagingPool):
    """staging_bytes with writer='process': the staged tail in shared memory, the live part's
    bytes sent over the socket in pieces as the process writes them."""

    arena: SharedArena


class WriterProcess:
    """The rank's writer process and its socket; `write_tree` is a TreeWriter (payload.py)."""

    def __init__(self, pool: SharedStagingPool | SharedBoundedStagingPool) -> None:
        self.pool = pool
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._sock: socket.socket | None = None
        self._sent_segments: set[int] = set()
        self._storages: dict[int, int] = {}  # id(storage) -> key in the process
        self._lock = threading.Lock()
        self.deaths = 0

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the process if none runs (at construction, and after one died)."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._drop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                           if p)}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "distckpt.protocol.writer_child", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self._sock = ours
        self._conn = Connection(os.dup(ours.fileno()))
        self._sent_segments = set()
        self._storages = {}

    def write_tree(self, storage: Storage, path: str, tree: EncodedTree) -> dict[str, Any]:
        """Hand the file to the process and wait for its record. Raises what the process raised
        (an OSError as OSError, with its errno), or AsyncSaveError if the process died."""
        items, inline = [], set()
        for name, tensor in tree.tensors.items():
            where = self.pool.arena.locate(tensor) if tensor.numel() else (-1, 0)
            if where is None:  # a live tensor (staging_bytes): its bytes follow the request
                where = (INLINE, 0)
                inline.add(name)
            items.append((name, *tensor_spec(tensor), *where))
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start_locked()  # a previous process died (its save failed): a new one
            try:
                self._send_storage(storage)
                self._send_segments()
                assert self._conn is not None
                self._conn.send(("write", self._storages[id(storage)], path, tree.node_json, items,
                                 sorted(self._sent_segments), signing.writes_digests(storage)))
                for name, tensor in _aligned_order(tree.tensors):  # the order the process reads them in
                    if name in inline:
                        for piece in tensor_pieces(tensor):  # at most PIECE_BYTES reach the process at once
                            for start in range(0, piece.nbytes, PIECE_BYTES):
                                self._conn.send_bytes(piece[start:start + PIECE_BYTES])
                reply = self._conn.recv()
            except (EOFError, OSError) as e:
                raise self._died(path) from e
        if reply[0] == "ok":
            return dict(reply[1])
        _, kind, message, errno = reply
        if errno is not None:  # the storage's error, as the thread would have raised it (a full disk: ENOSPC)
            raise StorageError(errno, f"{message} (writer process, {kind})")
        raise AsyncSaveError(f"the writer process failed writing {path}: {kind}: {message}")

    def _send_storage(self, storage: Storage) -> None:
        if id(storage) in self._storages:
            return
        key = len(self._storages)
        assert self._conn is not None
        self._conn.send(("storage", key, pickle.dumps(storage)))
        self._storages[id(storage)] = key

    def _send_segments(self) -> None:
        assert self._conn is not None and self._sock is not None
        for segment in self.pool.arena.segments:
            if segment.index in self._sent_segments:
                continue
            self._conn.send(("segment", segment.index, segment.size))
            socket.send_fds(self._sock, [b"s"], [segment.fd])
            self._sent_segments.add(segment.index)

    def _died(self, path: str) -> AsyncSaveError:
        proc = self._proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.deaths += 1
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 and
               -code in signal.valid_signals() else f"exited with status {code}" if code is not None else "stopped answering")
        self._drop()
        return AsyncSaveError(
            f"the writer process (pid {None if proc is None else proc.pid}) {how} while writing {path}; this save "
            "is not committed and the checkpoints committed before it are intact. The next save starts a new "
            "writer process; if it keeps dying, look for the OOM killer (dmesg) or use writer='thread'")

    def _drop(self) -> None:
        for closeable in (self._conn, self._sock):
            if closeable is not None:
                try:
                    closeable.close()
                except OSError:
                    pass
        self._conn = self._sock = None
        self._proc = None

    def close(self, timeout_s: float = 10.0) -> None:
        """End the process (after the save in flight: the caller waited for it). A write still
        running after `timeout_s` (one abandoned as stuck) ends with the process: killed."""
        if not self._lock.acquire(timeout=timeout_s):
            proc = self._proc
            if proc is not None:
                proc.kill()  # the stuck write sees the socket's end and releases the lock
            self._lock.acquire()
        try:
            proc, conn = self._proc, self._conn
            if proc is None:
                return
            try:
                if conn is not None:
                    conn.send(("stop",))
                proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            self._drop()
        finally:
            self._lock.release()


def staging_for(config: Any) -> tuple[StagingPool, WriterProcess | None]:
    """The session's staging pool and writer process for its settings (writer=, staging_bytes=):
    shared-memory buffers and a process started now (it imports torch while the job starts up)
    for writer='process'; a bounded pool for staging_bytes; else today's pool and thread."""
    if config.async_save and config.writer == "process":
        pool: SharedStagingPool | SharedBoundedStagingPool = (
            SharedStagingPool() if config.staging_bytes is None else SharedBoundedStagingPool(config.staging_bytes))
        writer = WriterProcess(pool)
        writer.start()
        return pool, writer
    if config.async_save and config.staging_bytes is not None:
        return BoundedStagingPool(config.staging_bytes), None
    return StagingPool(), None
