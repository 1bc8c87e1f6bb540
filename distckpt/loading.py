"""The load protocol, as short functions of named phases (the overview: protocol.py).

    choose    rank 0 lists committed steps, newest first, and broadcasts the list (with a local
              tier: the steps every node holds, checked against the durable root's leases)
    read      every rank: marker, manifest, replicated file and its own rank file, verified by
              checksum and checked against `state` before anything is changed; a damaged
              candidate makes all ranks move to the previous one together, with a warning
    agree     all ranks hold the same (step, epoch, manifest digest), or all raise
    apply     every rank restores its entries, RNG last; outcomes exchanged once more, and a
              failure anywhere is undone everywhere (undo.py)
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from . import faults, fencing, incremental, sharded, tiers
from . import manifest as mf
from .capture import (
    PER_RANK,
    SHARDED,
    CheckpointWarning,
    Entry,
    loading_entry,
    normalize_imported,
    replaced_under_key,
    resolve_sharded_entry,
    use_rank_buffers,
    warn_extra_entries,
)
from .commit import (
    check_not_superseded,
    check_written_under_a_lease,
    is_committed,
    list_committed,
    read_marker,
    read_verified_manifest,
    step_candidates,
)
from .coord import Coordinator, Outcome, agree, attempt_on_root, attempt_phase, raise_if_failed, run_on_root
from .copying import CopyFailed, PageRelease, Prefault
from .errors import (
    CorruptCheckpointError,
    DistCkptError,
    IncompatibleCheckpointError,
    MissingFileError,
    NotCommittedError,
    RankDisagreementError,
    StorageError,
    SupersededCheckpointError,
)
from .fencing import Lease
from .interrupts import sigint_deferred
from .kinds import check_destinations_apart, copy_destinations, is_late, live_ties, restore_entry, snapshot, validate_entry
from .rng import capture_process_rng, check_process_rng, restore_process_rng
from .serialize import load_tree_file
from .storage import Storage, release_pages
from .undo import Undo, run_undos
from .validation import LoadRules

log = logging.getLogger("distckpt")


class CheckpointFallbackWarning(UserWarning):
    """The newest committed checkpoint was damaged; an older one was loaded instead."""


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
    # which tier it came from: "local" (the manager's local_dir) or "durable" (its URL)
    tier: str = "durable"


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


WORLD_SIZE_POLICIES = ("refuse", "reshard", "replicated_only")  # the last: the older name of "reshard"


def read_checkpoint(storage: Storage, step: int, rank: int, world_size: int,
                    world_size_policy: str = "refuse", leases: list[Lease] | None = None,
                    owned_by_leases: bool = False, superseded_ok: bool = False) -> ReadCheckpoint:
    """Read and verify what this rank needs of one committed step. Raises CorruptCheckpointError.

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
    if imported or (manifest.world_size != world_size and world_size_policy in ("reshard", "replicated_only")):
        replicated = _read_tree(storage, base, replicated_name, manifest, where, buffers)
        own: dict[str, Any] = {"epoch": manifest.epoch, "rank": rank, "entries": {}, "rng": None}
        return ReadCheckpoint(step, marker.manifest_digest, manifest, replicated, own, per_rank_restored=False,
                              buffers=buffers)
    if manifest.world_size != world_size:
        raise IncompatibleCheckpointError(
            f"{where} was written by {manifest.world_size} ranks, this job has {world_size}: "
            "per-rank state (RNG streams, sampler and loader positions) cannot be mapped to "
            f"another world size; relaunch with --nproc-per-node/--nnodes giving {manifest.world_size} ranks, "
            "or pass world_size_policy='reshard' to restore the replicated and sharded state and keep "
            "this run's per-rank state")
    replicated = _read_tree(storage, base, replicated_name, manifest, where, buffers)
    own = _read_tree(storage, base, rank_names[rank], manifest, where, buffers, per_rank=True)
    return ReadCheckpoint(step, marker.manifest_digest, manifest, replicated, own, buffers=buffers)


