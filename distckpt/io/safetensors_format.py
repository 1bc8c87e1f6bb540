"""The safetensors format of every file distckpt writes: the bytes of a tree file, and its header
read back and checked before any tensor is made.

A tree file is a safetensors file: an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range, then the tensors' bytes. Its ``__metadata__`` holds
the format's name and the tree (serialize.py encodes it) as a JSON string, so the file describes
itself and any safetensors reader opens it. Every tensor the file holds is referenced by the tree.

The limits of a file (MAX_HEADER_BYTES, MAX_TENSORS) are shared by the writer, which refuses at
save what a load would refuse (check_limits), and the reader, which checks them before parsing.
Nothing is allocated by a number read from a header before the file's real size bounds it.

This module never imports torch.distributed.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from distckpt.errors import CorruptCheckpointError, UnstorableValueError
from distckpt.io.staging import tensor_pieces

TREE_METADATA_KEY = "distckpt.tree"
FORMAT_METADATA_KEY = "format"
FORMAT_NAME = "distckpt-tree-v1"
# The limits of a tree file, shared by the writer (checked at save, so a save never commits
# what a load refuses) and the reader (checked before parsing). Sized for real models: a
# million parameter tensors with their AdamW moments and steps is 4,000,000 tensors and a
# header of ~400 MB. The reader never allocates by them before checking the file's real size.
MAX_HEADER_BYTES = 1024 * 1024 * 1024
MAX_TENSORS = 1 << 22
# safetensors reserves this header key for the file's own metadata: no tensor may be named so
METADATA_KEY = "__metadata__"
_INT64 = 1 << 63

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _code
ST_TO_DTYPE = {code: dtype for dtype, code in DTYPE_TO_ST.items()}

@dataclass
class EncodedTree:
    """A tree ready to write: JSON-able nodes plus the tensors they reference by name."""

    node: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _node_json: str | None = field(default=None, repr=False, compare=False)
    # called once the file holding the tree is written (or failed): bounded staging's release
    written: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @property
    def node_json(self) -> str:
        """The tree's JSON, made once: the save-time limit check and the file header both need it."""
        if self._node_json is None:
            self._node_json = json.dumps(self.node, allow_nan=False, separators=(",", ":"))
        return self._node_json

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def check_limits(tree: EncodedTree, where: str) -> None:
    """Refuse at save time what the loader would refuse (the limits are the loader's)."""
    if len(tree.tensors) > MAX_TENSORS:
        raise UnstorableValueError(f"{where} holds {len(tree.tensors):,} tensors; one checkpoint file holds "
                                   f"at most {MAX_TENSORS:,}: stack small tensors into larger ones")
    # Each tensor's header entry is its name plus ~80 bytes; the tree's JSON travels as a JSON
    # string in the header, so each '"' and '\' in it takes two bytes there (a tree of quotes
    # under the limit by its own length was committed, then refused by every load).
    node_json = tree.node_json
    estimate = (sum(len(name) + 80 for name in tree.tensors) + len(node_json) + node_json.count('"')
                + node_json.count("\\") + 2)
    if estimate > MAX_HEADER_BYTES:
        raise UnstorableValueError(
            f"{where}: its plain values and tensor names need about {estimate:,} bytes of header, more than "
            f"the {MAX_HEADER_BYTES:,} a checkpoint file may hold: store large lists of numbers as tensors")


# -- writing -------------------------------------------------------------------------------------

def safetensors_chunks(tree: EncodedTree,
                       pieces: Callable[[torch.Tensor], Iterator[memoryview]] | None = None) -> Iterator[memoryview]:
    """Yield the bytes of a safetensors file holding the tree, without building it in memory.

    Hand-written because safetensors' own `save`/`save_file` first assemble the whole file in
    one buffer (a second copy of the state) and give no way to checksum while writing.
    `pieces` gives a tensor's bytes (default: tensor_pieces; the writer process's reads some
    from its socket).
    """
    pieces = pieces or tensor_pieces
    header: dict[str, Any] = {METADATA_KEY: {
        FORMAT_METADATA_KEY: FORMAT_NAME,
        TREE_METADATA_KEY: tree.node_json,
    }}
    offset = 0
    ordered = _aligned_order(tree.tensors)
    for name, t in ordered:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    yield memoryview(struct.pack("<Q", len(raw)) + raw)
    small = bytearray()
    for _, t in ordered:
        if not t.numel():
            continue
        # a view of t's memory (valid while the tree, the caller's, holds t); a tensor not in
        # host memory in order (a live one under bounded staging) comes in bounded pieces
        for data in pieces(t):
            if data.nbytes >= SMALL_TENSOR_BYTES:
                if small:
                    yield memoryview(small)
                    small = bytearray()
                yield data
            else:
                small += data
                if len(small) >= COALESCE_BYTES:
                    yield memoryview(small)
                    small = bytearray()
    if small:
        yield memoryview(small)


