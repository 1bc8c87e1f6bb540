"""The writer process's main (writer_process.py starts it: `python -m distckpt.protocol.writer_child
FD PARENT_PID`). It serves one request at a time from its socket:

    ("storage", key, pickled Storage)        keep a storage to write to
    ("segment", index, size) + an fd         map a shared staging segment (the fd follows as
                                             SCM_RIGHTS on the same socket)
    ("write", key, path, node_json, items, live_segments)
                                             write a payload file from the staged tensors, answer
                                             ("ok", record) or ("error", type, message, errno)
    ("stop",)                                exit

It never outlives the trainer: EOF on the socket ends it, and a watchdog thread ends it within
half a second once its parent is gone (a SIGKILLed trainer sends no EOF while another process,
a DataLoader worker forked later, still holds the socket). SIGINT is ignored: a Ctrl-C in the
terminal reaches the whole process group, and the trainer decides what happens to the save.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Iterator

PARENT_CHECK_S = 0.5


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(PARENT_CHECK_S)


def _nbytes(dtype_name: str, shape: list[int]) -> int:
    import torch

    numel = 1
    for n in shape:
        numel *= n
    return numel * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


class _Inline:
    """The bytes of a request's live tensors (staging_bytes), read from the socket in order."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.expected = 0
        self.received = 0

    def pieces(self, tensor: Any) -> Iterator[memoryview]:
        if not tensor.is_meta:
            from distckpt.io.staging import tensor_pieces

            yield from tensor_pieces(tensor)
            return
        left = tensor.numel() * tensor.element_size()
        while left > 0:
            piece = self.conn.recv_bytes()
            self.received += len(piece)
            left -= len(piece)
            yield memoryview(piece)

    def drain(self) -> None:
        while self.received < self.expected:
            self.received += len(self.conn.recv_bytes())


def main(fd: int, parent: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), name="distckpt-writer-watchdog", daemon=True).start()
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    # imported after the watchdog runs: torch takes seconds to import on a loaded machine
    from distckpt.io.safetensors_format import EncodedTree, safetensors_chunks
    from distckpt.io.shared_staging import tensor_in
    from distckpt.protocol.payload import write_chunks
    from distckpt.protocol.writer_process import INLINE

    storages: dict[int, Any] = {}
    segments: dict[int, mmap.mmap] = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return 0
        kind = request[0]
        if kind == "stop":
            return 0
        if kind == "storage":
            storages[request[1]] = pickle.loads(request[2])  # our own parent's Storage object
        elif kind == "segment":
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            segments[request[1]] = mmap.mmap(fds[0], request[2])
            os.close(fds[0])
        elif kind == "write":
            _, key, path, node_json, items, live, digest = request  # digest: a signing key's BLAKE3 too
            for index in set(segments) - set(live):  # given up by the trainer (its pool compacted)
                segments.pop(index).close()
            inline = _Inline(conn)
            inline.expected = sum(_nbytes(dtype, shape) for _, dtype, shape, seg, _ in items if seg == INLINE)
            try:
                tensors = {name: tensor_in(segments[seg] if seg >= 0 else None if seg == INLINE else b"", offset,
                                           dtype, shape)
                           for name, dtype, shape, seg, offset in items}
                tree = EncodedTree(None, tensors, _node_json=node_json)
                record = write_chunks(storages[key], path, safetensors_chunks(tree, inline.pieces), digest)
                del tree, tensors
                reply: tuple[Any, ...] = ("ok", record)
            except Exception as e:  # told to the trainer's writer thread, which fails the save
                reply = ("error", type(e).__name__, str(e), e.errno if isinstance(e, OSError) else None)
            try:
                inline.drain()  # the trainer sends every live byte before it reads the reply
            except (EOFError, OSError):
                return 0
            conn.send(reply)
    return 0


if __name__ == "__main__":
    code = main(int(sys.argv[1]), int(sys.argv[2]))
    # Every file it wrote is durable and answered by now. An ordinary interpreter exit would wait on
    # (or, for a client library's native threads still running, abort on: "terminate called without
    # an active exception", printed on the trainer's stderr) what the storages left behind.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