def _read_tree(storage: Storage, base: str, name: str, manifest: mf.Manifest, where: str,
               buffers: list[Any] | None = None, per_rank: bool = False) -> Any:
    """One verified tree file, its tensors viewing the file's buffer (appended to `buffers`). A
    mapped file is verified piece by piece, each piece's pages let go once hashed, so a load
    never holds the whole file resident (the restore lets go of them again as it copies)."""
    record = manifest.files.get(name)
    if record is None:
        raise CorruptCheckpointError(f"{where}: the manifest lists no {name}")
    try:
        data = storage.read_buffer(f"{base}/{name}")
    except MissingFileError as e:
        raise CorruptCheckpointError(f"{where}/{name} is missing") from e
    except StorageError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(str(e)) from e
        raise
    mf.verify_file(data, record, f"{where}/{name}", lambda start, n: release_pages(data, start, n))
    if buffers is not None:
        buffers.append(data)
    extra = incremental.resolve(storage, manifest, where) if name == manifest.payload_names()[0] else None
    tree = load_tree_file(data, f"{where}/{name}", extra)
    mf.check_tree(tree, f"{where}/{name}", per_rank)
    return tree


# A load whose every candidate vanished or was not committed yet while it read (a concurrent
# writer's next save and retention) lists again; a few times, as each listing can lose again.
_LISTING_ATTEMPTS = 4


def load(coord: Coordinator, storage: Storage, entries: list[Entry], state: dict[str, Any],
         step: int | None = None, world_size_policy: str = "refuse",
         rules: LoadRules = LoadRules(), local: Storage | None = None) -> Progress | None:
    """The load protocol (call on every rank). None when nothing is committed yet. With a
    `local` tier (tiers.py), a step committed on every node's local tier is tried before the
    durable copy of the same step, and a damaged copy falls back to the next candidate."""
    storages = {tiers.DURABLE: storage, tiers.LOCAL: local or storage}
    previous: list[tuple[int, str]] | None = None
    failure: CorruptCheckpointError | None = None
    for _ in range(_LISTING_ATTEMPTS):
        candidates, leases = _choose_phase(coord, storage, step, local)  # the same on every rank
        if failure is not None and set(candidates) == set(previous or []):
            break  # nothing changed: the damage stands (a None is retried as is: see below)
        if not candidates:
            return None
        prefault = Prefault(copy_destinations(entries))  # while the files are read and verified
        try:
            found = _read_phase(coord, storages, entries, candidates, step is not None, world_size_policy, leases, rules)
        finally:
            prefault.stop()
        if isinstance(found, tuple):
            chosen, tier = found
            with sigint_deferred():  # a Ctrl-C here would leave the state half-restored (interrupts.py)
                notes, kept = _apply_phase(coord, entries, state, chosen, rules)
            return Progress(chosen.step, chosen.own["epoch"], chosen.manifest.metric,
                            f"{storages[tier].url}/{mf.step_dir(chosen.step)}", tuple(notes), tuple(kept), tier)
        # Agreed on every rank, so all list again or none. A None is retried even on the same
        # listing: the loader may read a step's marker before its commit and the previous step's
        # after retention removed it (cheap: only markers were read).
        previous, failure = candidates, found
        log.info("rank %d: no candidate of %s could be loaded; listing again", coord.rank, [s for s, _ in candidates[:10]])
    if failure is not None:
        raise failure
    return None  # step directories, but none committed


def _choose_phase(coord: Coordinator, storage: Storage, step: int | None,
                  local: Storage | None = None) -> tuple[list[tuple[int, str]], list[Lease] | None]:
    """The candidates (step, tier), newest first, and the durable root's leases (None: it could
    not be read, so local steps are loaded without checking who wrote them)."""
    if local is not None:
        return _choose_tiered(coord, storage, step, local)

    def choose() -> dict[str, Any]:
        steps = _durable_candidates(storage, step)
        leases = fencing.read_leases(storage) if steps else []
        return {"candidates": tiers.merge_candidates([], steps, step),
                "leases": [dataclasses.asdict(lease) for lease in leases]}

    chosen = run_on_root(coord, "load/choose", "choosing a checkpoint to load", choose)
    return ([(int(s), str(t)) for s, t in chosen["candidates"]], [Lease(**d) for d in chosen["leases"]])


