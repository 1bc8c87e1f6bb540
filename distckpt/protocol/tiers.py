"""Two tiers: a fast node-local root written at every save, the durable root every Nth save.

Both tiers are ordinary distckpt roots: the same layout, marker, checksums and commit rule, so a
local step directory copied anywhere is a valid checkpoint. They share one generation space:
the write lease is taken on the durable root (the one that outlives a VM), the local tier's
files and markers carry its generation, and a reader of either tier applies the durable root's
leases. So the zombie predicate (fencing.superseded_by) means the same on both tiers.

* `upload_step`: copies a committed local step to the durable root, every file re-verified
  against its checksum on the way (damaged local bytes are never made durable), manifest by
  exclusive create, marker last. An upload that stops half-way leaves no marker: not committed.
* `ship_to_nodes`: with several nodes, rank 0 (handed every rank's files in a gather) sends the
  committed step to one rank per other node, which commits it into its own `local_dir`.
* `local_candidates`: the steps every node holds committed locally (a collective), the only
  local steps a load may choose.

This module never imports torch.distributed: collectives go through the coordinator.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable

from distckpt.errors import (
    CheckpointFallbackWarning,
    ConfigError,
    CorruptCheckpointError,
    DistCkptError,
    DurableUploadWarning,  # noqa: F401  (re-exported where it was defined)
    MissingFileError,
    RunConflictError,
    shown,
    warn,
)
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.protocol import fencing
from distckpt.protocol.commit import ReplacePolicy, clear_step_dir, create_manifest, create_marker, list_committed, read_marker
from distckpt.protocol.coord import Coordinator, attempt_on_root, attempt_phase
from distckpt.protocol.fencing import Lease
from distckpt.runtime import faults
from distckpt.storage import Storage, local_path_of

log = logging.getLogger("distckpt")

LOCAL, DURABLE = "local", "durable"
NODE_ENV = "DISTCKPT_NODE"  # overrides the host name as a node's identity (containers, tests)



@dataclass(frozen=True)
class TierSettings:
    """The two-tier settings of a CheckpointManager; `local_dir` None means one tier."""

    local_dir: str | None = None
    durable_every: int = 10
    keep_local: int | None = None

    @classmethod
    def check(cls, url: str, local_dir: Any, durable_every: Any, keep_local: Any) -> "TierSettings":
        if local_dir is None:
            for name, value in (("durable_every", durable_every), ("keep_local", keep_local)):
                if value is not None:
                    raise ConfigError(f"{name}={shown(value)} needs local_dir= (the node-local tier it counts "
                                      "saves of); without local_dir every save goes to the URL")
            return cls()
        path = _local_path(local_dir)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"local_dir={shown(local_dir)} is a file: the local tier is a directory on node-local disk")
        url_path = local_path_of(url)
        if url_path is not None:
            _refuse_nesting(local_dir, path, url_path)
        every = 10 if durable_every is None else durable_every
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ConfigError(f"durable_every={shown(durable_every)}: must be an int >= 1 (every Nth save is also "
                              "made durable; 1: every save)")
        if keep_local is not None and (isinstance(keep_local, bool) or not isinstance(keep_local, numbers.Integral)
                                       or keep_local < 1):
            raise ConfigError(f"keep_local={shown(keep_local)}: must be a positive int or None (keep all)")
        return cls(path, int(every), None if keep_local is None else int(keep_local))


def _refuse_nesting(local_dir: Any, path: str, url_path: str) -> None:
    """The two tiers in one tree: each root's listing would see the other's steps as its own
    uncommitted leftovers (a local tier inside the URL was named by `distckpt gc URL` as an
    uncommitted step to remove, though it held the newest checkpoint)."""
    local, durable = os.path.realpath(path), os.path.realpath(url_path)
    if local == durable:
        raise ConfigError(f"local_dir={shown(local_dir)} is the checkpoint URL itself: the local tier must be "
                          "another directory, on node-local disk")
    if local.startswith(durable + os.sep) or durable.startswith(local + os.sep):
        inner = "inside the checkpoint URL" if local.startswith(durable + os.sep) else "around the checkpoint URL"
        raise ConfigError(f"local_dir={shown(local_dir)} is {inner} ({shown(url_path)}): each tier's retention and gc would "
                          "take the other's files for its own leftovers; give two directories neither of which "
                          "holds the other")


def _local_path(local_dir: Any) -> str:
    if isinstance(local_dir, os.PathLike):
        local_dir = os.fspath(local_dir)
    if not isinstance(local_dir, str) or not local_dir.strip() or "\0" in local_dir:
        raise ConfigError(f"local_dir={shown(local_dir)}: must be a directory path on node-local disk")
    if local_dir.startswith("file://"):
        host, _, path = local_dir[len("file://"):].partition("/")
        if host not in ("", "localhost"):  # file://otherhost/x landed in ./otherhost/x
            raise ConfigError(f"local_dir={shown(local_dir)}: file:// URLs name a local absolute path (file:///abs/path "
                              f"or file://localhost/abs/path), not the host {host!r}")
        if not path.strip():
            raise ConfigError(f"local_dir={shown(local_dir)}: names no directory; give a path on node-local disk")
        local_dir = "/" + path
    try:
        literal = local_path_of(local_dir)  # taken literally, as the URL's local path is
    except ConfigError:
        literal = None  # s3:/x, an fsspec chain: no local path either
    if literal is None:
        raise ConfigError(f"local_dir={shown(local_dir)}: must be a path on node-local disk, not a URL; the durable "
                          "tier is the first argument")
    return literal


def node_name() -> str:
    import socket

    return os.environ.get(NODE_ENV) or socket.gethostname()


@dataclass(frozen=True)
class Nodes:
    """Which rank runs on which node; the lowest rank of a node writes its local tier."""

    names: tuple[str, ...]  # by rank

    def leader_of(self, rank: int) -> int:
        return self.names.index(self.names[rank])

    @property
    def count(self) -> int:
        return len(set(self.names))

    def leaders(self) -> list[int]:
        return sorted({self.leader_of(r) for r in range(len(self.names))})


def upload_step(local: Storage, durable: Storage, step: int, lease: Lease) -> bool:
    """Make committed local `step` durable; returns False if it already was (same marker)."""
    base = mf.step_dir(step)
    where = f"{local.url}/{base}"
    marker = read_marker(local, step)
    manifest_bytes = local.read_bytes(f"{base}/{mf.MANIFEST}", mf._MAX_MANIFEST_BYTES)
    manifest = mf.Manifest.parse(manifest_bytes, marker, where)
    signing.check_step(local, base, manifest_bytes, manifest)  # with a verify key: never upload an untrusted step
    if _same_marker(durable, step, marker):
        return False
    policy = ReplacePolicy(lease.floor, lease.generation)
    fencing.check_current(durable, lease)
    for name, record in manifest.files.items():
        mf.check_relative_path(name, where)
        data = local.read_buffer(f"{base}/{name}")
        mf.verify_file(data, record, f"{where}/{name}", digest=signing.verifies(local))  # damaged local bytes never become durable
        durable.write_file(f"{base}/{name}", [memoryview(data)])
    signing.copy_signature(local, durable, base)  # before the marker, as the save wrote it
    faults.point("upload/files-written", step=step, rank=0)
    clear_step_dir(durable, step, policy)  # a superseded writer's commit: taken down only now (saving.py)
    create_manifest(durable, base, manifest_bytes, lease.generation, policy, step)
    fencing.check_current(durable, lease)  # last check before the durable commit
    create_marker(durable, marker, policy)
    return True


def _same_marker(storage: Storage, step: int, marker: mf.Marker) -> bool:
    try:
        return read_marker(storage, step) == marker
    except (MissingFileError, CorruptCheckpointError):
        return False


def committed_files(storage: Storage, step: int) -> dict[str, bytes]:
    """Every file of committed `step` (manifest and marker included), verified."""
    base = mf.step_dir(step)
    where = f"{storage.url}/{base}"
    marker = read_marker(storage, step)
    manifest_bytes = storage.read_bytes(f"{base}/{mf.MANIFEST}", mf._MAX_MANIFEST_BYTES)
    manifest = mf.Manifest.parse(manifest_bytes, marker, where)
    signing.check_step(storage, base, manifest_bytes, manifest)
    out = {mf.MANIFEST: manifest_bytes, mf.MARKER: marker.to_bytes()}
    for name, record in manifest.files.items():
        mf.check_relative_path(name, where)
        data = storage.read_buffer(f"{base}/{name}")
        mf.verify_file(data, record, f"{where}/{name}", digest=signing.verifies(storage))
        out[name] = bytes(data)
    try:  # the signature travels with the step (written before its marker by commit_files)
        out[signing.SIGNATURE] = storage.read_bytes(f"{base}/{signing.SIGNATURE}", signing.MAX_SIGNATURE_BYTES)
    except MissingFileError:
        pass
    return out


def commit_files(storage: Storage, step: int, files: dict[str, bytes], lease: Lease) -> None:
    """Write a shipped committed step into this node's local tier, marker last."""
    base = mf.step_dir(step)
    policy = ReplacePolicy(lease.floor, lease.generation)
    for name, data in files.items():
        if name not in (mf.MANIFEST, mf.MARKER):
            storage.write_file(f"{base}/{name}", [data])
    clear_step_dir(storage, step, policy)  # a superseded writer's commit: taken down only now (saving.py)
    create_manifest(storage, base, files[mf.MANIFEST], lease.generation, policy, step)
    create_marker(storage, mf.Marker.parse(files[mf.MARKER], f"{storage.url}/{base}"), policy)


