"""The load protocol, as short functions of named phases (the overview: protocol.py).

    request   every rank's request (the step, the policy, the state's keys) to rank 0, which
              checks they agree and, in the same exchange, makes the choice below
    choose    rank 0 lists committed steps, newest first, and broadcasts the list (with a local
              tier: the steps every node holds, checked against the durable root's leases;
              choosing.py, with what "nothing committed" means)
    read      every rank: marker, manifest, replicated file and its own rank file, verified by
              checksum and checked against `state` before anything is changed; a damaged
              candidate makes all ranks move to the previous one together, with a warning
    again     a candidate committed or removed while it was read (a concurrent writer): every rank
              lists again together, up to _LISTING_ATTEMPTS listings (see load)
    agree     all ranks hold the same (step, epoch, manifest digest), or all raise
    apply     every rank restores its entries, RNG last; outcomes exchanged once more (twice
              where an early entry's restore may fail: _apply_phase), and a failure anywhere
              is undone everywhere (undo.py)
"""

from __future__ import annotations

import errno
import functools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distckpt.errors import (  # noqa: F401  (re-exported where it was defined)
    CheckpointFallbackWarning,
    ConfigError,
    CorruptCheckpointError,
    DistCkptError,
    IncompatibleCheckpointError,
    MissingFileError,
    NotCommittedError,
    RankDisagreementError,
    ReshardWarning,
    StorageError,
    SupersededCheckpointError,
    UntrustedCheckpointError,
    warn,
)
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.io.copying import CopyFailed, PageRelease, Prefault
from distckpt.io.reading import read_verified
from distckpt.io.serialize import ShardRef, load_tree_file
from distckpt.protocol import elastic, fencing, incremental, load_warnings, tiers
from distckpt.protocol.choosing import check_nothing_was_committed, choose, committed_since, settled_uncommitted
from distckpt.protocol.commit import (
    check_not_superseded,
    check_written_under_a_lease,
    read_marker,
    read_verified_manifest,
    removed_meanwhile,
)
from distckpt.protocol.cooperative import CooperativeRead, reading_together
from distckpt.protocol.coord import Coordinator, Outcome, agree, attempt_phase, raise_if_failed
from distckpt.protocol.fencing import Lease
from distckpt.protocol.load_request import agree_on_the_request, load_request
from distckpt.runtime import faults
from distckpt.runtime.interrupts import sigint_deferred
from distckpt.state import sharded
from distckpt.state.capture import (
    PER_RANK,
    SHARDED,
    Entry,
    persistent_buffers,
    unwrap_module,
    use_rank_buffers,
    warn_extra_entries,
)
from distckpt.state.kinds import (
    check_destinations_apart,
    copy_destinations,
    is_late,
    live_ties,
    loading_entry,
    normalize_imported,
    replaced_under_key,
    resolve_sharded_entry,
    resolves_own_shards,
    restore_entry,
    snapshot,
    validate_entry,
)
from distckpt.state.rng import capture_process_rng, check_process_rng, restore_process_rng
from distckpt.state.undo import Undo, run_undos
from distckpt.state.validation import LoadRules, mappings_read_once
from distckpt.storage import Storage, release_pages

if TYPE_CHECKING:
    import torch

log = logging.getLogger("distckpt")


@dataclass(frozen=True)
class Progress:
    """Where a loaded checkpoint left off. `config_diff` lists config keys that differ."""

    step: int
    epoch: int | None
    metric: float | None = None
    url: str = ""
    config_diff: tuple[str, ...] = ()
    # world_size_policy="reshard" at another world size: what this rank did not restore but kept
    # as its own seeding made it ("rng" and per-rank entry keys); () after an exact resume
    rederived: tuple[str, ...] = ()
    # which tier it came from: "memory" / "peer" (memory_tier: the nodes' own copies / some node's
    # files from its partner), "local" (the manager's local_dir) or "durable" (its URL)
    tier: str = "durable"
    # the write lease generation of the incarnation that committed it (fencing.py; 0: before fencing)
    generation: int = 0
    # False when the durable tier could not be read at the load: a local step was chosen without the
    # durable root's leases, so the first save checks it against them before it writes (leases.py)
    leases_checked: bool = True


