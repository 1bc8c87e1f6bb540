"""Sharded state (FSDP2 / DTensor): every rank writes its own shards; loads reshard.

Save: a module whose parameters are DTensors (``fully_shard``, tensor parallel) and its
optimizer are captured through ``torch.distributed.checkpoint.state_dict`` (fully qualified
names, DTensor values). The encoder hands each DTensor to :class:`LocalShards`: rank 0's
replicated tree keeps a reference ``{"S": name}``, and every rank keeps the local shard it owns
(along Replicate mesh dimensions only coordinate 0 owns it) with its global offsets. Each rank
writes its shards as ``shards/rank-R.gG.safetensors`` — a plain safetensors file, any reader
opens it — and reports the file's size, checksum and chunk boxes; rank 0 checks that the chunks
of every tensor cover it exactly and puts the chunk table into the manifest before the marker.

Load: for every reference, the live target — a DTensor with this job's mesh and placements, or a
plain tensor in a world of one — defines the box this rank needs, assembled from every saved
chunk that overlaps it. So a checkpoint written by N ranks loads into M ranks.

DCP's own format was not used for the payload: its ``.metadata`` is a pickle (never unpickled
here), and its files are torch.save streams; a chunk table in the JSON manifest carries the same
information and the shard files stay readable by any safetensors reader.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from distckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError, UnstorableValueError
from distckpt.io import manifest as mf
from distckpt.io.checksums import checksum_of
from distckpt.io.reading import read_verified
from distckpt.io.safetensors_format import DTYPE_TO_ST, ST_TO_DTYPE, EncodedTree
from distckpt.io.serialize import (
    ShardRef,
    check_dtype,
    encode_tree,
    is_dtensor,
    key_path,
    load_tree_file,
)
from distckpt.io.staging import StagingPool, memory_of, region_key
from distckpt.storage import Storage, release_pages

SHARDED = "sharded"
SHARD_PREFIX = "shards/"


def shard_file(rank: int, generation: int) -> str:
    return f"{SHARD_PREFIX}rank-{rank:05d}.g{generation:06d}.safetensors"


# -- detection and capture ----------------------------------------------------------------------

def _fsdp_module_class() -> type | None:
    """FSDP2's module class if FSDP2 is in use: a module is fully_shard-ed only once torch's fsdp
    package was imported, so it is looked up, never imported (the capture never pulls in
    torch.distributed: tests/test_gates.py)."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):  # torch >= 2.6, 2.4/2.5
        cls = getattr(sys.modules.get(name), "FSDPModule", None)
        if isinstance(cls, type):
            return cls
    return None


def reshard_fully_sharded(objects: Any) -> None:
    """Put every FSDP2 module among `objects` (and their submodules) back in its sharded form.
    fully_shard leaves the root module unsharded after a forward (reshard_after_forward is off
    for it): after an evaluation pass under no_grad its parameters are plain full tensors while
    the optimizer holds the DTensor shards, so a save refused the optimizer ('no module holds
    all of them') and the module was not seen as sharded. FSDP2's own state_dict() reshards the
    same way; the next forward gathers them again."""
    fsdp = _fsdp_module_class()
    if fsdp is None:
        return
    for obj in objects:
        if isinstance(obj, nn.Module):
            for m in obj.modules():
                if isinstance(m, fsdp):
                    reshard: Any = m.reshard  # FSDPModule's; typed loosely in torch's stubs
                    reshard()


def has_dtensor_params(params: Any) -> bool:
    return any(is_dtensor(p) for p in params)


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def capture_module(module: nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"state_dict": dict(get_model_state_dict(module)),
            "training": {name: m.training for name, m in module.named_modules()}}


