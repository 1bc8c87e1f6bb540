"""The save and load protocols, as short functions of named phases.

Save(step)
    capture   every rank: RNG first, then its per-rank entries; rank 0 also the replicated ones
    agree     all ranks: everyone captured, and all hold the same step and epoch
    gather    per-rank files (bytes) to rank 0
    shards    every rank, with sharded entries: its own shard file, then a report (size,
              checksum, chunk boxes) through the store — no collective, so it runs in the
              background writer too (sharded.py)
    write     rank 0: replicated file, rank files; every rank's shard report; manifest
    commit    rank 0: COMMITTED, exclusive create, last
    share     rank 0's outcome to every rank, so a failed save fails everywhere

Load
    choose    rank 0 lists committed steps, newest first, and broadcasts the list
    read      every rank: marker, manifest, replicated file and its own rank file, verified by
              checksum and checked against `state` before anything is changed; a damaged
              candidate makes all ranks move to the previous one together, with a warning
    agree     all ranks hold the same (step, epoch, manifest digest), or all raise
    apply     every rank restores its entries, RNG last; outcomes exchanged once more

Every phase ends in `coord.agree`, so every rank takes the same branch.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from . import faults, fencing, incremental, sharded, tiers
from . import manifest as mf
from .capture import (
    PER_RANK,
    REPLICATED,
    SHARDED,
    CheckpointWarning,
    Entry,
    capture_entry,
    capture_rank_buffers,
    loading_entry,
    normalize_imported,
    resolve_sharded_entry,
    restore_entry,
    use_rank_buffers,
    warn_extra_entries,
)
from .commit import (
    ReplacePolicy,
    check_not_superseded,
    check_root_is_ours,
    check_step_is_free,
    check_written_under_a_lease,
    clear_step_dir,
    create_manifest,
    create_marker,
    is_committed,
    list_committed,
    read_marker,
    read_verified_manifest,
    step_candidates,
)
from .coord import Coordinator, Outcome, Reports, agree, hostname, raise_if_failed, run_on_root, run_phase
from .errors import (
    CheckpointExistsError,
    CoordinationError,
    CorruptCheckpointError,
    DistCkptError,
    FencedError,
    IncompatibleCheckpointError,
    MissingFileError,
    NotCommittedError,
    RankDisagreementError,
    StorageError,
    UnstorableValueError,
)
from .fencing import Lease
from .incremental import ContentTable
from .rng import capture_process_rng, check_process_rng, restore_process_rng
from .serialize import EncodedTree, StagingPool, encode_tree, load_tree_file, safetensors_chunks
from .storage import Storage, is_mapped, release_pages
from .undo import LATE_KINDS, Undo, run_undos, snapshot
from .validation import LoadRules, validate_entry

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
class StagedSave:
    """Everything rank 0 needs to write one checkpoint, detached from live training state."""

    step: int
    epoch: int | None
    metric: float | None
    run_id: str
    replicated: EncodedTree
    rank_files: list[bytes]
    ranks: list[dict[str, Any]]
    entries: dict[str, dict[str, str]]
    timings: dict[str, float] = field(default_factory=dict)
    shard_meta: dict[str, dict[str, Any]] = field(default_factory=dict)  # global dtype/shape by name
    shard_report_keys: list[str] = field(default_factory=list)           # one per rank; [] if none
    manifest_extra: dict[str, Any] = field(default_factory=dict)        # imports: {"imported": source}
    failures: list[Outcome] = field(default_factory=list)  # ranks that failed after the capture (async)


@dataclass
class ShardWrite:
    """One rank's shard file of a save, and where to report it (see sharded.py)."""

    rank: int
    step: int
    generation: int
    tree: EncodedTree
    boxes: dict[str, list[list[int]]]
    report_key: str

    def run(self, storage: Storage, reports: Reports) -> None:
        """Write the file durably, then report it; a failure is reported too, then raised."""
        name = sharded.shard_file(self.rank, self.generation)
        report = sharded.ShardReport(self.rank)
        try:
            record = _write(storage, f"{mf.step_dir(self.step)}/{name}", safetensors_chunks(self.tree))
            faults.point("save/shards-written", step=self.step, rank=self.rank)
            report = sharded.ShardReport(self.rank, name, record, self.boxes)
        except Exception as e:
            report.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            reports.post(self.report_key, report.to_json())


