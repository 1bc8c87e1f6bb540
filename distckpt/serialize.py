"""Turning state into bytes and back, with no pickle in either direction.

A state tree is made of tensors and plain values (None, bool, int, float, str, list, tuple,
dict with str or int keys). It is stored as one file in the safetensors format: the tensors
are the file's tensors, and the tree, with every tensor replaced by a reference to its name,
is JSON in the file's ``__metadata__`` (so the file is self-describing and any safetensors
reader opens it).

Tree encoding (JSON): None/bool/int/str and finite floats are themselves; every container is
tagged so that types survive the round trip exactly::

    {"d": [[key, value], ...]}   dict (keys str or int, order kept)
    {"l": [...]}                 list
    {"t": [...]}                 tuple
    {"T": "name"}                tensor stored under `name`
    {"S": "name"}                sharded tensor (DTensor): its chunks live in the ranks' shard
                                 files, listed by the manifest (sharded.py); decodes to a ShardRef
    {"f": "nan" | "inf" | "-inf"} non-finite float

Tensors are written as their own bytes: a view of a large buffer costs only its elements, a
non-contiguous tensor is written in row-major order, and tensors that share the same storage
region (tied weights) are written once and come back as one tensor object.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch

from .errors import CorruptCheckpointError, UnstorableValueError

TREE_METADATA_KEY = "distckpt.tree"
FORMAT_METADATA_KEY = "format"
FORMAT_NAME = "distckpt-tree-v1"
# A header larger than this is not one we wrote; refuse before parsing it.
MAX_HEADER_BYTES = 64 * 1024 * 1024

_DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPE_TO_ST[getattr(torch, _name)] = _code
_ST_TO_DTYPE = {code: dtype for dtype, code in _DTYPE_TO_ST.items()}


def key_path(path: tuple[Any, ...], root: str = "state") -> str:
    """`("config", "lr")` -> `state['config']['lr']`, the form used in every error message."""
    return root + "".join(f"[{p!r}]" for p in path)


@dataclass
class EncodedTree:
    """A tree ready to write: JSON-able nodes plus the tensors they reference by name."""

    node: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class StagingPool:
    """Host buffers for async saves, allocated once and reused while shapes stay the same.

    Pinned when CUDA is present, so device-to-host copies run asynchronously; `sync()` waits for
    them before the background write starts. Call between saves only: a save in flight reads them.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self._pending_device_copies = False

    def stage(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self.buffers[name] = buf
        device = tensor.device.type != "cpu"
        buf.copy_(tensor, non_blocking=device)
        self._pending_device_copies |= device
        return buf

    def sync(self) -> None:
        if self._pending_device_copies and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._pending_device_copies = False


@dataclass(frozen=True)
class ShardRef:
    """A sharded tensor in a decoded tree: resolved against the live DTensor on load."""

    name: str


class ShardSink(Protocol):
    """Where the encoder hands DTensors (sharded.LocalShards); returns the name to reference."""

    def add(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> str: ...

    def add_whole(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> str: ...


class _Encoder:
    def __init__(self, stage: "bool | StagingPool", shards: "ShardSink | None" = None,
                 split: bool = False) -> None:
        self.stage = stage
        self.shards = shards
        self.split = split
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_region: dict[tuple[Any, ...], str] = {}

    def encode(self, value: Any, path: tuple[Any, ...]) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)  # int subclasses (IntEnum) become plain ints
        if isinstance(value, float):
            return value if math.isfinite(value) else {"f": repr(float(value))}
        if isinstance(value, torch.Tensor) and is_dtensor(value) and self.shards is not None:
            return {"S": self.shards.add(value, path)}
        if isinstance(value, torch.Tensor) and self.split and self.shards is not None:
            self._check_dense(value, path)
            return {"S": self.shards.add_whole(value, path)}
        if isinstance(value, torch.Tensor):
            return {"T": self._add_tensor(value, path)}
        if isinstance(value, dict):
            return {"d": [[self._check_key(k, path), self.encode(v, path + (k,))]
                          for k, v in value.items()]}
        if isinstance(value, list):
            return {"l": [self.encode(v, path + (i,)) for i, v in enumerate(value)]}
        if isinstance(value, tuple):
            return {"t": [self.encode(v, path + (i,)) for i, v in enumerate(value)]}
        raise UnstorableValueError(
            f"{key_path(path)} is {_describe(value)}: store tensors and plain values only "
            "(None, bool, int, float, str, list, tuple, dict); convert it, or give its owner "
            "state_dict()/load_state_dict()")

    @staticmethod
    def _check_key(key: Any, path: tuple[Any, ...]) -> str | int:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise UnstorableValueError(
                f"{key_path(path)} has a key {key!r} of type {type(key).__name__}: "
                "dict keys must be str or int")
        return key if isinstance(key, str) else int(key)

    def _add_tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> str:
        self._check_dense(tensor, path)
        check_dtype(tensor, path)
        region = _region_key(tensor)
        if region is not None and region in self._by_region:
            return self._by_region[region]
        name = self._unique_name(path)
        if isinstance(self.stage, StagingPool):
            self.tensors[name] = self.stage.stage(name, tensor.detach())
        else:
            self.tensors[name] = _detach_for_write(tensor, self.stage)
        if region is not None:
            self._by_region[region] = name
        return name

    @staticmethod
    def _check_dense(tensor: torch.Tensor, path: tuple[Any, ...]) -> None:
        if is_dtensor(tensor):
            raise UnstorableValueError(
                f"{key_path(path)} is a DTensor outside a sharded module or optimizer: put the "
                "FSDP2 / DTensor model itself and its optimizer in `state`, or store .full_tensor()")
        if tensor.is_sparse or tensor.is_quantized:
            raise UnstorableValueError(
                f"{key_path(path)} is a {type(tensor).__name__} with layout {tensor.layout}: "
                "only dense tensors are stored; convert it (e.g. .to_dense())")

    def _unique_name(self, path: tuple[Any, ...]) -> str:
        base = "/".join(str(p) for p in path) or "tensor"
        name, n = base, 1
        while name in self.tensors:
            name, n = f"{base}#{n}", n + 1
        return name


def check_dtype(tensor: torch.Tensor, path: tuple[Any, ...]) -> None:
    if tensor.dtype not in _DTYPE_TO_ST:
        raise UnstorableValueError(
            f"{key_path(path)} has dtype {tensor.dtype}, which the safetensors format "
            "cannot hold; convert it (complex: torch.view_as_real)")


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def _region_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Tensors with equal keys are the same bytes (tied weights); None: never shared."""
    if tensor.numel() == 0:
        return None
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _detach_for_write(tensor: torch.Tensor, stage: bool) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type != "cpu":
        return t.to("cpu", copy=True).contiguous()
    if stage:
        # A snapshot for a background write: training may change the original in place.
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()  # no copy when already contiguous (a view keeps only its extent)


def _describe(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        return "a function" if hasattr(value, "__code__") else f"a callable {type(value).__name__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def encode_tree(value: Any, path: tuple[Any, ...] = (), *, stage: "bool | StagingPool" = False,
                shards: "ShardSink | None" = None, split: bool = False) -> EncodedTree:
    """Check and encode a tree; raises UnstorableValueError naming the key path of a bad value.

    With ``stage=True`` every tensor is copied, with a StagingPool into its reused buffers, so
    the result no longer aliases live state. With `shards`, DTensors are handed to it and the
    tree keeps a reference ({"S": name}); without, a DTensor is refused. With `split` too, every
    other tensor goes to `shards` whole (split writes: ranks share the replicated payload).
    """
    encoder = _Encoder(stage, shards, split)
    node = encoder.encode(value, path)
    if isinstance(stage, StagingPool):
        stage.sync()
    return EncodedTree(node, encoder.tensors)


def decode_tree(node: Any, tensors: dict[str, torch.Tensor], where: str = "tree") -> Any:
    """Inverse of encode_tree; a node we never write is a CorruptCheckpointError."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (tag, body), = node.items()
        if tag == "d" and isinstance(body, list):
            return {_pair(p, where)[0]: decode_tree(_pair(p, where)[1], tensors, where) for p in body}
        if tag == "l" and isinstance(body, list):
            return [decode_tree(v, tensors, where) for v in body]
        if tag == "t" and isinstance(body, list):
            return tuple(decode_tree(v, tensors, where) for v in body)
        if tag == "T" and isinstance(body, str) and body in tensors:
            return tensors[body]
        if tag == "S" and isinstance(body, str):
            return ShardRef(body)
        if tag == "f" and body in ("nan", "inf", "-inf"):
            return float(body)
    raise CorruptCheckpointError(f"{where}: unexpected node {str(node)[:80]!r}")


def _pair(p: Any, where: str) -> tuple[Any, Any]:
    if isinstance(p, list) and len(p) == 2 and isinstance(p[0], (str, int)):
        return p[0], p[1]
    raise CorruptCheckpointError(f"{where}: malformed dict entry {str(p)[:80]!r}")


# -- the safetensors container -------------------------------------------------------------

def safetensors_chunks(tree: EncodedTree) -> Iterator[memoryview]:
    """Yield the bytes of a safetensors file holding the tree, without building it in memory.

    Hand-written because safetensors' own `save`/`save_file` first assemble the whole file in
    one buffer (a second copy of the state) and give no way to checksum while writing.
    """
    header: dict[str, Any] = {"__metadata__": {
        FORMAT_METADATA_KEY: FORMAT_NAME,
        TREE_METADATA_KEY: json.dumps(tree.node, allow_nan=False, separators=(",", ":")),
    }}
    offset = 0
    for name, t in _aligned_order(tree.tensors):
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    yield memoryview(struct.pack("<Q", len(raw)) + raw)
    for _, t in _aligned_order(tree.tensors):
        if t.numel():
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _aligned_order(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Largest elements first: with the header padded to 8 bytes, every tensor then starts at an
    offset divisible by its element size, so a reader can view it in place without copying
    (the format forbids gaps between tensors, so padding is not an option)."""
    return sorted(tensors.items(), key=lambda kv: -kv[1].element_size())


def read_header(data: bytes | memoryview, where: str) -> tuple[dict[str, Any], int]:
    """Parse the safetensors header; returns (header, data_start). Bounded before parsing."""
    if len(data) < 8:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes is too short for a header")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise CorruptCheckpointError(f"{where}: header length {n} exceeds the file ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: header is not a JSON object")
    return header, 8 + n


def load_tree_file(data: bytes | bytearray | memoryview, where: str) -> Any:
    """Decode a tree file (already checksum-verified) into the original tree.

    Tensors are views into `data` when it is writable and they are aligned, so a load costs no
    copy beyond the one into the live state: 256 MiB parsed in ~0.001 s here, against 0.18 s
    (1,433 MiB/s) for safetensors.torch.load, which copies every tensor out of the buffer.
    Every range is checked (dtype, bounds, size, overlaps) before any tensor is made.
    """
    header, start = read_header(data, where)
    meta = header.pop("__metadata__", None) or {}
    if meta.get(FORMAT_METADATA_KEY) != FORMAT_NAME or TREE_METADATA_KEY not in meta:
        raise CorruptCheckpointError(f"{where}: not a {FORMAT_NAME} file")
    if len(header) > MAX_TENSORS:
        raise CorruptCheckpointError(f"{where}: {len(header)} tensors is more than any checkpoint we write")
    ranges = sorted((_checked_range(name, spec, len(data) - start, where) for name, spec in header.items()),
                    key=lambda r: r[1])
    end = 0
    for name, begin, stop, _, _ in ranges:
        if begin != end:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} at byte {begin} overlaps or leaves a gap after byte {end}")
        end = stop
    if start + end != len(data):
        raise CorruptCheckpointError(f"{where}: {len(data) - start - end} bytes after the last tensor")
    buffer = memoryview(data)
    with warnings.catch_warnings():
        # A read-only buffer (bytes from an object store) is viewed too: restore only copies out
        # of these tensors, and entries an owner keeps are cloned first (capture._owned).
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensors = {name: _tensor_at(buffer, start + begin, stop - begin, dtype, shape)
                   for name, begin, stop, dtype, shape in ranges}
    try:
        return decode_tree(json.loads(meta[TREE_METADATA_KEY]), tensors, where)
    except (ValueError, RecursionError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: the tree is not valid: {str(e)[:200]}") from e


MAX_TENSORS = 100_000  # far above real models (thousands); bounds the parse of a hostile header


def _checked_range(name: str, spec: Any, available: int, where: str) -> tuple[str, int, int, torch.dtype, list[int]]:
    try:
        dtype = _ST_TO_DTYPE[spec["dtype"]]
        shape = [int(d) for d in spec["shape"]]
        begin, stop = (int(x) for x in spec["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has a malformed entry: {str(spec)[:120]}") from e
    numel = 1
    for d in shape:
        if d < 0:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} has a negative dimension")
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= stop <= available or stop - begin != numel * itemsize:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} claims bytes [{begin}, {stop}) for "
                                     f"{numel} x {itemsize} bytes in a {available}-byte data section")
    return name, begin, stop, dtype, shape


def _tensor_at(buffer: memoryview, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    if offset % raw.new_empty((), dtype=dtype).element_size():
        raw = raw.clone()  # a file from another writer, not aligned: copy rather than fail
    return raw.view(dtype).reshape(shape)
