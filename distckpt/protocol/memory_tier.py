"""The memory tier, one node's side: where its copies live in shared memory, and how they commit.

A node's memory root is a directory in shared memory (``/dev/shm``: its files outlive the worker
processes, so torchrun's restart of the same node finds them), an ordinary distckpt root per
area, written with the same commit rule as every tier (files, manifest, COMMITTED marker last,
each file checked against the manifest's checksum when it is read back):

    <memory root>/own/step-N/...             this node's copy: the replicated file, the node's
                                             ranks' own files, the manifest and marker of step N
    <memory root>/peer/node-K/step-N/...     a partner copy for node K: node K's ranks' own files,
                                             the manifest and marker of step N

The memory root is ``/dev/shm/distckpt/<key>`` where the key is made of a hash of the job's URL
and the node's rank (torchrun's GROUP_RANK), or DISTCKPT_MEMORY_DIR where that is set (read
here, at construction only): two torchrun agents on one machine then act as two nodes.

This module never imports torch.distributed: the exchanges are memory_copies.py's.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import numbers
import os
import shutil
from dataclasses import dataclass
from typing import Any

from distckpt.errors import ConfigError, DistCkptError, MemoryTierFullError, shown
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.protocol.commit import ReplacePolicy, list_committed, read_marker, read_verified_manifest
from distckpt.protocol.fencing import Lease
from distckpt.protocol.tiers import commit_files
from distckpt.runtime import faults
from distckpt.storage import Storage, open_storage

log = logging.getLogger("distckpt")

MEMORY_DIR_ENV = "DISTCKPT_MEMORY_DIR"  # this node's memory root, instead of /dev/shm/distckpt/<key>
FREE_BYTES_ENV = "DISTCKPT_MEMORY_FREE_BYTES"  # the free shared memory counted at most
SHM_ROOT = "/dev/shm/distckpt"
OWN, PEER, INCOMING = "own", "peer", "incoming"
JOB_FILE = "JOB"  # the URL of the job whose copies a memory root holds
# Headroom left free in shared memory besides the step being written: the rest of the node (the
# job's own /dev/shm users, NCCL, DataLoader workers' shared tensors) must not be starved by it.
HEADROOM_BYTES = 64 << 20


@dataclass(frozen=True)
class MemorySettings:
    """The memory tier's settings; `enabled` False means no memory tier."""

    enabled: bool = False
    every: int = 1
    keep: int = 2
    root: str = ""  # this node's memory root (a directory in shared memory)
    node: int = 0   # this node's rank (torchrun's GROUP_RANK)
    free_limit: int | None = None  # DISTCKPT_MEMORY_FREE_BYTES: the free shared memory counted at most
    disk_every: int = 1  # every Nth save is written to disk too; the others are committed to memory only
    job: str = ""  # the job's URL: a memory root holds one job's copies (NodeMemory.claim)

    @classmethod
    def check(cls, url: str, memory_tier: Any, memory_every: Any, keep_memory: Any,
              disk_every: Any = None) -> "MemorySettings":
        if not isinstance(memory_tier, bool):
            raise ConfigError(f"memory_tier={shown(memory_tier)}: must be True or False")
        if not memory_tier:
            for name, value in (("memory_every", memory_every), ("keep_memory", keep_memory),
                                ("disk_every", disk_every)):
                if value is not None:
                    raise ConfigError(f"{name}={shown(value)} needs memory_tier=True (the tier in shared memory "
                                      "it sets); without it no save is kept in memory")
            return cls()
        every = _positive("memory_every", 1 if memory_every is None else memory_every,
                          "every Nth save is also committed to memory; 1: every save")
        keep = _positive("keep_memory", 2 if keep_memory is None else keep_memory,
                         "the newest steps kept in memory on each node")
        disk = _positive("disk_every", 1 if disk_every is None else disk_every,
                         "every Nth save is written to disk too, the others to memory only; 1: every save")
        if disk > 1 and every > 1:
            raise ConfigError(f"disk_every={disk} with memory_every={every}: a save that is neither a memory save nor "
                              "a disk save would be lost; with disk_every every save goes to memory (memory_every=1)")
        node = node_rank()
        return cls(True, every, keep, memory_root(url, node), node, _free_limit(), disk, url)


    def shared(self) -> dict[str, Any]:
        """The settings every rank must share (compared when the managers are built)."""
        return {"memory_tier": self.enabled, "memory_every": self.every, "keep_memory": self.keep,
                "disk_every": self.disk_every}