# -- save -------------------------------------------------------------------------------------

@dataclass
class _Captured:
    rank_file: bytes = b""
    replicated: EncodedTree | None = None   # rank 0
    shards: sharded.LocalShards | None = None  # every rank, when the state has sharded entries
    generation: int | None = None            # rank 0, when it has: the lease shard names carry


@dataclass
class CapturedSave:
    """One rank's save after the capture and agree phases: what the gather needs. It holds no
    reference to live training state (tensors are staged or encoded), so the gather and write
    may run in the background while training goes on."""

    step: int
    epoch: int | None
    metric: float | None
    run_id: str
    rank: int
    local: _Captured
    infos: list[dict[str, Any]]
    kinds: dict[str, dict[str, str]]
    report_keys: list[str]
    shard_write: ShardWrite | None
    capture_s: float


def stage_save(coord: Coordinator, *args: Any) -> tuple[StagedSave | None, ShardWrite | None]:
    """Phases capture, agree and gather (call on every rank; the arguments are capture_save's).
    Rank 0 gets the StagedSave; every rank gets its ShardWrite when the state has sharded entries
    or `split_writes` spreads the replicated tensors across the ranks."""
    captured = capture_save(coord, *args)
    return gather_save(coord, captured), captured.shard_write


def capture_save(coord: Coordinator, storage: Storage, entries: list[Entry], step: int,
                 epoch: int | None, metric: float | None, run_id: str,
                 staging: StagingPool | None, replaceable: "ReplacePolicy | None" = None,
                 take_lease: Callable[[], Lease] | None = None,
                 save_seq: int = 0, split_writes: bool = False,
                 durable: Storage | None = None,
                 prepare: Callable[[], None] | None = None) -> CapturedSave:
    """Phases capture and agree (call on every rank; one exchange): every rank has captured
    and all hold the same step and epoch, or every rank raises the same error. With two tiers
    `storage` is the local one, the `durable` root is the one checked to be this run's, and rank 0
    runs `prepare` first (it clears another job's steps out of the local tier)."""
    t0 = time.perf_counter()
    split = split_writes and coord.world_size > 1
    def capture() -> _Captured:
        local = _capture_phase(coord, storage, entries, step, epoch, staging, replaceable, take_lease, split,
                               durable, prepare)
        faults.point("save/captured", step=step, rank=coord.rank)
        return local

    def described(local: _Captured) -> dict[str, Any]:
        return {"rank": coord.rank, "step": step, "epoch": epoch, "host": hostname(), "pid": os.getpid(),
                "per_rank_entries": sorted(e.key for e in entries if e.scope == PER_RANK),
                "generation": local.generation, "async": staging is not None}

    local, outcomes = run_phase(coord, "save/capture", f"save of step {step}", capture, described)
    infos = [o.info for o in outcomes]
    _check_same_progress(infos, f"save of step {step}")
    keys = [f"distckpt/{run_id}/save-{save_seq}/shards/rank-{r}" for r in range(coord.world_size)]
    shard_write = None
    if local.shards is not None:
        generation = int(infos[0]["generation"])
        boxes = {name: [local.shards.offsets[name], list(t.shape)] for name, t in local.shards.pieces.items()}
        shard_write = ShardWrite(coord.rank, step, generation, local.shards.file_tree(coord.rank), boxes,
                                 keys[coord.rank])
    kinds = {e.key: {"scope": e.scope, "kind": e.kind} for e in entries}
    return CapturedSave(step, epoch, metric, run_id, coord.rank, local, infos, kinds, keys, shard_write,
                        time.perf_counter() - t0)


