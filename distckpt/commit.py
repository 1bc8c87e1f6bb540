"""What "committed" means, in one place: the marker, the replace rules, the verified reads.

A checkpoint exists if and only if its step directory holds a COMMITTED marker that matches its
manifest (same rule on local disk and object stores, so a copied checkpoint stays valid).

* `list_committed`: committed steps, newest first, names parsed strictly (manifest.parse_step_dir).
* `read_marker`, `read_verified_manifest`: bounded reads, parsed against the schema
  (manifest.py), CorruptCheckpointError naming the file and field.
* `create_manifest`, `create_marker`: exclusive creates; the marker last.
* `ReplacePolicy`, `check_step_is_free`, `clear_step_dir`: which existing commit a writer may
  replace (only a superseded incarnation's output: fencing.superseded_by is the one predicate).
* `check_root_is_ours`: a writer that never loaded does not save into another run's root.

This module never imports torch.distributed.
"""

from __future__ import annotations

import errno
import json
import logging
from dataclasses import dataclass

from . import fencing
from . import manifest as mf
from .errors import CheckpointExistsError, CorruptCheckpointError, MissingFileError, RunConflictError, StorageError
from .fencing import Lease
from .storage import Storage

log = logging.getLogger("distckpt")


def read_marker(storage: Storage, step: int) -> mf.Marker:
    """The step's COMMITTED marker; MissingFileError if absent, CorruptCheckpointError if bad."""
    base = mf.step_dir(step)
    return mf.Marker.parse(_bounded(storage, f"{base}/{mf.MARKER}", mf.MAX_MARKER_BYTES),
                           f"{storage.url}/{base}/{mf.MARKER}")


def read_verified_manifest(storage: Storage, step: int, marker: mf.Marker) -> dict:
    """The step's manifest, checked against its marker and the schema."""
    base = mf.step_dir(step)
    data = _bounded(storage, f"{base}/{mf.MANIFEST}", mf._MAX_MANIFEST_BYTES)
    return mf.parse_manifest(data, marker, f"{storage.url}/{base}")


def _bounded(storage: Storage, path: str, limit: int) -> bytes:
    try:
        return storage.read_bytes(path, limit)
    except MissingFileError:
        raise
    except StorageError as e:
        if e.errno in (errno.EFBIG, errno.ELOOP):
            raise CorruptCheckpointError(str(e)) from e
        raise


@dataclass(frozen=True)
class ReplacePolicy:
    """Which existing commit of a step a writer may replace: only zombie output, i.e. one of an
    older generation than `generation` at a step after `floor` (the step this incarnation
    resumed from). The default replaces nothing."""

    floor: int | None = None
    generation: int | None = None  # None: the lease is not taken yet, so every existing one is older

    def allows(self, marker: mf.Marker) -> bool:
        return (self.floor is not None and marker.step > self.floor
                and (self.generation is None or marker.generation < self.generation))


def check_root_is_ours(storage: Storage, policy: ReplacePolicy) -> None:
    """RunConflictError when a writer that never loaded makes its first save into a root that
    holds another run's commits: its steps would interleave with that run's, and its restart
    would resume from whichever step is newest, possibly the other run's."""
    if policy.floor is not None or policy.generation is not None:
        return  # it loaded (and so continues what is there), or it already saved here
    committed = list_committed(storage)
    if committed:
        raise RunConflictError(
            f"{storage.url} already holds committed steps {committed[:5]} of another run, and this "
            "manager never loaded: call load_latest(state) first to continue that run (it returns None "
            "on an empty root, and then saves freely), or give this run its own directory, or remove "
            "the old checkpoints first")


def check_step_is_free(storage: Storage, step: int, policy: ReplacePolicy) -> mf.Marker | None:
    """CheckpointExistsError if `step` holds a commit the writer may not replace; else that
    commit's marker (to be replaced) or None."""
    base = mf.step_dir(step)
    try:
        marker = read_marker(storage, step)
    except MissingFileError:
        return None
    except CorruptCheckpointError:
        marker = mf.Marker(step, "", "?", 0)  # unreadable: treat as the oldest generation
    if policy.allows(marker):
        return marker
    raise CheckpointExistsError(
        errno.EEXIST, f"step {step} is already committed at {storage.url}/{base}; "
        "resume with load_latest() so steps continue after it, or use another directory")


