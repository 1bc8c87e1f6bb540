"""Reading checkpoints for people and scripts (the CLI), with exactly the loader's rules.

A checkpoint is committed iff its marker exists and matches the manifest; files are checked
against the manifest's sizes and checksums. Nothing here is collective or restores state.
"""

from __future__ import annotations

import math
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from distckpt.errors import CorruptCheckpointError, DistCkptError, SupersededCheckpointError
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.io.copying import same_bits
from distckpt.io.safetensors_format import checked_header
from distckpt.io.serialize import decode_tree, load_tree_file
from distckpt.protocol import incremental
from distckpt.protocol.commit import check_not_superseded, list_committed, read_marker, read_verified_manifest
from distckpt.protocol.fencing import Lease, read_leases
from distckpt.protocol.payload_trees import check_rank_tree, check_replicated_tree, rank_of_file
from distckpt.state.kinds import kind_named
from distckpt.storage import Storage


def read_manifest(storage: Storage, step: int, leases: list[Lease] | None = None) -> mf.Manifest:
    """The verified manifest; with `leases`, a superseded writer's commit is refused as the loader does."""
    marker = read_marker(storage, step)
    check_not_superseded(marker, leases or [], f"{storage.url}/{mf.step_dir(step)}")
    return read_verified_manifest(storage, step, marker)


@dataclass(frozen=True)
class StepListing:
    step: int
    status: str  # "committed", "damaged: …", "superseded: …", "uncommitted", "retired: …"
    manifest: mf.Manifest | None = None


def list_steps(storage: Storage) -> list[StepListing]:
    """Every step directory with its status. A step the whole-root listing cannot show as
    committed is asked on its own: a marker replaced by a directory (no file to list), or a
    listing that failed on one unreadable step directory (which failed the whole command and hid
    the readable steps), is then listed as damaged with its error."""
    try:
        committed: set[int] | None = set(list_committed(storage))
    except (DistCkptError, OSError):
        committed = None
    leases = read_leases(storage)
    out = []
    shared: set[str] = set()
    for name in storage.list_dir(""):
        step = mf.parse_step_dir(name)
        if step is None:
            continue
        if (committed is None or step not in committed) and not marker_may_stand(storage, step):
            out.append(StepListing(step, "uncommitted"))
            continue
        try:
            out.append(StepListing(step, "committed", read_manifest(storage, step, leases)))
            shared.update(out[-1].manifest.shared_files or {})  # type: ignore[union-attr]
        except SupersededCheckpointError as e:  # intact, but a zombie's: loaded only as the last resort
            out.append(StepListing(step, f"superseded: {e}"))
        except (DistCkptError, OSError) as e:
            out.append(StepListing(step, f"damaged: {e}"))
    for i, listing in enumerate(out):  # incremental: a deleted step whose files newer ones share
        if listing.status == "uncommitted" and any(p.startswith(mf.step_dir(listing.step) + "/") for p in shared):
            out[i] = StepListing(listing.step, "retired: holds files committed steps share")
    return sorted(out, key=lambda s: s.step)


def marker_may_stand(storage: Storage, step: int) -> bool:
    """Whether something stands where the step's marker goes; when the store cannot say (an
    unreadable step directory), yes: reading the marker then names the error."""
    try:
        storage.list_dir(mf.step_dir(step))  # raises for a directory that cannot be read
        return storage.exists(f"{mf.step_dir(step)}/{mf.MARKER}")
    except (DistCkptError, OSError):
        return True


def verify_step(storage: Storage, step: int, progress: Callable[[int], None] = lambda n: None,
                leases: list[Lease] | None = None, superseded: list[str] | None = None) -> list[str]:
    """Problems found in one step (empty when it verifies): each names its file. Pass `leases`
    (read_leases) when verifying many steps, so they are read once. With `superseded` (a list),
    a superseded writer's commit is not a problem in itself: why it is superseded is appended
    there and its files are verified like any other step's (it is the loader's last resort)."""
    base = mf.step_dir(step)
    try:
        manifest = read_manifest(storage, step, read_leases(storage) if leases is None else leases)
    except SupersededCheckpointError as e:
        if superseded is None:
            return [str(e)]
        superseded.append(str(e))
        try:
            manifest = read_manifest(storage, step)
        except (DistCkptError, OSError) as e2:
            return [str(e2)]
    except (DistCkptError, OSError) as e:
        return [str(e)]
    problems = []
    replicated_name = manifest.payload_names()[0]
    for name, record in manifest.files.items():
        where = f"{storage.url}/{base}/{name}"
        try:
            data = storage.read_bytes(f"{base}/{name}")
            mf.verify_file(data, record, where, digest=signing.verifies(storage))
            # incremental: the files it shares with older steps are verified as its own
            extra = incremental.resolve(storage, manifest, where) if name == replicated_name else None
            tree = load_tree_file(data, where, extra)
            rank = rank_of_file(manifest, name)
            if rank is None:
                check_replicated_tree(tree, manifest, where)
            else:
                check_rank_tree(tree, rank, manifest, where)
        except (DistCkptError, OSError) as e:
            problems.append(str(e) if where in str(e) else f"{where}: {e}")
        progress(record["size"])
    return problems