def gather_save(coord: Coordinator, captured: CapturedSave,
                failure: BaseException | None = None) -> StagedSave | None:
    """Phase gather (call on every rank, after capture_save; one exchange): the per-rank files
    to rank 0, which gets the StagedSave; None elsewhere. `coord` may be a group of its own
    (the background writer's), as the captured save no longer touches live state. A rank that
    failed since the capture sends its `failure` instead of its file: rank 0's StagedSave lists
    it (`failures`; raise_gathered_failures), so that rank 0 writes nothing and shares the error."""
    t1 = time.perf_counter()
    local = captured.local
    mine = Outcome.failure(captured.rank, failure) if failure is not None else Outcome(captured.rank)
    gathered = coord.gather({"file": local.rank_file if failure is None else b"", "outcome": mine}, "save/gather")
    if captured.rank != 0:
        return None
    assert gathered is not None and local.replicated is not None  # rank 0 invariant, not user input
    staged = StagedSave(captured.step, captured.epoch, captured.metric, captured.run_id, local.replicated,
                        [g["file"] for g in gathered], captured.infos, captured.kinds,
                        {"capture_s": captured.capture_s, "gather_s": time.perf_counter() - t1})
    staged.failures = [g["outcome"] for g in gathered if not g["outcome"].ok]
    if local.shards is not None:
        staged.shard_meta, staged.shard_report_keys = local.shards.meta, captured.report_keys
    return staged


def raise_gathered_failures(coord: Coordinator, staged: StagedSave | None) -> None:
    """Rank 0: the error naming every rank that failed after the capture (gather_save)."""
    if staged is not None and staged.failures:
        raise_if_failed(coord, staged.failures, f"save of step {staged.step}")


def _capture_phase(coord: Coordinator, storage: Storage, entries: list[Entry], step: int,
                   epoch: int | None, staging: StagingPool | None, replaceable: "ReplacePolicy | None",
                   take_lease: Callable[[], Lease] | None, split: bool,
                   durable: Storage | None = None, prepare: Callable[[], None] | None = None) -> _Captured:
    """This rank's capture: RNG first, then its per-rank entries; rank 0 the replicated ones."""
    out = _Captured()
    rng = capture_process_rng()  # first: nothing below may draw before it is recorded
    if coord.rank == 0:
        if prepare is not None:
            prepare()
        check_root_is_ours(durable if durable is not None else storage, replaceable or ReplacePolicy())
        check_step_is_free(storage, step, replaceable or ReplacePolicy())
    own = {"step": step, "epoch": epoch, "rank": coord.rank, "world_size": coord.world_size,
           "rng": rng,
           "entries": {e.key: capture_entry(e) for e in entries if e.scope == PER_RANK}}
    if coord.world_size > 1:
        own["buffers"] = capture_rank_buffers(entries)
    rank_tree = _encode_checked(own, ("per-rank state",), stage=True)
    out.rank_file = b"".join(safetensors_chunks(rank_tree))
    stage: bool | StagingPool = staging if staging is not None else False
    if split or any(e.scope == SHARDED for e in entries):
        out.shards = sharded.LocalShards(stage, coord.rank, coord.world_size)
        if coord.rank == 0 and take_lease is not None:
            out.generation = take_lease().generation  # other ranks' shard names carry it
    if coord.rank == 0:
        tree: dict[str, Any] = {"step": step, "epoch": epoch,
                "entries": {e.key: capture_entry(e) for e in entries if e.scope in (REPLICATED, SHARDED)}}
        out.replicated = _encode_checked(tree, ("replicated",), entries, stage=stage, shards=out.shards,
                                         split=split)
    elif out.shards is not None:
        scopes = (REPLICATED, SHARDED) if split else (SHARDED,)
        tree = {"entries": {e.key: capture_entry(e) for e in entries if e.scope in scopes}}
        if split:
            _check_storable(tree["entries"], entries)
        encode_tree(tree, ("replicated",), shards=out.shards, split=split)  # the same names as rank 0's
    if out.shards is not None:
        out.shards.sync()
    return out