def capture_optimizer(module: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """The optimizer's state as it is. DCP's get_optimizer_state_dict first "initialises" an
    optimizer without state by taking a step with zero gradients and lr 0: a save before the
    first step then left AdamW at step 1 with zero moments (the run diverged from one without
    saves) and fired every step hook (an EMA update). Here that initialisation is skipped."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _dcp_optimizer_init(_no_init):
        return get_optimizer_state_dict(module, opt)


def _allowed_placement(placement: Any) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    return type(placement) in (Shard, Replicate)  # not _StridedShard, not Partial


def local_box(dt: Any) -> tuple[list[int], list[int]]:
    """(global offsets, shape) of this rank's local piece of DTensor `dt`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return [int(o) for o in offsets], [int(s) for s in shape]


def _owns(dt: Any) -> bool:
    """Only coordinate 0 along Replicate mesh dimensions writes a piece (no duplicate bytes)."""
    from torch.distributed.tensor import Replicate

    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, p in zip(coordinate, dt.placements) if isinstance(p, Replicate))


class LocalShards:
    """Collects this rank's pieces of every DTensor the encoder meets (a serialize.ShardSink).

    With split writes (``CheckpointManager(split_writes=True)``) it also takes the replicated
    tensors, each whole, and assigns each to one rank — the one with the fewest bytes so far, in
    the order the encoder meets them, which is the same on every rank — so that the ranks write
    the replicated payload in parallel.
    """

    def __init__(self, stage: "bool | StagingPool", rank: int = 0, world_size: int = 1) -> None:
        self.stage = stage
        self.rank, self.world_size = rank, world_size
        self.meta: dict[str, dict[str, Any]] = {}      # name -> global dtype and shape
        self.pieces: dict[str, torch.Tensor] = {}      # name -> the local piece this rank writes
        self.offsets: dict[str, list[int]] = {}
        # Checksums of the pieces of DTensors on part of the world's ranks (tensor parallel on one
        # dimension of a 2-D mesh): the ranks of the other dimensions hold copies the DTensor does
        # not know of, each writes its own, and rank 0 keeps one after checking they are equal.
        self.digests: dict[str, str] = {}
        self._by_id: dict[int, str] = {}
        self._by_region: dict[tuple[Any, ...], str] = {}
        self._assigned = [0] * world_size               # bytes of whole tensors given to each rank
        # Regions rank 0 writes whatever the balance: module buffers, which every rank updates
        # on its own (FSDP2, DDP without broadcast_buffers). Spread over the ranks, the stored
        # model mixed them (rank 0's running_mean beside rank 1's running_var), and a reshard
        # load, load_weights and export got a pair no rank ever held.
        self.rank0_regions: set[tuple[Any, ...]] = set()

    def add_whole(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> str:
        """A replicated tensor: stored whole, in the file of the rank it is assigned to."""
        region = region_key(tensor)
        if region is not None and region in self._by_region:  # tied weights: stored once
            return self._by_region[region]
        check_dtype(tensor, path)
        name = "/".join(str(p) for p in path)
        if region is not None:
            self._by_region[region] = name
        self.meta[name] = {"dtype": DTYPE_TO_ST[tensor.dtype], "shape": list(tensor.shape)}
        if tensor.numel():
            owner = 0 if region in self.rank0_regions else \
                min(range(self.world_size), key=lambda r: (self._assigned[r], r))
            self._assigned[owner] += tensor.numel() * tensor.element_size()
            if owner == self.rank:
                self.offsets[name] = [0] * tensor.dim()
                self.pieces[name] = self._snapshot(name, tensor.detach())
        return name

    def add(self, dt: torch.Tensor, path: tuple[Any, ...]) -> str:
        if id(dt) in self._by_id:  # the same DTensor twice (tied): one set of chunks
            return self._by_id[id(dt)]
        bad = [p for p in dt.placements if not _allowed_placement(p)]  # type: ignore[attr-defined]
        if bad:
            raise UnstorableValueError(
                f"{key_path(path)} is a DTensor with placements {dt.placements}: distckpt "  # type: ignore[attr-defined]
                "stores Shard(dim) and Replicate() placements only (FSDP2, HSDP, tensor parallel). A Partial "
                "tensor: .redistribute() it to Replicate() first; a strided shard (FSDP2 over tensor parallel "
                "on a 2-D mesh): shard the model with one of them, or HSDP (fully_shard over a 2-D mesh)")
        check_dtype(dt, path)
        name = "/".join(str(p) for p in path)
        self._by_id[id(dt)] = name
        self.meta[name] = {"dtype": DTYPE_TO_ST[dt.dtype], "shape": list(dt.shape)}
        local = dt.to_local().detach()  # type: ignore[attr-defined]
        if _owns(dt) and local.numel():
            self.offsets[name] = local_box(dt)[0]
            self.pieces[name] = self._snapshot(name, local)
            if dt.device_mesh.size() < self.world_size:  # type: ignore[attr-defined]
                self.digests[name] = checksum_of(memory_of(local if local.device.type == "cpu" else local.cpu()))
        return name

    def _snapshot(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if isinstance(self.stage, StagingPool):
            return self.stage.stage(f"shard:{name}", local)
        if self.stage or local.device.type != "cpu":
            return local.to("cpu", copy=True).contiguous()
        return local.contiguous()

    def sync(self) -> None:
        if isinstance(self.stage, StagingPool):
            self.stage.sync()

    def file_tree(self, rank: int) -> EncodedTree:
        """The shard file: the pieces plus their offsets, self-describing like every file we write."""
        return encode_tree({"rank": rank, "offsets": dict(self.offsets), "shards": dict(self.pieces)})


@dataclass
class ShardReport:
    """A rank's durable shard file, as the chunk table needs it (from saving.RankReport)."""

    rank: int
    file: str | None = None
    record: dict[str, Any] | None = None           # size and checksum, as in manifest "files"
    boxes: dict[str, list[Any]] | None = None  # name -> [offsets, shape], + checksum for a piece on part of the mesh


def chunk_table(meta: dict[str, dict[str, Any]], reports: list[ShardReport], where: str) -> dict[str, Any]:
    """The manifest's "sharded" table; raises if the reported chunks do not cover every tensor."""
    table = {name: {"dtype": m["dtype"], "shape": m["shape"], "chunks": []} for name, m in meta.items()}
    written: dict[tuple[str, str], tuple[int, Any]] = {}  # (name, box) -> the first rank's (rank, checksum)
    for report in reports:
        for name, box in (report.boxes or {}).items():
            offsets, shape = box[0], box[1]
            if name not in table:
                raise IncompatibleCheckpointError(f"{where}: rank {report.rank} wrote a shard of {name!r}, "
                                                  "which rank 0's state does not hold; ranks hold different models")
            digest = box[2] if len(box) > 2 else None
            first = written.setdefault((name, repr((offsets, shape))), (report.rank, digest))
            if first[0] != report.rank:  # a copy along a mesh dimension the DTensor does not span
                if digest is None or digest != first[1]:
                    raise IncompatibleCheckpointError(
                        f"{where}: ranks {first[0]} and {report.rank} hold the same piece of {name!r} with different "
                        "values: a DTensor on part of the mesh (tensor parallel inside data parallel) must be equal "
                        "on every copy; average the gradients over the other mesh dimension too")
                continue
            table[name]["chunks"].append({"file": report.file, "offsets": offsets, "shape": shape})
    for name, entry in table.items():
        covered = sum(math.prod(c["shape"]) for c in entry["chunks"])
        if covered != math.prod(entry["shape"]) or _overlapping(entry["chunks"]):
            raise IncompatibleCheckpointError(
                f"{where}: the shards of {name!r} cover {covered} of {math.prod(entry['shape'])} elements "
                "(overlapping or missing pieces); every rank must hold the same sharded model")
    return table


def _overlapping(chunks: list[dict[str, Any]]) -> bool:
    boxes = [(c["offsets"], c["shape"]) for c in chunks]
    return any(_intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _intersect(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> tuple[list[int], list[int]] | None:
    """The box both cover ((offsets, shape)), or None."""
    lo = [max(x, y) for x, y in zip(a[0], b[0])]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1])]
    if any(h <= l_ for l_, h in zip(lo, hi)):
        return None
    return lo, [h - l_ for l_, h in zip(lo, hi)]


# -- load ---------------------------------------------------------------------------------------

class ShardReader:
    """Assembles any box of a saved sharded tensor from the chunks that overlap it.

    Shard files are read whole, verified against the manifest's checksum, once per load.
    """

    def __init__(self, storage: Storage, base: str, manifest: "mf.Manifest", where: str,
                 bounded: bool = False) -> None:
        self.storage, self.base, self.where = storage, base, where
        self.files: dict[str, Any] = manifest.files
        self.table: dict[str, Any] = manifest.sharded or {}
        self._opened: dict[str, dict[str, torch.Tensor]] = {}
        self._buffers: list[Any] = []
        self.bounded = bounded  # export: verified files are not kept resident (release())

    def spec(self, name: str) -> tuple[torch.dtype, list[int], list[dict[str, Any]]]:
        entry = self.table.get(name)
        try:
            dtype = ST_TO_DTYPE[entry["dtype"]]  # type: ignore[index]
            shape = [int(s) for s in entry["shape"]]  # type: ignore[index]
            chunks = list(entry["chunks"])  # type: ignore[index]
            for c in chunks:
                if len(c["offsets"]) != len(shape) or len(c["shape"]) != len(shape) or c["file"] not in self.files:
                    raise ValueError(c)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{self.where}: the manifest's chunk table for {name!r} is malformed: {e}") from e
        return dtype, shape, chunks

    def assemble(self, name: str, offsets: list[int], shape: list[int], may_alias: bool = False) -> torch.Tensor:
        """The box (offsets, shape) of tensor `name`. With `may_alias`, a box that is exactly one
        saved chunk (a resume at the same world size) is a view into the file's buffer: the caller
        copies it into live tensors anyway (a module's load_state_dict), and the second copy cost
        0.105 s of a 0.165 s load (2 ranks, 256 MiB, bench/profile_sharded.py --what load)."""
        dtype, global_shape, chunks = self.spec(name)
        if may_alias:
            exact = [c for c in chunks if c["offsets"] == offsets and c["shape"] == shape]
            if exact:
                return self._piece(exact[0]["file"], name, shape, dtype)
        out = torch.empty(shape, dtype=dtype)
        filled = 0
        for chunk in chunks:
            box = _intersect((offsets, shape), (chunk["offsets"], chunk["shape"]))
            if box is None:
                continue
            piece = self._piece(chunk["file"], name, chunk["shape"], dtype)
            src, dst = piece, out
            for dim, (lo, n) in enumerate(zip(*box)):
                src = src.narrow(dim, lo - chunk["offsets"][dim], n)
                dst = dst.narrow(dim, lo - offsets[dim], n)
            dst.copy_(src)
            filled += math.prod(box[1])
        if filled != math.prod(shape):
            raise CorruptCheckpointError(f"{self.where}: the chunks of {name!r} cover {filled} of the "
                                         f"{math.prod(shape)} elements this rank needs")
        return out

    def _piece(self, file: str, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        if file not in self._opened:
            mf.check_relative_path(file, self.where)
            release = (lambda buffer: lambda start, n: release_pages(buffer, start, n)) if self.bounded else None
            data = read_verified(self.storage, f"{self.base}/{file}", self.files[file], f"{self.where}/{file}", release)
            self._buffers.append(data)
            tree = load_tree_file(data, f"{self.where}/{file}")
            if not isinstance(tree, dict) or not isinstance(tree.get("shards"), dict):
                raise CorruptCheckpointError(f"{self.where}/{file}: not a shard file")
            self._opened[file] = tree["shards"]
        piece = self._opened[file].get(name)
        if not isinstance(piece, torch.Tensor) or list(piece.shape) != shape or piece.dtype != dtype:
            raise CorruptCheckpointError(f"{self.where}/{file}: holds no {list(shape)} {dtype} piece of {name!r}")
        return piece


    def open_all(self) -> None:
        """Read and verify every shard file the chunk table names, now: a damaged shard is found
        while the step is being chosen (the caller falls back to an older one), never half-way
        through copying tensors out of it."""
        for name, entry in self.table.items():
            for chunk in entry.get("chunks", []) if isinstance(entry, dict) else []:
                file = chunk.get("file") if isinstance(chunk, dict) else None
                if isinstance(file, str) and file not in self._opened:
                    dtype, _, _ = self.spec(name)
                    self._piece(file, name, list(chunk.get("shape", [])), dtype)

    def release(self) -> None:
        """Drop the shard files' mapped pages from this process (they stay readable)."""
        for data in self._buffers:
            release_pages(data)


def resolve_whole(saved: Any, reader: ShardReader, made: dict[ShardRef, torch.Tensor] | None = None) -> Any:
    """`saved` with every ShardRef replaced by the whole tensor (replicated entries written with
    split writes), a Parameter, requires_grad and laid out as saved; one object per reference
    (`made`), so ties survive. The result may view the files' buffers: restore copies or clones it."""
    made = {} if made is None else made
    if isinstance(saved, ShardRef):
        if saved not in made:
            _, shape, _ = reader.spec(saved.name)
            if saved.order is not None and len(saved.order) != len(shape):
                raise CorruptCheckpointError(f"{reader.where}: {saved.name!r} has a dimension order "
                                             f"{list(saved.order)} for a {shape} tensor")
            made[saved] = saved.as_saved(reader.assemble(saved.name, [0] * len(shape), shape, may_alias=True))
        return made[saved]
    return _rebuilt(saved, lambda v: resolve_whole(v, reader, made))


def _rebuilt(saved: Any, resolve_item: Callable[[Any], Any]) -> Any:
    """A container of the same type (OrderedDict, Counter, torch.Size kept) with its items resolved."""
    if isinstance(saved, dict):
        out = type(saved)()
        for k, v in saved.items():  # item by item: Counter(pairs) would count the pairs
            out[k] = resolve_item(v)
        return out
    if type(saved) is list:
        return [resolve_item(v) for v in saved]
    if type(saved) is tuple:
        return tuple(resolve_item(v) for v in saved)
    return saved  # a leaf, or a torch.Size (ints only)


def resolve(saved: Any, target: Any, reader: ShardReader, path: tuple[Any, ...], may_alias: bool = False) -> Any:
    """`saved` with every ShardRef replaced by a tensor laid out like its counterpart in `target`
    (a DTensor gets this rank's piece under the same mesh and placements; a plain tensor the whole).
    `may_alias`: the result is copied by its consumer, so it may view the file's buffer."""
    if isinstance(saved, ShardRef):
        return _resolve_ref(saved, target, reader, path, may_alias)
    if isinstance(saved, torch.Tensor) and is_dtensor(target):
        return _piece_of_whole(saved, target, path)
    if isinstance(saved, dict):
        return {k: resolve(v, target.get(k) if isinstance(target, dict) else None, reader, path + (k,), may_alias)
                for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        items = [resolve(v, target[i] if isinstance(target, (list, tuple)) and i < len(target) else None,
                         reader, path + (i,), may_alias) for i, v in enumerate(saved)]
        return items if isinstance(saved, list) else tuple(items)
    return saved


def _resolve_ref(ref: ShardRef, target: Any, reader: ShardReader, path: tuple[Any, ...],
                 may_alias: bool) -> torch.Tensor:
    dtype, shape, _ = reader.spec(ref.name)
    if not isinstance(target, torch.Tensor):
        raise IncompatibleCheckpointError(
            f"{key_path(path)}: the checkpoint holds a sharded {shape} tensor, this job has "
            f"{type(target).__name__} there; build the same model as the run that saved")
    if list(target.shape) != shape or target.dtype != dtype:
        raise IncompatibleCheckpointError(
            f"{key_path(path)}: {shape} {dtype} in the checkpoint, {list(target.shape)} {target.dtype} here")
    if not is_dtensor(target):
        return reader.assemble(ref.name, [0] * len(shape), shape, may_alias).to(target.device)
    from torch.distributed.tensor import DTensor

    offsets, local_shape = local_box(target)
    local = reader.assemble(ref.name, offsets, local_shape, may_alias).to(target.to_local().device)  # type: ignore[attr-defined]
    return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,  # type: ignore[attr-defined]
                              shape=target.shape, stride=target.stride())


def _piece_of_whole(whole: torch.Tensor, target: Any, path: tuple[Any, ...]) -> torch.Tensor:
    """A tensor saved whole (a plain parameter of a partly tensor-parallel model) loaded where this
    job holds a DTensor (the same model under fully_shard): this rank's piece of it. Handed over as
    it was, set_model_state_dict failed mixing a plain tensor and a DTensor in copy_."""
    from torch.distributed.tensor import DTensor

    if list(target.shape) != list(whole.shape):
        raise IncompatibleCheckpointError(
            f"{key_path(path)}: {list(whole.shape)} {whole.dtype} in the checkpoint, {list(target.shape)} "
            f"{target.dtype} here")
    offsets, local_shape = local_box(target)
    piece = whole[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))]
    local = piece.to(device=target.to_local().device, dtype=target.dtype).contiguous()
    return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,  # type: ignore[attr-defined]
                              shape=target.shape, stride=target.stride())