@dataclass
class ReadCheckpoint:
    step: int
    digest: str
    manifest: mf.Manifest
    replicated: dict[str, Any]
    own: dict[str, Any]
    per_rank_restored: bool = True
    entries: list[Entry] = field(default_factory=list)  # as restored (sharded ones resolved)
    buffers: list[Any] = field(default_factory=list)  # the files' buffers the tensors view
    sources: list[dict[str, Any]] | None = None  # "elastic" at another world size: every old rank's file
    rederived: list[str] = field(default_factory=list)  # what an elastic resume seeded afresh here
    # an early entry whose restore may fail (kinds' restore_checked) on this rank; once the read
    # phase's outcomes are exchanged, on any rank: the apply then agrees between early and late entries
    barrier: bool = True
    elastic_note: str = ""  # its warning, said once the load is applied


WORLD_SIZE_POLICIES = ("refuse", "reshard", "replicated_only", elastic.POLICY)  # replicated_only: reshard's older name


def read_checkpoint(storage: Storage, step: int, rank: int, world_size: int,
                    world_size_policy: str = "refuse", leases: list[Lease] | None = None,
                    owned_by_leases: bool = False, superseded_ok: bool = False,
                    together: CooperativeRead | None = None) -> ReadCheckpoint:
    """Read and verify what this rank needs of one committed step. Raises CorruptCheckpointError.
    With `together`, the replicated file is read with the other ranks (cooperative.py).

    With another world size than the writer's: "refuse" raises IncompatibleCheckpointError;
    "reshard" (or its older name "replicated_only") reads the replicated state and the sharded
    entries (resharded to this world), and this rank keeps its own per-rank state (RNG streams,
    samplers, loaders) as this run seeded it.
    """
    base = mf.step_dir(step)
    where = f"{storage.url}/{base}"
    try:
        marker = read_marker(storage, step)
    except MissingFileError as e:
        raise NotCommittedError(f"{where} holds no {mf.MARKER} marker: not committed") from e
    try:
        if not superseded_ok:
            check_not_superseded(marker, leases or [], where)
        if owned_by_leases:  # a local tier step: written by a job of this durable root
            check_written_under_a_lease(marker, leases or [], where)
        manifest = read_verified_manifest(storage, step, marker)
    except MissingFileError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from e
    replicated_name, rank_names = manifest.payload_names()
    imported = manifest.imported is not None  # from torch.save / DCP: no per-rank state in the source
    buffers: list[Any] = []
    if imported or (manifest.world_size != world_size and world_size_policy in WORLD_SIZE_POLICIES[1:]):
        replicated = _read_tree(storage, base, replicated_name, manifest, where, buffers, together=together)
        own: dict[str, Any] = {"epoch": manifest.epoch, "rank": rank, "entries": {}, "rng": None}
        sources = None if imported or world_size_policy != elastic.POLICY else elastic.read_sources(
            lambda name: _read_tree(storage, base, name, manifest, where, buffers, per_rank=True), manifest, where)
        return ReadCheckpoint(step, marker.manifest_digest, manifest, replicated, own, per_rank_restored=False,
                              buffers=buffers, sources=sources)
    if manifest.world_size != world_size:
        raise IncompatibleCheckpointError(
            f"{where} was written by {manifest.world_size} ranks, this job has {world_size}: "
            "per-rank state (RNG streams, sampler and loader positions) cannot be mapped to "
            f"another world size; relaunch with --nproc-per-node/--nnodes giving {manifest.world_size} ranks, "
            "or pass world_size_policy='reshard' to restore the replicated and sharded state and keep "
            "this run's per-rank state, or 'elastic' to also continue the interrupted epoch's sample order")
    replicated = _read_tree(storage, base, replicated_name, manifest, where, buffers, together=together)
    mf.check_tree_belongs(replicated, manifest.step, manifest.epoch, f"{where}/{replicated_name}")
    own = _read_tree(storage, base, rank_names[rank], manifest, where, buffers, per_rank=True)
    _check_rank_file_belongs(own, manifest, rank, f"{where}/{rank_names[rank]}")
    return ReadCheckpoint(step, marker.manifest_digest, manifest, replicated, own, buffers=buffers)


def _check_rank_file_belongs(own: dict[str, Any], manifest: mf.Manifest, rank: int, where: str) -> None:
    """The rank file, and the manifest's line for the rank, record the step and epoch the manifest
    does: another step's rank file re-sealed into this one loaded silently (its RNG streams and
    loader position from step 1 under a step-3 resume) when the epochs matched, and was a
    RankDisagreementError instead of a fallback when they did not."""
    recorded = manifest.ranks[rank] if rank < len(manifest.ranks) else None
    views = [("the rank file", own.get("step", manifest.step), own.get("epoch"))]
    if recorded is not None:
        views.append(("the manifest's line for the rank", recorded.get("step"), recorded.get("epoch")))
    for what, step, epoch in views:
        if (step, epoch) != (manifest.step, manifest.epoch):
            raise CorruptCheckpointError(f"{where}: {what} records step {step} epoch {epoch}, the manifest step "
                                         f"{manifest.step} epoch {manifest.epoch}: the files do not belong together")