class _NoShards:
    """A ShardSink for validation only: accepts every DTensor, copies nothing."""

    def add(self, tensor: Any, path: tuple[Any, ...]) -> str:
        return ""

    def add_whole(self, tensor: Any, path: tuple[Any, ...]) -> str:
        return ""


def _encode_checked(tree: dict[str, Any], path: tuple[Any, ...], entries: Sequence[Entry] = (),
                    **options: Any) -> EncodedTree:
    """encode_tree, with unstorable values named by the user's key path (state['config'][...]).

    Without shards the encoder refuses every bad value itself, so the check by key path runs
    only when it fails (the second pass cost an async save() of the demo's state 8.4 -> 6.7 ms);
    with shards (sharded entries, split writes) it runs first, as only it knows which entries
    may hold DTensors."""
    if options.get("shards") is not None:
        _check_storable(tree["entries"], entries)
        return encode_tree(tree, path, **options)
    try:
        return encode_tree(tree, path, **options)
    except UnstorableValueError:
        _check_storable(tree["entries"], entries)  # raises the same refusal, by the user's key path
        raise


def _check_storable(captured: dict[str, Any], entries: Sequence[Entry] = ()) -> None:
    """Refuse unstorable values with the user's key path (state['config'][...]), not ours.
    DTensors are accepted only inside sharded entries (a sharded module or its optimizer)."""
    sharded_keys = {e.key for e in entries if e.scope == SHARDED}
    for key, entry in captured.items():
        sink = _NoShards() if key in sharded_keys else None
        encode_tree(entry["state"], (key,), shards=sink)  # validation only: no tensor is copied


def _check_same_progress(infos: list[dict[str, Any]], what: str) -> None:
    modes = {i["async"] for i in infos}
    if len(modes) > 1:  # the two take different paths from here on: the ranks would wait on each other
        table = ", ".join(f"rank {r}: async_save={i['async']}" for r, i in enumerate(infos))
        raise RankDisagreementError(f"{what}: ranks disagree on async_save — {table}; build every rank's "
                                    "CheckpointManager with the same arguments")
    views = {(i["step"], i["epoch"]) for i in infos}
    if len(views) > 1:
        table = ", ".join(f"rank {r}: step {i['step']} epoch {i['epoch']}" for r, i in enumerate(infos))
        raise RankDisagreementError(f"{what}: ranks disagree on (step, epoch) — {table}; "
                                    "every rank must call save() with the same step and epoch")


def write_and_commit(storage: Storage, staged: StagedSave, versions: dict[str, Any], lease: Lease,
                     reports: Reports | None = None, content: ContentTable | None = None) -> str:
    """Phases write and commit (rank 0). Returns the manifest digest. Never touches other steps
    (except a zombie's commit of this same step, which it replaces: see fencing.py). With sharded
    entries, `reports` brings every rank's shard report before the manifest is written."""
    try:
        return _write_and_commit(storage, staged, versions, lease, reports, content)
    except (OSError, CheckpointExistsError) as e:
        # A newer incarnation clearing this step under us makes our writes fail: say why.
        try:
            fencing.check_current(storage, lease)
        except FencedError as fenced:
            raise fenced from e
        except OSError:
            pass
        raise


