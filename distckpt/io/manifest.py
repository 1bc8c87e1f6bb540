"""The step directory layout, the manifest, the commit marker and the payload trees' schema
(checksums: checksums.py).

    <root>/step-000000100/
        replicated/state.g000003.safetensors   replicated entries (tree in the safetensors metadata)
        ranks/rank-00000.g000003.safetensors   per-rank state of each rank
        manifest.json                          every file with size and xxh3-64, versions, ranks
        COMMITTED                              written last: the manifest's digest, run id, generation

A step exists if and only if COMMITTED exists and its digest matches manifest.json. Payload
names carry the writer's lease generation (fencing.py), so a stale writer still running can
never overwrite the files of a newer one, even inside the same step directory.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from distckpt.errors import ConfigError, CorruptCheckpointError, shown
from distckpt.io.checksums import RELEASE_CHUNK, Checksum, checksum_of, verify_file  # noqa: F401  (the format's checksums)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
LEGACY_REPLICATED_FILE = "replicated/state.safetensors"  # generation 0: written before fencing
_STEP_RE = re.compile(r"step-(\d{9,})")
_MAX_MANIFEST_BYTES = 1024 * 1024 * 1024  # a sharded manifest lists every chunk of every tensor
MAX_MARKER_BYTES = 4096
MAX_LEASE_BYTES = 65536
MAX_WORLD_SIZE = 1 << 20  # far above any job; a bound before the number meets the file list


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def refuse_step_directory(url: str, name: str = "url") -> None:
    """A root named as a step directory is one step of another root (`Progress.url`, a path out
    of `distckpt ls`): a manager there found nothing committed and the run started over, its
    saves nested inside the committed step."""
    trimmed = url.rstrip("/")
    last = trimmed.rsplit("/", 1)[-1]
    step = parse_step_dir(last)
    if step is not None:
        parent = trimmed[: -len(last)].rstrip("/") or "/"
        raise ConfigError(f"{name}={shown(url)}: is the directory of step {step} inside the checkpoint root {shown(parent)}, "
                          f"not a root (a manager there finds nothing committed and starts over); pass {parent!r}, "
                          f"with load(state, step={step}) (or --step {step} on the command line) for that step")


def check_tree_belongs(tree: Any, step: int, epoch: Any, where: str) -> None:
    """A payload file's tree records the step and epoch of the manifest that lists it: another
    step's file sealed into this step (digests recomputed) verified and loaded under this
    step's number."""
    if not isinstance(tree, dict):
        return  # the schema check names a tree of the wrong shape
    recorded = (tree.get("step", step), tree.get("epoch", epoch))
    if recorded != (step, epoch):
        raise CorruptCheckpointError(f"{where}: the file records step {recorded[0]} epoch {recorded[1]}, the manifest "
                                     f"step {step} epoch {epoch}: the files do not belong together")


def parse_step_dir(name: str) -> int | None:
    """The step a directory name holds, only in the one spelling step_dir writes: a second
    spelling of the same step (step-0000000001 beside step-000000001) is not a checkpoint."""
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(step) == name else None


def replicated_file(generation: int) -> str:
    return f"replicated/state.g{generation:06d}.safetensors" if generation else LEGACY_REPLICATED_FILE