def clear_step_dir(storage: Storage, step: int, policy: ReplacePolicy) -> None:
    """Remove a zombie's commit of `step`: its marker first, then the files its manifest lists,
    then the manifest. Nothing else: other ranks may be writing their shard files into this
    directory right now, and uncommitted leftovers carry their generation in their names, so
    they are never confused with ours (gc collects them)."""
    base = mf.step_dir(step)
    replaced = check_step_is_free(storage, step, policy)
    if replaced is None:
        return
    log.warning("rank 0: replacing %s/%s, committed by superseded generation %d after this job "
                "resumed from step %s", storage.url, base, replaced.generation, policy.floor)
    storage.remove_file(f"{base}/{mf.MARKER}")
    try:
        listed = json.loads(storage.read_bytes(f"{base}/{mf.MANIFEST}", mf._MAX_MANIFEST_BYTES)).get("files", {})
        for name in listed:
            mf.check_relative_path(name, base)
            storage.remove_file(f"{base}/{name}")
        storage.remove_file(f"{base}/{mf.MANIFEST}")
    except (OSError, ValueError, AttributeError, CorruptCheckpointError) as e:
        # the stale writer may still be adding files; no marker names them, so they are ignored
        log.warning("rank 0: could not clear all of %s/%s (%s); its stray files are ignored", storage.url, base, e)


def create_manifest(storage: Storage, base: str, data: bytes, generation: int, policy: ReplacePolicy,
                     step: int) -> None:
    """Exclusive create: of two writers of one step, the second learns it here, before any marker.
    An existing manifest is replaced only if it is ours (an earlier failed attempt) or a
    superseded writer's in the range this job took over."""
    path = f"{base}/{mf.MANIFEST}"
    for attempt in range(2):
        try:
            storage.create_exclusive(path, data)
            return
        except CheckpointExistsError:
            other = _manifest_generation(storage, path)
            ours_or_zombie = other == generation or (other < generation and policy.floor is not None
                                                     and step > policy.floor)
            if attempt or not ours_or_zombie:
                raise CheckpointExistsError(
                    errno.EEXIST, f"{storage.url}/{path} exists, written by generation {other} (this writer: "
                    f"{generation}): another save of step {step} is in progress or was left unfinished; "
                    "one save per step commits (gc removes unfinished ones after leftover_grace_s)") from None
            storage.remove_file(path)


def _manifest_generation(storage: Storage, path: str) -> int:
    try:
        return int(json.loads(storage.read_bytes(path, mf._MAX_MANIFEST_BYTES)).get("generation", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def create_marker(storage: Storage, marker: mf.Marker, policy: ReplacePolicy) -> None:
    path = f"{mf.step_dir(marker.step)}/{mf.MARKER}"
    try:
        storage.create_exclusive(path, marker.to_bytes())
    except CheckpointExistsError:
        if check_step_is_free(storage, marker.step, policy) is None:  # raises unless a zombie's
            raise
        storage.remove_file(path)
        storage.create_exclusive(path, marker.to_bytes())


def list_committed(storage: Storage) -> list[int]:
    """Committed steps, newest first: a step directory with a COMMITTED marker."""
    steps = [s for s in (mf.parse_step_dir(n) for n in storage.list_dir("")) if s is not None]
    return sorted((s for s in steps if storage.exists(f"{mf.step_dir(s)}/{mf.MARKER}")), reverse=True)


def committed_generations(storage: Storage) -> list[int]:
    """The writer generation of every committed step (one marker read each)."""
    out = []
    for step in list_committed(storage):
        try:
            out.append(read_marker(storage, step).generation)
        except (MissingFileError, CorruptCheckpointError):
            out.append(0)  # unreadable or gone meanwhile: keep every lease
    return out


def check_not_superseded(marker: mf.Marker, leases: list[Lease], where: str) -> None:
    """CorruptCheckpointError for zombie output (see fencing.py): never loaded, never preferred."""
    newer = fencing.superseded_by(marker.generation, marker.step, leases)
    if newer is not None:
        raise CorruptCheckpointError(
            f"{where}: committed by generation {marker.generation} after a newer incarnation took over "
            f"from step {newer.floor} ({newer.describe()}): output of a superseded writer, not loaded")


def check_written_under_a_lease(marker: mf.Marker, leases: list[Lease], where: str) -> None:
    """CorruptCheckpointError unless a lease of the durable root names the marker's writer
    (generation and run): a local tier step of another job, or of a job of another durable
    root, is never loaded as this job's."""
    if not any(lease.generation == marker.generation and lease.run_id == marker.run_id for lease in leases):
        raise CorruptCheckpointError(
            f"{where}: committed by generation {marker.generation} (run {marker.run_id[:8]}), which holds no "
            "lease at the durable root: this local tier was written by another job (or for another URL); not "
            "loaded. Give each run its own local_dir, or remove this one")
