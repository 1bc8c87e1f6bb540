"""The Storage protocol: what the checkpoint protocol needs from a place to keep checkpoints.

Paths handed to a backend are relative to the checkpoint root and use "/" separators. Each
backend (registry.py says how to add one) meets this contract, and one suite tests them all
(tests/test_storage_contract.py).

This module never imports torch.distributed.
"""

from __future__ import annotations

from typing import Iterable, Protocol

from distckpt.storage.capabilities import Capabilities


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
