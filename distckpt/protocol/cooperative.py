"""Cooperative loads: each byte of the replicated file read from storage once per job.

Without it every rank of a load read the whole replicated file: a 4-rank load from S3 moved 4x
the state's bytes, 8 copies over one link on a node of 8 GPUs. Here the ranks split the file
into equal byte ranges, each reads its own range (the store's ranged reads), and the ranges
travel between the ranks over the manager's gloo group in rounds of at most CHUNK_BYTES in
all, so the extra memory of the exchange is bounded whatever the file's size. Every rank then
holds the whole file and verifies it against the manifest's checksum before anything is parsed
or restored; the bytes are the same on every rank, so the verdict is too: damage anywhere in any
rank's range fails the checksum on every rank at once, and the load falls back to the previous
step together, as it does for a damaged file read whole (a failed checksum is read once more,
all ranks together, before it counts as damage: a transfer may have been corrupted on its way).

Who cooperates (the same answer on every rank, since every rank has the same URL):
* object stores (a backend with ranged reads: S3, GCS, Azure): yes, once per job — the ranks
  of all nodes split the file (docs/design/scaling.md says why not once per node);
* a local or shared filesystem: no. A file on local disk is mapped from the page cache that
  every rank of the node shares; cooperation would copy every byte through gloo instead
  (scaling.md gives the measurement);
* a world of one, and files under MIN_BYTES: no (one request costs less than an exchange).

Protocol, per candidate step, on every rank (call exactly one of `read` or `skip`):
    plan      all ranks exchange (file, size, checksum) or None (a rank that failed before it
              reached the replicated file: it skips). Unless every rank names the same file,
              the ranks that can read it read it whole, as before: the failing rank's error
              is what the read phase's outcome exchange reports.
    parts     each rank reads its range; its success or its error is exchanged, and any error
              is the same error on every rank
    exchange  rounds of all_gather into each rank's copy of the file
    verify    size and checksum (with a verify key: the signed BLAKE3 digest), on every rank
A rank that dies during the exchange fails the collective on the others (CoordinationError
within the manager's timeout); nothing live has been changed by then.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
from typing import Any, Iterator

from distckpt.errors import CorruptCheckpointError, MissingFileError, StorageError
from distckpt.io.reading import read_verified, verify_read
from distckpt.protocol.coord import Coordinator, Outcome, error_of
from distckpt.runtime import faults
from distckpt.storage.spill import SpillError, download_mapped

log = logging.getLogger("distckpt")

CHUNK_BYTES = 64 << 20  # the bytes of one exchange round, all ranks' together: the exchange's extra memory
MIN_BYTES = 1 << 20  # smaller replicated files: every rank reads them whole (one request each)


def cooperates(coord: Coordinator, storage: Any) -> bool:
    """Whether loads from `storage` split the replicated file among the ranks (the same on every
    rank): object stores with ranged reads, in a world of more than one rank."""
    capabilities = getattr(storage, "capabilities", None)
    return (coord.world_size > 1 and hasattr(coord, "all_gather_into") and hasattr(storage, "read_range")
            and capabilities is not None and capabilities.ranged_reads)


@contextlib.contextmanager
def reading_together(coord: Coordinator, storage: Any, step: int) -> Iterator[CooperativeRead | None]:
    """A CooperativeRead for one candidate step where the load cooperates (else None); a rank
    that leaves without reading the replicated file (it failed before) still takes part in the
    plan, so that the others do not wait for it."""
    together = CooperativeRead(coord, storage, step) if cooperates(coord, storage) else None
    try:
        yield together
    finally:
        if together is not None:
            together.skip()


class CooperativeRead:
    """One candidate step's replicated file, read cooperatively. Every rank calls exactly one of
    `read` (it reached the replicated file) or `skip` (it failed before): see the module's
    docstring for the phases."""

    def __init__(self, coord: Coordinator, storage: Any, step: int) -> None:
        self.coord = coord
        self.storage = storage
        self.step = step
        self.done = False

    def skip(self) -> None:
        """This rank failed before the replicated file: it still takes part in the plan."""
        if not self.done:
            self.done = True
            self._plan(None)

    def read(self, path: str, record: dict[str, Any], where: str, release: Any = None) -> Any:
        """The verified bytes of `path` (the replicated file), on every rank."""
        self.done = True
        plan = self._plan({"file": path, "size": int(record["size"]), "sum": str(record["xxh3_64"])})
        if plan is None:
            return read_verified(self.storage, path, record, where, release)
        first: CorruptCheckpointError | None = None
        for attempt in (1, 2):
            data = self._read_together(path, int(record["size"]), where)
            try:
                verify_read(self.storage, data, record, where, release)  # with a verify key: its BLAKE3
            except CorruptCheckpointError as e:
                if attempt == 2:
                    raise  # damage at rest, or in every read: the fallback says so on every rank
                first = e  # the same verdict on every rank (the same bytes): all read again together
                continue
            if first is not None:
                log.warning("%s: the first cooperative read failed (%s); the second verified, so it is not "
                            "counted as damage", where, first)
            return data
        raise AssertionError("unreachable")  # pragma: no cover

    def _plan(self, mine: dict[str, Any] | None) -> dict[str, Any] | None:
        """Every rank's (file, size, checksum); the plan when they are all the same and large
        enough to be worth splitting, else None (every rank that can reads the file whole)."""
        plans = self.coord.all_gather(mine, f"load/cooperative plan step {self.step}")
        if mine is None or any(p != mine for p in plans) or mine["size"] < MIN_BYTES:
            return None
        return mine

    def _read_together(self, path: str, size: int, where: str) -> Any:
        """Every rank's copy of the file: its own range read, the others' received. Into a
        mapped download file where the storage has a `spill_dir` (as its own reads of large
        files: the pages are let go of as they are verified and restored), else in memory."""
        import torch

        part = -(-size // self.coord.world_size)  # every range this long (the last padded): all_gather lines up
        padded = part * self.coord.world_size
        directory = getattr(self.storage, "spill_dir", None)
        if directory:
            try:
                return download_mapped(directory, padded, lambda fd: self._into_file(fd, path, size, part, where))[:size]
            except SpillError as e:  # only this rank's destination: the exchange is the same either way
                log.warning("%s: a download file in %s could not be made (%s); holding the file in memory "
                            "instead (storage option spill_dir)", where, directory, e)
        whole = torch.empty(padded, dtype=torch.uint8)
        self._fill(whole, path, size, part, where)
        return whole.numpy().data[:size]

    def _into_file(self, fd: int, path: str, size: int, part: int, where: str) -> None:
        """The exchange written through a shared mapping of the download file, its pages let go
        of once written (they stay in the file, mapped again to be read)."""
        import torch

        writable = mmap.mmap(fd, part * self.coord.world_size, access=mmap.ACCESS_WRITE)
        whole = torch.frombuffer(writable, dtype=torch.uint8)
        try:
            self._fill(whole, path, size, part, where)
        finally:
            del whole
            if hasattr(mmap, "MADV_DONTNEED"):
                writable.madvise(mmap.MADV_DONTNEED)
            try:
                writable.close()
            except BufferError:  # a view still held somewhere: unmapped when it goes
                pass

    def _fill(self, whole: Any, path: str, size: int, part: int, where: str) -> None:
        world, rank = self.coord.world_size, self.coord.rank
        start, end = min(size, rank * part), min(size, (rank + 1) * part)
        error = self._read_part(path, whole.numpy(), size, start, end, where)
        outcomes = self.coord.all_gather(Outcome.failure(rank, error) if error else Outcome(rank),
                                         f"load/cooperative parts step {self.step}")
        failed = [o for o in outcomes if not o.ok]
        if failed:
            raise error_of(failed, f"reading {where} together") from error
        faults.point("load/cooperative-exchange", step=self.step, rank=rank)
        chunk = max(1, CHUNK_BYTES // world)
        for offset in range(0, part, chunk):
            n = min(chunk, part - offset)
            outputs = [whole[r * part + offset:r * part + offset + n] for r in range(world)]
            self.coord.all_gather_into(outputs, outputs[rank].clone(),  # type: ignore[attr-defined]
                                       f"load/cooperative exchange step {self.step}")

    def _check_size(self, path: str, size: int, where: str) -> None:
        """A stored file of another size than the manifest's is damage (a truncated or replaced
        object), as for a file read whole: the load falls back, rather than failing on a range
        past the object's end."""
        actual = self.storage.size(path)
        if actual is None:
            raise MissingFileError(errno.ENOENT, f"{where} does not exist")
        if actual != size:
            raise CorruptCheckpointError(f"{where}: {actual} bytes, the manifest says {size} (truncated or replaced)")

    def _read_part(self, path: str, whole: Any, size: int, start: int, end: int, where: str) -> BaseException | None:
        """This rank's range into `whole` (a uint8 array), read once more after a failed
        transfer; its error, as the error every rank will raise, or None."""
        import numpy as np

        def put(offset: int, data: bytes) -> None:
            whole[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

        for attempt in (1, 2):
            try:
                self._check_size(path, size, where)
                if end > start:
                    self.storage.read_range(path, start, end, put)
                faults.point("load/cooperative-part", step=self.step, rank=self.coord.rank, start=start, end=end)
                return None
            except CorruptCheckpointError as e:
                return e
            except MissingFileError as e:
                return _chained(CorruptCheckpointError(f"{where} is missing"), e)
            except StorageError as e:
                if attempt == 2 or e.errno != errno.EIO:
                    return e
                log.warning("%s: reading bytes %d-%d failed (%s); reading them once more", where, start, end, e)
            except Exception as e:  # noqa: BLE001  (every rank must hear of it: none may wait in the exchange)
                return e
        return None  # pragma: no cover


def _chained(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error