def _durable_candidates(storage: Storage, step: int | None) -> list[int]:
    """Rank 0: the step directories to try, newest first (commit.step_candidates: the read phase
    skips one without a marker); an explicit `step` must be committed."""
    if step is None:
        steps = step_candidates(storage)
        if not steps:
            storage.check_root()  # nothing found: a missing bucket is an error, not a fresh start
        return steps
    if not is_committed(storage, step):
        committed = list_committed(storage)
        raise IncompatibleCheckpointError(f"step {step} is not committed at {storage.url} (committed: {committed[:10]})")
    return [step]


def _choose_tiered(coord: Coordinator, storage: Storage, step: int | None,
                   local: Storage) -> tuple[list[tuple[int, str]], list[Lease] | None]:
    """Two tiers: rank 0 lists the durable root and reads its leases; every rank then keeps the
    local steps a lease of that root wrote (another job's are skipped with a warning) and the
    ranks agree on those every node holds. An unreadable durable root is a warning on every rank
    when local candidates remain, else the error on every rank."""
    def read_durable() -> dict[str, Any]:
        steps = step_candidates(storage) if step is None else [s for s in [step] if is_committed(storage, s)]
        if not steps:
            storage.check_root()
        return {"steps": steps, "leases": [dataclasses.asdict(x) for x in fencing.read_leases(storage)]}

    outcome, _ = attempt_on_root(coord, "load/durable", read_durable)
    durable = outcome.info if outcome.ok else {"steps": [], "leases": None}
    leases = None if durable["leases"] is None else [Lease(**d) for d in durable["leases"]]
    local_steps = tiers.common_local_steps(coord, local, leases)
    if not outcome.ok:
        message = (f"rank {coord.rank}: the durable tier {storage.url} cannot be read "
                   f"({outcome.error_type}: {outcome.message})")
        if not local_steps:
            raise StorageError(errno.EIO, f"{message}; and no local tier step is committed on every node")
        message += ("; choosing among the local tier's steps without checking who wrote them (its leases "
                    "live at the durable root)")
        log.warning(message)
        warnings.warn(message, CheckpointFallbackWarning, stacklevel=5)
    steps = list(durable["steps"])
    if step is not None and step not in steps and step not in local_steps:
        raise IncompatibleCheckpointError(
            f"step {step} is not committed at {storage.url} (committed: {steps[:10]}) nor on every node's "
            f"local tier (common: {local_steps[:10]})")
    return tiers.merge_candidates(local_steps, steps, step), leases


def _read_phase(coord: Coordinator, storages: dict[str, Storage], entries: list[Entry],
                candidates: list[tuple[int, str]], explicit: bool, world_size_policy: str,
                leases: list[Lease] | None,
                rules: LoadRules = LoadRules()) -> tuple[ReadCheckpoint, str] | CorruptCheckpointError | None:
    """The newest candidate every rank reads and verifies, and its tier. Otherwise (the same on
    every rank) None when no candidate was committed (directories of saves that never committed,
    or removed meanwhile), or the error saying none verifies; an explicit step raises it."""
    tiered = storages[tiers.LOCAL] is not storages[tiers.DURABLE]
    committed = 0
    superseded: list[tuple[int, str]] = []
    for i, (step, tier) in enumerate(candidates):
        read, exc, outcomes = _attempt_read(coord, storages[tier], entries, step, tier, world_size_policy, leases, rules)
        if all(o.error_type == NotCommittedError.__name__ for o in outcomes):
            continue  # a save that never committed (or removed meanwhile): not a checkpoint
        committed += 1
        damaged = [o for o in outcomes if o.error_type in _SKIPPABLE]
        following = candidates[i + 1] if i + 1 < len(candidates) else None
        may_fall_back = not explicit or (following is not None and following[0] == step)
        if damaged and len(damaged) == len([o for o in outcomes if not o.ok]) and may_fall_back:
            _warn_fallback(step, tier, following, damaged, coord.rank, tiered)
            if all(o.error_type == SupersededCheckpointError.__name__ for o in damaged):
                superseded.append((step, tier))
            continue
        raise_if_failed(coord, outcomes, f"loading step {step}", exc)
        _check_agreement(outcomes, step)
        assert read is not None  # every rank succeeded
        return read, tier
    if superseded and not explicit:
        last_resort = _read_superseded(coord, storages, entries, superseded[0], world_size_policy, leases, rules)
        if last_resort is not None:
            return last_resort
    if not committed and not explicit:
        return None
    where = storages[tiers.DURABLE].url + (f" or {storages[tiers.LOCAL].url}" if tiered else "")
    tried = [f"{s} ({t})" for s, t in candidates[:10]] if tiered else [s for s, _ in candidates[:10]]
    error = CorruptCheckpointError(
        f"no committed checkpoint at {where} verifies (tried steps {tried}); "
        "see the warnings above for each damaged file; `distckpt verify` lists them")
    if explicit:
        raise error
    return error