def ship_to_nodes(coord: Coordinator, local: Storage, nodes: Nodes, step: int, lease: Lease | None,
                  leases: Callable[[], list[Lease]] | None = None) -> list[int]:
    """Rank 0's committed local `step` to the local tier of every other node (collective).
    Returns the ranks whose node failed to commit it (they then resume from elsewhere). With
    `leases` (rank 0: the durable root's, read at the first shipment), the receiving nodes also
    remove another job's steps from their local tier first."""
    def pack() -> dict[str, Any]:
        return {"files": committed_files(local, step), "lease": dataclasses.asdict(lease) if lease else None,
                "leases": [dataclasses.asdict(x) for x in leases()] if leases is not None else None}

    shipped, _ = attempt_on_root(coord, f"tiers/ship step {step}", pack)

    def receive() -> None:
        if not shipped.ok:
            raise OSError(f"{shipped.error_type}: {shipped.message}")
        if coord.rank != 0 and nodes.leader_of(coord.rank) == coord.rank and nodes.names[coord.rank] != nodes.names[0]:
            payload = shipped.info
            if payload.get("leases") is not None:
                remove_foreign(local, [Lease(**d) for d in payload["leases"]], coord.rank)
            commit_files(local, step, payload["files"], Lease(**payload["lease"]))

    _, _, outcomes = attempt_phase(coord, f"tiers/shipped step {step}", receive)
    failed = [o.rank for o in outcomes if not o.ok]
    if failed and coord.rank == 0:
        log.warning("rank 0: step %d is not on the local tier of rank(s) %s' node(s) (%s); a resume needs it on "
                    "every node, so it would load an older step or the durable tier", step, failed,
                    "; ".join(str(o.message) for o in outcomes if not o.ok))
    return failed


