"""Weights in and out of checkpoints, in one process without a process group.

* `load_weights(source, module)`: the model entry of a distckpt checkpoint written by any number
  of ranks (replicated, split writes or FSDP2 shards), or a Hugging Face safetensors file or
  directory (with `model.safetensors.index.json`), into a module; nothing changes unless every
  check passes (keys, shapes; strict by default).
* `export_weights(url, out_dir)`: the model entry as `model.safetensors`, or shards plus
  `model.safetensors.index.json` (the Hugging Face layout), keys as the bare module names them;
  written one tensor at a time, each read back and checked against the source after writing.

Files are verified against their manifest checksums before a tensor is taken from them; nothing
unpickles. This module never touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import xxhash
from torch import nn

from distckpt.config import arguments_checked
from distckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    DistCkptError,
    IncompatibleCheckpointError,
    MissingFileError,
    StorageError,
    SupersededCheckpointError,
    shown,
)
from distckpt.io import manifest as mf
from distckpt.io.copying import byte_extent, elements_overlap, same_bits
from distckpt.io.reading import read_verified
from distckpt.io.serialize import _DTYPE_TO_ST, _ST_TO_DTYPE, ShardRef, load_tree_file
from distckpt.io.staging import flat_bytes
from distckpt.protocol import incremental
from distckpt.protocol.commit import check_not_superseded, list_committed, read_marker, read_verified_manifest, step_candidates
from distckpt.protocol.fencing import FENCE_DIR, read_leases
from distckpt.runtime.gcpause import paused_while_running
from distckpt.state.capture import loads_by_copy_alone, unwrap_module
from distckpt.state.kinds import kind_named
from distckpt.state.sharded import ShardReader
from distckpt.state.undo import module_copy_aside
from distckpt.state.validation import check_step, check_writable, mappings_read_once
from distckpt.storage import Storage, local_path_of, open_storage, release_pages
from distckpt.tools import sizes

log = logging.getLogger("distckpt")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


@dataclass
class WeightsReport:
    """What `load_weights` did: the source, and keys missing, unexpected, cast or ignored."""

    source: str
    step: int | None = None
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


# -- reading the model entry of a checkpoint ---------------------------------------------------

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
                          storage_options: dict[str, Any] | None = None, bounded: bool = False) -> ModelSource:
    """The model entry of a committed distckpt checkpoint (the newest that verifies, or `step`).
    `bounded`: the files are verified piece by piece and their mapped pages released, so the
    source never keeps more than one tensor resident (with ModelSource.release after each)."""
    storage = open_storage(url, storage_options)
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
            if isinstance(e, StorageError) and not isinstance(e, MissingFileError) and e.errno != errno.ELOOP:
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
    data = storage.read_buffer(f"{base}/{name}")
    mf.verify_file(data, record, f"{where}/{name}",
                   (lambda start, n: release_pages(data, start, n)) if bounded else None)
    shared_buffers: list[Any] = []  # incremental: files shared with older steps
    extra = incremental.resolve(storage, manifest, where, _releaser if bounded else None, shared_buffers)
    tree = load_tree_file(data, f"{where}/{name}", extra)
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
    """The ranks' own files verify too (small: RNG streams, loader positions): a step load_latest
    would skip as damaged is not exported or loaded as weights either."""
    for name, record in manifest.files.items():
        if name.startswith("ranks/"):
            read_verified(storage, f"{mf.step_dir(manifest.step)}/{name}", record, f"{where}/{name}")


def _releaser(data: Any) -> Callable[[int, int], None]:
    return lambda start, n: release_pages(data, start, n)


def open_hf_model(path: str) -> ModelSource:
    """A Hugging Face safetensors file, or a directory with one or with an index of shards; a
    file the safetensors library cannot read is a CorruptCheckpointError naming it."""
    try:
        source = _open_hf_model(path)
    except DistCkptError:
        raise
    except Exception as e:  # OSError, ValueError, KeyError, and safetensors' own SafetensorError
        raise _unreadable(path, e) from e
    getter = source._get

    def checked(name: str) -> torch.Tensor:
        try:
            return getter(name)
        except Exception as e:  # noqa: BLE001  (as above)
            raise _unreadable(path, e) from e

    source._get = checked
    return source


def _unreadable(path: str, e: BaseException) -> DistCkptError:
    if isinstance(e, FileNotFoundError):
        return MissingFileError(2, f"{path}: {e.filename or ''} is missing ({e.strerror}); the export is incomplete")
    return CorruptCheckpointError(f"{path}: not readable as safetensors ({type(e).__name__}: "
                                  f"{(str(e).splitlines() or [''])[0][:200]}); export it again")


def _open_hf_model(path: str) -> ModelSource:
    from safetensors import safe_open

    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            weight_map = _read_index(index)
            files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.exists(os.path.join(path, SINGLE_NAME)):
            files = None
            path = os.path.join(path, SINGLE_NAME)
        else:
            raise MissingFileError(2, f"{path}: neither {SINGLE_NAME} nor {INDEX_NAME} is there")
    else:
        files = None
    if files is None:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        files = {name: path for name in names}
    spec: dict[str, tuple[torch.dtype, list[int]]] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in files and files[name] != file:
                    raise CorruptCheckpointError(f"{file}: holds {name!r}, which the index places in {files[name]}: "
                                                 "a tensor in two shards (which one is the model's?)")
                if files.get(name) == file:
                    sl = f.get_slice(name)
                    if sl.get_dtype() not in _ST_TO_DTYPE:
                        raise IncompatibleCheckpointError(
                            f"{file}: {name!r} is stored as {sl.get_dtype()}, a dtype distckpt does not load "
                            f"(it loads {sorted(_ST_TO_DTYPE)}): convert it, or leave it out with ignore=")
                    spec[name] = (_ST_TO_DTYPE[sl.get_dtype()], list(sl.get_shape()))
    absent = sorted(name for name in files if name not in spec)
    if absent:
        raise CorruptCheckpointError(f"{path}: the index places {absent[:8]} in files that do not hold them "
                                     f"({sorted({os.path.basename(files[n]) for n in absent})[:4]}); export it again")

    def getter(name: str) -> torch.Tensor:
        with safe_open(files[name], framework="pt") as f:
            return f.get_tensor(name)

    return ModelSource(list(files), spec, getter, path)


def _read_index(index: str) -> dict[str, str]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map names to file names")
        for file in set(weight_map.values()):
            mf.check_relative_path(file, index)
        return weight_map
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{index}: not a safetensors index: {e}") from e


def open_model_source(source: str, *, step: int | None = None, entry: str = "model",
                      storage_options: dict[str, Any] | None = None) -> ModelSource:
    """A distckpt root (it has committed steps) or a Hugging Face file / directory."""
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"source={shown(source)}: must be a distckpt URL or a safetensors file / directory")
    source = os.fspath(source)
    _check_source_args(step, entry)
    local = local_path_of(source)  # a plain path or file:// URL, taken literally
    if local is not None and (local.endswith(".safetensors") or os.path.exists(os.path.join(local, INDEX_NAME))
                              or os.path.exists(os.path.join(local, SINGLE_NAME))):
        source = local
        if _is_checkpoint_root(source):
            raise ConfigError(f"source={shown(source)} holds both distckpt checkpoints and exported safetensors "
                              f"({SINGLE_NAME} or {INDEX_NAME}): which to load is ambiguous; move the exported "
                              "files to a directory of their own")
        if step is not None:
            raise ConfigError(f"step={shown(step)}: {shown(source)} is an exported safetensors file or directory, which holds "
                              "one set of weights; step= applies to a distckpt checkpoint root")
        return open_hf_model(source)
    return open_checkpoint_model(source, step=step, entry=entry, storage_options=storage_options)


# -- load_weights -----------------------------------------------------------------------------

@paused_while_running
@arguments_checked
def load_weights(source: str, module: nn.Module, *, step: int | None = None, strict: bool = True,
                 entry: str = "model", prefix_map: dict[str, str] | None = None,
                 ignore: tuple[str, ...] | list[str] = (), allow_cast: bool = True,
                 storage_options: dict[str, Any] | None = None) -> WeightsReport:
    """Load weights into `module` (bare, DDP-wrapped or compiled) from a distckpt checkpoint of any
    world size (its `entry`, the newest committed step unless `step`) or a Hugging Face
    safetensors file / directory. One process, no process group.

    `prefix_map` renames source keys before matching ({"transformer.": ""} drops a prefix);
    `ignore` holds fnmatch patterns of source or module keys to leave out. Every check (keys with
    `strict`, shapes, dtypes unless `allow_cast`) passes before any parameter changes; raises
    IncompatibleCheckpointError naming the keys otherwise. Returns a WeightsReport.
    """
    if not isinstance(module, nn.Module):
        raise ConfigError(f"module={type(module).__name__}: must be an nn.Module")
    if not isinstance(strict, bool) or not isinstance(allow_cast, bool):
        raise ConfigError("strict and allow_cast must be True or False")
    _check_patterns(prefix_map, ignore)
    src = open_model_source(source, step=step, entry=entry, storage_options=storage_options)
    bare = unwrap_module(module)
    target = bare.state_dict(keep_vars=True)
    mapping = _map_keys(src.names, prefix_map or {})
    _refuse_collisions(mapping, src.where)
    report = WeightsReport(src.where, src.step)
    report.ignored = sorted(k for k in mapping if _ignored(k, ignore) or _ignored(mapping[k], ignore))
    wanted = {mapping[k]: k for k in mapping if k not in report.ignored}
    if not loads_by_copy_alone(bare):
        return _load_through_module(bare, src, wanted, target, strict, allow_cast, report)
    report.unexpected = sorted(k for k in wanted if k not in target)
    # A key tied to one the source fills (Hugging Face saves a tied lm_head once) is filled with it.
    filled = {_view_of(target[k]) for k in wanted if k in target}
    report.missing = sorted(k for k in target if k not in wanted and not _ignored(k, ignore)
                            and _view_of(target[k]) not in filled)
    problems = []
    for key, src_key in wanted.items():
        if key not in target:
            continue
        dtype, shape = src.spec[src_key]
        if list(target[key].shape) != shape:
            problems.append(f"{key}: {shape} in the source, {list(target[key].shape)} here")
        elif dtype != target[key].dtype:
            report.cast.append(key)
    nothing_loads = bool(target) and not any(k in target for k in wanted)
    if strict and (report.missing or report.unexpected):
        problems.append(f"missing {report.missing[:8]}, unexpected {report.unexpected[:8]}")
    if nothing_loads:
        problems.append(_nothing_loads(list(wanted), len(report.ignored), len(target)))
    if report.cast and not allow_cast:
        problems.append(f"dtypes differ for {report.cast[:8]} (pass allow_cast=True)")
    if problems:
        hint = ("strict=False loads the common keys, prefix_map renames keys" if strict and not nothing_loads else
                "ignore=[...] leaves keys out, prefix_map renames keys")
        raise IncompatibleCheckpointError(f"{src.where} does not fit the module: {'; '.join(problems)}; {hint}")
    with mappings_read_once():
        for key in wanted:
            if key in target:
                check_writable(target[key], f"{src.where} into the module's {key!r}")
    _refuse_differing_ties({key: src_key for key, src_key in wanted.items() if key in target}, target, src)
    with torch.no_grad():
        for key, src_key in wanted.items():
            if key in target:
                try:
                    target[key].copy_(src.tensor(src_key))
                except Exception as e:
                    # Every check above passed and every file of a checkpoint verified: only the
                    # source changing or failing under the read is left. Say what was loaded.
                    raise StorageError(f"{src.where}: reading {src_key!r} failed after {len(report.loaded)} of "
                                       f"{len(wanted)} tensors were copied into the module, which is now partly "
                                       f"loaded: load again ({type(e).__name__}: {e})") from e
                report.loaded.append(key)
    return report


def _load_through_module(bare: nn.Module, src: ModelSource, wanted: dict[str, str], target: dict[str, Any],
                         strict: bool, allow_cast: bool, report: WeightsReport) -> WeightsReport:
    """A module with loading of its own (load_state_dict hooks that rename legacy keys, its own
    `_load_from_state_dict` that converts what it is given, extra state) gets the source through
    its own `load_state_dict`, as `model.load_state_dict(source)` would: copying tensor by tensor
    would skip that code. torch matches the keys and copies as it goes, then raises for what did
    not fit; so the module's tensors are copied aside first and put back on any failure: still
    nothing changed by a load that fails."""
    report.cast = sorted(k for k, s in wanted.items() if k in target and isinstance(target[k], torch.Tensor)
                         and src.spec[s][0] != target[k].dtype)
    if report.cast and not allow_cast:
        raise IncompatibleCheckpointError(f"{src.where} does not fit the module: dtypes differ for "
                                          f"{report.cast[:8]} (pass allow_cast=True)")
    with mappings_read_once():
        for key, value in target.items():
            if isinstance(value, torch.Tensor):
                check_writable(value, f"{src.where} into the module's {key!r}")
    put_back = module_copy_aside(bare)
    given = {key: src.tensor(src_key) for key, src_key in wanted.items()}
    try:
        with torch.no_grad():
            result = bare.load_state_dict(given, strict=strict)
    except Exception as e:
        put_back()
        raise IncompatibleCheckpointError(
            f"{src.where} does not fit the module (loaded through its own load_state_dict, which has hooks or "
            f"loading code of its own; the module was left as it was): {e}") from e
    report.missing, report.unexpected = sorted(result.missing_keys), sorted(result.unexpected_keys)
    report.loaded = sorted(k for k in given if k not in set(result.unexpected_keys))
    if target and not report.loaded:
        put_back()
        raise IncompatibleCheckpointError(f"{src.where} does not fit the module: "
                                          f"{_nothing_loads(list(given), len(report.ignored), len(target))}; the module was left as it "
                                          "was; prefix_map renames keys, ignore=[...] leaves keys out")
    return report


def _nothing_loads(left: list[str], ignored: int, module_keys: int) -> str:
    """Why a load that would copy no tensor at all is refused, under strict=False too: a prefix
    that differs (`module.` of a DDP state_dict) or an ignore pattern that matches everything
    leaves the module exactly as it was, which a caller reading only the return value would take
    for a load."""
    return (f"not one of the module's {module_keys} keys would be loaded: the source's {len(left)} keys left "
            f"after ignore= ({ignored} ignored) match none of them (first: {sorted(left)[:3]})")


def _view_of(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two state_dict entries one tensor: the same memory seen the same way."""
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if t.numel() else (id(t),)