def rank_file(rank: int, generation: int) -> str:
    return f"ranks/rank-{rank:05d}.g{generation:06d}.safetensors" if generation else f"ranks/rank-{rank:05d}.safetensors"


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """JSON bytes of a manifest's fields, refused (UnstorableValueError) beyond what a load reads.
    Writers go through Manifest.to_bytes, which also checks the schema."""
    from distckpt.errors import UnstorableValueError

    try:
        # Compact: the C encoder runs only without indent (20,000 tensors: 0.023 s against 0.082 s
        # indented, and 0.95 against 1.29 MB); `distckpt inspect` prints it readably.
        data = json.dumps(manifest, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:  # a NaN, a key or a value JSON has no spelling for
        raise UnstorableValueError(f"the manifest is not storable as JSON: {e}") from e
    if len(data) > _MAX_MANIFEST_BYTES:
        raise UnstorableValueError(f"the manifest would be {len(data):,} bytes, more than the {_MAX_MANIFEST_BYTES:,} "
                                   "a load reads: fewer, larger tensors")
    return data


FileRecord = dict[str, Any]  # {"size": bytes, "xxh3_64": hex digest}


@dataclass(frozen=True)
class Manifest:
    """manifest.json: what one committed step holds. The one home of its schema: `to_bytes`
    refuses at save what `parse` would refuse at load, so a checkpoint that saved also loads.

    The optional fields are left out of the JSON when None: older writers, unsharded and
    non-incremental saves never wrote them, and the format stays the same bytes for them."""

    step: int
    world_size: int
    files: dict[str, FileRecord]
    run_id: str
    created_unix: float
    entries: dict[str, dict[str, str]]  # key -> {"kind", "scope"}
    versions: dict[str, str | None]
    ranks: list[dict[str, Any]]  # per rank: rank, step, epoch, host
    epoch: int | None = None
    metric: float | None = None
    generation: int = 0  # the writer's lease (fencing.py)
    payload_bytes: int | None = None
    sharded: dict[str, Any] | None = None  # tensor name -> chunk table (sharded.py)
    imported: str | None = None  # the torch.save / DCP source an import came from
    reused: dict[str, dict[str, str]] | None = None  # incremental: tensor -> {"file", "tensor"}
    shared_files: dict[str, FileRecord] | None = None  # incremental: older steps' files referenced

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None or f.name not in _LEFT_OUT_WHEN_NONE:
                out[f.name] = value
        return out

    def to_bytes(self) -> bytes:
        """The bytes to write; UnstorableValueError if a reader would refuse them."""
        from distckpt.errors import UnstorableValueError

        raw = self.to_json()
        try:
            check_manifest_schema(raw, MANIFEST)
        except CorruptCheckpointError as e:
            raise UnstorableValueError(f"this save's manifest would not load: {e}") from e
        return manifest_bytes(raw)

    @classmethod
    def parse(cls, data: bytes, marker: "Marker", where: str) -> "Manifest":
        """Check the bytes against their marker, then the structure (CorruptCheckpointError names
        the field)."""
        if len(data) > _MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{where}: manifest of {len(data)} bytes is larger than any we write")
        if checksum_of(data) != marker.manifest_digest:
            raise CorruptCheckpointError(f"{where}: manifest does not match its COMMITTED marker (damaged or replaced)")
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: manifest is not JSON: {e}") from e
        manifest = cls.from_json(raw, where)
        if manifest.step != marker.step:
            raise CorruptCheckpointError(f"{where}: manifest step {manifest.step} differs from the marker's {marker.step}")
        if manifest.generation != marker.generation:
            raise CorruptCheckpointError(f"{where}: manifest generation {manifest.generation} differs from the marker's {marker.generation}")
        return manifest

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "Manifest":
        """A manifest from its parsed JSON, schema-checked; fields this version does not know are
        ignored (readers ignore everything else)."""
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_VERSION:
            raise CorruptCheckpointError(f"{where}: manifest format {raw.get('format') if isinstance(raw, dict) else '?'} is not {FORMAT_VERSION}")
        check_manifest_schema(raw, f"{where}/{MANIFEST}")
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})

    def payload_names(self) -> tuple[str, list[str]]:
        """(replicated file, rank files by rank)."""
        return replicated_file(self.generation), [rank_file(r, self.generation) for r in range(self.world_size)]

    @property
    def owned_bytes(self) -> int:
        """Bytes of the files this step holds itself (not those it shares with older steps)."""
        return sum(r["size"] for r in self.files.values())

    @property
    def shared_bytes(self) -> int:
        return sum(r["size"] for r in (self.shared_files or {}).values())


_LEFT_OUT_WHEN_NONE = {"payload_bytes", "sharded", "imported", "reused", "shared_files"}  # the rest is required


@dataclass(frozen=True)
class Marker:
    step: int
    manifest_digest: str
    run_id: str
    generation: int = 0  # the writer's lease (fencing.py); 0 before fencing existed
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex)  # tells our write from another's

    def to_bytes(self) -> bytes:
        fields = {"format": FORMAT_VERSION, "step": self.step, "manifest_xxh3_64": self.manifest_digest,
                  "run_id": self.run_id, "generation": self.generation, "nonce": self.nonce}
        return json.dumps({**fields, _MARKER_SUM: _marker_sum(fields)}).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> "Marker":
        if len(data) > MAX_MARKER_BYTES:
            raise CorruptCheckpointError(f"{where}: commit marker of {len(data)} bytes is larger than any we write")
        try:
            d = json.loads(data)
            _check_marker_sum(d, where)
            step, generation = d["step"], d.get("generation", 0)
            if not (_is_count(step) and _is_count(generation) and isinstance(d["manifest_xxh3_64"], str)
                    and isinstance(d["run_id"], str) and isinstance(d.get("nonce", ""), str)):
                raise TypeError("fields of the wrong type")
            return cls(step, d["manifest_xxh3_64"], d["run_id"], generation, d.get("nonce", ""))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: unreadable commit marker: {e}") from e


