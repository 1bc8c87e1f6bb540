"""Existing checkpoints in: a `torch.save` file or a `torch.distributed.checkpoint` directory
written as a committed distckpt checkpoint that a resuming job loads with `load_latest`.

Both sources are pickles (torch.save files; DCP's `.metadata`), so reading them can run code:
the caller must say it trusts the file (`trust_pickle=True`, `--trust-pickle`). What comes out is
safe to open anywhere, as every distckpt checkpoint. Each top-level key of the source becomes an
entry that restores into whatever the resuming job's `state` holds under that key: a module's
state_dict into the module (training flags are not in the source: the module keeps its own), an
optimizer's into the optimizer, a plain value as a value. The source holds no per-rank state
(RNG streams, loader positions): a job resuming from an import keeps its own, with a warning.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import stat
import tempfile
import uuid
from typing import Any, Callable

from distckpt.errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    MissingFileError,
    UnstorableValueError,
    shown,
)
from distckpt.io.safetensors_format import safetensors_chunks
from distckpt.io.serialize import encode_tree
from distckpt.protocol.commit import list_committed
from distckpt.protocol.fencing import acquire
from distckpt.protocol.saving import StagedSave, write_and_commit
from distckpt.runtime.versions import collect_versions
from distckpt.state.capture import IMPORTED
from distckpt.state.validation import LARGEST_COUNT
from distckpt.storage import open_storage

MAX_IMPORT_WORLD = 1 << 16  # one rank file each, written by this process: 10^6 took a GiB and minutes

PICKLE_WARNING = ("{source} is a pickle: loading it can run code it holds (distckpt reads it with torch's "
                  "restricted weights_only unpickler, and DCP's metadata with torch's own reader). Pass "
                  "--trust-pickle (trust_pickle=True) only for files you or a trusted job wrote; the "
                  "checkpoint written from it never needs unpickling again.")


def import_torch(file: str, url: str, *, trust_pickle: bool = False, world_size: int = 1,
                 step: int | None = None, storage_options: dict[str, Any] | None = None,
                 progress: Callable[[str], None] = lambda phase: None) -> int:
    """Write `file` (a torch.save of a dict of state_dicts and values) as a committed checkpoint
    at `url`; returns its step (from the file's "step"/"global_step", else `step`, else 0).
    `progress` is called as each of its three phases starts, with what it does."""
    if not trust_pickle:
        raise ConfigError(PICKLE_WARNING.format(source=file))
    _require_regular_files([file])
    progress(f"reading {os.path.basename(file)}")
    return _write_import(_load_weights_only(file), url, f"torch.save file {os.path.basename(file)}", world_size,
                         step, storage_options, progress)


def import_dcp(directory: str, url: str, *, trust_pickle: bool = False, world_size: int = 1,
               step: int | None = None, storage_options: dict[str, Any] | None = None,
               progress: Callable[[str], None] = lambda phase: None) -> int:
    """Write a DCP checkpoint directory (any world size that wrote it) as a committed checkpoint.
    `progress` is called as each of its four phases starts, with what it does."""
    if not trust_pickle:
        raise ConfigError(PICKLE_WARNING.format(source=os.path.join(directory, ".metadata")))
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not os.path.isdir(directory) or not os.path.isfile(os.path.join(directory, ".metadata")):
        raise MissingFileError(2, f"{directory}: not a DCP checkpoint directory (no .metadata file in it)")
    _require_regular_files([os.path.join(directory, n) for n in sorted(os.listdir(directory))
                            if n == ".metadata" or n.endswith(".distcp")])
    with tempfile.TemporaryDirectory(prefix="distckpt-import-") as tmp:
        whole = os.path.join(tmp, "whole.pt")
        progress(f"converting {os.path.basename(os.path.normpath(directory))} with DCP")
        try:
            dcp_to_torch_save(directory, whole)  # one process, no process group
        except (Exception, CheckpointException) as e:  # assertion, checkpoint, OS errors: a damaged directory
            raise CorruptCheckpointError(f"{directory}: DCP could not read it ({type(e).__name__}: "
                                         f"{_first_line(e)}); nothing was imported") from e
        progress("reading the converted file")
        obj = _load_weights_only(whole)
    return _write_import(_optimizer_keys_as_ints(obj), url, f"DCP checkpoint {os.path.basename(os.path.normpath(directory))}",
                         world_size, step, storage_options, progress)


def _require_regular_files(paths: list[str]) -> None:
    """Each source a regular file (a link to one is fine): a FIFO would block the import for
    ever on its first read, a device would be read without end."""
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError as e:
            raise MissingFileError(2, f"{path}: no such file; nothing was imported") from e
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{path} is not a regular file (a FIFO, device, socket or directory stands there); "
                              "import reads regular files only: nothing was imported")


def _load_weights_only(file: str) -> Any:
    """torch.load with weights_only=True: torch's restricted unpickler, which builds tensors and
    plain containers only, so even a trusted file cannot run code here; what it refuses (a
    pickled class) could not be stored as a checkpoint value anyway."""
    import torch

    try:
        with _numpy_scalars_allowed():
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError or others for refused globals
        raise UnstorableValueError(
            f"{file} is not a torch.save file of tensors and plain values ({type(e).__name__}: {_first_line(e)}); "
            "save a dict of state_dicts and plain values (e.g. vars(args), not args) and import that") from e


def _numpy_scalars_allowed() -> Any:
    """NumPy scalars (a `step` saved as np.int64, a metric as np.float32) let through torch's
    restricted unpickler: the scalar is rebuilt from its dtype and raw bytes, and the dtype from
    its code; arrays and every other class stay refused."""
    import numpy as np
    import torch

    try:
        multiarray = importlib.import_module("numpy._core.multiarray")  # NumPy 2
    except ImportError:
        multiarray = importlib.import_module("numpy.core.multiarray")
    allowed = [multiarray.scalar, np.dtype]
    dtypes = getattr(np, "dtypes", None)  # NumPy >= 1.25 pickles some dtypes by their class
    if dtypes is not None:
        allowed += [getattr(dtypes, name) for name in dir(dtypes) if name.endswith("DType")]
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:  # torch 2.4: no context manager, only the process-wide list
        torch.serialization.add_safe_globals(allowed)
        return contextlib.nullcontext()
    return safe_globals(allowed)


_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*m")  # torch's messages embolden words for a terminal


def _first_line(e: BaseException) -> str:
    return _TERMINAL_CODES.sub("", (str(e).splitlines() or ["(no message)"])[0])[:200]


def _write_import(obj: Any, url: str, source: str, world_size: int, step: int | None,
                  storage_options: dict[str, Any] | None, progress: Callable[[str], None]) -> int:
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise UnstorableValueError(f"{source} holds a {type(obj).__name__}; an import needs a dict of named "
                                   "entries (e.g. {'model': model.state_dict(), 'optimizer': opt.state_dict()})")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_IMPORT_WORLD:
        raise ConfigError(f"world_size={shown(world_size)}: must be an int from 1 to {MAX_IMPORT_WORLD} (the ranks of the "
                          "resuming job; the import writes one file per rank)")
    step = _step_of(obj, step)
    epoch = obj.get("epoch") if type(obj.get("epoch")) is int and obj["epoch"] >= 0 else None
    storage = open_storage(url, storage_options)
    committed = list_committed(storage)
    if committed:  # one run per root: an import starts a run, it never joins another's steps
        raise CheckpointExistsError(17, f"{storage.url} already holds committed steps {committed[:10]} of a run; "
                                    "import into a new root")
    entries = {key: {"kind": IMPORTED, "state": value} for key, value in obj.items()}
    progress(f"encoding {len(entries)} entries")
    replicated = encode_tree({"step": step, "epoch": epoch, "entries": entries}, ("imported",))
    rank_files = {r: b"".join(safetensors_chunks(encode_tree(
        {"step": step, "epoch": epoch, "rank": r, "world_size": world_size, "rng": None, "entries": {}})))
        for r in range(world_size)}  # handed over: this process writes every rank's file
    run_id = uuid.uuid4().hex
    ranks: list[dict[str, Any]] = [{"rank": r, "step": step, "epoch": epoch, "host": "import", "pid": os.getpid(),
              "per_rank_entries": [], "generation": None} for r in range(world_size)]
    kinds = {key: {"scope": "replicated", "kind": IMPORTED} for key in obj}
    staged = StagedSave(step, epoch, None, run_id, replicated, rank_files, ranks, kinds,
                        {"capture_s": 0.0, "gather_s": 0.0}, manifest_extra={"imported": source})
    progress(f"writing step {step} to {storage.url}")
    write_and_commit(storage, staged, collect_versions, acquire(storage, run_id, None))
    return step


def _optimizer_keys_as_ints(value: Any) -> Any:
    """DCP flattens keys to strings: an optimizer's per-parameter state comes back under "0", "1"
    while its param_groups still list 0, 1. Put the ints back, so load_state_dict matches them."""
    if isinstance(value, dict):
        if isinstance(value.get("state"), dict) and isinstance(value.get("param_groups"), list):
            state = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value["state"].items()}
            return {**value, "state": state}
        return {k: _optimizer_keys_as_ints(v) for k, v in value.items()}
    return value


def _step_of(obj: dict[str, Any], step: int | None) -> int:
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= LARGEST_COUNT:
            raise ConfigError(f"step={shown(step)}: must be an int >= 0 (at most 2**63-1, as save() takes)")
        return step
    for key in ("step", "global_step", "iteration"):
        if key not in obj:
            continue
        value = _integer(obj[key])
        # beyond 2**63-1 the job resumed from it could never save again (save() refuses such steps)
        if value is None or not 0 <= value <= LARGEST_COUNT:
            raise ConfigError(f"the source's {shown(key)} is {obj[key]!r}, not a step number (an int from 0 to "
                              "2**63-1); pass the step to commit it as (--step N, step=N)")
        return value
    return 0


def _integer(value: Any) -> int | None:
    """An int, a NumPy integer or a one-element integer tensor (`torch.tensor(1500)`), as an int."""
    import numpy as np
    import torch

    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point \
            and not value.dtype.is_complex and value.dtype != torch.bool:
        return int(value.item())
    return None

