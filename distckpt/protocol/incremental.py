"""Incremental checkpoints: bytes already committed are referenced, not written again.

With ``CheckpointManager(..., incremental=True)`` rank 0 hashes every tensor of the replicated
file it is about to write (xxh3-128 of its bytes, with dtype and shape). A tensor whose hash is
one the previous committed save of this manager wrote or referenced is left out of the new file;
the manifest references it where it lies instead:

    "reused":       {tensor name: {"file": "step-000000010/replicated/state.g000003.safetensors",
                                   "tensor": its name in that file}}
    "shared_files": {"step-000000010/replicated/state.g000003.safetensors": {"size": ..., "xxh3_64": ...}}

so every committed checkpoint is still whole and verifiable on its own: its manifest names every
file it needs, with size and checksum, and a reader verifies shared files exactly like its own.
References always point at the file that holds the bytes (never at a reference), and only at
older steps.

Why every tensor is hashed, rather than skipped by its version counter: `p.data.add_()` (EMA
updates, older optimizers, user code) changes the bytes without bumping `p._version`, so a
counter could call a changed tensor unchanged. Hashing reads the bytes (xxh3 runs at several
GB/s on one core here) and cannot: a false "unchanged" would need a 128-bit hash collision.

Retention and GC (retention.py) never delete a file that a committed checkpoint references.
Applies to the replicated file (a DDP model, its optimizer, everything rank 0 writes); per-rank
files and FSDP2 shard files are written whole at every save.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import xxhash

from distckpt.errors import CheckpointExistsError, CorruptCheckpointError, MissingFileError
from distckpt.io import manifest as mf
from distckpt.io.reading import read_verified
from distckpt.io.safetensors_format import checked_header, tensors_of_file
from distckpt.io.staging import tensor_pieces
from distckpt.storage import Storage

log = logging.getLogger("distckpt")

REUSED, SHARED = "reused", "shared_files"
Key = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class Stored:
    """Where a tensor's bytes lie in a committed file (root-relative path, its record)."""

    file: str
    tensor: str
    record: dict[str, Any]


def content_key(tensor: torch.Tensor) -> Key:
    """Streamed over the tensor's pieces (the same digest as over its bytes at once): under
    staging_bytes a tensor may still be where it lives (a GPU, a non-contiguous view)."""
    h = xxhash.xxh3_128()
    for piece in tensor_pieces(tensor.detach()):
        h.update(piece)
    return h.hexdigest(), str(tensor.dtype), tuple(tensor.shape)


@dataclass
class Split:
    own: dict[str, torch.Tensor]     # written into the new file
    reused: dict[str, Stored]        # referenced where they lie
    keys: dict[str, Key]             # every tensor's content key


# Every save checks the size of each file it would reference; every VERIFY_EVERY-th save reads
# them whole and checks their checksums too (a file damaged after it was written would otherwise
# be referenced by every later save, and retention would age out the checkpoints that do not
# depend on it). Between two such checks, damage that keeps a file's size goes unnoticed by saves
# (loads and `verify` still catch it).
VERIFY_EVERY = 8


class ContentTable:
    """Rank 0: the content of the last committed save, by key, and where each lies."""

    def __init__(self) -> None:
        self._where: dict[Key, Stored] = {}
        self._splits = 0

    def split(self, tensors: dict[str, torch.Tensor]) -> Split:
        keys = {name: content_key(t) for name, t in tensors.items()}
        reused = {name: self._where[k] for name, k in keys.items() if k in self._where and tensors[name].numel()}
        own = {name: t for name, t in tensors.items() if name not in reused}
        return Split(own, reused, keys)

    def committed(self, split: Split, file: str, record: dict[str, Any]) -> None:
        """The save of `split` committed, its new tensors in `file`: the next save compares with it."""
        where = {split.keys[name]: Stored(file, name, record) for name in split.own}
        where.update({split.keys[name]: stored for name, stored in split.reused.items()})
        self._where = where

    def split_present(self, tensors: dict[str, torch.Tensor], storage: Storage, step: int) -> Split:
        """split(), then every tensor whose file is gone or damaged is written again: a
        reference is made only to a file of the recorded size (and, every VERIFY_EVERY-th save,
        checksum). So is one whose file lies in the directory of `step` or a later step (a run
        that saves a lower step than its last): a step references older steps' files only, which
        retention relies on."""
        split = self.split(tensors)
        for name in [n for n, s in split.reused.items() if _step_of(s.file) >= step]:
            split.own[name] = tensors[name]
            del split.reused[name]
        self._splits += 1
        records = {s.file: s.record for s in split.reused.values()}
        bad = {f for f, r in records.items() if not _intact(storage, f, r, self._splits % VERIFY_EVERY == 0)}
        for name in [n for n, s in split.reused.items() if s.file in bad]:
            del split.reused[name]
            split.own[name] = tensors[name]
        if bad:
            log.warning("rank 0: %s changed since it was written (size or checksum); its tensors are written "
                        "again instead of referenced", sorted(bad))
        return split


