"""close() with disk_every: the newest save, committed to memory only, written to the URL.

A job that ends cleanly must not keep its final state in shared memory alone (a VM's memory
goes with the VM). The step is copied as it was committed in memory, byte for byte: each node's
lowest rank writes its node's ranks' files from its node's copy (verified against the manifest
as they are read), rank 0 also the replicated file; once every node has written, rank 0 checks
the fence and commits with the same manifest, signature and marker (the commit rule of every
tier: marker last). Collective; a failure is the same error on every rank, and nothing is
committed at the URL.
"""

from __future__ import annotations

from typing import Any

from distckpt.errors import CorruptCheckpointError
from distckpt.io import manifest as mf
from distckpt.io.signing import SIGNATURE
from distckpt.protocol import fencing
from distckpt.protocol.commit import ReplacePolicy, clear_step_dir, create_manifest, create_marker
from distckpt.protocol.coord import Coordinator, run_on_root, run_phase
from distckpt.protocol.fencing import Lease
from distckpt.state import sharded
from distckpt.storage import Storage

_SMALL = (mf.MANIFEST, mf.MARKER, SIGNATURE)


def flush_to_disk(tier: Any, coord: Coordinator, step: int, durable: Storage, lease: Lease | None,
                  policy: ReplacePolicy) -> None:
    """Commit memory-only `step` at `durable` from the nodes' memory copies (collective).
    `tier` is the manager's MemoryTier; `lease` and `policy` rank 0's."""
    what = f"close(): writing step {step}, saved to memory only, to {durable.url}"
    base = mf.step_dir(step)
    small: dict[str, bytes] = {}

    def write_node_files() -> None:
        if tier.leader(tier.node_of[coord.rank]) != coord.rank:
            return
        head = tier.memory.read_step(tier.memory.own, step, names=[])  # the marker and manifest, verified
        marker = mf.Marker.parse(head[mf.MARKER], f"{tier.memory.own.url}/{base}")
        listed = mf.Manifest.parse(head[mf.MANIFEST], marker, base).files
        names = [name for r in tier.ranks_of(tier.node_of[coord.rank])  # the node's ranks' own files
                 for name in (mf.rank_file(r, marker.generation), sharded.shard_file(r, marker.generation))
                 if name in listed]
        if coord.rank == 0:  # rank 0's node writes the replicated file, once
            names.append(mf.replicated_file(marker.generation))
        files = tier.memory.read_step(tier.memory.own, step, names, copy=False)  # each verified as it is read
        for name in names:
            durable.write_file(f"{base}/{name}", [files[name]])
        if coord.rank == 0:
            small.update({k: bytes(v) for k, v in files.items() if k in _SMALL})

    run_phase(coord, "memory/flush-files", what, write_node_files)

    def commit() -> dict[str, Any]:
        assert lease is not None  # rank 0 holds it: it committed the step in memory under it
        manifest = mf.Manifest.parse(small[mf.MANIFEST], mf.Marker.parse(small[mf.MARKER], base), base)
        missing = sorted(set(manifest.files) - set(durable.list_files(base)))
        if missing:
            raise CorruptCheckpointError(f"{durable.url}/{base}: {len(missing)} file(s) the nodes wrote are not "
                                         f"there for rank 0 (first: {missing[0]}); nothing was committed")
        fencing.check_current(durable, lease)
        clear_step_dir(durable, step, policy)
        create_manifest(durable, base, small[mf.MANIFEST], lease.generation, policy, step)
        if SIGNATURE in small:  # before the marker: a committed signed step has its signature
            durable.write_file(f"{base}/{SIGNATURE}", [small[SIGNATURE]])
        fencing.check_current(durable, lease)
        create_marker(durable, mf.Marker.parse(small[mf.MARKER], base), policy)
        return {}

    run_on_root(coord, "memory/flush-commit", what, commit)