def _check_patterns(prefix_map: Any, ignore: Any) -> None:
    if prefix_map is not None and (not isinstance(prefix_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in prefix_map.items())):
        raise ConfigError(f"prefix_map={shown(prefix_map)}: must be a dict of str to str (source prefix -> module prefix)")
    if isinstance(ignore, (str, bytes)) or not isinstance(ignore, (list, tuple)) or not all(
            isinstance(p, str) for p in ignore):
        raise ConfigError(f"ignore={shown(ignore)}: must be a list or tuple of fnmatch patterns (a single pattern "
                          "too: ignore=['head.*'])")


def _refuse_collisions(mapping: dict[str, str], where: str) -> None:
    """Two source keys renamed onto one module key: one would silently overwrite the other."""
    seen: dict[str, str] = {}
    for name, mapped in mapping.items():
        if mapped in seen:
            raise IncompatibleCheckpointError(
                f"{where}: {seen[mapped]!r} and {name!r} both map to {mapped!r} (prefix_map); one would "
                "overwrite the other. Map them apart, or ignore one")
        seen[mapped] = name


def _refuse_differing_ties(pairs: dict[str, str], target: dict[str, torch.Tensor], src: "ModelSource") -> None:
    """Module keys that are one tensor here (tied weights) loaded from source tensors that differ:
    the second copy would silently replace the first. Equal bits are fine (an export of a tied model)."""
    by_memory: dict[tuple[Any, int], list[str]] = {}
    for key in pairs:
        t = target[key]
        if t.numel():
            by_memory.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(key)
    for keys in by_memory.values():
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                (start_a, end_a), (start_b, end_b) = byte_extent(target[a]), byte_extent(target[b])
                if end_a <= start_b or end_b <= start_a or not elements_overlap(target[a], target[b]):
                    continue  # views of one buffer that share no byte
                if target[a].data_ptr() == target[b].data_ptr() and same_bits(src.tensor(pairs[a]), src.tensor(pairs[b])):
                    continue
                raise IncompatibleCheckpointError(
                    f"{src.where}: {a!r} and {b!r} are one tensor in the module (tied) but differ in the source "
                    f"({pairs[a]!r}, {pairs[b]!r}); loading both would keep only the second. Untie them in the "
                    "module, or ignore one key")