# The marker's own fields are covered by a checksum of their own (the manifest's digest covers
# only the manifest): a flipped bit in run_id, generation or nonce would otherwise load, or make
# fencing judge the step a superseded writer's. Markers written before it carry no sum and are
# read as before; any key we never write is refused, so a flip in the sum's own name is caught.
_MARKER_SUM = "marker_xxh3_64"
_MARKER_KEYS = frozenset({"format", "step", "manifest_xxh3_64", "run_id", "generation", "nonce", _MARKER_SUM})


def _marker_sum(fields: dict[str, Any]) -> str:
    return checksum_of(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


def _check_marker_sum(d: Any, where: str) -> None:
    if not isinstance(d, dict):
        raise TypeError("not a JSON object")
    unknown = set(d) - _MARKER_KEYS
    if unknown:
        raise CorruptCheckpointError(f"{where}: commit marker has fields we never write: {sorted(unknown)[:4]}")
    if _MARKER_SUM in d:
        fields = {k: v for k, v in d.items() if k != _MARKER_SUM}
        if d[_MARKER_SUM] != _marker_sum(fields):
            raise CorruptCheckpointError(f"{where}: commit marker does not match its own checksum (damaged)")


def check_manifest_schema(manifest: dict[str, Any], where: str) -> None:
    """Types and ranges of every field a reader uses (the loader, inspect, ls, verify), before any
    is used: a manifest may come from anywhere, and a number in it (world_size) must not size an
    allocation unchecked. CorruptCheckpointError names the field."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CorruptCheckpointError(f"{where}: field 'files' must be a non-empty object of file records")
    for path, record in files.items():
        check_relative_path(path, where)
        if not (isinstance(record, dict) and _is_count(record.get("size"))
                and isinstance(record.get("xxh3_64"), str) and len(record["xxh3_64"]) <= 32):
            raise CorruptCheckpointError(f"{where}: field 'files'[{path[:80]!r}] must hold 'size' (int >= 0) and "
                                         "'xxh3_64' (hex string)")
    world = manifest.get("world_size")
    if not isinstance(world, int) or not _is_count(world) or not 1 <= world <= min(MAX_WORLD_SIZE, len(files)):
        raise CorruptCheckpointError(f"{where}: field 'world_size' is {str(world)[:40]}: must be an int from 1 to "
                                     f"the {len(files)} files the manifest lists (one per rank at least)")
    for name, check, what in _FIELDS:
        if name not in manifest and name in _OPTIONAL:
            continue
        if not check(manifest.get(name, _ABSENT)):
            raise CorruptCheckpointError(f"{where}: field {name!r} must be {what}, got {str(manifest.get(name, 'nothing'))[:40]}")
    check_incremental_fields(manifest, where)
    ranks = manifest["ranks"]
    if len(ranks) not in (0, world):
        raise CorruptCheckpointError(f"{where}: field 'ranks' lists {len(ranks)} ranks for a world of {world}")
    for i, info in enumerate(ranks):
        for name, check, what in _RANK_FIELDS:
            if not check(info.get(name, _ABSENT)):
                raise CorruptCheckpointError(f"{where}: field 'ranks'[{i}][{name!r}] must be {what}")


_REUSED, _SHARED = "reused", "shared_files"  # incremental checkpoints (incremental.py)


def check_incremental_fields(manifest: dict[str, Any], where: str) -> None:
    """Types of the two fields, and every reference to an older step's file the manifest lists."""
    reused, shared = manifest.get(_REUSED), manifest.get(_SHARED)
    if reused is None and shared is None:
        return
    if not isinstance(reused, dict) or not isinstance(shared, dict) or not reused:
        raise CorruptCheckpointError(f"{where}: fields {_REUSED!r} and {_SHARED!r} must be objects, together")
    for path, record in shared.items():
        check_shared_path(path, manifest.get("step"), where)
        if not (isinstance(record, dict) and type(record.get("size")) is int and record["size"] >= 0
                and isinstance(record.get("xxh3_64"), str) and len(record["xxh3_64"]) <= 32):
            raise CorruptCheckpointError(f"{where}: field {_SHARED!r}[{path[:80]!r}] must hold 'size' and 'xxh3_64'")
    for name, ref in reused.items():
        if not (isinstance(name, str) and isinstance(ref, dict) and isinstance(ref.get("tensor"), str)
                and ref.get("file") in shared):
            raise CorruptCheckpointError(f"{where}: field {_REUSED!r}[{str(name)[:80]!r}] must name a tensor of a "
                                         f"file listed in {_SHARED!r}")


def check_shared_path(path: Any, step: Any, where: str) -> None:
    """A root-relative path into an older step's directory, nothing else."""
    if not isinstance(path, str) or "/" not in path:
        raise CorruptCheckpointError(f"{where}: shared file {str(path)[:80]!r} is not inside a step directory")
    head, rest = path.split("/", 1)
    older = parse_step_dir(head)
    if older is None or not isinstance(step, int) or older >= step:
        raise CorruptCheckpointError(f"{where}: shared file {path[:80]!r} is not in an older step's directory")
    check_relative_path(rest, where)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


_ABSENT = object()
_OPTIONAL = {"generation", "sharded", "payload_bytes", "imported"}  # older writers, unsharded saves, imports


def _is_entry_kinds(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("kind"), str) and isinstance(v.get("scope"), str)
        for k, v in value.items())


