"""Retention and garbage collection (rank 0 only, after a commit).

A checkpoint is deleted marker first, then data, so a half-deleted checkpoint is never seen
as committed. Leftovers of saves that never committed are removed once they are older than a
grace period (a save in progress elsewhere must not be collected under its writer).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

from distckpt.errors import CorruptCheckpointError, DistCkptError, MissingFileError
from distckpt.io import manifest as mf
from distckpt.protocol.commit import CommitIndex
from distckpt.runtime import faults
from distckpt.runtime.interrupts import Helpers, Task
from distckpt.storage import Storage

log = logging.getLogger("distckpt")


@dataclass(frozen=True)
class Committed:
    step: int
    metric: float | None
    shared: frozenset[str] = frozenset()  # files of other steps it references (incremental)
    readable: bool = True


def kept_references(committed: list[Committed], doomed: list[int]) -> set[str]:
    """Files the checkpoints that stay reference: retention must keep them. An unreadable kept
    manifest could reference anything, so then every file of the doomed steps is kept."""
    kept = [c for c in committed if c.step not in doomed]
    if not all(c.readable for c in kept):
        return {f"{mf.step_dir(step)}/" for step in doomed}  # a prefix of every file: keep all
    return {path for c in kept for path in c.shared}


def superseded_to_retire(superseded: set[int], others: list[int]) -> list[int]:
    """The superseded writer's steps (fencing.py) retention removes, counted toward no keep_last:
    all of them, unless no other committed step is left; then all but the newest, which the
    loader takes as the last resort (a new incarnation that died before its first commit)."""
    if others or not superseded:
        return sorted(superseded)
    return sorted(superseded)[:-1]


def plan_retention(committed: list[Committed], keep_last: int | None, keep_best: int | None,
                   best_mode: str) -> list[int]:
    """Steps to delete: everything outside the newest `keep_last` and the best `keep_best`."""
    if keep_last is None and keep_best is None:
        return []
    by_step = sorted(committed, key=lambda c: c.step, reverse=True)
    keep = {c.step for c in by_step[:keep_last]} if keep_last is not None else {c.step for c in by_step}
    if keep_best:
        keep |= set(best_first(committed, best_mode)[:keep_best])

    return sorted(c.step for c in committed if c.step not in keep)


def best_first(committed: list[Committed], best_mode: str) -> list[int]:
    """The steps with a metric, best first by `best_mode`; of equal metrics the newest first."""
    scored = sorted(((c.metric, c.step) for c in committed if c.metric is not None), key=lambda ms: -ms[1])
    scored.sort(key=lambda ms: ms[0] if best_mode == "min" else -ms[0])  # stable: ties stay newest first
    return [step for _, step in scored]


def read_committed(storage: Storage, steps: list[int], index: CommitIndex | None = None) -> list[Committed]:
    """What retention needs of each step (its metric, the files it references). With the
    manager's `index` (scanned just before), a step already read is not read again."""
    if index is None:
        index = CommitIndex(storage)
        index.scan()
    return [_committed(index, step) for step in steps]


def _committed(index: CommitIndex, step: int) -> Committed:
    try:
        manifest = index.manifest_json(step)
    except (OSError, ValueError, RecursionError, CorruptCheckpointError) as e:  # unreadable: never "best", still subject to keep_last
        if isinstance(e, MissingFileError) or isinstance(e.__cause__, MissingFileError):
            log.debug("retention: step %d was removed meanwhile (another process's retention): %s", step, e)
        else:
            log.warning("retention: cannot read the manifest of step %d: %s", step, e)
        return Committed(step, None, frozenset(), False)
    metric = manifest.get("metric")
    refs = manifest.get(mf._SHARED)
    shared = frozenset(p for p in refs if isinstance(p, str)) if isinstance(refs, dict) else frozenset()
    return Committed(step, metric if isinstance(metric, (int, float)) else None, shared)


class UnreadableReferencesError(OSError):
    """A committed manifest could not be read: which files it references is unknown."""


def referenced_files(storage: Storage, steps: list[int] | None = None, index: CommitIndex | None = None) -> set[str]:
    """Root-relative files that committed checkpoints reference from other steps (incremental
    checkpoints). Raises UnreadableReferencesError if a committed manifest cannot be read: then
    nothing that might be referenced may be deleted."""
    if index is None:
        index = CommitIndex(storage)
        index.scan()
    out: set[str] = set()
    for step in index.listing.committed() if steps is None else steps:
        try:
            manifest = index.manifest_json(step)
        except MissingFileError:
            continue  # deleted meanwhile (marker first, so it was not committed any more)
        except (OSError, ValueError, RecursionError, CorruptCheckpointError) as e:
            raise UnreadableReferencesError(f"cannot read the manifest of committed step {step}: {e}") from e
        shared = manifest.get(mf._SHARED)
        if isinstance(shared, dict):
            out.update(path for path in shared if isinstance(path, str))
    return out


def delete_checkpoint(storage: Storage, step: int, keep: set[str] | None = None) -> None:
    """Marker first (from there on it is not committed), then its files, except those in `keep`
    (root-relative: files that other committed checkpoints reference, which stay where they are;
    the directory then holds only them, and is collected once nothing references them)."""
    retire(storage, step)
    delete_files(storage, step, keep)


def retire(storage: Storage, step: int) -> None:
    """The first half of a deletion: the marker goes; from here on the step is not committed in
    any listing, and its files are an uncommitted leftover until delete_files removes them."""
    storage.remove_file(f"{mf.step_dir(step)}/{mf.MARKER}")
    faults.point("retention/marker-removed", step=step, rank=0)


