"""The model entry of a committed checkpoint, read tensor by tensor, in one process.

`open_checkpoint_model(url)` chooses the step as load_latest does (the newest that verifies; a
superseded writer's output only as the last resort), verifies its files against the manifest
(the ranks' own files too, so a step a load would skip is not read as weights either), and gives
a ModelSource: the entry's tensors by state_dict name, replicated, split or FSDP2-sharded ones
assembled whole. Nothing unpickles; nothing here touches torch.distributed.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator

import torch

from distckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    DistCkptError,
    IncompatibleCheckpointError,
    MissingFileError,
    NotAFileError,
    StorageError,
    SupersededCheckpointError,
    shown,
)
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.io.reading import read_verified
from distckpt.io.serialize import ShardRef, load_tree_file
from distckpt.protocol import incremental
from distckpt.protocol.commit import check_not_superseded, list_committed, read_marker, read_verified_manifest, step_candidates
from distckpt.protocol.fencing import FENCE_DIR, read_leases
from distckpt.protocol.payload_trees import check_rank_tree, check_replicated_tree, rank_of_file
from distckpt.state.kinds import kind_named
from distckpt.state.sharded import ShardReader
from distckpt.state.validation import check_step
from distckpt.storage import Storage, open_storage, release_pages

log = logging.getLogger("distckpt")


class ModelSource:
    """The tensors of one model entry, by state_dict name, materialised one at a time."""

    def __init__(self, names: list[str], spec: dict[str, tuple[torch.dtype, list[int]]],
                 getter: Callable[[str], torch.Tensor], where: str, step: int | None = None,
                 release: Callable[[], None] = lambda: None) -> None:
        self.names, self.spec, self._get, self.where, self.step = names, spec, getter, where, step
        self.release = release  # drops the source's mapped file pages once a tensor is consumed

    def tensor(self, name: str) -> torch.Tensor:
        return self._get(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self._get(name)


def _newest_first(storage: Storage, committed: list[int]) -> list[int]:
    """The steps to try, newest first, as load_latest sees them: the committed ones, and a step
    directory the whole-root listing did not follow (replaced by a symbolic link) whose marker
    stands behind it, so that it is tried and said damaged rather than passed over unsaid."""
    listed = set(committed)
    hidden = [s for s in step_candidates(storage) if s not in listed and _marker_stands(storage, s)]
    return sorted(listed | set(hidden), reverse=True) if hidden else committed


def _marker_stands(storage: Storage, step: int) -> bool:
    try:
        return storage.exists(f"{mf.step_dir(step)}/{mf.MARKER}")
    except (DistCkptError, OSError):
        return False


def open_checkpoint_model(url: str, *, step: int | None = None, entry: str = "model",
                          storage_options: dict[str, Any] | None = None, bounded: bool = False,
                          verify_key: Any = None) -> ModelSource:
    """The model entry of a committed distckpt checkpoint (the newest that verifies, or `step`).
    `bounded`: the files are verified piece by piece and their mapped pages released, so the
    source never keeps more than one tensor resident (with ModelSource.release after each).
    `verify_key` (else DISTCKPT_VERIFY_KEY): only a step it signed verifies (io/signing.py)."""
    verifier = signing.load_verify_key(verify_key)
    storage = open_storage(url, storage_options)
    signing.attach(storage, signing.Trust(verifier=verifier) if verifier is not None else None)
    mf.refuse_step_directory(url)
    steps = list_committed(storage)
    if step is not None:
        if step not in steps:
            raise IncompatibleCheckpointError(f"step {step} is not committed at {storage.url} (committed: {steps[:10]})")
        return _model_of_step(storage, step, entry, bounded)
    if not steps:
        storage.check_root()  # a root behind a dangling link (a volume not mounted) is said as such, as loads say it
        raise MissingFileError(2, f"no committed checkpoint at {storage.url}")
    # the loader's choice: the newest step that verifies, a superseded writer's output only as
    # the last resort (export and load_weights took the newest listed, a zombie's step included)
    leases = read_leases(storage)
    errors, superseded = [], []
    for candidate in _newest_first(storage, steps):
        try:
            check_not_superseded(read_marker(storage, candidate), leases, f"{storage.url}/{mf.step_dir(candidate)}")
            return _model_of_step(storage, candidate, entry, bounded)
        except SupersededCheckpointError as e:
            superseded.append(candidate)
            log.warning("%s; trying the previous step", e)
        except (CorruptCheckpointError, MissingFileError, StorageError) as e:  # a listed step missing its manifest: damaged
            if isinstance(e, StorageError) and not isinstance(e, (MissingFileError, NotAFileError)):
                raise  # the storage failing, not the step: no older step is chosen behind its back
            errors.append(str(e))
            log.warning("step %d at %s is damaged, trying the previous one: %s", candidate, storage.url, e)
    for candidate in superseded:
        try:
            source = _model_of_step(storage, candidate, entry, bounded)
            log.warning("no step of the newest incarnation at %s verifies; using step %d, written by a superseded "
                        "writer, as the last resort (as load_latest does)", storage.url, candidate)
            return source
        except (CorruptCheckpointError, MissingFileError) as e:
            errors.append(str(e))
    raise CorruptCheckpointError(f"no committed checkpoint at {storage.url} verifies: {'; '.join(errors)[:600]}")


def _model_of_step(storage: Storage, step: int, entry: str, bounded: bool = False) -> ModelSource:
    marker = read_marker(storage, step)
    manifest = read_verified_manifest(storage, step, marker)
    base = mf.step_dir(step)
    where = f"{storage.url}/{base}"
    _verify_rank_files(storage, manifest, where)
    name, _ = manifest.payload_names()
    record = manifest.files.get(name)
    if record is None:
        raise CorruptCheckpointError(f"{where}: the manifest lists no {name}")
    data = read_verified(storage, f"{base}/{name}", record, f"{where}/{name}", _releaser if bounded else None)
    shared_buffers: list[Any] = []  # incremental: files shared with older steps
    extra = incremental.resolve(storage, manifest, where, _releaser if bounded else None, shared_buffers)
    tree = load_tree_file(data, f"{where}/{name}", extra)
    check_replicated_tree(tree, manifest, f"{where}/{name}")
    entries = tree.get("entries", {}) if isinstance(tree, dict) else {}
    saved: Any = entries.get(entry)
    if not _holds_weights(saved):
        modules = sorted(k for k, v in entries.items() if _holds_weights(v))
        raise IncompatibleCheckpointError(f"{where}: no module entry {entry!r} (module entries: {modules}); "
                                          "pass entry=<the key of the model in `state`>")
    state_dict = _weights_of(saved) or {}
    reader = ShardReader(storage, base, manifest, where, bounded)
    reader.open_all()
    spec: dict[str, tuple[torch.dtype, list[int]]] = {}
    for key, value in state_dict.items():
        if isinstance(value, ShardRef):
            dtype, shape, _ = reader.spec(value.name)
            spec[key] = (dtype, shape)
        elif isinstance(value, torch.Tensor):
            spec[key] = (value.dtype, list(value.shape))

    def getter(key: str) -> torch.Tensor:
        value = state_dict[key]
        if isinstance(value, ShardRef):
            dtype, shape = spec[key]
            return reader.assemble(value.name, [0] * len(shape), shape)
        return value

    def release() -> None:
        release_pages(data)
        for buffer in shared_buffers:
            release_pages(buffer)
        reader.release()

    return ModelSource(list(spec), spec, getter, where, step, release if bounded else lambda: None)


def _holds_weights(saved: Any) -> bool:
    """A module entry, or an imported entry that is a state_dict (str keys, tensors only)."""
    return _weights_of(saved) is not None


def _weights_of(saved: Any) -> dict[str, Any] | None:
    """The model state_dict a saved entry holds, as its kind says (an imported torch.save / DCP
    checkpoint holds it as it was saved)."""
    return kind_named(saved.get("kind")).saved_weights(saved.get("state")) if isinstance(saved, dict) else None


def _verify_rank_files(storage: Storage, manifest: mf.Manifest, where: str) -> None:
    """The ranks' own files verify too (small: RNG streams, loader positions), their trees checked
    as a load checks them: a step load_latest would skip as damaged is not exported or loaded as
    weights either."""
    for name, record in manifest.files.items():
        rank = rank_of_file(manifest, name)
        if rank is not None:
            data = read_verified(storage, f"{mf.step_dir(manifest.step)}/{name}", record, f"{where}/{name}")
            check_rank_tree(load_tree_file(data, f"{where}/{name}"), rank, manifest, f"{where}/{name}")


def _releaser(data: Any) -> Callable[[int, int], None]:
    return lambda start, n: release_pages(data, start, n)


def check_source_args(step: Any, entry: Any) -> None:
    if step is not None:
        check_step("step", step)
    if not isinstance(entry, str) or not entry:
        raise ConfigError(f"entry={shown(entry)}: must be the key of the model in the saved `state` (a str)")


def is_checkpoint_root(path: str) -> bool:
    """A local directory distckpt writes checkpoints into: step directories, or leases."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return FENCE_DIR in names or any(mf.parse_step_dir(n) is not None for n in names)