def _step_of(file: str) -> int:
    step = mf.parse_step_dir(file.split("/", 1)[0])
    return -1 if step is None else step


def _intact(storage: Storage, file: str, record: dict[str, Any], read: bool) -> bool:
    try:
        if storage.size(file) != record["size"]:
            return False
        if read:
            mf.verify_file(storage.read_buffer(file), record, f"{storage.url}/{file}")
        return True
    except (OSError, CorruptCheckpointError):
        return False


def check_not_overwriting_shared(storage: Storage, path: str, step: int) -> None:
    """CheckpointExistsError if `path` (a step's replicated file, about to be written) is a file
    committed checkpoints reference: saving a step again within one generation (after
    `load(state, step=...)` of an older step) would otherwise replace bytes they depend on."""
    if not storage.exists(path):
        return
    from distckpt.protocol.commit import list_committed
    from distckpt.protocol.retention import referenced_files

    if path in referenced_files(storage, list_committed(storage)):
        raise CheckpointExistsError(
            errno.EEXIST, f"{storage.url}/{path} is referenced by newer committed checkpoints (incremental): "
            f"saving step {step} again would change them. Continue from the newest step, or remove the newer "
            "steps first (distckpt prune)")


def manifest_fields(split: Split) -> dict[str, Any]:
    if not split.reused:
        return {}
    return {REUSED: {name: {"file": s.file, "tensor": s.tensor} for name, s in split.reused.items()},
            SHARED: {s.file: s.record for s in split.reused.values()}}


def resolve(storage: Storage, manifest: mf.Manifest, where: str,
            release: Callable[[Any], Callable[[int, int], None]] | None = None,
            buffers: list[Any] | None = None) -> dict[str, torch.Tensor]:
    """The reused tensors by name, read from the shared files (each verified against the
    manifest's record). CorruptCheckpointError when a shared file is missing or damaged.
    `release`/`buffers`: export's bounded reading (verified piece by piece; the opened buffers
    are appended to `buffers`, so their pages can be released after use)."""
    reused = manifest.reused or {}
    if not reused:
        return {}
    opened: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for name, ref in reused.items():
        file = ref["file"]
        if file not in opened:
            opened[file] = _open_shared(storage, file, (manifest.shared_files or {})[file], where, release, buffers)
        tensor = opened[file].get(ref["tensor"])
        if tensor is None:
            raise CorruptCheckpointError(f"{where}: shared file {file} holds no tensor {ref['tensor']!r}")
        # A tensor object of its own per name: two tensors that merely hold equal bytes reference
        # the same stored one, and must not come back tied (ties are by name, in the tree).
        out[name] = tensor.view(tensor.shape)
    return out


def _open_shared(storage: Storage, file: str, record: dict[str, Any], where: str,
                 release: Callable[[Any], Callable[[int, int], None]] | None,
                 buffers: list[Any] | None) -> dict[str, torch.Tensor]:
    try:
        data = read_verified(storage, file, record, f"{storage.url}/{file} (shared)", release)
    except MissingFileError as e:
        raise CorruptCheckpointError(f"{where}: shared file {storage.url}/{file} is missing") from e
    if buffers is not None:
        buffers.append(data)
    _, tensors = tensors_of_file(data, f"{storage.url}/{file}")
    return tensors


def reused_specs(storage: Storage, manifest: mf.Manifest) -> dict[str, tuple[str, list[int], int, str]]:
    """name -> (dtype, shape, bytes, shared file) of every reused tensor, from the shared files'
    headers (for inspect: no checksum, no tensor bytes used)."""
    out = {}
    headers: dict[str, dict[str, Any]] = {}
    for name, ref in (manifest.reused or {}).items():
        file = ref["file"]
        if file not in headers:
            _, ranges, _ = checked_header(storage.read_bytes(file), f"{storage.url}/{file}")
            headers[file] = {r[0]: r for r in ranges}
        found = headers[file].get(ref["tensor"])
        if found is None:
            raise CorruptCheckpointError(f"{storage.url}/{file} holds no tensor {ref['tensor']!r}")
        _, begin, stop, dtype, shape = found
        out[name] = (str(dtype).replace("torch.", ""), list(shape), stop - begin, file)
    return out