def _header_tree(data: bytes, where: str,
                 reused: dict[str, tuple[str, list[int], int, str]] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """The tree with tensors shown as descriptions, from the checked header alone (no tensor
    bytes, no checksum: that is `verify`'s job). `reused`: tensors shared with older steps."""
    tree, ranges, _ = checked_header(data, where)
    table = [{"name": name, "dtype": str(dtype).replace("torch.", ""), "shape": shape, "bytes": stop - begin}
             for name, begin, stop, dtype, shape in sorted(ranges)]
    table += [{"name": name, "dtype": dtype, "shape": shape, "bytes": n, "shared_from": file}
              for name, (dtype, shape, n, file) in sorted((reused or {}).items())]
    # meta tensors, not stand-in objects: the decoder re-strides, wraps as Parameter and sets
    # requires_grad exactly as a load does, and a meta tensor supports all of it with no bytes
    placeholders = {t["name"]: torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]), device="meta")
                    for t in table}
    return decode_tree(tree, placeholders, where), table


def _describe_tensor(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).replace("torch.", "")
    parameter = isinstance(tensor, torch.nn.Parameter)
    grad = " requires_grad" if tensor.requires_grad and not parameter else ""
    return f"<{'parameter' if parameter else 'tensor'} {dtype} {list(tensor.shape)}{grad}>"


def describe_step(storage: Storage, step: int, rank_tensors: bool = False) -> dict[str, Any]:
    """Manifest, per-rank summaries (RNG streams, samplers, loaders), config, tensor table; with
    `rank_tensors`, each rank's tensor table too ("rank_tensors", a list by rank)."""
    try:
        return _describe_step(storage, step, rank_tensors)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise CorruptCheckpointError(f"{storage.url}/{mf.step_dir(step)}: a tree does not have the structure "
                                     f"distckpt writes ({type(e).__name__}: {str(e)[:120]})") from e


def _describe_step(storage: Storage, step: int, rank_tensors: bool = False) -> dict[str, Any]:
    manifest = read_manifest(storage, step)
    base = mf.step_dir(step)
    replicated_name, rank_names = manifest.payload_names()
    reused = incremental.reused_specs(storage, manifest)
    # each file named by its URL: "replicated: 0 bytes is too short for a header" named no file
    replicated, table = _header_tree(_verified_bytes(storage, manifest, replicated_name),
                                     f"{storage.url}/{base}/{replicated_name}", reused)
    ranks: list[dict[str, Any]] = []
    tables: list[list[dict[str, Any]]] = []
    for rank in range(manifest.world_size):
        own, own_table = _header_tree(_verified_bytes(storage, manifest, rank_names[rank]),
                                      f"{storage.url}/{base}/{rank_names[rank]} (rank {rank})")
        ranks.append({"rank": rank, "epoch": own.get("epoch"), "rng_streams": sorted(own.get("rng") or {}),
                      "entries": {k: _summarise(v) for k, v in own["entries"].items()}})
        tables.append(own_table)
    config = replicated["entries"].get("config", {}).get("state")
    shared = manifest.shared_bytes  # the referenced files' sizes, as `ls` counts them
    owned = manifest.owned_bytes
    described = {"manifest": manifest.to_json(), "ranks": ranks, "config": _plain(config), "tensors": table,
                 "bytes_owned": owned, "bytes_shared": shared}
    return {**described, "rank_tensors": tables} if rank_tensors else described


def _verified_bytes(storage: Storage, manifest: mf.Manifest, name: str) -> bytes:
    """One of the step's files, its size and checksum checked against the manifest as a load
    checks them: a step no load can read is never described as if it were whole (the file is
    read whole anyway, so the checksum costs no extra read)."""
    base = mf.step_dir(manifest.step)
    data = storage.read_bytes(f"{base}/{name}")
    mf.verify_file(data, manifest.files[name], f"{storage.url}/{base}/{name}")
    return data