_SKIPPABLE = (CorruptCheckpointError.__name__, NotCommittedError.__name__, SupersededCheckpointError.__name__)


def _attempt_read(coord: Coordinator, storage: Storage, entries: list[Entry], step: int, tier: str,
                  world_size_policy: str, leases: list[Lease] | None, rules: LoadRules,
                  superseded_ok: bool = False) -> tuple[ReadCheckpoint | None, BaseException | None, list[Outcome]]:
    owned = tier == tiers.LOCAL and leases is not None
    return attempt_phase(
        coord, f"load/read step {step} ({tier})",
        functools.partial(_read_and_check, coord, storage, entries, step, world_size_policy,
                          leases or [], rules, owned, superseded_ok),
        lambda r: {"step": r.step, "epoch": r.own["epoch"], "digest": r.digest})


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
    message = (f"rank {coord.rank}: no checkpoint of the newest incarnation verifies, only steps committed by a "
               f"superseded writer (see the warnings above); loading the newest of them, step {step}, as the last "
               "resort: the run continues from that writer's state, not from the newer incarnation's. "
               "`distckpt ls` shows the leases and steps")
    log.warning(message)
    warnings.warn(message, CheckpointFallbackWarning, stacklevel=5)
    assert read is not None
    return read, tier


def _read_and_check(coord: Coordinator, storage: Storage, entries: list[Entry], step: int,
                    world_size_policy: str, leases: list[Lease], rules: LoadRules = LoadRules(),
                    owned_by_leases: bool = False, superseded_ok: bool = False) -> ReadCheckpoint:
    """This rank's files of `step`, verified, and checked against the live state. A step whose
    files vanished while they were read, and whose marker is gone too, was removed by a
    concurrent writer's retention: NotCommittedError, skipped like a save that never committed."""
    try:
        read = read_checkpoint(storage, step, coord.rank, coord.world_size, world_size_policy, leases,
                               owned_by_leases, superseded_ok)
        read.entries = replaced_under_key(_resolve_sharded(storage, entries, read),
                                          {**read.replicated["entries"], **read.own["entries"]})
    except CorruptCheckpointError as e:
        if not isinstance(e, NotCommittedError) and _removed_meanwhile(storage, step):
            raise NotCommittedError(f"{storage.url}/{mf.step_dir(step)} was removed while it was read "
                                    "(retention of a concurrent writer)") from e
        raise
    _validate_against_state(read.entries, read, (coord.rank, coord.world_size), rules)
    faults.point("load/read", step=step, rank=coord.rank)
    return read


def _removed_meanwhile(storage: Storage, step: int) -> bool:
    try:
        return not is_committed(storage, step)
    except DistCkptError:
        return False  # cannot tell: the damage stands as reported


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
    for saved in saved_entries.values():  # replicated tensors stored by split writes
        if isinstance(saved, dict) and saved.get("kind") not in ("sharded_module", "sharded_optimizer"):
            saved["state"] = sharded.resolve_whole(saved.get("state"), reader)
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


def _warn_per_rank_kept(read: ReadCheckpoint, coord: Coordinator, kept: list[str]) -> None:
    if read.manifest.imported is not None:
        message = (f"rank {coord.rank}: step {read.step} was imported from {read.manifest.imported}, which holds no "
                   f"per-rank state: the RNG streams and the per-rank entries {kept} keep what this process set. "
                   "The run continues from the imported state, not bit for bit.")
        log.warning(message)
        warnings.warn(message, CheckpointFallbackWarning, stacklevel=4)
        return
    message = (f"rank {coord.rank}: step {read.step} was written by {read.manifest.world_size} ranks and "
               f"is loaded by {coord.world_size} (world_size_policy='reshard'): replicated and sharded state "
               f"restored; kept as this process set them, not restored: the RNG streams (Python, NumPy, "
               f"torch, devices) and the per-rank entries {kept}. The run continues, not bit for bit.")
    log.warning(message)
    warnings.warn(message, CheckpointFallbackWarning, stacklevel=4)