def _read_tree(storage: Storage, base: str, name: str, manifest: mf.Manifest, where: str,
               buffers: list[Any] | None = None, per_rank: bool = False,
               together: CooperativeRead | None = None) -> Any:
    """One verified tree file, its tensors viewing the file's buffer (appended to `buffers`). A
    mapped file is verified piece by piece, each piece's pages let go once hashed, so a load
    never holds the whole file resident (the restore lets go of them again as it copies)."""
    record = manifest.files.get(name)
    if record is None:
        raise CorruptCheckpointError(f"{where}: the manifest lists no {name}")
    read = together.read if together is not None else functools.partial(read_verified, storage)
    try:
        data = read(f"{base}/{name}", record, f"{where}/{name}",
                    lambda buffer: lambda start, n: release_pages(buffer, start, n))
    except MissingFileError as e:
        raise CorruptCheckpointError(f"{where}/{name} is missing") from e
    except StorageError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(str(e)) from e
        raise
    if buffers is not None:
        buffers.append(data)
    extra = incremental.resolve(storage, manifest, where) if name == manifest.payload_names()[0] else None
    tree = load_tree_file(data, f"{where}/{name}", extra, place=True)
    mf.check_tree(tree, f"{where}/{name}", per_rank)
    return tree


# A concurrent writer (its next save, its retention) can make every candidate of a listing look
# uncommitted or vanish while a load reads it, or commit a newer step meanwhile. The load then
# lists again, at most this many times in all (each listing can lose the race again).
_LISTING_ATTEMPTS = 10
_RELIST_PAUSE_S = 0.002  # before the k-th listing again, a random pause of up to 2**k times this (at most
# 0.25 s): a reader whose reads keep lining up with the writer's saves falls out of step with them.
# A private stream: a load never draws from the process's own (what it restores, or leaves alone).
_JITTER = random.Random()
# A step found while a newer one was committed meanwhile is read again for the newer one this
# many times at most: a writer that saves without pause (keep_last=1, every few ms) always has a
# newer step in progress, and chasing it to the last listing ended in an error once a listing
# lost the race (2 in 3 runs of the reader race test with the S3 server busy on the same cores).
_CHASE_ATTEMPTS = 3


@dataclass
class _Attempt:
    """One read phase over one listing, the same on every rank (its outcomes were exchanged)."""

    found: tuple[ReadCheckpoint, str] | None = None  # the checkpoint read, and its tier
    error: CorruptCheckpointError | None = None      # none verifies (for a load of the newest)
    raced: bool = False  # a candidate newer than `found` (or any, with none found) was uncommitted or vanished while read
    split: dict[int, str] = field(default_factory=dict)  # steps some ranks read and others found uncommitted


