"""The Hugging Face safetensors layout: `model.safetensors`, or shards named
`model-00001-of-0000N.safetensors` beside `model.safetensors.index.json` (its weight_map names the
shard of each tensor). Read as a ModelSource (load_weights from an exported directory or file),
and written one shard at a time (export), each shard read back with the safetensors library.

Tensor names are the model's state_dict keys. A name the layout cannot hold (the header's
reserved `__metadata__`, text with no UTF-8 form) is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import struct
from typing import Any, BinaryIO, Callable

import torch
import xxhash

from distckpt.errors import CorruptCheckpointError, DistCkptError, IncompatibleCheckpointError, MissingFileError
from distckpt.io import manifest as mf
from distckpt.io.safetensors_format import DTYPE_TO_ST, METADATA_KEY, ST_TO_DTYPE
from distckpt.io.staging import flat_bytes
from distckpt.storage.local import file_kind
from distckpt.tools.model_source import ModelSource

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
EXPORT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


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
        with safe_open(_regular_file(path), framework="pt") as f:
            names = list(f.keys())
        files = {name: path for name in names}
    spec: dict[str, tuple[torch.dtype, list[int]]] = {}
    for file in sorted(set(files.values())):
        with safe_open(_regular_file(file), framework="pt") as f:
            for name in f.keys():
                if name in files and files[name] != file:
                    raise CorruptCheckpointError(f"{file}: holds {name!r}, which the index places in {files[name]}: "
                                                 "a tensor in two shards (which one is the model's?)")
                if files.get(name) == file:
                    sl = f.get_slice(name)
                    if sl.get_dtype() not in ST_TO_DTYPE:
                        raise IncompatibleCheckpointError(
                            f"{file}: {name!r} is stored as {sl.get_dtype()}, a dtype distckpt does not load "
                            f"(it loads {sorted(ST_TO_DTYPE)}): convert it, or leave it out with ignore=")
                    spec[name] = (ST_TO_DTYPE[sl.get_dtype()], list(sl.get_shape()))
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
        with open(_regular_file(index)) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map names to file names")
        for file in set(weight_map.values()):
            mf.check_relative_path(file, index)
        return weight_map
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{index}: not a safetensors index: {e}") from e


def _regular_file(path: str) -> str:
    """`path`, once it is known to be a regular file (links followed: a Hugging Face cache's
    snapshot files are links into its blobs). Looked at before it is opened: the open() of a FIFO
    standing there waits for a writer forever, and a device may read without end."""
    mode = os.stat(path).st_mode  # FileNotFoundError: said as missing by _unreadable
    if not stat.S_ISREG(mode):
        raise CorruptCheckpointError(f"{path} is {file_kind(mode)}, not a regular file: safetensors files and their "
                                     "index always are, so it was not opened; export it again")
    return path


def check_tensor_names(names: list[str], where: str) -> None:
    """Refuse, before anything is written, a name the layout cannot hold as a tensor's: the
    header's reserved metadata key (such a tensor replaced the file's metadata, and the export
    failed its own read-back) or text with no UTF-8 form (the safetensors library refuses the
    whole file). Names are state_dict keys: a module may register a parameter under either."""
    for name in names:
        if name == METADATA_KEY:
            raise IncompatibleCheckpointError(
                f"{where}: the model has a tensor named {name!r}, the key the safetensors format reserves for "
                "a file's metadata, so a Hugging Face file cannot hold it: rename it in the model (load_weights "
                "reads the checkpoint itself as saved); nothing was written")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise IncompatibleCheckpointError(
                f"{where}: the model's tensor name {ascii(name)} is not UTF-8 text, which a safetensors file "
                "cannot hold: rename it in the model; nothing was written") from None


def open_new(path: str) -> BinaryIO:
    """`path` created for writing, whatever stood there removed first (a file an export killed
    part-way left; a FIFO, whose open() for writing waits for a reader forever), exclusively and
    following no link."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a directory there: IsADirectoryError, the export fails naming it
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def plan_shards(names: list[str], spec: dict[str, tuple[torch.dtype, list[int]]], limit: int) -> list[list[str]]:
    """Tensors in state_dict order, a new shard whenever the next would pass the limit (a tensor
    larger than the limit gets a shard of its own, as Hugging Face's save does)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = nbytes(*spec[name])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_shard(path: str, names: list[str], spec: dict[str, tuple[torch.dtype, list[int]]], src: ModelSource,
                 cast: torch.dtype | None, progress: Callable[[int], None]) -> dict[str, str]:
    """Header first (known from the specs), then one tensor at a time: at most one tensor of the
    source in memory besides the file being written. Returns each tensor's xxh3 of its bytes."""
    header: dict[str, Any] = {METADATA_KEY: {"format": "pt"}}
    offset = 0
    for name in names:
        dtype, shape = spec[name]
        n = nbytes(dtype, shape)
        header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digests = {}
    with open_new(path) as f:
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


def verify_shard(path: str, digests: dict[str, str]) -> None:
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


def write_synced(path: str, data: bytes) -> None:
    with open_new(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
