"""Writing one payload file (a tree of tensors as safetensors), in this process or another.

saving.py writes every payload file through `write_tree`. An async save's writer thread may
hand the work to a writer process (writer="process": writer_process.py) by setting the tree
writer for its own context; everything else (the manifest, the marker, the fencing checks, the
exchanges) stays where it was, so the commit rule does not depend on who wrote the bytes.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Protocol

from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.io.safetensors_format import EncodedTree, safetensors_chunks
from distckpt.storage import Storage


class TreeWriter(Protocol):
    def write_tree(self, storage: Storage, path: str, tree: EncodedTree) -> dict[str, Any]:
        """Write `tree` durably to `path`; returns its record ({"size", "xxh3_64"}, and the digest when signing)."""


_WRITER: "contextvars.ContextVar[TreeWriter | None]" = contextvars.ContextVar("distckpt_tree_writer", default=None)


def write_tree(storage: Storage, path: str, tree: EncodedTree) -> dict[str, Any]:
    """The payload file of `tree` at `path`, durable; its size and checksum. Then the tree's
    `written` callback (bounded staging: the training thread waits for it)."""
    try:
        writer = _WRITER.get()
        if writer is not None:
            return writer.write_tree(storage, path, tree)
        return write_chunks(storage, path, safetensors_chunks(tree))
    finally:
        if tree.written is not None:
            tree.written()


def write_chunks(storage: Storage, path: str, chunks: Any, digest: bool | None = None) -> dict[str, Any]:
    """`digest`: also the file's cryptographic digest (a signing key); None: as the storage's keys say."""
    check = mf.Checksum(digest=signing.writes_digests(storage) if digest is None else digest)
    storage.write_file(path, check.wrap(chunks))
    return check.record()


@contextlib.contextmanager
def trees_written_by(writer: TreeWriter | None) -> Iterator[None]:
    """Within the block (this thread's context), payload files are written by `writer`."""
    token = _WRITER.set(writer)
    try:
        yield
    finally:
        _WRITER.reset(token)