def load(coord: Coordinator, storage: Storage, entries: list[Entry], state: dict[str, Any],
         step: int | None = None, world_size_policy: str = "refuse",
         rules: LoadRules = LoadRules(), local: Storage | None = None) -> Progress | None:
    """The load protocol (call on every rank). None when nothing is committed yet. With a
    `local` tier (tiers.py), a step committed on every node's local tier is tried before the
    durable copy of the same step, and a damaged copy falls back to the next candidate."""
    storages = {tiers.DURABLE: storage, tiers.LOCAL: local or storage}
    # the requests agreed and the candidates chosen, the same on every rank: one exchange
    candidates, leases = choose(coord, storage, step, local,
                                lambda then: agree_on_the_request(coord, load_request(step, world_size_policy, entries), then))
    split: set[int] | None = None  # the steps split between ranks at every read so far
    for attempt in range(1, _LISTING_ATTEMPTS + 1):
        if not candidates:
            check_nothing_was_committed(coord, storage, leases, local)
            return None
        prefault = Prefault(copy_destinations(entries))  # while the files are read and verified
        try:
            read = _read_phase(coord, storages, entries, candidates, step is not None, world_size_policy, leases, rules)
        finally:
            prefault.stop()
        split = set(read.split) if split is None else split & set(read.split)
        if read.found is not None and not read.raced:
            return _apply(coord, entries, state, read.found, storages, rules, leases is not None)
        if attempt == _LISTING_ATTEMPTS:
            break
        time.sleep(_JITTER.uniform(0, min(0.25, _RELIST_PAUSE_S * 2 ** attempt)))
        listed, listed_leases = choose(coord, storage, step, local)
        changed = set(listed) != set(candidates) or (read.raced and (
            committed_since(coord, storage, listed, read.found[0].step) if read.found is not None
            else not settled_uncommitted(coord, storage, listed)))
        if read.found is not None and not read.split and (not changed or attempt >= _CHASE_ATTEMPTS):
            # nothing newer came; or a writer saving all the time keeps a newer step in progress:
            # `found` was the newest committed step when the newer candidates' markers were read
            return _apply(coord, entries, state, read.found, storages, rules, leases is not None)
        if read.error is not None and not changed and not read.split:
            raise read.error  # the damage stands
        if read.found is None and read.error is None and not changed and not read.split and attempt > 1:
            check_nothing_was_committed(coord, storage, leases, local)
            return None  # step directories, none committed, twice the same: a fresh start
        # Otherwise read again: a step was committed or removed meanwhile (a None is retried once
        # even on the same listing: a step's marker read before its commit and the previous
        # step's after retention removed it), or the ranks disagreed on a step's marker.
        log.info("rank %d: the steps at %s changed while they were read; reading again", coord.rank, storage.url)
        candidates, leases = listed, listed_leases
    if split:  # the same steps, at every read: the ranks do not see one storage
        _raise_split_view(storage, [read.split[s] for s in sorted(split, reverse=True)])
    if read.found is not None:  # newer steps kept coming: the newest this load could read
        return _apply(coord, entries, state, read.found, storages, rules, leases is not None)
    if read.error is not None:
        raise read.error
    raise CorruptCheckpointError(
        f"{storage.url}: every committed step this load found was removed before it could be read, "
        f"{_LISTING_ATTEMPTS} listings in a row: a concurrent writer commits and removes steps faster "
        "than this process reads them (keep_last=1 with frequent saves); keep two or more steps "
        "(keep_last=2) so that readers have time, or load while the writer pauses")


def _raise_split_view(storage: Storage, split: list[str]) -> None:
    """Some ranks read a step the others found uncommitted, on an unchanged listing: not a race."""
    raise RankDisagreementError(
        f"the ranks see different checkpoints at {storage.url}: {'; '.join(split[:3])}. Every rank must "
        "see the same storage (a local path must be on a filesystem shared by every node; otherwise "
        "use an object store URL, or local_dir= for node-local disks)")


def _apply(coord: Coordinator, entries: list[Entry], state: dict[str, Any], found: tuple[ReadCheckpoint, str],
           storages: dict[str, Storage], rules: LoadRules, leases_checked: bool = True) -> Progress:
    chosen, tier = found
    with sigint_deferred():  # a Ctrl-C here would leave the state half-restored (interrupts.py)
        notes, kept = _apply_phase(coord, entries, state, chosen, rules)
    return Progress(chosen.step, chosen.own["epoch"], chosen.manifest.metric,
                    f"{storages[tier].url}/{mf.step_dir(chosen.step)}", tuple(notes), tuple(kept), tier,
                    chosen.manifest.generation, leases_checked)


