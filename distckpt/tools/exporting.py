"""`export_weights(url, out_dir)` (`distckpt export`): the model entry of a committed
checkpoint as Hugging Face safetensors (hf_layout.py), keys as the bare module names them. Written
one tensor at a time under temporary names, each shard read back and checked against the source,
then moved into place: a failure half-way leaves an earlier export in `out_dir` whole.

With `sign_key` (an elliptic-curve private key), the finished directory is signed in the format
of OpenSSF model-signing (io/model_signature.py), by default into `OUT.sig` beside it: the key and
the signature's place are checked before anything is read or written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from distckpt.config import arguments_checked
from distckpt.errors import ConfigError, shown
from distckpt.io import manifest as mf
from distckpt.io import model_signature
from distckpt.protocol.fencing import FENCE_DIR
from distckpt.runtime.gcpause import paused_while_running
from distckpt.storage import local_path_of
from distckpt.tools import sizes
from distckpt.tools.hf_layout import (
    EXPORT_FILE,
    INDEX_NAME,
    SINGLE_NAME,
    check_tensor_names,
    nbytes,
    plan_shards,
    verify_shard,
    write_shard,
    write_synced,
)
from distckpt.tools.model_source import check_source_args, is_checkpoint_root, open_checkpoint_model

log = logging.getLogger("distckpt")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


@dataclass
class ExportSummary:
    out_dir: str
    step: int | None
    files: list[str]
    tensors: int
    total_size: int
    dtype: str | None
    signature: str | None = None  # the OpenSSF model-signing signature written, with sign_key


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, as Hugging Face's max_shard_size; a
    ConfigError naming the value for anything else (sizes.py)."""
    return sizes.parse_size(text)


@paused_while_running
@arguments_checked
def export_weights(url: str, out_dir: str, *, step: int | None = None, entry: str = "model",
                   dtype: str | None = None, max_shard_size: str | int = "5GB",
                   storage_options: dict[str, Any] | None = None,
                   progress: Callable[[int], None] = lambda n: None, verify_key: Any = None,
                   sign_key: Any = None, signature: str | os.PathLike[str] | None = None) -> ExportSummary:
    """Write the model entry as Hugging Face safetensors under `out_dir` (see the module doc).
    `verify_key` (else DISTCKPT_VERIFY_KEY): only a step it signed is exported.

    `sign_key` (an elliptic-curve P-256, P-384 or P-521 private key: PEM bytes, text or a path):
    afterwards, every file of `out_dir` is signed for OpenSSF model-signing (`model_signing verify
    key`) into `signature` (default `out_dir` + ".sig", beside it; one inside `out_dir` is recorded
    as ignored). Any other key, or a signature path that cannot be written, is a ConfigError before
    anything is read or written."""
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
    check_source_args(step, entry)
    cast = _DTYPES.get(dtype.lower()) if isinstance(dtype, str) else None
    if dtype is not None and cast is None:
        raise ConfigError(f"dtype={shown(dtype)}: one of {sorted(_DTYPES)}")
    limit = parse_size(max_shard_size)
    if is_checkpoint_root(out_dir):
        raise ConfigError(f"out_dir={shown(out_dir)} is a distckpt checkpoint root (it holds step directories or "
                          f"{FENCE_DIR}/): export into a directory of its own")
    inside = _inside_a_step_directory(out_dir)
    if inside is not None:
        raise ConfigError(f"out_dir={shown(out_dir)} lies in {inside}, a step directory (or the leases) of a distckpt "
                          "checkpoint root, which ls, gc and the loader own: export into a directory of its own")
    signer, plan = _signing_plan(out_dir, sign_key, signature)
    src = open_checkpoint_model(url, step=step, entry=entry, storage_options=storage_options, bounded=True,
                                verify_key=verify_key)
    check_tensor_names(src.names, src.where)
    out_spec = {name: (_out_dtype(d, cast), shape) for name, (d, shape) in src.spec.items()}
    shards = plan_shards(src.names, out_spec, limit)
    os.makedirs(out_dir, exist_ok=True)
    files = [SINGLE_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {name: file for file, names in zip(files, shards) for name in names}
    total = sum(nbytes(*out_spec[n]) for n in src.names)
    if len(shards) > 1:
        files.append(INDEX_NAME)
    # Every file is written and read back under a temporary name first and only then moved into
    # place: a failure half-way (a source read, a full disk) leaves the earlier export whole
    # (writing each shard into place as it went mixed two steps' shards under one index).
    staged = [os.path.join(out_dir, file + ".tmp") for file in files]
    try:
        for tmp, names in zip(staged, shards):
            digests = write_shard(tmp, names, out_spec, src, cast, progress)
            verify_shard(tmp, digests)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            write_synced(staged[-1], json.dumps(index, indent=2).encode())
        for tmp, file in zip(staged, files):
            os.replace(tmp, os.path.join(out_dir, file))
    except BaseException:
        for tmp in staged:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    _remove_stale_exports(out_dir, set(files))
    signed = None
    if signer is not None and plan is not None:
        signed = model_signature.sign_directory(signer, plan)
        log.info("export: %d files of %s signed for OpenSSF model-signing into %s (public key hint %s)",
                 signed.files, out_dir, signed.path, signed.key_hint)
    return ExportSummary(out_dir, src.step, files, len(src.names), total, dtype,
                         signed.path if signed is not None else None)


def _signing_plan(out_dir: str, sign_key: Any,
                  signature: Any) -> tuple[Any, model_signature.SignaturePlan | None]:
    """The export's signer and where its signature goes, or (None, None) without `sign_key`;
    every check runs now, before the source is opened: the key's type, the signature's place,
    and (for an earlier export there) no link or special file in `out_dir`, which model-signing
    refuses."""
    if sign_key is None:
        if signature is not None:
            raise ConfigError(f"signature={shown(signature)}: names where the sign_key's signature goes; "
                              "give sign_key too (an elliptic-curve private key in PEM)")
        return None, None
    signer = model_signature.load_key(sign_key, "sign_key")
    plan = model_signature.plan_signature(out_dir, signature, reserved=_export_writes)
    if os.path.isdir(out_dir):
        model_signature.directory_files(plan)
    return signer, plan


def _export_writes(name: str) -> bool:
    """Whether a path relative to out_dir is one an export writes (or stages as .tmp)."""
    return EXPORT_FILE.fullmatch(name.removesuffix(".tmp")) is not None


def _remove_stale_exports(out_dir: str, written: set[str]) -> None:
    """A previous export's files this one did not write (its shards, its index, or a single file
    where there are shards now) would be read with or instead of these: removed, as Hugging Face's
    save_pretrained removes its own stale shards. Only names an export writes are touched."""
    for name in os.listdir(out_dir):
        if name not in written and EXPORT_FILE.fullmatch(name) and os.path.isfile(os.path.join(out_dir, name)):
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
        if (mf.parse_step_dir(name) is not None or name == FENCE_DIR) and is_checkpoint_root(parent):
            return current
        current = parent


def _out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and dtype.is_floating_point else dtype
