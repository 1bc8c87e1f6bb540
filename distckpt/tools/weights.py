"""Weights in and out of checkpoints, in one process without a process group.

* `load_weights(source, module)` (here): the model entry of a distckpt checkpoint written by any
  number of ranks (replicated, split writes or FSDP2 shards: model_source.py), or a Hugging Face
  safetensors file or directory (with `model.safetensors.index.json`: hf_layout.py), into a
  module; nothing changes unless every check passes (keys, shapes; strict by default).
* `export_weights(url, out_dir)` (exporting.py): the model entry as `model.safetensors`, or shards
  plus `model.safetensors.index.json` (the Hugging Face layout), keys as the bare module names
  them; written one tensor at a time, each read back and checked against the source after writing.

Files are verified against their manifest checksums before a tensor is taken from them; nothing
unpickles. This module never touches torch.distributed.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distckpt.config import arguments_checked
from distckpt.errors import ConfigError, IncompatibleCheckpointError, StorageError, shown
from distckpt.io.copying import byte_extent, elements_overlap, same_bits
from distckpt.runtime.gcpause import paused_while_running
from distckpt.state.capture import loads_by_copy_alone, unwrap_module
from distckpt.state.undo import module_copy_aside
from distckpt.state.validation import check_writable, mappings_read_once
from distckpt.storage import local_path_of
from distckpt.tools.exporting import ExportSummary, export_weights, parse_size
from distckpt.tools.hf_layout import INDEX_NAME, SINGLE_NAME, open_hf_model
from distckpt.tools.model_source import (
    ModelSource,
    check_source_args,
    is_checkpoint_root,
    open_checkpoint_model,
)

# export_weights and the model source are imported from here by the command line and the package
__all__ = ["ExportSummary", "ModelSource", "WeightsReport", "export_weights", "load_weights", "open_checkpoint_model",
           "open_model_source", "parse_size"]


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


def open_model_source(source: str, *, step: int | None = None, entry: str = "model",
                      storage_options: dict[str, Any] | None = None, verify_key: Any = None) -> ModelSource:
    """A distckpt root (it has committed steps) or a Hugging Face file / directory. With
    `verify_key` (or DISTCKPT_VERIFY_KEY) a distckpt step must be signed by it; an exported
    safetensors source carries no signature, so an explicit verify_key refuses it."""
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"source={shown(source)}: must be a distckpt URL or a safetensors file / directory")
    source = os.fspath(source)
    check_source_args(step, entry)
    local = local_path_of(source)  # a plain path or file:// URL, taken literally
    if local is not None and (local.endswith(".safetensors") or os.path.exists(os.path.join(local, INDEX_NAME))
                              or os.path.exists(os.path.join(local, SINGLE_NAME))):
        source = local
        if is_checkpoint_root(source):
            raise ConfigError(f"source={shown(source)} holds both distckpt checkpoints and exported safetensors "
                              f"({SINGLE_NAME} or {INDEX_NAME}): which to load is ambiguous; move the exported "
                              "files to a directory of their own")
        if step is not None:
            raise ConfigError(f"step={shown(step)}: {shown(source)} is an exported safetensors file or directory, which holds "
                              "one set of weights; step= applies to a distckpt checkpoint root")
        if verify_key is not None:
            raise ConfigError(f"verify_key: {shown(source)} is an exported safetensors file or directory, which carries "
                              "no distckpt signature; verify_key applies to a distckpt checkpoint root")
        return open_hf_model(source)
    return open_checkpoint_model(source, step=step, entry=entry, storage_options=storage_options,
                                 verify_key=verify_key)


@paused_while_running
@arguments_checked
def load_weights(source: str, module: nn.Module, *, step: int | None = None, strict: bool = True,
                 entry: str = "model", prefix_map: dict[str, str] | None = None,
                 ignore: tuple[str, ...] | list[str] = (), allow_cast: bool = True,
                 storage_options: dict[str, Any] | None = None, verify_key: Any = None) -> WeightsReport:
    """Load weights into `module` (bare, DDP-wrapped or compiled) from a distckpt checkpoint of any
    world size (its `entry`, the newest committed step unless `step`) or a Hugging Face
    safetensors file / directory. One process, no process group.

    `prefix_map` renames source keys before matching ({"transformer.": ""} drops a prefix);
    `ignore` holds fnmatch patterns of source or module keys to leave out. Every check (keys with
    `strict`, shapes, dtypes unless `allow_cast`) passes before any parameter changes; raises
    IncompatibleCheckpointError naming the keys otherwise. `verify_key` (an Ed25519 public key:
    PEM bytes or a path; else DISTCKPT_VERIFY_KEY): only a step it signed is loaded, the newest
    that verifies. Returns a WeightsReport.
    """
    if not isinstance(module, nn.Module):
        raise ConfigError(f"module={type(module).__name__}: must be an nn.Module")
    if not isinstance(strict, bool) or not isinstance(allow_cast, bool):
        raise ConfigError("strict and allow_cast must be True or False")
    _check_patterns(prefix_map, ignore)
    src = open_model_source(source, step=step, entry=entry, storage_options=storage_options, verify_key=verify_key)
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