def target_module_state(module: nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(module))


def target_optimizer_state(module: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """The optimizer's state laid out for this job: where it has none yet, the layout of the
    state its first step would make (DCP's zero step), taken without hooks and then undone, so a
    load that fails afterwards leaves the optimizer without state, as it was."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if opt.state:
        return capture_optimizer(module, opt)
    with _dcp_optimizer_init(_init_without_side_effects):
        target = get_optimizer_state_dict(module, opt)
    opt.state = defaultdict(dict)
    return target


@contextlib.contextmanager
def _dcp_optimizer_init(init: Callable[[torch.optim.Optimizer], None]) -> Iterator[None]:
    """DCP's state_dict functions with their optimizer initialisation replaced by `init`."""
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    original = dcp_state_dict._init_optim_state
    dcp_state_dict._init_optim_state = init  # type: ignore[assignment]
    try:
        yield
    finally:
        dcp_state_dict._init_optim_state = original


def _no_init(opt: torch.optim.Optimizer) -> None:
    return None


def _init_without_side_effects(opt: torch.optim.Optimizer) -> None:
    """DCP's zero step (zero gradients, lr 0) with no step hook run, no gradient left behind and
    the scheduler's step tracking untouched: only the state it creates remains (for its layout)."""
    from torch.optim import optimizer as torch_optimizer

    params = [p for group in opt.param_groups for p in group["params"]]
    if opt.state or any(p.grad is not None for p in params):
        return  # as DCP: nothing to initialise, or gradients it would not replace
    hooks: list[dict[Any, Any]] = [opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks,
                                   torch_optimizer._global_optimizer_pre_hooks,
                                   torch_optimizer._global_optimizer_post_hooks]
    parked = [dict(h) for h in hooks]
    lrs = [group.get("lr") for group in opt.param_groups]
    tracked = vars(opt).get("_opt_called", _UNSET)
    try:
        for h in hooks:
            h.clear()
        for group in opt.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        opt.step()
    finally:
        for h, kept in zip(hooks, parked):
            h.update(kept)
        for group, lr in zip(opt.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p in params:
            p.grad = None
        if tracked is _UNSET:
            vars(opt).pop("_opt_called", None)
        else:
            opt._opt_called = tracked  # type: ignore[attr-defined]


_UNSET = object()


def check_module_keys(saved: dict[str, Any], target: dict[str, Any], module: nn.Module, where: str) -> None:
    missing = [k for k in target if k not in saved["state_dict"]]
    unexpected = [k for k in saved["state_dict"] if k not in target]
    names = {name for name, _ in module.named_modules()}
    if missing or unexpected or set(saved["training"]) != names:
        raise IncompatibleCheckpointError(
            f"{where} does not match the checkpoint: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]}, submodules {sorted(set(saved['training']) ^ names)[:5]}; build the "
            "same model as the run that saved")


def restore_module(module: nn.Module, saved: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, saved["state_dict"], options=StateDictOptions(strict=True))
    for name, sub in module.named_modules():
        sub.training = bool(saved["training"][name])


def restore_optimizer(module: nn.Module, opt: torch.optim.Optimizer, saved: Any) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    with _dcp_optimizer_init(_init_without_side_effects):  # the loaded state then replaces what it made
        set_optimizer_state_dict(module, opt, saved)