def _map_keys(names: list[str], prefix_map: dict[str, str]) -> dict[str, str]:
    out = {}
    for name in names:
        mapped = name
        for old, new in prefix_map.items():
            if mapped.startswith(old):
                mapped = new + mapped[len(old):]
                break
        out[name] = mapped
    return out


def _ignored(key: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


# -- export -----------------------------------------------------------------------------------

@dataclass
class ExportSummary:
    out_dir: str
    step: int | None
    files: list[str]
    tensors: int
    total_size: int
    dtype: str | None


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, as Hugging Face's max_shard_size; a
    ConfigError naming the value for anything else (sizes.py)."""
    return sizes.parse_size(text)


@paused_while_running
def _check_source_args(step: Any, entry: Any) -> None:
    if step is not None:
        check_step("step", step)
    if not isinstance(entry, str) or not entry:
        raise ConfigError(f"entry={shown(entry)}: must be the key of the model in the saved `state` (a str)")


@arguments_checked
def export_weights(url: str, out_dir: str, *, step: int | None = None, entry: str = "model",
                   dtype: str | None = None, max_shard_size: str | int = "5GB",
                   storage_options: dict[str, Any] | None = None,
                   progress: Callable[[int], None] = lambda n: None) -> ExportSummary:
    """Write the model entry as Hugging Face safetensors under `out_dir` (see the module doc)."""
    if isinstance(out_dir, os.PathLike):
        out_dir = os.fspath(out_dir)
    if not isinstance(out_dir, str) or not out_dir.strip() or "\0" in out_dir:
        raise ConfigError(f"out_dir={shown(out_dir)}: must be a directory path")
    local = local_path_of(out_dir)
    if local is None:
        raise ConfigError(f"out_dir={shown(out_dir)}: the export is written to a local directory (a path or "
                          "file://...); copy it to object storage afterwards")
    out_dir = local
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"out_dir={shown(out_dir)} is a file: export into a directory (new or holding an earlier export)")
    if not callable(progress):
        raise ConfigError(f"progress={shown(progress)}: must be a callable taking a byte count")
    _check_source_args(step, entry)
    cast = _DTYPES.get(dtype.lower()) if isinstance(dtype, str) else None
    if dtype is not None and cast is None:
        raise ConfigError(f"dtype={shown(dtype)}: one of {sorted(_DTYPES)}")
    limit = parse_size(max_shard_size)
    if _is_checkpoint_root(out_dir):
        raise ConfigError(f"out_dir={shown(out_dir)} is a distckpt checkpoint root (it holds step directories or "
                          f"{FENCE_DIR}/): export into a directory of its own")
    inside = _inside_a_step_directory(out_dir)
    if inside is not None:
        raise ConfigError(f"out_dir={shown(out_dir)} lies in {inside}, a step directory (or the leases) of a distckpt "
                          "checkpoint root, which ls, gc and the loader own: export into a directory of its own")
    src = open_checkpoint_model(url, step=step, entry=entry, storage_options=storage_options, bounded=True)
    if "__metadata__" in src.names:  # safetensors' own header key: the tensor replaced the file's metadata
        raise IncompatibleCheckpointError(
            f"{src.where}: the model has a tensor named '__metadata__', the key the safetensors format reserves "
            "for a file's metadata, so a Hugging Face file cannot hold it: rename it in the model (load_weights "
            "reads the checkpoint itself as saved); nothing was written")
    out_spec = {name: (_out_dtype(d, cast), shape) for name, (d, shape) in src.spec.items()}
    shards = _plan_shards(src.names, out_spec, limit)
    os.makedirs(out_dir, exist_ok=True)
    files = [SINGLE_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {name: file for file, names in zip(files, shards) for name in names}
    total = sum(_nbytes(*out_spec[n]) for n in src.names)
    if len(shards) > 1:
        files.append(INDEX_NAME)
    # Every file is written and read back under a temporary name first and only then moved into
    # place: a failure half-way (a source read, a full disk) leaves the earlier export whole
    # (writing each shard into place as it went mixed two steps' shards under one index).
    staged = [os.path.join(out_dir, file + ".tmp") for file in files]
    try:
        for tmp, names in zip(staged, shards):
            digests = _write_shard(tmp, names, out_spec, src, cast, progress)
            _verify_shard(tmp, digests)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            _write_synced(staged[-1], json.dumps(index, indent=2).encode())
        for tmp, file in zip(staged, files):
            os.replace(tmp, os.path.join(out_dir, file))
    except BaseException:
        for tmp in staged:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    _remove_stale_exports(out_dir, set(files))
    return ExportSummary(out_dir, src.step, files, len(src.names), total, dtype)


_EXPORT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def _remove_stale_exports(out_dir: str, written: set[str]) -> None:
    """A previous export's files this one did not write (its shards, its index, or a single file
    where there are shards now) would be read with or instead of these: removed, as Hugging Face's
    save_pretrained removes its own stale shards. Only names an export writes are touched."""
    for name in os.listdir(out_dir):
        if name not in written and _EXPORT_FILE.fullmatch(name) and os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
            log.info("export: removed %s, left by an earlier export", os.path.join(out_dir, name))


def _inside_a_step_directory(path: str) -> str | None:
    """The step directory (or fence/) of a checkpoint root that `path` is or lies in, else None:
    an export there would be written into a committed step, or listed as an uncommitted one and
    collected by gc. A directory of another name beside the steps is left to the user."""
    current = os.path.abspath(path)
    while True:
        parent = os.path.dirname(current)
        if parent == current:
            return None
        name = os.path.basename(current)
        if (mf.parse_step_dir(name) is not None or name == FENCE_DIR) and _is_checkpoint_root(parent):
            return current
        current = parent


def _is_checkpoint_root(path: str) -> bool:
    """A local directory distckpt writes checkpoints into: step directories, or leases."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return FENCE_DIR in names or any(mf.parse_step_dir(n) is not None for n in names)