def _is_time(value: Any) -> bool:
    return type(value) in (int, float) and 0 <= value < 2 ** 33  # seconds since 1970, before year 2242


def _is_optional_count(value: Any) -> bool:
    return value is None or _is_count(value)


_FIELDS: list[tuple[str, Any, str]] = [
    ("step", _is_count, "an int >= 0"),
    ("generation", _is_count, "an int >= 0"),
    ("epoch", _is_optional_count, "an int >= 0 or null"),
    ("metric", lambda v: v is None or (type(v) in (int, float) and math.isfinite(v)), "a finite number or null"),
    ("run_id", lambda v: isinstance(v, str), "a string"),
    ("created_unix", _is_time, "seconds since 1970"),
    ("payload_bytes", _is_count, "an int >= 0"),
    ("entries", _is_entry_kinds, "an object of {kind, scope} records"),
    ("versions", lambda v: isinstance(v, dict) and all(isinstance(x, (str, type(None))) for x in v.values()),
     "an object of version strings"),
    ("ranks", lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), "a list of objects"),
    ("sharded", lambda v: v is None or isinstance(v, dict), "an object"),
    ("imported", lambda v: isinstance(v, str), "the source's description"),
]
_RANK_FIELDS: list[tuple[str, Any, str]] = [
    ("rank", _is_count, "an int >= 0"),
    ("step", _is_count, "an int >= 0"),
    ("epoch", _is_optional_count, "an int >= 0 or null"),
    ("host", lambda v: isinstance(v, str), "a string"),
]


def check_tree(tree: Any, where: str, per_rank: bool) -> None:
    """The structure a load reads of a payload file's tree (the replicated one, or a rank's with
    its rank, epoch, RNG streams and buffers), checked before any of it is used: a file may be
    forged and re-signed. CorruptCheckpointError names the field."""
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{where}: the tree is a {type(tree).__name__}, not an object of fields")
    entries = tree.get("entries")
    if not isinstance(entries, dict):
        raise CorruptCheckpointError(f"{where}: field 'entries' must be an object of entries")
    for key, record in entries.items():
        if not (isinstance(key, str) and isinstance(record, dict) and isinstance(record.get("kind"), str)
                and "state" in record):
            raise CorruptCheckpointError(f"{where}: entry {str(key)[:80]!r} must hold 'kind' (a string) and 'state'")
    if not per_rank:
        return
    for name, check, what in _RANK_TREE_FIELDS:
        if not check(tree.get(name, _ABSENT)):
            raise CorruptCheckpointError(f"{where}: field {name!r} must be {what}")
    buffers = tree.get("buffers", {})
    if not (isinstance(buffers, dict) and all(isinstance(b, dict) for b in buffers.values())):
        raise CorruptCheckpointError(f"{where}: field 'buffers' must be an object of each module's buffers")


_RANK_TREE_FIELDS: list[tuple[str, Any, str]] = [
    ("rank", _is_count, "an int >= 0"),
    ("epoch", _is_optional_count, "an int >= 0 or null"),
    ("rng", lambda v: isinstance(v, dict), "an object of RNG streams"),
]


def check_relative_path(path: str, where: str) -> None:
    """A manifest may only name files inside its own step directory."""
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or "\x00" in path or "::" in path
            or "://" in path or any(p in ("", ".", "..") for p in parts)):
        raise CorruptCheckpointError(f"{where}: manifest names an unsafe path {path!r}")