def _positive(name: str, value: Any, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{name}={shown(value)}: must be an int >= 1 ({why})")
    return int(value)


def node_rank() -> int:
    """This node's rank in the job: torchrun's GROUP_RANK (0 without torchrun)."""
    raw = os.environ.get("GROUP_RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"GROUP_RANK={shown(raw)}: torchrun sets it to the node's rank, an int") from None


def _free_limit() -> int | None:
    """DISTCKPT_MEMORY_FREE_BYTES: count at most this much shared memory as free (a node with
    little memory, simulated; a node that shares /dev/shm with other work, bounded)."""
    raw = os.environ.get(FREE_BYTES_ENV)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{FREE_BYTES_ENV}={shown(raw)}: must be a number of bytes >= 0")
    return value


def memory_root(url: str, node: int) -> str:
    """This node's memory root: DISTCKPT_MEMORY_DIR, else one per (job URL, node) in /dev/shm."""
    override = os.environ.get(MEMORY_DIR_ENV)
    if override:
        if not os.path.isabs(override):
            raise ConfigError(f"{MEMORY_DIR_ENV}={shown(override)}: must be an absolute directory path (in shared "
                              "memory, e.g. under /dev/shm)")
        return override
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    return f"{SHM_ROOT}/{key}-node{node}"


class NodeMemory:
    """One node's memory root: its own copies and the partner copies it keeps for another node."""

    def __init__(self, settings: MemorySettings, trust: signing.Trust | None = None) -> None:
        self.settings = settings
        self.root = settings.root
        self.trust = trust  # signing_key / verify_key: a memory copy is signed and verified as any tier
        self.own = self._open(f"{self.root}/{OWN}")
        self._peers: dict[int, Storage] = {}

    def claim(self) -> str | None:
        """Why this node cannot use its memory root (None: it can): a root that is not a
        directory, or one holding another job's copies (two jobs given one DISTCKPT_MEMORY_DIR
        would prune and load each other's steps). The first job to use a root records its URL."""
        root, job = self.root, self.settings.job
        if os.path.lexists(root) and not os.path.isdir(root):
            return f"the memory root {root} is not a directory"
        path = os.path.join(root, JOB_FILE)
        try:
            os.makedirs(root, exist_ok=True)
            try:
                with open(path, encoding="utf-8") as f:
                    holder = f.read(4096)
            except FileNotFoundError:
                with open(f"{path}.{os.getpid()}", "w", encoding="utf-8") as f:
                    f.write(job)
                os.replace(f"{path}.{os.getpid()}", path)  # ranks of one node race here with the same text
                return None
        except OSError as e:
            return f"the memory root {root} cannot be used: {e}"
        if holder != job:
            return (f"the memory root {root} holds the copies of another job ({holder}): give each job its own "
                    f"{MEMORY_DIR_ENV} (or leave it unset: one per job URL and node), or remove {root} if that job is over")
        return None

    def _open(self, root: str) -> Storage:
        storage = open_storage(root)
        signing.attach(storage, self.trust)
        return storage

    def peer(self, node: int) -> Storage:
        """The area holding node `node`'s partner copies."""
        if node not in self._peers:
            self._peers[node] = self._open(f"{self.root}/{PEER}/node-{node}")
        return self._peers[node]

    def peer_nodes(self) -> list[int]:
        """The nodes this node holds partner copies for (from the directory names)."""
        try:
            names = os.listdir(f"{self.root}/{PEER}")
        except OSError:
            return []
        out = []
        for name in names:
            if name.startswith("node-") and name[5:].isdigit():
                out.append(int(name[5:]))
        return sorted(out)

    def steps(self, storage: Storage) -> list[int]:
        """The committed steps of one area, newest first; an unreadable area holds none."""
        try:
            return list_committed(storage)
        except (OSError, DistCkptError) as e:
            log.warning("the memory tier's %s cannot be listed (%s); treating it as empty", storage.url, e)
            return []

    def check_room(self, own_bytes: int, peer_bytes: int, step: int) -> None:
        """Refuse, naming the sizes, a step that would not fit in shared memory: a full tmpfs fails a
        write with ENOSPC at best, and a bus error in a process that maps a file of it at worst."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # the job's state: not for other users of the node
        free = shutil.disk_usage(self.root).free
        if self.settings.free_limit is not None:
            free = min(free, self.settings.free_limit)
        needed = own_bytes + peer_bytes + HEADROOM_BYTES
        if needed > free:
            raise MemoryTierFullError(
                errno.ENOSPC,
                f"the memory tier at {self.root} has {_mib(free)} free, and step {step} needs {_mib(needed)} there "
                f"(this node's copy {_mib(own_bytes)} + the partner copy it keeps for another node "
                f"{_mib(peer_bytes)} + {_mib(HEADROOM_BYTES)} headroom); nothing was written to memory. Lower "
                "keep_memory, give the node more shared memory (docker --shm-size, a larger /dev/shm), or save "
                "without memory_tier=True")

    def area(self, key: str) -> Storage:
        """An area by its key: OWN, or "peer/node-K"."""
        return self.own if key == OWN else self.peer(int(key.rsplit("-", 1)[1]))

    def incoming(self, key: str, step: int) -> str:
        """Where files received for an area's `step` wait, outside the area, until they are
        committed into it (a partner copy being restored: until they are verified)."""
        return f"{self.root}/{INCOMING}/{key}/{mf.step_dir(step)}"

    def receive_into(self, key: str, step: int, sizes: list[tuple[str, int]], fresh: bool = True) -> dict[str, Any]:
        """Files of these sizes made in the area's incoming directory (fresh: stale ones removed
        first), each mapped writable: the buffers a transfer receives into, straight into shared memory."""
        where = self.incoming(key, step)
        if fresh:
            shutil.rmtree(where, ignore_errors=True)
        out: dict[str, Any] = {}
        for name, size in sizes:
            mf.check_relative_path(name, where)
            path = f"{where}/{name}"
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(path, "w+b") as f:
                f.truncate(size)
                out[name] = mmap.mmap(f.fileno(), size) if size else bytearray()
        return out

    def drop_incoming(self, key: str, step: int) -> None:
        shutil.rmtree(self.incoming(key, step), ignore_errors=True)

    def commit(self, storage: Storage, step: int, files: dict[str, bytes], lease: Lease, rank: int,
               placed: str | None = None) -> None:
        """Commit `files` (manifest and marker among them) as `step` of one area, marker last;
        with `placed` (an area key), the files received into its incoming directory are moved in first."""
        faults.point("memory/files-writing", step=step, rank=rank, area=storage.url)
        if placed is not None:
            self._move_in(placed, step)
        commit_files(storage, step, files, lease)
        faults.point("memory/committed", step=step, rank=rank, area=storage.url)

    def _move_in(self, key: str, step: int) -> None:
        """The received files into the area's step directory (renames within one tmpfs: no copy)."""
        source, target = self.incoming(key, step), f"{self.root}/{key}/{mf.step_dir(step)}"
        for folder, _dirs, names in os.walk(source):
            relative = os.path.relpath(folder, source)
            os.makedirs(os.path.normpath(f"{target}/{relative}"), mode=0o700, exist_ok=True)
            for name in names:
                os.replace(f"{folder}/{name}", os.path.normpath(f"{target}/{relative}/{name}"))
        shutil.rmtree(source, ignore_errors=True)

    def prune(self, storage: Storage, spared: int | None = None) -> list[int]:
        """Keep the newest keep_memory committed steps of one area (marker first, then files), and
        remove what saves that never committed left there."""
        from distckpt.protocol.retention import delete_checkpoint

        steps = self.steps(storage)
        doomed = [s for s in steps[self.settings.keep:] if s != spared]
        for step in doomed:
            delete_checkpoint(storage, step)
        committed = set(steps) - set(doomed)
        for name in _step_dirs(storage):  # leftovers of copies that never committed, older than the newest
            left = mf.parse_step_dir(name)
            if left is not None and left not in committed and left != spared and (not steps or left < steps[0]):
                storage.remove_tree(name)
        return doomed

    def read_step(self, storage: Storage, step: int, names: list[str] | None = None,
                  copy: bool = True) -> dict[str, Any]:
        """Manifest, marker and `names` (None: every file the manifest lists) of committed `step`,
        each verified against the manifest (copy=False: the files as read, mapped, not copied).
        Raises CorruptCheckpointError / MissingFileError."""
        marker = read_marker(storage, step)
        manifest = read_verified_manifest(storage, step, marker)
        base = mf.step_dir(step)
        out: dict[str, Any] = {mf.MANIFEST: storage.read_bytes(f"{base}/{mf.MANIFEST}", mf._MAX_MANIFEST_BYTES),
                               mf.MARKER: marker.to_bytes()}
        for name in (list(manifest.files) if names is None else names):
            mf.check_relative_path(name, f"{storage.url}/{base}")
            record = manifest.files.get(name)
            if record is None:
                from distckpt.errors import CorruptCheckpointError

                raise CorruptCheckpointError(f"{storage.url}/{base}: the manifest lists no {name}")
            data = storage.read_buffer(f"{base}/{name}")
            mf.verify_file(data, record, f"{storage.url}/{base}/{name}")
            out[name] = bytes(data) if copy else data
        signature = signed_copy(storage, step)
        if signature is not None:
            out[signing.SIGNATURE] = signature
        return out


def signed_copy(storage: Storage, step: int) -> bytes | None:
    """The step's SIGNATURE file where it has one (it travels with every copy of the step)."""
    from distckpt.errors import MissingFileError

    try:
        return storage.read_bytes(f"{mf.step_dir(step)}/{signing.SIGNATURE}", signing.MAX_SIGNATURE_BYTES)
    except MissingFileError:
        return None


def verify_files(files: dict[str, Any], step: int, where: str) -> mf.Manifest:
    """Files received from a partner, checked before any is written: the manifest against the
    marker, every other file against the manifest. Raises CorruptCheckpointError."""
    from distckpt.errors import CorruptCheckpointError

    if mf.MANIFEST not in files or mf.MARKER not in files:
        raise CorruptCheckpointError(f"{where}: the copy of step {step} lacks its manifest or marker")
    marker = mf.Marker.parse(files[mf.MARKER], where)
    manifest = mf.Manifest.parse(files[mf.MANIFEST], marker, where)
    if manifest.step != step:
        raise CorruptCheckpointError(f"{where}: the copy records step {manifest.step}, not {step}")
    for name, data in files.items():
        if name in (mf.MANIFEST, mf.MARKER, signing.SIGNATURE):  # the signature is checked at the load
            continue
        record = manifest.files.get(name)
        if record is None:
            raise CorruptCheckpointError(f"{where}: the manifest of step {step} lists no {name}")
        mf.verify_file(data, record, f"{where}/{name}")
    return manifest


def replace_policy(lease: Lease) -> ReplacePolicy:
    return ReplacePolicy(lease.floor, lease.generation)


def _step_dirs(storage: Storage) -> list[str]:
    try:
        return [name for name in storage.list_dir("") if mf.parse_step_dir(name) is not None]
    except (OSError, DistCkptError):
        return []


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