def _read_phase(coord: Coordinator, storages: dict[str, Storage], entries: list[Entry],
                candidates: list[tuple[int, str]], explicit: bool, world_size_policy: str,
                leases: list[Lease] | None, rules: LoadRules = LoadRules()) -> _Attempt:
    """The newest candidate every rank reads and verifies. Otherwise (the same on every rank)
    nothing when no candidate was committed (directories of saves that never committed, or
    removed meanwhile), or the error saying none verifies; an explicit step raises it."""
    tiered = storages[tiers.LOCAL] is not storages[tiers.DURABLE]
    committed = 0
    uncommitted = False
    split: dict[int, str] = {}
    superseded: list[tuple[int, str]] = []
    # damaged committed steps, warned about once what is loaded instead is known: the next
    # candidate may be a directory that never committed (an upload cut off), named before as the
    # one loaded while an older step was
    skipped: list[tuple[int, str, list[Outcome]]] = []
    tried: list[tuple[int, str]] = []  # the committed steps skipped, for the error when none verifies
    for i, (step, tier) in enumerate(candidates):
        read, exc, outcomes = _attempt_read(coord, storages[tier], entries, step, tier, world_size_policy, leases, rules)
        if _uncommitted(outcomes):
            uncommitted = True
            if any(o.ok for o in outcomes):
                split[step] = (f"step {step}: rank(s) {[o.rank for o in outcomes if o.ok]} read it, rank(s) "
                               f"{[o.rank for o in outcomes if not o.ok]} found no {mf.MARKER} marker")
            continue  # a save that never committed (or removed meanwhile, seen so by some rank): not a checkpoint
        committed += 1
        damaged = [o for o in outcomes if o.error_type in _SKIPPABLE]
        following = candidates[i + 1] if i + 1 < len(candidates) else None
        may_fall_back = not explicit or (following is not None and following[0] == step)
        if damaged and len(damaged) == len([o for o in outcomes if not o.ok]) and may_fall_back:
            skipped.append((step, tier, damaged))
            tried.append((step, tier))
            if all(o.error_type == SupersededCheckpointError.__name__ for o in damaged):
                superseded.append((step, tier))
            continue
        load_warnings.warn_fallbacks(skipped, (step, tier), coord.rank, tiered)
        raise_if_failed(coord, outcomes, f"loading step {step}", exc)
        _check_agreement(outcomes, step)
        assert read is not None  # every rank succeeded
        read.barrier = _any_barrier(outcomes)
        return _Attempt((read, tier), raced=uncommitted, split=split)
    load_warnings.warn_fallbacks(skipped, None, coord.rank, tiered)
    damaged_leases = [lease for lease in leases or [] if lease.damaged]
    if superseded and not explicit and damaged_leases:
        return _Attempt(error=_unreadable_lease_error(storages[tiers.DURABLE], damaged_leases, superseded), split=split)
    if superseded and not explicit:
        last_resort = _read_superseded(coord, storages, entries, superseded[0], world_size_policy, leases, rules)
        if last_resort is not None:
            return _Attempt(last_resort, raced=uncommitted, split=split)
    if not committed and not explicit:
        # raced: a step read as uncommitted may be committed by now (the listing would not show it)
        return _Attempt(raced=uncommitted, split=split)  # settled before it counts as nothing committed
    where = storages[tiers.DURABLE].url + (f" or {storages[tiers.LOCAL].url}" if tiered else "")
    named = [f"{s} ({t})" for s, t in tried[:10]] if tiered else [s for s, _ in tried[:10]]
    error = CorruptCheckpointError(
        f"no committed checkpoint at {where} verifies (committed steps tried: {named}); "
        "see the warnings above for each damaged file; `distckpt verify` lists them"
        + signing.refusal_hint(storages[tiers.DURABLE]))
    if explicit:
        raise error
    return _Attempt(error=error, split=split)


def _unreadable_lease_error(durable: Storage, damaged: list[Lease], steps: list[tuple[int, str]]) -> CorruptCheckpointError:
    """The last resort would guess: a damaged lease hides the step its incarnation resumed from."""
    names = ", ".join(f"{durable.url}/{fencing.lease_path(lease.generation)} ({lease.damaged})" for lease in damaged)
    return CorruptCheckpointError(
        f"only steps of older writers than generation {damaged[-1].generation} verify ({[s for s, _ in steps[:10]]}), and "
        f"that incarnation's write lease is unreadable: {names}. From which step it resumed cannot be told, so none "
        "of them is loaded (any could be a superseded writer's late output). If no later incarnation of the job wrote "
        "to this directory, remove the unreadable lease and load again; `distckpt ls` shows the leases and steps")


def _uncommitted(outcomes: list[Outcome]) -> bool:
    """Not committed where some rank looked: on every rank, or on some while the others read it
    (a step committed or removed between two ranks' reads of its marker): never damage."""
    failed = [o for o in outcomes if not o.ok]
    return bool(failed) and all(o.error_type == NotCommittedError.__name__ for o in failed)


_SKIPPABLE = (CorruptCheckpointError.__name__, NotCommittedError.__name__, SupersededCheckpointError.__name__,
              UntrustedCheckpointError.__name__)  # a verify key's refusal falls back as damage does