def local_steps(storage: Storage, rank: int) -> list[int]:
    """This node's committed local steps; an unreadable local dir holds none (with a warning)."""
    try:
        return list_committed(storage)
    except (OSError, DistCkptError) as e:
        log.warning("rank %d: cannot list the local tier %s (%s); treating it as empty", rank, storage.url, e)
        return []


def owned(marker: mf.Marker, leases: list[Lease]) -> bool:
    """Written by a job of this durable root: a lease there names the marker's writer."""
    return any(lease.generation == marker.generation and lease.run_id == marker.run_id for lease in leases)


def foreign_steps(storage: Storage, steps: list[int], leases: list[Lease]) -> list[int]:
    """The steps whose marker no lease of the durable root names (another job's, or for another
    URL). An unreadable marker is not called foreign: the loader reports it as damaged."""
    out = []
    for step in steps:
        try:
            if not owned(read_marker(storage, step), leases):
                out.append(step)
        except (OSError, DistCkptError):
            continue
    return out


def remove_foreign(storage: Storage, leases: list[Lease], rank: int) -> list[int]:
    """Before a job's first commit into its local tier: remove the committed steps another job
    left there (marker first). No job of this durable root can ever load them, and kept they
    would collide with this job's step numbers and retention."""
    from distckpt.protocol.retention import delete_checkpoint

    present = local_steps(storage, rank)
    if present and not leases:
        raise RunConflictError(
            f"rank {rank}: the local tier {storage.url} holds committed steps {present[:10]}, and the durable root "
            "holds no lease at all: either the URL is not the one this local_dir was written for (a mount missing, "
            "a typo), or this local_dir belongs to another job; check the URL, or give this job another local_dir "
            "(or remove that one)")
    doomed = foreign_steps(storage, present, leases)
    for step in doomed:
        delete_checkpoint(storage, step)
    if doomed:
        log.warning("rank %d: removed steps %s from the local tier %s: they were written by another job (no "
                    "lease of the durable root names their writer); a local_dir belongs to one job",
                    rank, doomed, storage.url)
    return doomed