def _write_and_commit(storage: Storage, staged: StagedSave, versions: dict[str, Any], lease: Lease,
                      reports: Reports | None, content: ContentTable | None = None) -> str:
    t0 = time.perf_counter()
    faults.point("save/gathered", step=staged.step, rank=0)
    fencing.check_current(storage, lease)
    base = mf.step_dir(staged.step)
    policy = ReplacePolicy(lease.floor, lease.generation)
    clear_step_dir(storage, staged.step, policy)
    gen = lease.generation
    replicated = staged.replicated
    split = content.split_present(replicated.tensors, storage) if content is not None else None
    if split is not None:  # incremental: what an earlier commit holds is referenced, not written
        replicated = EncodedTree(replicated.node, split.own)
        incremental.check_not_overwriting_shared(storage, f"{base}/{mf.replicated_file(gen)}", staged.step)
    files = {mf.replicated_file(gen): _write(storage, f"{base}/{mf.replicated_file(gen)}",
                                             safetensors_chunks(replicated))}
    faults.point("save/replicated-written", step=staged.step, rank=0)
    for rank, data in enumerate(staged.rank_files):
        files[mf.rank_file(rank, gen)] = _write(storage, f"{base}/{mf.rank_file(rank, gen)}", [data])
    faults.point("save/rank-files-written", step=staged.step, rank=0)
    table = _collect_shards(staged, reports, files, f"{storage.url}/{base}")
    t1 = time.perf_counter()
    manifest = {
        "format": mf.FORMAT_VERSION, "step": staged.step, "epoch": staged.epoch,
        "metric": staged.metric, "run_id": staged.run_id, "generation": gen, "created_unix": time.time(),
        "world_size": len(staged.rank_files), "ranks": staged.ranks, "entries": staged.entries,
        "files": files, "versions": versions,
        "payload_bytes": replicated.payload_bytes + sum(
            r["size"] for name, r in files.items() if name.startswith(sharded.SHARD_PREFIX)),
    }
    if split is not None:
        manifest.update(incremental.manifest_fields(split))
    if table is not None:
        manifest["sharded"] = table
    manifest.update(staged.manifest_extra)
    data = mf.manifest_bytes(manifest)
    create_manifest(storage, base, data, gen, policy, staged.step)
    digest = mf.checksum_of(data)
    faults.point("save/manifest-written", step=staged.step, rank=0)
    fencing.check_current(storage, lease)  # last check before the point of no return
    create_marker(storage, mf.Marker(staged.step, digest, staged.run_id, gen), policy)
    _check_still_current(storage, lease, staged.step)
    if content is not None and split is not None:
        content.committed(split, f"{base}/{mf.replicated_file(gen)}", files[mf.replicated_file(gen)])
    staged.timings.update(write_s=t1 - t0, commit_s=time.perf_counter() - t1)
    faults.point("save/committed", step=staged.step, rank=0)
    return digest


def _collect_shards(staged: StagedSave, reports: Reports | None, files: dict[str, Any],
                    where: str) -> dict[str, Any] | None:
    """Wait for every rank's shard report; add their files; return the chunk table (or None)."""
    if not staged.shard_report_keys:
        return None
    if reports is None:
        raise CoordinationError(f"{where}: a sharded save needs the ranks' reports")
    got = [sharded.ShardReport.from_json(d) for d in
           reports.collect(staged.shard_report_keys, f"save of step {staged.step}: shard reports")]
    failed = [r for r in got if r.error]
    if failed:
        raise StorageError(errno.EIO, f"{where}: rank(s) {[r.rank for r in failed]} could not write "
                           f"their shards — " + "; ".join(f"rank {r.rank}: {r.error}" for r in failed))
    for report in got:
        if report.file is not None and report.record is not None:
            mf.check_relative_path(report.file, where)
            files[report.file] = report.record
    return sharded.chunk_table(staged.shard_meta, got, where)


def _check_still_current(storage: Storage, lease: Lease, step: int) -> None:
    """Closes the race between the last fence check and the marker: a lease taken in between
    saw this commit or not; either way this writer is stale now and must stop."""
    try:
        fencing.check_current(storage, lease)
    except FencedError as e:
        raise FencedError(f"step {step}'s marker was written while a newer incarnation took over; the "
                          "newer one loads it only if it resumed from this step or later. " + str(e)) from None
    except OSError as e:  # the commit stands; the next save checks the fence again
        log.warning("rank 0: step %d is committed, but checking the fence after it failed: %s", step, e)