def _attempt_read(coord: Coordinator, storage: Storage, entries: list[Entry], step: int, tier: str,
                  world_size_policy: str, leases: list[Lease] | None, rules: LoadRules,
                  superseded_ok: bool = False) -> tuple[ReadCheckpoint | None, BaseException | None, list[Outcome]]:
    owned = tier != tiers.DURABLE and leases is not None  # a node's own copy (local tier, memory tier)
    return attempt_phase(
        coord, f"load/read step {step} ({tier})",
        functools.partial(_read_and_check, coord, storage, entries, step, world_size_policy,
                          leases or [], rules, owned, superseded_ok),
        lambda r: {"step": r.step, "epoch": r.own["epoch"], "digest": r.digest, "barrier": r.barrier})


def _read_superseded(coord: Coordinator, storages: dict[str, Storage], entries: list[Entry],
                     candidate: tuple[int, str], world_size_policy: str, leases: list[Lease] | None,
                     rules: LoadRules) -> tuple[ReadCheckpoint, str] | None:
    """The last resort: nothing but a superseded writer's steps verify. That happens when the newer
    incarnation took its lease and stopped before its first commit, while the older one's retention
    had removed the step it resumed from; the run continues from the older writer's newest step
    (a complete checkpoint of its own run) rather than from nothing. The next incarnation's lease
    then resumes from this step, so the older writer stays fenced."""
    step, tier = candidate
    read, _, outcomes = _attempt_read(coord, storages[tier], entries, step, tier, world_size_policy, leases, rules,
                                      superseded_ok=True)
    if not all(o.ok for o in outcomes):
        return None
    _check_agreement(outcomes, step)
    assert read is not None
    read.barrier = _any_barrier(outcomes)
    message = (f"rank {coord.rank}: no checkpoint of the newest incarnation verifies, only steps committed by a "
               f"superseded writer (see the warnings above); loading the newest of them, step {step}, as the last "
               "resort: the run continues from that writer's state, not from the newer incarnation's. "
               "`distckpt ls` shows the leases and steps")
    warn(message, CheckpointFallbackWarning)
    assert read is not None
    return read, tier


def _read_and_check(coord: Coordinator, storage: Storage, entries: list[Entry], step: int,
                    world_size_policy: str, leases: list[Lease], rules: LoadRules = LoadRules(),
                    owned_by_leases: bool = False, superseded_ok: bool = False) -> ReadCheckpoint:
    """This rank's files of `step`, verified, and checked against the live state. A step whose
    files vanished while they were read, and whose marker is gone too, was removed by a
    concurrent writer's retention: NotCommittedError, skipped like a save that never committed."""
    try:
        with reading_together(coord, storage, step) as together:  # the replicated file: cooperative.py
            read = read_checkpoint(storage, step, coord.rank, coord.world_size, world_size_policy, leases,
                                   owned_by_leases, superseded_ok, together)
        read.entries = replaced_under_key(_resolve_sharded(storage, entries, read),
                                          {**read.replicated["entries"], **read.own["entries"]})
        if read.sources is not None:
            elastic.derive(read, read.entries, coord.rank, coord.world_size)
    except CorruptCheckpointError as e:
        if not isinstance(e, NotCommittedError) and removed_meanwhile(storage, step):
            raise NotCommittedError(f"{storage.url}/{mf.step_dir(step)} was removed while it was read "
                                    "(retention of a concurrent writer)") from e
        raise
    _validate_against_state(read.entries, read, (coord.rank, coord.world_size), rules)
    read.barrier = any(not is_late(e) and not e.kind_spec.restore_checked for e in read.entries)
    faults.point("load/read", step=step, rank=coord.rank)
    return read


def _resolve_sharded(storage: Storage, entries: list[Entry], read: ReadCheckpoint) -> list[Entry]:
    """The entries as they will be restored; each sharded one's saved state gets this rank's
    pieces, assembled from whichever ranks' shard files overlap them (nothing is changed yet)."""
    if not read.manifest.sharded:  # no shard files: nothing to resolve (most loads)
        return list(entries)
    base = mf.step_dir(read.step)
    reader = sharded.ShardReader(storage, base, read.manifest, f"{storage.url}/{base}")
    saved_entries = read.replicated["entries"]
    out = []
    for entry in entries:
        saved = saved_entries.get(entry.key)
        entry = loading_entry(entry, saved.get("kind") if isinstance(saved, dict) else None)
        if entry.scope == SHARDED and isinstance(saved, dict) and saved.get("kind") == entry.kind:
            saved["state"] = resolve_sharded_entry(entry, saved["state"], reader)
        out.append(entry)
    made: dict[ShardRef, torch.Tensor] = {}  # one object per stored tensor across entries: ties survive
    for saved in saved_entries.values():  # replicated tensors stored by split writes
        if isinstance(saved, dict) and not resolves_own_shards(saved.get("kind")):
            saved["state"] = sharded.resolve_whole(saved.get("state"), reader, made)
    return out