def _summarise(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry's kind and the few values its kind shows of it (a sampler's epoch, a loader's position)."""
    return {"kind": entry["kind"], **kind_named(entry["kind"]).summary(entry["state"])}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def load_trees(storage: Storage, step: int) -> dict[str, Any]:
    """Every tree of a step (replicated and each rank), verified, tensors included."""
    manifest = read_manifest(storage, step)
    base = mf.step_dir(step)
    out = {}
    replicated_name = manifest.payload_names()[0]
    for name, record in manifest.files.items():
        data = storage.read_bytes(f"{base}/{name}")
        mf.verify_file(data, record, f"{storage.url}/{base}/{name}")
        extra = incremental.resolve(storage, manifest, f"{storage.url}/{base}") if name == replicated_name else None
        out[name] = load_tree_file(data, name, extra)
    return out


def flatten(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    kind = type(value)
    if kind not in (dict, list) and isinstance(value, (dict, list, tuple)):
        yield f"{path}<type>", kind.__name__  # an OrderedDict, Counter or tuple comes back as such
    if isinstance(value, OrderedDict):
        yield f"{path}<order>", [str(k) for k in value]  # its order is part of what is restored
    if isinstance(value, dict) and any(type(k) is int for k in value):
        yield f"{path}<int keys>", [k for k in value if type(k) is int]  # 1 and "1" share a path below
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from flatten(v, f"{path}/{k}" if path else str(k))
    elif isinstance(value, (list, tuple)) and value and not all(type(v) in (int, float, str, bool, type(None)) for v in value):
        for i, v in enumerate(value):
            yield from flatten(v, f"{path}/{i}")
    else:
        yield path, value


def _tensor_change(key: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    xd, yd = x.double(), y.double()
    changed = ~((xd == yd) | (xd.isnan() & yd.isnan()))
    if not bool(changed.any()):  # equal values in other bits: -0.0 for 0.0, another NaN payload
        return {"key": key, "change": "bits", "changed_elements": 0, "max_abs_diff": 0.0}
    delta = (xd - yd).abs()[changed]
    finite = delta[delta.isfinite()]
    return {"key": key, "change": "values", "changed_elements": int(changed.sum()),
            "max_abs_diff": float(finite.max()) if finite.numel() == delta.numel() else float("inf")}


def diff_steps(storage: Storage, a: int, b: int) -> list[dict[str, Any]]:
    """What changed between two steps: per tensor the max absolute difference (or its dtype,
    shape, kind, requires_grad, layout), per value old/new, compared as a load restores them:
    by type and bits (-0.0 against 0.0, 1 against 1.0), an OrderedDict's order included. Files
    are paired by their role (replicated, each rank), not by the writer's generation in the name."""
    left = dict(kv for name, tree in load_trees(storage, a).items() for kv in flatten(tree, _role(name)))
    right = dict(kv for name, tree in load_trees(storage, b).items() for kv in flatten(tree, _role(name)))
    rows = []
    for key in sorted(set(left) | set(right)):
        if key not in left or key not in right:
            rows.append({"key": key, "change": "added" if key not in left else "removed"})
            continue
        row = _value_change(key, left[key], right[key])
        if row is not None:
            rows.append(row)
    return rows


_GENERATION_SUFFIX = re.compile(r"(\.g\d+)?\.safetensors$")


def _role(file_name: str) -> str:
    """'replicated/state.g000002.safetensors' -> 'replicated/state': the same role in every incarnation."""
    return _GENERATION_SUFFIX.sub("", file_name)


def _value_change(key: str, x: Any, y: Any) -> dict[str, Any] | None:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return _tensor_pair_change(key, x, y)
    if type(x) is not type(y):  # 1 against 1.0, a tensor against a number, a list against a tuple
        return {"key": key, "change": f"{_kind(x)} -> {_kind(y)}", "old": _plain(x), "new": _plain(y)}
    if isinstance(x, float):
        if struct.pack("<d", x) == struct.pack("<d", y):
            return None
        if x == y or (math.isnan(x) and math.isnan(y)):  # -0.0 against 0.0, another NaN payload
            return {"key": key, "change": "bits", "old": _float_bits(x), "new": _float_bits(y)}
        return {"key": key, "change": "value", "old": _plain(x), "new": _plain(y)}
    if isinstance(x, (list, tuple)):  # a list of plain values, compared item by item as above
        if len(x) != len(y) or any(_value_change(key, a, b) is not None for a, b in zip(x, y)):
            return {"key": key, "change": "value", "old": _plain(x), "new": _plain(y)}
        return None
    if x != y:
        return {"key": key, "change": "value", "old": _plain(x), "new": _plain(y)}
    return None


def _tensor_pair_change(key: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any] | None:
    if x.shape != y.shape or x.dtype != y.dtype:
        return {"key": key, "change": f"{x.dtype}{list(x.shape)} -> {y.dtype}{list(y.shape)}"}
    if not same_bits(x, y):  # an unchanged NaN is unchanged
        return _tensor_change(key, x, y)
    if type(x) is not type(y) or x.requires_grad != y.requires_grad:
        return {"key": key, "change": f"{_describe_tensor(x)} -> {_describe_tensor(y)}"}
    if x.stride() != y.stride():
        return {"key": key, "change": f"layout: strides {list(x.stride())} -> {list(y.stride())}"}
    return None


def _kind(value: Any) -> str:
    return _describe_tensor(value) if isinstance(value, torch.Tensor) else type(value).__name__


def _float_bits(value: float) -> str:
    return f"{value!r} (0x{struct.pack('>d', value).hex()})"