def _write(storage: Storage, path: str, chunks: Any) -> dict[str, Any]:
    check = mf.Checksum()
    storage.write_file(path, check.wrap(chunks))
    return {"size": check.size, "xxh3_64": check.hexdigest()}


def share_outcome(coord: Coordinator, exc: BaseException | None, phase: str, what: str) -> None:
    """Broadcast rank 0's outcome of a write; every rank raises the same error if it failed."""
    def outcome() -> dict[str, Any]:
        if exc is not None:
            raise exc
        return {}

    run_on_root(coord, phase, what, outcome, exc)


# -- load -------------------------------------------------------------------------------------

@dataclass
class ReadCheckpoint:
    step: int
    digest: str
    manifest: dict[str, Any]
    replicated: dict[str, Any]
    own: dict[str, Any]
    per_rank_restored: bool = True
    entries: list[Entry] = field(default_factory=list)  # as restored (sharded ones resolved)
    buffers: list[Any] = field(default_factory=list)  # the files' buffers the tensors view


WORLD_SIZE_POLICIES = ("refuse", "reshard", "replicated_only")  # the last: the older name of "reshard"


def read_checkpoint(storage: Storage, step: int, rank: int, world_size: int,
                    world_size_policy: str = "refuse", leases: list[Lease] | None = None,
                    owned_by_leases: bool = False) -> ReadCheckpoint:
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
        check_not_superseded(marker, leases or [], where)
        if owned_by_leases:  # a local tier step: written by a job of this durable root
            check_written_under_a_lease(marker, leases or [], where)
        manifest = read_verified_manifest(storage, step, marker)
    except MissingFileError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from e
    replicated_name, rank_names = mf.payload_names(manifest)
    imported = bool(manifest.get("imported"))  # from torch.save / DCP: no per-rank state in the source
    buffers: list[Any] = []
    if imported or (manifest["world_size"] != world_size and world_size_policy in ("reshard", "replicated_only")):
        replicated = _read_tree(storage, base, replicated_name, manifest, where, buffers)
        own: dict[str, Any] = {"epoch": manifest.get("epoch"), "rank": rank, "entries": {}, "rng": None}
        return ReadCheckpoint(step, marker.manifest_digest, manifest, replicated, own, per_rank_restored=False,
                              buffers=buffers)
    if manifest["world_size"] != world_size:
        raise IncompatibleCheckpointError(
            f"{where} was written by {manifest['world_size']} ranks, this job has {world_size}: "
            "per-rank state (RNG streams, sampler and loader positions) cannot be mapped to "
            f"another world size; relaunch with --nproc-per-node/--nnodes giving {manifest['world_size']} ranks, "
            "or pass world_size_policy='reshard' to restore the replicated and sharded state and keep "
            "this run's per-rank state")
    replicated = _read_tree(storage, base, replicated_name, manifest, where, buffers)
    own = _read_tree(storage, base, rank_names[rank], manifest, where, buffers)
    return ReadCheckpoint(step, marker.manifest_digest, manifest, replicated, own, buffers=buffers)


def _read_tree(storage: Storage, base: str, name: str, manifest: dict[str, Any], where: str,
               buffers: list[Any] | None = None) -> Any:
    """One verified tree file, its tensors viewing the file's buffer (appended to `buffers`). A
    mapped file is verified piece by piece, each piece's pages let go once hashed, so a load
    never holds the whole file resident (the restore lets go of them again as it copies)."""
    record = manifest["files"].get(name)
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
    extra = incremental.resolve(storage, manifest, where) if name == mf.payload_names(manifest)[0] else None
    return load_tree_file(data, f"{where}/{name}", extra)