def delete_files(storage: Storage, step: int, keep: set[str] | None = None) -> None:
    """The second half: a retired step's files, except those in `keep` (see delete_checkpoint)."""
    base = mf.step_dir(step)
    kept = {path for path in (keep or set()) if path.startswith(base + "/")}
    if f"{base}/" in kept:  # keep everything (kept_references could not tell)
        return
    if not kept:
        storage.remove_tree(base)
        return
    _remove_all_but(storage, base, kept)


def _remove_all_but(storage: Storage, base: str, kept: set[str]) -> None:
    for name in storage.list_dir(base):
        path = f"{base}/{name}"
        if path in kept:
            continue
        if any(k.startswith(path + "/") for k in kept):
            _remove_all_but(storage, path, kept)
        elif _is_directory(storage, path):
            storage.remove_tree(path)
        else:
            storage.remove_file(path)


def _is_directory(storage: Storage, path: str) -> bool:
    try:
        return bool(storage.list_dir(path))
    except (OSError, DistCkptError):  # listing a file: it is one
        return False


def collect_leftovers(storage: Storage, grace_s: float, now: float | None = None,
                      index: CommitIndex | None = None, skip: frozenset[str] = frozenset(),
                      dry_run: bool = False, uploads: list[str] | None = None,
                      progress: Callable[[str], None] | None = None) -> list[str]:
    """Remove step directories without a marker that are older than `grace_s`; returns them.
    Files that committed checkpoints reference (incremental) stay until nothing does. With the
    manager's `index` (scanned just before), which steps are committed comes from its listing.
    Directories in `skip` (retired steps whose files the Sweeper is removing) are left to it.
    `dry_run`: what would be removed, removing nothing (the same decisions, for `distckpt gc`).
    `uploads`: filled with the abandoned multipart uploads aborted (or, dry run, to abort).
    `progress`: called with each directory's name once it is removed (a command line's bar)."""
    now = time.time() if now is None else now
    if index is None:
        index = CommitIndex(storage)
        index.scan()
    committed = {mf.step_dir(step) for step in index.listing.committed()}
    names = set(index.listing.step_names())
    if storage.capabilities.keeps_empty_directories:  # a directory without files is in no listing of files
        names |= {name for name in storage.list_dir("") if name not in names and _not_a_file(storage, name)}
    removed = []
    references: set[str] | None = None
    for name in sorted(names):
        if mf.parse_step_dir(name) is None or name in committed or name in skip:
            continue
        try:
            newest = storage.newest_mtime(name)
            if newest is not None and now - newest < grace_s:
                continue
            if references is None:
                references = referenced_files(storage, index=index)
            kept = {path for path in references if path.startswith(name + "/")}
            if dry_run:
                if not kept:
                    removed.append(name)
                continue
            if kept:
                _remove_all_but(storage, name, kept)
                index.forget(name)  # what stays is listed again at the next full listing
                continue
            log.info("collecting %s/%s: an uncommitted save", storage.url, name)
            storage.remove_tree(name)
            index.forget(name)
        except (OSError, DistCkptError) as e:  # a stray file of that name: not ours, left alone
            log.warning("gc: skipping %s/%s: %s", storage.url, name, e)
            continue
        removed.append(name)
        if progress is not None:
            progress(name)
    aborted = storage.collect_abandoned_uploads(grace_s, dry_run=dry_run)
    if aborted and not dry_run:
        log.info("aborted %d abandoned multipart upload(s) under %s", len(aborted), storage.url)
    if uploads is not None:
        uploads.extend(aborted)
    return removed


def _not_a_file(storage: Storage, name: str) -> bool:
    """A name of the root's own listing that holds no files: an empty directory (a save's
    leftover), or a stray file spelled like a step, which is not ours to remove."""
    try:
        storage.list_dir(name)
        return True
    except (OSError, DistCkptError):  # ENOTDIR: a file
        return False


class Sweeper:
    """Removes retired checkpoints' files on a thread of its own (rank 0).

    Retention retires a doomed step at once (its marker goes: from then on no listing calls it
    committed) and hands its files here: unlinking the 256 MiB file of a retired step took
    0.16 s of a 0.69 s sync save on this machine's disk (the kernel drops the file's cached
    pages), which now passes while training runs. `drain()` waits for the files handed over so
    far; the manager drains before each save writes, so the disk never holds more than
    keep_last + 1 checkpoints, and at close(). A failure is logged: the files are then an
    uncommitted leftover, collected later (collect_leftovers)."""

    def __init__(self) -> None:
        self._tasks: list[Task] = []  # handed over, not yet seen done by drain()
        self._pid = os.getpid()

    def submit(self, storage: Storage, steps: list[int], keep: set[str] | None) -> None:
        def sweep() -> None:
            for step in steps:
                try:
                    delete_files(storage, step, keep)
                except Exception as e:  # noqa: BLE001  (never fails a save: the files are a leftover)
                    log.warning("rank 0: removing the files of retired step %d from %s failed (it is not "
                                "committed; leftover collection removes them later): %s", step, storage.url, e)

        self._forget_if_forked()
        self._tasks.append(_SWEEPING.submit(sweep))

    def drain(self) -> None:
        """Wait for every removal handed over so far. An interrupted drain leaves the rest for
        the next (a Task's wait cannot be wedged by a Ctrl-C; a Condition's could: interrupts.py)."""
        self._forget_if_forked()
        while self._tasks:
            self._tasks[0].result()
            self._tasks.pop(0)

    def close(self) -> None:
        self.drain()

    def _forget_if_forked(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's removals are not this process's
            self._tasks, self._pid = [], os.getpid()


# One thread removes every manager's retired files, in the order they were handed over.
_SWEEPING = Helpers(1, "distckpt-sweeper")