# Tensors smaller than SMALL_TENSOR_BYTES travel to storage in shared pieces of about
# COALESCE_BYTES: one write and one hash update per piece, not per tensor (a save of the demo's
# optimizer state writes ~110 tensors averaging 10 KiB). Larger ones go as they are: copying
# 64 MiB of 0.64 MiB tensors into shared pieces cost 19 ms of a 0.18 s save.
SMALL_TENSOR_BYTES = 64 << 10
COALESCE_BYTES = 1 << 20


def _aligned_order(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Largest elements first: with the header padded to 8 bytes, every tensor then starts at an
    offset divisible by its element size, so a reader can view it in place without copying
    (the format forbids gaps between tensors, so padding is not an option)."""
    return sorted(tensors.items(), key=lambda kv: -_itemsize(kv[1].dtype))


# -- reading -------------------------------------------------------------------------------------

def read_header(data: bytes | bytearray | memoryview, where: str) -> tuple[dict[str, Any], int]:
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


def checked_header(data: bytes | bytearray | memoryview, where: str,
                   check_references: bool = True) -> tuple[Any, list[Any], int]:
    """The header checked against the format: (tree JSON, tensor ranges by offset, data start).
    Every field is checked before use; nothing is allocated by a number read from it. Without
    `check_references` the caller checks that the tree references every tensor (load_tree_file
    does as it decodes: a walk of its own cost 10 us per tensor)"""
    header, start = read_header(data, where)
    meta = header.pop(METADATA_KEY, None) or {}
    if not isinstance(meta, dict) or meta.get(FORMAT_METADATA_KEY) != FORMAT_NAME \
            or not isinstance(meta.get(TREE_METADATA_KEY), str):
        raise CorruptCheckpointError(f"{where}: not a {FORMAT_NAME} file (field '__metadata__')")
    if len(header) > MAX_TENSORS:
        raise CorruptCheckpointError(f"{where}: {len(header)} tensors is more than any checkpoint holds "
                                     f"(at most {MAX_TENSORS:,})")
    try:
        tree = json.loads(meta[TREE_METADATA_KEY])
    except (ValueError, RecursionError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: the tree is not valid: {str(e)[:200]}") from e
    if check_references:
        refuse_unreferenced(set(header) - _referenced_names(tree), where)
    ranges = sorted((_checked_range(name, spec, len(data) - start, where) for name, spec in header.items()),
                    key=lambda r: r[1])
    return tree, ranges, start


def refuse_unreferenced(names: set[str], where: str) -> None:
    if names:
        raise CorruptCheckpointError(f"{where}: {len(names)} tensors are not referenced by the tree "
                                     "(a file we write references every tensor it holds)")


def tensors_of_file(data: bytes | bytearray | memoryview, where: str,
                    check_references: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """The tree JSON and the file's tensors by name (views into `data`), every range checked."""
    tree, ranges, start = checked_header(data, where, check_references)
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
    return tree, tensors


def _referenced_names(tree: Any) -> set[str]:
    """Every tensor name the tree references (iterative: a hostile tree may nest deep)."""
    names: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("T"), str):
                names.add(node["T"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return names


def _checked_range(name: str, spec: Any, available: int, where: str) -> tuple[str, int, int, torch.dtype, list[int]]:
    ok = (isinstance(spec, dict) and isinstance(spec.get("dtype"), str) and spec["dtype"] in ST_TO_DTYPE
          and isinstance(spec.get("shape"), list) and len(spec["shape"]) <= 64
          and all(type(d) is int and 0 <= d < _INT64 for d in spec["shape"])
          and isinstance(spec.get("data_offsets"), list) and len(spec["data_offsets"]) == 2
          and all(type(x) is int for x in spec["data_offsets"]))
    if not ok:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has a malformed entry (dtype, shape as a list of "
                                     f"ints, two data_offsets): {str(spec)[:120]}")
    dtype = ST_TO_DTYPE[spec["dtype"]]
    shape = list(spec["shape"])
    begin, stop = spec["data_offsets"]
    numel = math.prod(shape)
    itemsize = _itemsize(dtype)
    if not 0 <= begin <= stop <= available or stop - begin != numel * itemsize:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} claims bytes [{begin}, {stop}) for "
                                     f"{numel} x {itemsize} bytes in a {available}-byte data section")
    return name, begin, stop, dtype, shape


_ITEMSIZES: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element (remembered: making an empty tensor to ask cost 30 us per tensor, 0.6 s
    for a file of 20,000 tensors)."""
    size = _ITEMSIZES.get(dtype)
    if size is None:
        size = _ITEMSIZES[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def _tensor_at(buffer: memoryview, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = _itemsize(dtype)
    if offset % itemsize:  # a file from another writer, not aligned: copy rather than fail
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset).clone()
        return raw.view(dtype).reshape(shape)
    # Straight to the dtype, and no reshape of what is already 1-D: per tensor, 13 -> 3 us of a
    # 20,000-tensor load (frombuffer in bytes + view(dtype) + reshape against one frombuffer).
    flat = torch.frombuffer(buffer, dtype=dtype, count=nbytes // itemsize, offset=offset)
    return flat if len(shape) == 1 else flat.view(shape)