def load(coord: Coordinator, storage: Storage, entries: list[Entry], state: dict[str, Any],
         step: int | None = None, world_size_policy: str = "refuse",
         rules: LoadRules = LoadRules(), local: Storage | None = None) -> Progress | None:
    """The load protocol (call on every rank). None when nothing is committed yet. With a
    `local` tier (tiers.py), a step committed on every node's local tier is tried before the
    durable copy of the same step, and a damaged copy falls back to the next candidate."""
    candidates, leases = _choose_phase(coord, storage, step, local)
    if not candidates:
        return None
    storages = {tiers.DURABLE: storage, tiers.LOCAL: local or storage}
    found = _read_phase(coord, storages, entries, candidates, step is not None, world_size_policy, leases, rules)
    if found is None:
        return None  # step directories, but none committed
    chosen, tier = found
    notes, kept = _apply_phase(coord, entries, state, chosen, rules)
    return Progress(chosen.step, chosen.own["epoch"], chosen.manifest.get("metric"),
                    f"{storages[tier].url}/{mf.step_dir(chosen.step)}", tuple(notes), tuple(kept), tier)


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
        return step_candidates(storage)
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
    durable: dict[str, Any] = {"steps": [], "leases": None, "error": None}
    if coord.rank == 0:
        try:
            steps = step_candidates(storage) if step is None else [s for s in [step] if is_committed(storage, s)]
            durable = {"steps": steps, "leases": [dataclasses.asdict(x) for x in fencing.read_leases(storage)],
                       "error": None}
        except Exception as e:  # every rank hears it below: none may be left waiting in the broadcast
            durable["error"] = f"{type(e).__name__}: {e}"
    durable = coord.broadcast(durable if coord.rank == 0 else None, "load/durable")
    leases = None if durable["leases"] is None else [Lease(**d) for d in durable["leases"]]
    local_steps = tiers.common_local_steps(coord, local, leases)
    if durable["error"] is not None:
        message = (f"rank {coord.rank}: the durable tier {storage.url} cannot be read ({durable['error']})")
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
                leases: list[Lease] | None, rules: LoadRules = LoadRules()) -> tuple[ReadCheckpoint, str] | None:
    """The newest candidate every rank reads and verifies, and its tier; None when no candidate
    was committed at all (directories of saves that never committed)."""
    tiered = storages[tiers.LOCAL] is not storages[tiers.DURABLE]
    committed = 0
    for i, (step, tier) in enumerate(candidates):
        owned = tier == tiers.LOCAL and leases is not None
        read, exc = _try_read(coord, storages[tier], entries, step, world_size_policy, leases or [], rules, owned)
        if read is not None:
            info = {"step": read.step, "epoch": read.own["epoch"], "digest": read.digest}
            outcome = Outcome(coord.rank, info=info)
        else:
            outcome = Outcome.failure(coord.rank, exc or CoordinationError("read failed"))
        outcomes = coord.all_gather(outcome, f"load/read step {step} ({tier})")
        if all(o.error_type == NotCommittedError.__name__ for o in outcomes):
            continue  # a save that never committed (or removed meanwhile): not a checkpoint
        committed += 1
        damaged = [o for o in outcomes if o.error_type in (CorruptCheckpointError.__name__, NotCommittedError.__name__)]
        following = candidates[i + 1] if i + 1 < len(candidates) else None
        may_fall_back = not explicit or (following is not None and following[0] == step)
        if damaged and len(damaged) == len([o for o in outcomes if not o.ok]) and may_fall_back:
            _warn_fallback(step, tier, following, damaged, coord.rank, tiered)
            continue
        raise_if_failed(coord, outcomes, f"loading step {step}", exc)
        _check_agreement(outcomes, step)
        assert read is not None  # every rank succeeded
        return read, tier
    if not committed and not explicit:
        return None
    where = storages[tiers.DURABLE].url + (f" or {storages[tiers.LOCAL].url}" if tiered else "")
    tried = [f"{s} ({t})" for s, t in candidates[:10]] if tiered else [s for s, _ in candidates[:10]]
    raise CorruptCheckpointError(
        f"no committed checkpoint at {where} verifies (tried steps {tried}); "
        "see the warnings above for each damaged file; `distckpt verify` lists them")


