"""The save protocol, as short functions of named phases (the overview: protocol.py).

    capture   every rank: RNG first, then its per-rank entries; rank 0 also the replicated ones
    agree     all ranks: everyone captured, and all hold the same step and epoch
    own files every rank: its rank file and, with sharded entries or split writes, its shard
              file, durable; then one report (names, sizes, checksums, chunk boxes, or its
              failure) through the store — no collective, so it runs in the background writer too
    write     rank 0: the replicated file; every rank's report; the manifest
    commit    rank 0: COMMITTED, exclusive create, last (commit.py holds the rule)
    share     rank 0's outcome to every rank, so a failed save fails everywhere

One shape for every layout: each rank writes its own files and reports, rank 0 commits. The one
exception is a local tier on several nodes (tiers.py): a node's disk is not the others', so the
rank files travel to rank 0 in a gather (`handover`) and rank 0 writes the whole step, which it
then ships to every node; that layout refuses sharded entries and split writes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

from distckpt.errors import (
    CheckpointExistsError,
    CoordinationError,
    FencedError,
    RankDisagreementError,
    StorageError,
    UnstorableValueError,
)
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.io.safetensors_format import EncodedTree, safetensors_chunks
from distckpt.io.serialize import check_key_text, encode_tree, key_path
from distckpt.io.staging import StagingPool, region_key
from distckpt.protocol import fencing, incremental
from distckpt.protocol.agreement import check_replicated_agree, replicated_digests
from distckpt.protocol.commit import (
    ReplacePolicy,
    check_root_is_ours,
    check_step_is_free,
    clear_step_dir,
    create_manifest,
    create_marker,
)
from distckpt.protocol.coord import Coordinator, Outcome, error_of, hostname, raise_if_failed, run_on_root, run_phase
from distckpt.protocol.fencing import Lease
from distckpt.protocol.incremental import ContentTable
from distckpt.protocol.payload import write_tree
from distckpt.protocol.reports import Reports
from distckpt.runtime import faults
from distckpt.state import sharded
from distckpt.state.capture import (
    PER_RANK,
    REPLICATED,
    SHARDED,
    Entry,
    has_class_named,
)
from distckpt.state.kinds import capture_entry, capture_rank_buffers
from distckpt.state.rng import capture_process_rng
from distckpt.storage import Storage

log = logging.getLogger("distckpt")


@dataclass
class StagedSave:
    """Everything rank 0 needs to write one checkpoint, detached from live training state."""

    step: int
    epoch: int | None
    metric: float | None
    run_id: str
    replicated: EncodedTree
    handed_over: dict[int, bytes]   # rank files rank 0 writes for their ranks (several nodes' local tier, imports)
    ranks: list[dict[str, Any]]
    entries: dict[str, dict[str, str]]
    timings: dict[str, float] = field(default_factory=dict)
    shard_meta: dict[str, dict[str, Any]] = field(default_factory=dict)  # global dtype/shape by name
    report_keys: list[str] = field(default_factory=list)  # one per rank that writes its own files
    manifest_extra: dict[str, Any] = field(default_factory=dict)        # imports: {"imported": source}
    failures: list[Outcome] = field(default_factory=list)  # ranks that failed after the capture (async)

    @property
    def world_size(self) -> int:
        return len(self.ranks)


@dataclass
class RankReport:
    """What a rank tells rank 0 once its own files are durable, or why they are not."""

    rank: int
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> size and checksum, as in "files"
    shard_file: str | None = None
    boxes: dict[str, list[Any]] | None = None  # the shard file's pieces: name -> [offsets, shape(, checksum)]
    failure: Outcome | None = None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "files": self.files, "shard_file": self.shard_file, "boxes": self.boxes,
                "failure": None if self.failure is None else asdict(self.failure)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RankReport":
        failure = d.get("failure")
        return cls(int(d["rank"]), dict(d.get("files") or {}), d.get("shard_file"), d.get("boxes"),
                   None if failure is None else Outcome(**failure))

    def shard_report(self) -> sharded.ShardReport:
        record = self.files.get(self.shard_file) if self.shard_file is not None else None
        return sharded.ShardReport(self.rank, self.shard_file, record, self.boxes)


@dataclass
class RankWrite:
    """One rank's own files of a save — its rank file (unless handed over to rank 0) and its
    shard file (sharded entries, split writes) — and the key of its report to rank 0."""

    rank: int
    step: int
    generation: int
    rank_file: bytes | None
    shard_tree: EncodedTree | None
    boxes: dict[str, list[Any]]
    report_key: str

    def run(self, storage: Storage, reports: Reports, failure: BaseException | None = None) -> None:
        """Write the files durably, then report them. A failure — this rank's since the capture
        (`failure`, not raised again) or the write's (raised) — is reported instead, so that
        rank 0 never waits for a report that will not come."""
        report = RankReport(self.rank, failure=None if failure is None else Outcome.failure(self.rank, failure))
        try:
            if failure is None:
                self._write_files(storage, report)
        except Exception as e:
            report = RankReport(self.rank, failure=Outcome.failure(self.rank, e))
            raise
        finally:
            reports.post(self.report_key, report.to_json())

    def _write_files(self, storage: Storage, report: RankReport) -> None:
        base = mf.step_dir(self.step)
        if self.rank_file is not None:
            name = mf.rank_file(self.rank, self.generation)
            report.files[name] = _write(storage, f"{base}/{name}", [self.rank_file])
            faults.point("save/rank-files-written", step=self.step, rank=self.rank)
        if self.shard_tree is not None:
            name = sharded.shard_file(self.rank, self.generation)
            report.files[name] = write_tree(storage, f"{base}/{name}", self.shard_tree)
            report.shard_file, report.boxes = name, self.boxes
            faults.point("save/shards-written", step=self.step, rank=self.rank)


# -- save -------------------------------------------------------------------------------------

@dataclass
class _Captured:
    rank_file: bytes = b""
    replicated: EncodedTree | None = None   # rank 0
    shards: sharded.LocalShards | None = None  # every rank, when the state has sharded entries
    generation: int | None = None            # rank 0: the lease generation every rank's files carry
    digests: dict[str, str] = field(default_factory=dict)  # replicated values, compared across ranks


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
    report_keys: list[str]   # [] when the rank files are handed over to rank 0
    own_write: RankWrite | None
    capture_s: float


def stage_save(coord: Coordinator, *args: Any, **options: Any) -> tuple[StagedSave | None, RankWrite | None]:
    """Phases capture and agree, and the gather where the rank files are handed over (call on
    every rank; the arguments are capture_save's). Rank 0 gets the StagedSave; every rank the
    RankWrite of its own files (None when it has none: rank files handed over, nothing sharded)."""
    captured = capture_save(coord, *args, **options)
    return gather_save(coord, captured), captured.own_write


def capture_save(coord: Coordinator, storage: Storage, entries: list[Entry], step: int,
                 epoch: int | None, metric: float | None, run_id: str,
                 staging: StagingPool | None, replaceable: "ReplacePolicy | None" = None,
                 take_lease: Callable[[], Lease] | None = None,
                 save_seq: int = 0, split_writes: bool = False,
                 durable: Storage | None = None,
                 prepare: Callable[[], None] | None = None, handover: bool = False,
                 memory_only: bool = False) -> CapturedSave:
    """Phases capture and agree (call on every rank; one exchange): every rank has captured
    and all hold the same step and epoch, or every rank raises the same error. With two tiers
    `storage` is the local one, the `durable` root is the one checked to be this run's, and rank 0
    runs `prepare` first (it clears another job's steps out of the local tier). With `handover`
    (the same on every rank) the rank files go to rank 0 in the gather instead of being written
    by their ranks. A `memory_only` save (memory_tier with disk_every) writes nothing to `storage`:
    its step there is not checked."""
    t0 = time.perf_counter()
    split = split_writes and coord.world_size > 1
    def capture() -> _Captured:
        consolidate_zero_optimizers(entries)  # first: a collective of every rank, before any can fail
        local = _capture_phase(coord, storage, entries, step, epoch, staging, replaceable, take_lease, split,
                               durable, prepare, handover, memory_only)
        if coord.world_size > 1:  # a module's GPU parameters at a manager's first save only (a device sync)
            local.digests = replicated_digests(entries, gpu_modules=save_seq <= 1, save_seq=save_seq)
        faults.point("save/captured", step=step, rank=coord.rank)
        return local

    def described(local: _Captured) -> dict[str, Any]:
        return {"rank": coord.rank, "step": step, "epoch": epoch, "host": hostname(), "pid": os.getpid(),
                "per_rank_entries": sorted(e.key for e in entries if e.scope == PER_RANK),
                "entries": sorted([e.key, e.scope, e.kind] for e in entries),
                "generation": local.generation, "async": staging is not None, "replicated": local.digests,
                "save_seq": save_seq}

    local, outcomes = run_phase(coord, "save/capture", f"save of step {step}", capture, described)
    infos = [o.info for o in outcomes]
    _check_same_progress(infos, f"save of step {step}")
    check_replicated_agree([i["replicated"] for i in infos], f"save of step {step}")
    # Rank 0's count names the reports: after ranks met in different calls (one in save, another
    # in load_latest) the counts differ, and the next save waited out its timeout for a report
    # under another name, then left its files behind.
    agreed_seq = infos[0].get("save_seq", save_seq)
    keys = [f"distckpt/{run_id}/save-{agreed_seq}/files/rank-{r}" for r in range(coord.world_size)]
    own_write = _own_write(coord.rank, step, local, infos, keys[coord.rank], handover)
    kinds = {e.key: {"scope": e.scope, "kind": e.kind} for e in entries}
    return CapturedSave(step, epoch, metric, run_id, coord.rank, local, infos, kinds,
                        [] if own_write is None else keys, own_write, time.perf_counter() - t0)


def is_zero_optimizer(obj: Any) -> bool:
    """torch.distributed.optim.ZeroRedundancyOptimizer (or a subclass), told apart without
    importing torch.distributed.optim."""
    return has_class_named(obj, "ZeroRedundancyOptimizer", "torch.distributed.optim")


def consolidate_zero_optimizers(entries: list[Entry]) -> None:
    """Every ZeroRedundancyOptimizer in `state` gathers its shards on rank 0, which captures it.

    Its state_dict() is what its last consolidate_state_dict() gathered, however old: a loop that
    consolidated once and saved later wrote that step's weights with an earlier step's moments,
    and resumed into another run without a word (and one that never consolidated failed the
    save). Consolidating here, on every rank at the same point of the collective save, makes the
    saved state the current one. The optimizer's own group must hold rank 0."""
    import torch.distributed as dist

    for e in entries:
        if not is_zero_optimizer(e.target):
            continue
        if e.scope == PER_RANK:  # its state_dict() exists on the rank it was consolidated to only
            raise UnstorableValueError(
                f"state[{e.key!r}] is a ZeroRedundancyOptimizer inside per_rank(...): it shards its state "
                "across the ranks itself, and each save gathers it to rank 0; put it in `state` as it is")
        group = getattr(e.target, "process_group", None)
        try:
            to = dist.get_group_rank(group, 0) if group is not None and dist.is_initialized() else 0
        except (ValueError, RuntimeError) as err:
            raise UnstorableValueError(
                f"state[{e.key!r}] is a ZeroRedundancyOptimizer over a process group without rank 0, "
                "which writes the replicated state: build it over a group holding rank 0 (the default group)") from err
        e.target.consolidate_state_dict(to=to)


def _own_write(rank: int, step: int, local: _Captured, infos: list[dict[str, Any]], key: str,
               handover: bool) -> RankWrite | None:
    """This rank's own files: its rank file (unless handed over) and its shard file, named with
    rank 0's lease generation (agreed in the capture), so a stale writer's never collide."""
    if handover and local.shards is None:
        return None
    tree = local.shards.file_tree(rank) if local.shards is not None else None
    boxes = {} if local.shards is None else \
        {name: [local.shards.offsets[name], list(t.shape)] + ([local.shards.digests[name]]
                                                               if name in local.shards.digests else [])
         for name, t in local.shards.pieces.items()}
    return RankWrite(rank, step, int(infos[0]["generation"]), None if handover else local.rank_file, tree,
                     boxes, key)


def gather_save(coord: Coordinator, captured: CapturedSave,
                failure: BaseException | None = None) -> StagedSave | None:
    """What rank 0 writes and commits (call on every rank, after capture_save): the StagedSave on
    rank 0, None elsewhere. No exchange unless the rank files are handed over to rank 0; then one
    gather, where a rank that failed since the capture sends its `failure` instead of its file:
    rank 0's StagedSave lists it (`failures`; raise_gathered_failures), so that rank 0 writes
    nothing and shares the error. `coord` may be a group of its own (the background writer's),
    as the captured save no longer touches live state."""
    t1 = time.perf_counter()
    local = captured.local
    handed_over: dict[int, bytes] = {}
    failures: list[Outcome] = []
    if not captured.report_keys:
        mine = Outcome.failure(captured.rank, failure) if failure is not None else Outcome(captured.rank)
        gathered = coord.gather({"file": local.rank_file if failure is None else b"", "outcome": mine},
                                "save/gather")
        if gathered is not None:
            handed_over = {rank: g["file"] for rank, g in enumerate(gathered)}
            failures = [g["outcome"] for g in gathered if not g["outcome"].ok]
    if captured.rank != 0:
        return None
    assert local.replicated is not None  # rank 0 invariant, not user input
    staged = StagedSave(captured.step, captured.epoch, captured.metric, captured.run_id, local.replicated,
                        handed_over, captured.infos, captured.kinds,
                        {"capture_s": captured.capture_s, "gather_s": time.perf_counter() - t1},
                        report_keys=captured.report_keys, failures=failures)
    if local.shards is not None:
        staged.shard_meta = local.shards.meta
    return staged


def raise_gathered_failures(coord: Coordinator, staged: StagedSave | None) -> None:
    """Rank 0: the error naming every rank that failed after the capture (gather_save)."""
    if staged is not None and staged.failures:
        raise_if_failed(coord, staged.failures, f"save of step {staged.step}")


def _capture_phase(coord: Coordinator, storage: Storage, entries: list[Entry], step: int,
                   epoch: int | None, staging: StagingPool | None, replaceable: "ReplacePolicy | None",
                   take_lease: Callable[[], Lease] | None, split: bool,
                   durable: Storage | None = None, prepare: Callable[[], None] | None = None,
                   handover: bool = False, memory_only: bool = False) -> _Captured:
    """This rank's capture: RNG first, then its per-rank entries; rank 0 the replicated ones."""
    out = _Captured()
    for entry in entries:  # a loader's first iterator draws: before the streams are recorded
        entry.kind_spec.prepare_capture(entry)
    rng = capture_process_rng()  # first: nothing below may draw before it is recorded
    if coord.rank == 0:
        if prepare is not None:
            prepare()
        check_root_is_ours(durable if durable is not None else storage, replaceable or ReplacePolicy())
        if not memory_only:
            check_step_is_free(storage, step, replaceable or ReplacePolicy())
        if take_lease is not None:
            out.generation = take_lease().generation  # every rank's own files are named with it
    own = {"step": step, "epoch": epoch, "rank": coord.rank, "world_size": coord.world_size,
           "rng": rng,
           "entries": {e.key: capture_entry(e) for e in entries if e.scope == PER_RANK}}
    rank_buffers = capture_rank_buffers(entries) if coord.world_size > 1 else {}
    if coord.world_size > 1:
        own["buffers"] = rank_buffers
    rank_tree = _encode_checked(own, ("per-rank state",), stage=True, placed=_handed_over(("per-rank state",), entries))
    out.rank_file = b"".join(safetensors_chunks(rank_tree))
    stage: bool | StagingPool = staging if staging is not None else False
    if split or any(e.scope == SHARDED for e in entries):
        out.shards = sharded.LocalShards(stage, coord.rank, coord.world_size)
        if split:  # the buffers captured for the rank file just above
            out.shards.rank0_regions = {key for buffers in rank_buffers.values()
                                        for key in map(region_key, buffers.values()) if key is not None}
    if coord.rank == 0:
        tree: dict[str, Any] = {"step": step, "epoch": epoch,
                "entries": {e.key: capture_entry(e) for e in entries if e.scope in (REPLICATED, SHARDED)}}
        try:
            out.replicated = _encode_checked(tree, ("replicated",), entries, stage=stage, shards=out.shards,
                                             split=split, placed=_handed_over(("replicated",), entries))
        except UnstorableValueError as e:
            if coord.world_size > 1:  # "failed on rank(s) [0]" read as if the other ranks' copies were fine
                notes = [*getattr(e, "__notes__", []),  # add_note from Python 3.11; the outcome reads these
                         "a replicated entry: every rank holds it, rank 0 checks and writes it for all"]
                e.__notes__ = notes  # type: ignore[attr-defined]
            raise
    elif out.shards is not None:
        scopes = (REPLICATED, SHARDED) if split else (SHARDED,)
        tree = {"entries": {e.key: capture_entry(e) for e in entries if e.scope in scopes}}
        if split:
            _check_storable(tree["entries"], entries)
        with _named_by_the_users_path(("replicated",), entries):
            encode_tree(tree, ("replicated",), shards=out.shards, split=split)  # the same names as rank 0's
    if out.shards is not None:
        out.shards.sync()
    return out


def _handed_over(path: tuple[Any, ...], entries: Sequence[Entry]) -> frozenset[tuple[Any, ...]]:
    """The entries whose restore hands the loaded tensors over as they are (refilled into a value,
    given to load_state_dict): their tensors record their device and go back to it, as torch.load
    does. A module's or a tensor entry's are copied into the live tensors, which keep theirs."""
    return frozenset((*path, "entries", e.key) for e in entries if e.kind_spec.handed_over)


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
    options["depth_base"] = len(path) + 2  # (file, "entries", key, "state"): the limit counts from state[key]
    if options.get("shards") is not None:
        _check_storable(tree["entries"], entries)
        with _named_by_the_users_path(path, entries):  # the shard sink's own refusals (placements)
            return encode_tree(tree, path, **options)
    try:
        return encode_tree(tree, path, **options)
    except UnstorableValueError as e:
        internal = e  # names our tree's path: not chained to the user's error below
    _check_storable(tree["entries"], entries)  # raises the same refusal, by the user's key path
    raise internal


@contextlib.contextmanager
def _named_by_the_users_path(path: tuple[Any, ...], entries: Sequence[Entry]) -> Iterator[None]:
    """An UnstorableValueError raised inside the encoder names our tree's path
    (state['replicated']['entries']['model']['state'][...]): re-raised naming the user's
    (state['model'][...])."""
    try:
        yield
    except UnstorableValueError as e:
        message = str(e)
        for entry in entries:
            message = message.replace(key_path((*path, "entries", entry.key, "state")), key_path((entry.key,)))
        if message == str(e):
            raise
        raise UnstorableValueError(message) from e


def _check_storable(captured: dict[str, Any], entries: Sequence[Entry] = ()) -> None:
    """Refuse unstorable values with the user's key path (state['config'][...]), not ours.
    DTensors are accepted only inside sharded entries (a sharded module or its optimizer). An
    entry's own key names its tensors too, so it must be UTF-8 text as any key inside must."""
    sharded_keys = {e.key for e in entries if e.scope == SHARDED}
    for key, entry in captured.items():
        check_key_text(key, ())
        sink = _NoShards() if key in sharded_keys else None
        encode_tree(entry["state"], (key,), shards=sink)  # validation only: no tensor is copied


def _check_same_progress(infos: list[dict[str, Any]], what: str) -> None:
    modes = {i["async"] for i in infos}
    if len(modes) > 1:  # the two take different paths from here on: the ranks would wait on each other
        table = ", ".join(f"rank {r}: async_save={i['async']}" for r, i in enumerate(infos))
        raise RankDisagreementError(f"{what}: ranks disagree on async_save — {table}; build every rank's "
                                    "CheckpointManager with the same arguments")
    _check_same_entries(infos, what)
    views = {(i["step"], i["epoch"]) for i in infos}
    if len(views) > 1:
        table = ", ".join(f"rank {r}: step {i['step']} epoch {i['epoch']}" for r, i in enumerate(infos))
        raise RankDisagreementError(f"{what}: ranks disagree on (step, epoch) — {table}; "
                                    "every rank must call save() with the same step and epoch")


def _check_same_entries(infos: list[dict[str, Any]], what: str) -> None:
    """Every rank saves the same keys of `state`, each of one kind. A module or per_rank entry only
    some ranks hold was left out of the checkpoint (rank 0 writes the replicated ones; a rank's own
    were never looked for), and every load then refused it. A per_rank entry's kind may differ
    between ranks: each rank writes and restores its own (nanoGPT's best_val_loss is a float on
    every rank until rank 0's first evaluation makes it a 0-d tensor there)."""
    tables = [{key: (scope, kind if scope != PER_RANK else "") for key, scope, kind in i.get("entries", [])}
              for i in infos]
    if all(t == tables[0] for t in tables[1:]):
        return
    differences = []
    for key in sorted({k for t in tables for k in t}):
        held = {r: t.get(key) for r, t in enumerate(tables)}
        if len(set(held.values())) == 1:
            continue
        lacking = [r for r, v in held.items() if v is None]
        kinds = sorted({f"{v[1]} ({v[0]})" for v in held.values() if v is not None})
        differences.append(f"state[{key!r}] " + (f"missing on rank(s) {lacking}" if lacking else "")
                           + (f"{'; ' if lacking else ''}held as {' / '.join(kinds)} by different ranks"
                              if len(kinds) > 1 else ""))
    raise RankDisagreementError(f"{what}: ranks save different entries — {'; '.join(differences[:8])}; every rank "
                                "must pass the same keys of `state` (a value some ranks keep for themselves: "
                                "wrap it in distckpt.per_rank(...) on every rank)")


def write_and_commit(storage: Storage, staged: StagedSave, versions: Callable[[], dict[str, Any]], lease: Lease,
                     reports: Reports | None = None, content: ContentTable | None = None) -> str:
    """Phases write and commit (rank 0). Returns the manifest digest. Never touches other steps
    (except a zombie's commit of this same step, which it replaces: see fencing.py). With sharded
    entries, `reports` brings every rank's shard report before the manifest is written.
    `versions` is called only then, after the payload is written: the manager's reads the
    environment from a git child that runs meanwhile (versions.VersionsProbe)."""
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


def _write_and_commit(storage: Storage, staged: StagedSave, versions: Callable[[], dict[str, Any]], lease: Lease,
                      reports: Reports | None, content: ContentTable | None = None) -> str:
    t0 = time.perf_counter()
    faults.point("save/gathered", step=staged.step, rank=0)
    fencing.check_current(storage, lease)
    base = mf.step_dir(staged.step)
    policy = ReplacePolicy(lease.floor, lease.generation)
    gen = lease.generation
    replicated = staged.replicated
    split = content.split_present(replicated.tensors, storage, staged.step) if content is not None else None
    if split is not None:  # incremental: what an earlier commit holds is referenced, not written
        replicated = EncodedTree(replicated.node, split.own, written=replicated.written)
        incremental.check_not_overwriting_shared(storage, f"{base}/{mf.replicated_file(gen)}", staged.step)
    files = {mf.replicated_file(gen): write_tree(storage, f"{base}/{mf.replicated_file(gen)}", replicated)}
    faults.point("save/replicated-written", step=staged.step, rank=0)
    for rank, data in staged.handed_over.items():
        files[mf.rank_file(rank, gen)] = _write(storage, f"{base}/{mf.rank_file(rank, gen)}", [data])
    if staged.handed_over:
        faults.point("save/rank-files-written", step=staged.step, rank=0)
    table = _collect_reports(staged, reports, files, gen, storage, base)
    # A superseded writer's commit of this step (see fencing.py) is taken down only now, every file
    # of this save durable beside it (the names carry the generation): until then it stays the
    # loader's last resort, should this writer die first.
    clear_step_dir(storage, staged.step, policy)
    t1 = time.perf_counter()
    data = manifest_bytes(staged, replicated, files, table, gen, versions,
                          incremental.manifest_fields(split) if split is not None else {})
    create_manifest(storage, base, data, gen, policy, staged.step)
    digest = mf.checksum_of(data)
    faults.point("save/manifest-written", step=staged.step, rank=0)
    signing.sign_step(storage, base, data)  # before the marker: a committed signed step has its signature
    fencing.check_current(storage, lease)  # last check before the point of no return
    create_marker(storage, mf.Marker(staged.step, digest, staged.run_id, gen), policy)
    _check_still_current(storage, lease, staged.step)
    if content is not None and split is not None:
        content.committed(split, f"{base}/{mf.replicated_file(gen)}", files[mf.replicated_file(gen)])
    staged.timings.update(write_s=t1 - t0, commit_s=time.perf_counter() - t1)
    faults.point("save/committed", step=staged.step, rank=0)
    return digest


def manifest_bytes(staged: StagedSave, replicated: EncodedTree, files: dict[str, Any], table: dict[str, Any] | None,
                   generation: int, versions: Callable[[], dict[str, Any]],
                   extra: dict[str, Any] | None = None) -> bytes:
    """The manifest of `staged` listing `files` (name -> record), as every tier commits it."""
    return mf.Manifest(
        step=staged.step, epoch=staged.epoch, metric=staged.metric, run_id=staged.run_id, generation=generation,
        created_unix=time.time(), world_size=staged.world_size, ranks=staged.ranks,
        entries=staged.entries, files=files, versions=versions(), sharded=table,
        payload_bytes=replicated.payload_bytes + sum(
            r["size"] for name, r in files.items() if name.startswith(sharded.SHARD_PREFIX)),
        **(extra or {}), **staged.manifest_extra).to_bytes()


def check_rank_reports(staged: StagedSave, got: list[RankReport], generation: int, where: str) -> dict[str, Any] | None:
    """Every rank's report of its own files checked (each names exactly its files); the chunk
    table of the sharded tensors, or None."""
    for rank, report in enumerate(got):
        _check_report(report, rank, generation, where)
    if not staged.shard_meta:
        return None
    return sharded.chunk_table(staged.shard_meta, [r.shard_report() for r in got], where)


def _collect_reports(staged: StagedSave, reports: Reports | None, files: dict[str, Any], generation: int,
                     storage: Storage, base: str) -> dict[str, Any] | None:
    """Wait for the report of every rank that writes its own files; add their files; return the
    chunk table of the sharded tensors (or None). A rank's failure fails the save, named."""
    where = f"{storage.url}/{base}"
    if not staged.report_keys:
        return None
    if reports is None:
        raise CoordinationError(f"{where}: the ranks' reports of their files are needed")
    got = [RankReport.from_json(d) for d in
           reports.collect(staged.report_keys, f"save of step {staged.step}: the ranks' reports of their files")]
    failed = [r.failure for r in got if r.failure is not None]
    if failed:
        raise error_of(failed, f"save of step {staged.step}: writing the ranks' own files")
    table = check_rank_reports(staged, got, generation, where)
    for report in got:
        files.update(report.files)
    _check_visible_to_the_committer(storage, base, got, where)
    return table


def _check_visible_to_the_committer(storage: Storage, base: str, reports: list[RankReport], where: str) -> None:
    """Every file the other ranks wrote is there for rank 0 to see (one listing), before the
    marker says the step is whole: ranks given directories that are not one storage (a node-local
    path per node) would otherwise commit steps no load can read."""
    written = {name for report in reports for name in report.files}
    if not written:
        return
    present = set(storage.list_files(base))
    missing = sorted(written - present)
    if missing and len(reports) == 1:  # rank 0 wrote them itself: the store's listing lags its writes
        raise StorageError(
            errno.EIO, f"{where}: {len(missing)} file(s) just written are not listed by the store "
            f"(first: {missing[0]}); nothing was committed. The storage's listing is not read-after-write "
            "consistent: a backend's list_files (its client's ls) must name every file written before it")
    if missing:
        raise RankDisagreementError(
            f"{where}: the ranks do not see one storage: {len(missing)} file(s) other ranks reported written are "
            f"not there for rank 0 (first: {missing[0]}); nothing was committed. Give every rank the same URL on "
            "storage all of them reach (a shared file system or an object store), or use local_dir for node-local "
            "disks (Two tiers)")


def _check_report(report: RankReport, rank: int, generation: int, where: str) -> None:
    """A report names exactly this rank's files of this generation (a mix-up is a bug, not a save)."""
    expected = {mf.rank_file(rank, generation)}  # reports come only where no rank file is handed over
    if report.shard_file is not None:
        expected.add(sharded.shard_file(rank, generation))
    if report.rank != rank or set(report.files) != expected:
        raise CoordinationError(f"{where}: rank {rank}'s report names {sorted(report.files)} (rank {report.rank}); "
                                f"expected {sorted(expected)}")
    for name in report.files:
        mf.check_relative_path(name, where)


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
    check = mf.Checksum(digest=signing.writes_digests(storage))
    storage.write_file(path, check.wrap(chunks))
    return check.record()


def share_outcome(coord: Coordinator, exc: BaseException | None, phase: str, what: str,
                  step: int | None = None) -> None:
    """Broadcast rank 0's outcome of a write; every rank raises the same error if it failed.
    If the broadcast itself fails (a rank slower than the timeout, or dead), the error says what
    each side knows: rank 0 whether it committed; the others that the step may or may not be."""
    def outcome() -> dict[str, Any]:
        if exc is not None:
            raise exc
        return {}

    try:
        run_on_root(coord, phase, what, outcome, exc)
    except CoordinationError as e:
        if getattr(e, "rank_tracebacks", None) is not None or step is None:
            raise  # rank 0's own error, shared: the outcome is known
        committed: bool | None
        if coord.rank == 0:
            committed = exc is None
            known = (f"step {step} IS committed (rank 0 finished its commit)" if committed else
                     f"step {step} is not committed ({type(exc).__name__}: {exc})")
        else:
            committed = None
            known = (f"rank 0's outcome did not arrive: step {step} may or may not be committed (it is if "
                     "rank 0 finished its commit; committed_steps() or a restart's load_latest tell)")
        error = CoordinationError(f"{what}: {known}; telling every rank failed: {e}. If rank 0's writes "
                                  "take longer than the timeout, raise timeout=")
        error.committed = committed  # type: ignore[attr-defined]  # what the exit line says (async_writer)
        raise error from e


# -- load -------------------------------------------------------------------------------------