def _warn_fallback(step: int, tier: str, following: tuple[int, str] | None, damaged: list[Outcome],
                   rank: int, tiered: bool) -> None:
    detail = "; ".join(f"rank {o.rank}: {o.message}" for o in damaged)
    where = f"step {step} on the {tier} tier" if tiered else f"step {step}"
    if following is None:
        then = "no other committed checkpoint is left to try"
    elif tiered or following[1] != tier:
        then = f"loading step {following[0]} from the {following[1]} tier"
    else:
        then = "trying the previous step"
    message = f"rank {rank}: committed {where} cannot be loaded and was skipped — {detail}; {then}"
    log.warning(message)
    warnings.warn(message, CheckpointFallbackWarning, stacklevel=4)


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
    """
    entries = read.entries or entries
    saved = {**read.replicated["entries"], **read.own["entries"]}
    kept = [] if read.per_rank_restored else [e.key for e in entries if e.scope == PER_RANK]
    absent = [e.key for e in entries if e.key not in saved and e.key not in kept]
    if absent:
        _warn_kept_missing(absent, read.step, coord.rank)
    warn_extra_entries(set(saved), {e.key for e in entries}, f"step {read.step}")
    todo = [e for e in entries if e.key not in kept and e.key not in absent]
    notes: list[str] = []
    memo = live_ties(todo, saved, by_region=not read.manifest.reused)  # tensors shared between entries stay shared, with the live ones too
    undos: list[tuple[str, Undo]] = []
    release = PageRelease(read.buffers)
    early = [e for e in todo if not is_late(e)]
    exc = _restore_all(early, saved, state, memo, notes, undos, coord.rank, read.step, release)
    outcome = Outcome.failure(coord.rank, exc) if exc else Outcome(coord.rank)
    _agree_or_undo(coord, outcome, exc, undos, f"restoring step {read.step}", "load/apply")
    late = [e for e in todo if is_late(e)]
    rng_before = capture_process_rng()
    undos.append(("rng", lambda: restore_process_rng(rng_before, f"rank {coord.rank}, undo")))
    exc = _restore_all(late, saved, state, memo, notes, undos, coord.rank, read.step, release)
    if exc is None:
        exc = _restore_rng(coord, read, kept)
    outcome = Outcome.failure(coord.rank, exc) if exc else Outcome(coord.rank)
    _agree_or_undo(coord, outcome, exc, undos, f"restoring the modules of step {read.step}", "load/apply-modules")
    return notes, ([] if read.per_rank_restored else ["rng", *kept])


def _restore_all(entries: list[Entry], saved: dict[str, Any], state: dict[str, Any], memo: dict[int, Any],
                 notes: list[str], undos: list[tuple[str, Undo]], rank: int, step: int,
                 release: "PageRelease | None" = None) -> BaseException | None:
    """Restore `entries` in order, recording an undo before each; the first failure stops it."""
    for entry in entries:
        try:
            undos.append((entry.key, snapshot(entry, state)))
            notes.extend(restore_entry(entry, saved[entry.key], state, memo, release))
            if release is not None and entry.kind != "tensor":
                release.everything()  # whatever the owner's own loading touched
        except DistCkptError as e:
            return e
        except Exception as e:
            return _restore_failed(e, entry.key, rank, step)
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


def _restore_rng(coord: Coordinator, read: ReadCheckpoint, kept: list[str]) -> BaseException | None:
    try:
        if read.per_rank_restored:
            restore_process_rng(read.own["rng"], f"rank {coord.rank}, step {read.step}")  # last
        else:
            _warn_per_rank_kept(read, coord, kept)
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
    except DistCkptError:
        failed = run_undos(undos, f"rank {coord.rank}")
        if failed:
            log.error("rank %d: after the failed load, state entries %s could not be put back", coord.rank, failed)
        raise


def _warn_kept_missing(keys: list[str], step: int, rank: int) -> None:
    message = (f"rank {rank}: step {step} holds no entries {keys}; they keep their live values "
               "(missing_entries='keep')")
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=5)