def _validate_against_state(entries: list[Entry], read: ReadCheckpoint, world: tuple[int, int],
                            rules: LoadRules = LoadRules()) -> None:
    if read.per_rank_restored:
        check_process_rng(read.own.get("rng"), f"step {read.step}, rank {world[0]}")
    if read.per_rank_restored and "buffers" in read.own:
        use_rank_buffers(read.replicated["entries"], read.own["buffers"], f"step {read.step}, rank {world[0]}")
    for entry in entries:
        if entry.key in read.replicated["entries"]:
            read.replicated["entries"][entry.key] = normalize_imported(entry, read.replicated["entries"][entry.key])
    saved = {**read.replicated["entries"], **read.own["entries"]}
    with mappings_read_once():
        for entry in entries:
            if entry.scope == PER_RANK and not read.per_rank_restored:
                continue
            if entry.key not in saved and rules.missing_entries == "keep":
                continue  # restored as nothing: keeps its live value (warned when applied)
            if entry.key not in saved:
                raise IncompatibleCheckpointError(
                    f"state[{entry.key!r}] is not in the checkpoint of step {read.step} (it holds "
                    f"{sorted(saved)}); remove it from `state`, start a new run directory, or pass "
                    "missing_entries='keep' to CheckpointManager to keep its live value")
            validate_entry(entry, saved[entry.key], world, rules)
    check_destinations_apart([e for e in entries if e.key in saved], saved)
    if read.own.get("rank") != world[0]:
        raise CorruptCheckpointError(f"step {read.step}: the file for rank {world[0]} holds rank {read.own.get('rank')}")


def _modules_with_buffers(entries: list[Entry]) -> list[str]:
    """Module entries holding persistent buffers (BatchNorm statistics): saved per rank, since
    each rank may update its own (kinds.capture_rank_buffers)."""
    return [e.key for e in entries if e.kind_spec.holds_weights and e.scope != PER_RANK
            and persistent_buffers(unwrap_module(e.target))]






def _any_barrier(outcomes: list[Outcome]) -> bool:
    """Whether any rank restores an early entry that may fail (the same answer on every rank)."""
    return any(o.info.get("barrier", True) for o in outcomes)


def _check_agreement(outcomes: list[Outcome], step: int) -> None:
    views = {(o.info["step"], o.info["epoch"], o.info["digest"]) for o in outcomes}
    if len(views) > 1:
        table = ", ".join(f"rank {o.rank}: step {o.info['step']} epoch {o.info['epoch']} "
                          f"manifest {o.info['digest']}" for o in outcomes)
        raise RankDisagreementError(f"loading step {step}: ranks disagree — {table}; "
                                    "the checkpoint's per-rank files do not belong together")


def _apply_phase(coord: Coordinator, entries: list[Entry], state: dict[str, Any],
                 read: ReadCheckpoint, rules: LoadRules = LoadRules()) -> tuple[list[str], list[str]]:
    """Restore every entry, in two agreed phases; returns (config notes, what was kept).

    Phase 1 restores everything but modules and tensor entries, each after a snapshot of it;
    if any rank fails, every rank puts its entries back and raises. Phase 2 restores the
    modules and tensors (checked completely before: keys, shapes, dtypes) and the process RNG
    streams, last. So a failure an owner's load_state_dict detects changes nothing anywhere.
    When no rank has an early entry whose restore may fail (`read.barrier`, agreed in the read
    phase: random streams, plain values), the two phases are one, with one exchange of outcomes:
    what could fail between them is checked before anything changed, and a failure of anything
    else is undone as a failure in phase 2 is.
    """
    entries = read.entries or entries
    saved = {**read.replicated["entries"], **read.own["entries"]}
    kept = [] if read.per_rank_restored else [e.key for e in entries if e.scope == PER_RANK]
    absent = [e.key for e in entries if e.key not in saved and e.key not in kept]
    if absent:
        load_warnings.warn_kept_missing(absent, read.step, coord.rank)
    warn_extra_entries(set(saved), {e.key for e in entries}, f"step {read.step}")
    todo = [e for e in entries if e.key not in kept and e.key not in absent]
    notes: list[str] = []
    memo = live_ties(todo, saved, by_region=not read.manifest.reused)  # tensors shared between entries stay shared, with the live ones too
    undos: list[tuple[str, Undo]] = []
    release = PageRelease(read.buffers)
    early = [e for e in todo if not is_late(e)]
    exc = _restore_all(early, saved, state, memo, notes, undos, coord.rank, read.step, release)
    if read.barrier:
        outcome = Outcome.failure(coord.rank, exc) if exc else Outcome(coord.rank)
        _agree_or_undo(coord, outcome, exc, undos, f"restoring step {read.step}", "load/apply")
    if exc is None:  # else (one phase) nothing more is restored: the exchange below undoes what was
        late = [e for e in todo if is_late(e)]
        rng_before = capture_process_rng()
        undos.append(("rng", lambda: restore_process_rng(rng_before, f"rank {coord.rank}, undo")))
        exc = _restore_all(late, saved, state, memo, notes, undos, coord.rank, read.step, release)
        if exc is None:
            exc = _restore_rng(coord, read, kept, entries)
    outcome = Outcome.failure(coord.rank, exc) if exc else Outcome(coord.rank)
    what, phase = ((f"restoring the modules of step {read.step}", "load/apply-modules") if read.barrier
                   else (f"restoring step {read.step}", "load/apply"))
    _agree_or_undo(coord, outcome, exc, undos, what, phase)
    return notes, (read.rederived if read.per_rank_restored else ["rng", *kept])