def _try_read(coord: Coordinator, storage: Storage, entries: list[Entry], step: int,
              world_size_policy: str, leases: list[Lease], rules: LoadRules = LoadRules(),
              owned_by_leases: bool = False) -> tuple[ReadCheckpoint | None, BaseException | None]:
    try:
        read = read_checkpoint(storage, step, coord.rank, coord.world_size, world_size_policy, leases,
                               owned_by_leases)
        read.entries = _resolve_sharded(storage, entries, read)
        _validate_against_state(read.entries, read, (coord.rank, coord.world_size), rules)
        faults.point("load/read", step=step, rank=coord.rank)
        return read, None
    except Exception as e:
        return None, e


def _resolve_sharded(storage: Storage, entries: list[Entry], read: ReadCheckpoint) -> list[Entry]:
    """The entries as they will be restored; each sharded one's saved state gets this rank's
    pieces, assembled from whichever ranks' shard files overlap them (nothing is changed yet)."""
    if not read.manifest.get("sharded"):  # no shard files: nothing to resolve (most loads)
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
    if read.own.get("rank") != world[0]:
        raise CorruptCheckpointError(f"step {read.step}: the file for rank {world[0]} holds rank {read.own.get('rank')}")


def _warn_per_rank_kept(read: ReadCheckpoint, coord: Coordinator, kept: list[str]) -> None:
    if read.manifest.get("imported"):
        message = (f"rank {coord.rank}: step {read.step} was imported from {read.manifest['imported']}, which holds no "
                   f"per-rank state: the RNG streams and the per-rank entries {kept} keep what this process set. "
                   "The run continues from the imported state, not bit for bit.")
        log.warning(message)
        warnings.warn(message, CheckpointFallbackWarning, stacklevel=4)
        return
    message = (f"rank {coord.rank}: step {read.step} was written by {read.manifest['world_size']} ranks and "
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
        then = "loading the previous committed step"
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
    memo: dict[int, Any] = {}  # tensors shared between entries stay shared
    undos: list[tuple[str, Undo]] = []
    release = PageRelease(read.buffers)
    early = [e for e in todo if e.kind not in LATE_KINDS]
    exc = _restore_all(early, saved, state, memo, notes, undos, coord.rank, read.step, release)
    outcome = Outcome.failure(coord.rank, exc) if exc else Outcome(coord.rank)
    _agree_or_undo(coord, outcome, exc, undos, f"restoring step {read.step}", "load/apply")
    late = [e for e in todo if e.kind in LATE_KINDS]
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
            err = IncompatibleCheckpointError(
                f"rank {rank}: restoring state[{entry.key!r}] of step {step} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            return err
    return None


class PageRelease:
    """Lets go of the file pages behind a restored tensor (storage.release_pages): a load into
    existing tensors then holds at most a piece of the mapped files resident, not all of them
    (the pages stay in the page cache; the tensors view them again if read). Tensors that do not
    view a mapped file are ignored."""

    PIECE = 8 << 20  # small tensors: the whole file is let go once this many bytes were copied

    def __init__(self, buffers: list[Any]) -> None:
        self._spans: list[list[Any]] = []  # [base address, length, buffer, bytes copied since released]
        for data in buffers:
            if len(data) and is_mapped(data):
                self._spans.append([torch.frombuffer(data, dtype=torch.uint8).data_ptr(), len(data), data, 0])

    def __call__(self, tensor: torch.Tensor) -> None:
        if not self._spans or tensor.device.type != "cpu":
            return
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for span in self._spans:
            base, length, data, pending = span
            if not base <= start < base + length:
                continue
            if nbytes >= self.PIECE // 4:
                release_pages(data, start - base, nbytes)
            elif pending + nbytes >= self.PIECE:  # one call for many small tensors (20,000 calls: 40 ms)
                release_pages(data)
                span[3] = 0
            else:
                span[3] = pending + nbytes
            return

    def everything(self) -> None:
        for span in self._spans:
            release_pages(span[2])
            span[3] = 0


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
