"""Checksums of payload files: xxh3-64, streamed while writing and verified while reading.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import xxhash

from distckpt.errors import CorruptCheckpointError
from distckpt.io import signing
from distckpt.runtime.cores import cores_per_rank
from distckpt.runtime.interrupts import Helpers, Task


class Checksum:
    """Counts and hashes chunks as they stream past (xxh3-64: several GB/s on one core).

    A large chunk is hashed on a helper thread while the consumer writes it (xxhash releases
    the GIL): the hash was 0.024 s of a 0.25 s save of 256 MiB, run before each write. One
    chunk at a time is in flight, so the hash sees the chunks in order.
    """

    algorithm = "xxh3_64"

    def __init__(self, digest: bool = False) -> None:
        self._h = xxhash.xxh3_64()
        # With signing (signing.py), a BLAKE3 digest too, in the same helper task as xxh3: the
        # write waits for neither unless the hash falls behind it.
        self._digest = signing.new_digest() if digest else None
        self.size = 0
        self._pending: Task | None = None

    def wrap(self, chunks: Iterable[memoryview | bytes]) -> Iterator[memoryview | bytes]:
        try:
            for chunk in chunks:
                n = memoryview(chunk).nbytes
                self._settle()
                if n >= _HASH_AHEAD_BYTES:
                    self._pending = _HASHER.submit(self._update, chunk)
                else:
                    self._update(chunk)
                self.size += n
                yield chunk
        finally:
            self._settle()

    def _update(self, chunk: memoryview | bytes) -> None:
        self._h.update(chunk)
        if self._digest is not None:
            self._digest.update(chunk)

    def _settle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def hexdigest(self) -> str:
        self._settle()
        return self._h.hexdigest()

    def record(self) -> dict[str, Any]:
        """The file's manifest record: size, xxh3 and, with digests, BLAKE3."""
        out: dict[str, Any] = {"size": self.size, "xxh3_64": self.hexdigest()}
        if self._digest is not None:
            out[signing.DIGEST] = self._digest.hexdigest()
        return out


_HASH_AHEAD_BYTES = 256 << 10  # smaller ones: handing over costs more than it saves
_HASHER = Helpers(2, "distckpt-hash")


def checksum_of(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


RELEASE_CHUNK = 8 << 20  # xxh3 over 8 MiB pieces runs as fast as over the whole file
# A verified file at least this large is hashed by BLAKE3 on several cores (digest_threads): a
# hasher with threads starts a pool of its own (about 1 ms), so small files stay on one.
PARALLEL_DIGEST_BYTES = 16 << 20
MAX_DIGEST_THREADS = 8


def digest_threads(nbytes: int) -> int:
    """How many threads BLAKE3 may use to verify `nbytes`: for a large file, the cores this
    process may run on, shared with the other ranks of its node (torchrun's LOCAL_WORLD_SIZE),
    less one for the load's own helper thread that runs meanwhile (copying.Prefault faults in the
    destination tensors): on 2 cores a second hash thread beside it made a 256 MiB verified load
    slower, 0.144 against 0.132 s (bench/verify_profile.py). One for a small file. (xxh3 stays on
    one: it is memory-bound already.)"""
    if nbytes < PARALLEL_DIGEST_BYTES:
        return 1
    return max(1, min(MAX_DIGEST_THREADS, cores_per_rank() - 1))


def verify_file(data: bytes | bytearray | memoryview, record: dict[str, Any], where: str,
                release: Any = None, digest: bool = False) -> None:
    """Size and checksum against the manifest's record. With `release` (a function of a byte
    range), the bytes are hashed in 8 MiB pieces and each piece released after it is hashed, so
    verifying a mapped file does not keep it resident (export's bounded memory).

    With `digest` (a reader with a verify key), the record's BLAKE3 digest instead of its xxh3
    (UntrustedCheckpointError when it is absent or differs), on several cores for a large file:
    BLAKE3 detects every change xxh3 does, so a file that matches it is not hashed twice (the
    xxh3 beside it in the record is vouched for by the same signature, and a record whose xxh3
    was edited fails that signature). A file that does not match is checked against xxh3 too, to
    name damage as damage."""
    if len(data) != record["size"]:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes, the manifest says {record['size']} (truncated or replaced)")
    if digest:
        crypto = signing.new_digest(digest_threads(len(data)))
        _hash_pieces(data, crypto, release)
        if crypto.hexdigest() != record.get(signing.DIGEST):
            _check_xxh3(checksum_of(data), record, where)  # the failure path only: damage, or forgery
            signing.check_digest(crypto, record, where)
        return
    if release is None:
        actual = checksum_of(data)
    else:
        h = xxhash.xxh3_64()
        _hash_pieces(data, h, release)
        actual = h.hexdigest()
    _check_xxh3(actual, record, where)


def _hash_pieces(data: bytes | bytearray | memoryview, h: Any, release: Any) -> None:
    view = memoryview(data)
    for start in range(0, len(view), RELEASE_CHUNK):
        h.update(view[start:start + RELEASE_CHUNK])
        if release is not None:
            release(start, min(RELEASE_CHUNK, len(view) - start))


def _check_xxh3(actual: str, record: dict[str, Any], where: str) -> None:
    if actual != record["xxh3_64"]:
        raise CorruptCheckpointError(f"{where}: checksum {actual} does not match the manifest's {record['xxh3_64']} (damaged)")