def _restore_all(entries: list[Entry], saved: dict[str, Any], state: dict[str, Any], memo: dict[int, Any],
                 notes: list[str], undos: list[tuple[str, Undo]], rank: int, step: int,
                 release: "PageRelease | None" = None) -> BaseException | None:
    """Restore `entries` in order, recording an undo before each; the first failure stops it."""
    for entry in entries:
        try:
            undos.append((entry.key, snapshot(entry, state)))
            notes.extend(restore_entry(entry, saved[entry.key], state, memo, release))
            if release is not None and not entry.kind_spec.restores_by_copies_alone:
                release.everything()  # whatever the owner's own loading touched
        except DistCkptError as e:
            return e
        except Exception as e:
            return _restore_failed(e, entry.key, rank, step)
        except BaseException as e:  # KeyboardInterrupt / SystemExit from an owner's load_state_dict:
            return e  # undone like any failure, then raised as it is (_agree_or_undo)
    try:
        if release is not None:
            release.finish()  # the phase's copies into tensors, checked before: in parallel
    except CopyFailed as e:  # nothing a check could see: memory exhausted, a device lost
        return _restore_failed(e.error, e.what, rank, step)
    return None


def _restore_failed(e: BaseException, what: str, rank: int, step: int) -> BaseException:
    if isinstance(e, DistCkptError):
        return e
    where = what if what.startswith("state[") else f"state[{what!r}]"
    err = IncompatibleCheckpointError(f"rank {rank}: restoring {where} of step {step} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


def _restore_rng(coord: Coordinator, read: ReadCheckpoint, kept: list[str],
                 entries: list[Entry]) -> BaseException | None:
    try:
        if read.per_rank_restored:
            restore_process_rng(read.own["rng"], f"rank {coord.rank}, step {read.step}")  # last
            if read.elastic_note:
                warn(read.elastic_note, ReshardWarning)
        else:
            # only here (a reshard or an import) are the modules' buffers looked at
            buffered = _modules_with_buffers(entries) if read.manifest.world_size > 1 else []
            load_warnings.warn_per_rank_kept(read, coord, kept, buffered)
        faults.point("load/applied", step=read.step, rank=coord.rank)
        return None
    except DistCkptError as e:
        return e
    except Exception as e:
        err = IncompatibleCheckpointError(f"rank {coord.rank}: restoring step {read.step} failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err


def _agree_or_undo(coord: Coordinator, outcome: Outcome, exc: BaseException | None,
                   undos: list[tuple[str, Undo]], what: str, phase: str) -> None:
    """Agree on the outcome; if any rank failed, put this rank's entries back, then raise."""
    try:
        agree(coord, outcome, phase, what, exc)
    except BaseException:
        failed = run_undos(undos, f"rank {coord.rank}")
        if failed:
            log.error("rank %d: after the failed load, state entries %s could not be put back", coord.rank, failed)
        if exc is not None and not isinstance(exc, Exception):
            raise exc from None  # this rank's own KeyboardInterrupt / SystemExit, after the undo
        raise