def _out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and dtype.is_floating_point else dtype


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _plan_shards(names: list[str], spec: dict[str, tuple[torch.dtype, list[int]]], limit: int) -> list[list[str]]:
    """Tensors in state_dict order, a new shard whenever the next would pass the limit (a tensor
    larger than the limit gets a shard of its own, as Hugging Face's save does)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = _nbytes(*spec[name])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _write_shard(path: str, names: list[str], spec: dict[str, tuple[torch.dtype, list[int]]], src: ModelSource,
                 cast: torch.dtype | None, progress: Callable[[int], None]) -> dict[str, str]:
    """Header first (known from the specs), then one tensor at a time: at most one tensor of the
    source in memory besides the file being written. Returns each tensor's xxh3 of its bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        dtype, shape = spec[name]
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": _DTYPE_TO_ST[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digests = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in names:
            tensor = src.tensor(name).detach()
            if cast is not None and tensor.is_floating_point():
                tensor = tensor.to(cast)
            data = flat_bytes(tensor).numpy().data if tensor.numel() else \
                memoryview(b"")
            digests[name] = xxhash.xxh3_64_hexdigest(data)
            f.write(data)
            progress(len(data))
            del tensor, data
            src.release()  # the source's pages of that tensor leave this process (bounded memory)
        f.flush()
        os.fsync(f.fileno())
    return digests


def _verify_shard(path: str, digests: dict[str, str]) -> None:
    """Read every tensor back with the safetensors library and compare its bytes."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        if set(f.keys()) != set(digests):
            raise CorruptCheckpointError(f"{path}: holds other tensors than written")
        for name, digest in digests.items():
            t = f.get_tensor(name)
            data = flat_bytes(t).numpy().tobytes() if t.numel() else b""
            if xxhash.xxh3_64_hexdigest(data) != digest:
                raise CorruptCheckpointError(f"{path}: {name} reads back differently than written")


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