def common_local_steps(coord: Coordinator, storage: Storage, leases: list[Lease] | None = None) -> list[int]:
    """Steps committed on the local tier of every rank's node, newest first (collective). With the
    durable root's `leases`, another job's steps are left out, with a warning; when the durable
    root holds no lease at all, local steps are not taken for another job's (the URL may be a
    mount that is missing, and removing them would lose the newest state): RunConflictError on
    every rank, saying what to check."""
    mine = local_steps(storage, coord.rank)
    conflict = None
    if leases is not None:
        foreign = foreign_steps(storage, mine, leases)
        if foreign and not leases:
            conflict = (f"rank {coord.rank}: the local tier {storage.url} holds committed steps {foreign[:10]}, and the "
                        "durable root holds no lease at all: either the URL is not the one this local_dir was "
                        "written for (a mount missing, a typo), or this local_dir belongs to another job; check the "
                        "URL, or give this job another local_dir (or remove that one)")
        elif foreign:
            message = (f"rank {coord.rank}: the local tier {storage.url} holds steps {foreign[:10]} written by "
                       "another job (no lease of the durable root names their writer); they are skipped and "
                       "removed at this job's first save. Give each job its own local_dir")
            warn(message, CheckpointFallbackWarning)
            mine = [s for s in mine if s not in foreign]
    views = coord.all_gather({"steps": mine, "conflict": conflict}, "load/local-steps")
    conflicts = [v["conflict"] for v in views if v["conflict"]]
    if conflicts:
        raise RunConflictError("; ".join(conflicts))
    common = set(views[0]["steps"]).intersection(*(set(v["steps"]) for v in views[1:]))
    return sorted(common, reverse=True)


def merge_candidates(local: list[int], durable: list[int], step: int | None) -> list[tuple[int, str]]:
    """(step, tier) to try in order: newest step first; of one step, the local copy first."""
    pairs = [(s, LOCAL) for s in local] + [(s, DURABLE) for s in durable]
    if step is not None:
        pairs = [p for p in pairs if p[0] == step]
    return sorted(pairs, key=lambda p: (-p[0], p[1] != LOCAL))
