"""The command line's text for people: entries grouped, key paths in natural order, a diff's
summary first. Pure functions of what inspection.py describes (no torch, no storage); --json
never goes through here, so its documents stay as they are.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

RNG = "(random streams)"  # each rank's Python, NumPy, torch and device streams: not an entry of `state`
META = "(step, epoch)"    # what every file records of where the run was


def natural_key(text: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key for key paths: runs of digits by their value, so layers.2 comes before layers.10."""
    return tuple((0, int(part), part) if part.isdigit() else (1, 0, part)
                 for part in re.split(r"([0-9]+)", text) if part)


def entry_of(path: str, keys: list[str]) -> str | None:
    """The entry of `state` a path inside a file belongs to: the longest entry key that the part
    after "entries/" is or starts with (a key may hold a slash); None outside the entries."""
    _, found, rest = path.partition("entries/")
    return _leading_key(rest, keys) if found else None


def _leading_key(path: str, keys: list[str]) -> str | None:
    for key in sorted(keys, key=len, reverse=True):
        if path == key or path.startswith((f"{key}/", f"{key}<")):
            return key
    return None


def rng_stream(name: str) -> str | None:
    """'per-rank state/rng/torch_cpu' -> 'rng/torch_cpu': a rank's own random stream; else None."""
    _, found, rest = f"/{name}".partition("/rng/")
    return f"rng/{rest}" if found else None


def tensor_path(name: str, keys: list[str]) -> str:
    """A table name as people say it: 'replicated/entries/model/state/state_dict/0.weight' ->
    'model/state_dict/0.weight' (the file and the entry's own wrapper left out)."""
    key = entry_of(name, keys)
    if key is None:
        return rng_stream(name) or (name.split("/", 1)[1] if name.startswith("replicated/") else name)
    rest = name.partition("entries/")[2][len(key):].lstrip("/")
    return f"{key}/{rest.removeprefix('state/')}" if rest not in ("", "state") else key


@dataclass
class EntryLine:
    """One entry of a step: what it is, where it lives, its tensors."""

    key: str
    kind: str
    scope: str
    tensors: int = 0
    bytes: int = 0
    dtypes: set[str] = field(default_factory=set)
    shared: int = 0  # incremental: tensors held in an older step's file


def group_entries(described: dict[str, Any]) -> list[EntryLine]:
    """One line per entry of the manifest, in its order: its tensors in the replicated file, in
    every rank's file (per-rank entries: counted over the ranks) and in the sharded table; the
    ranks' random streams as a line of their own."""
    manifest = described["manifest"]
    keys = list(manifest["entries"])
    lines = {key: EntryLine(key, info["kind"], info["scope"]) for key, info in manifest["entries"].items()}
    found = [(entry_of(t["name"], keys), t) for t in described["tensors"]]
    for table in described.get("rank_tensors", []):
        found += [(entry_of(t["name"], keys) or (RNG if rng_stream(t["name"]) else None), t) for t in table]
    found += [(_leading_key(name, keys), {"dtype": e["dtype"], "bytes": sharded_bytes(e)})
              for name, e in (manifest.get("sharded") or {}).items()]
    for key, tensor in found:
        if key is None:
            continue  # none in what distckpt writes: every tensor is inside an entry or the streams
        line = lines.setdefault(key, EntryLine(key, "rng", "per_rank"))
        line.tensors += 1
        line.bytes += tensor["bytes"]
        line.dtypes.add(str(tensor["dtype"]))
        line.shared += "shared_from" in tensor
    return list(lines.values())


# bytes per element of the safetensors dtype names the sharded table holds
_WIDTH = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def sharded_bytes(entry: dict[str, Any]) -> int:
    return math.prod(entry["shape"]) * _WIDTH.get(str(entry["dtype"]), 1)


def scope_text(scope: str, world_size: int) -> str:
    return f"per-rank ({world_size} rank{'' if world_size == 1 else 's'})" if scope == "per_rank" else scope


def entries_table(lines: list[EntryLine], world_size: int) -> list[str]:
    """The entries as a table, a total last."""
    rows = [(line.key, line.kind, scope_text(line.scope, world_size), f"{line.tensors:,}", f"{line.bytes:,}",
             ", ".join(sorted(line.dtypes)) + (f"  ({line.shared} in older steps' files)" if line.shared else ""))
            for line in lines]
    rows.append(("total", "", "", f"{sum(x.tensors for x in lines):,}", f"{sum(x.bytes for x in lines):,}", ""))
    header = ("entry", "kind", "scope", "tensors", "bytes", "dtypes")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    out = []
    for r in [header, *rows]:
        out.append(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  "
                   f"{r[3]:>{widths[3]}}  {r[4]:>{widths[4]}}  {r[5]}".rstrip())
    return out


def tensor_lines(described: dict[str, Any]) -> list[str]:
    """Every tensor: replicated, each rank's, and sharded ones, by key path in natural order."""
    keys = list(described["manifest"]["entries"])
    rows = [(tensor_path(t["name"], keys), "", t) for t in described["tensors"]]
    for rank, table in enumerate(described.get("rank_tensors", [])):
        rows += [(tensor_path(t["name"], keys), f"(rank {rank})", t) for t in table]
    for name, e in (described["manifest"].get("sharded") or {}).items():
        rows.append((name, f"sharded, {len(e['chunks'])} chunks",
                     {"dtype": e["dtype"], "shape": e["shape"], "bytes": sharded_bytes(e)}))
    rows.sort(key=lambda r: (natural_key(r[0]), natural_key(r[1])))
    width = min(max((len(r[0]) for r in rows), default=0), 72)
    return [f"  {path:<{width}}  {t['dtype']:>8}  {str(t['shape']):>16}  {t['bytes']:>12,}"
            + (f"  {where}" if where else "") + (f"  from {t['shared_from']}" if "shared_from" in t else "")
            for path, where, t in rows]


# diff


def diff_entry(key: str, keys: list[str]) -> str:
    """The entry a diff row's key belongs to ('replicated/state/entries/model/...' -> 'model');
    the random streams and the step/epoch records as lines of their own."""
    entry = entry_of(key, keys)
    if entry is not None:
        return entry
    return RNG if "/rng/" in f"/{key}" else META


@dataclass(frozen=True)
class DiffSummary:
    equal: list[str]
    changed: list[str]
    added: list[str]
    removed: list[str]


def summarize_diff(rows: list[dict[str, Any]], before: list[str], after: list[str]) -> DiffSummary:
    """Entries (of the two manifests) equal, changed, added and removed; a changed entry is one
    with a row of its own (a key of an added or removed entry makes no changed entry)."""
    keys = sorted(set(before) | set(after), key=natural_key)
    touched = {diff_entry(r["key"], keys) for r in rows}
    both = [k for k in keys if k in before and k in after]
    return DiffSummary(equal=[k for k in both if k not in touched], changed=[k for k in both if k in touched],
                       added=[k for k in keys if k not in before], removed=[k for k in keys if k not in after])


LARGEST_SHOWN = 5


def largest_changes(rows: list[dict[str, Any]], keys: list[str]) -> list[str]:
    """The tensors of the entries with the most elements changed (then the largest max |diff|), at
    most LARGEST_SHOWN. The random streams are left out: they move at every step, and a difference
    of their state bytes is no size of change."""
    moved = [r for r in rows if r["change"] == "values" and diff_entry(r["key"], keys) not in (RNG, META)]
    moved.sort(key=lambda r: (-r["changed_elements"], -_magnitude(r["max_abs_diff"]), natural_key(r["key"])))
    return [f"  {_diff_path(r['key'], keys)}: {r['changed_elements']:,} elements changed, "
            f"max |diff| {r['max_abs_diff']:.6g}" for r in moved[:LARGEST_SHOWN]]


def entry_changes(rows: list[dict[str, Any]], keys: list[str], changed: list[str]) -> list[str]:
    """Per changed entry: how many tensors and elements changed and where it moved most; how many
    other values changed."""
    width = max((len(k) for k in changed), default=0)
    lines = []
    for key in changed:
        own = [r for r in rows if diff_entry(r["key"], keys) == key]
        moved = [r for r in own if r["change"] == "values"]
        parts = []
        if moved:
            top = max(moved, key=lambda r: (_magnitude(r["max_abs_diff"]), r["changed_elements"]))
            parts.append(f"{len(moved)} tensor{'s' * (len(moved) != 1)}, "
                         f"{sum(r['changed_elements'] for r in moved):,} elements, max |diff| "
                         f"{top['max_abs_diff']:.6g} ({_diff_path(top['key'], keys)})")
        others = len(own) - len(moved)
        if others:
            parts.append(f"{others} other change{'s' * (others != 1)}")
        lines.append(f"  {key:<{width}}  {'; '.join(parts)}")
    return lines


def _magnitude(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not math.isnan(value) else math.inf


def _diff_path(key: str, keys: list[str]) -> str:
    """'replicated/state/entries/model/state/state_dict/0.weight' -> 'model/state_dict/0.weight';
    a rank's own keys keep their rank."""
    match = re.match(r"ranks/rank-0*([0-9]+)/", key)
    rank = f" (rank {match.group(1)})" if match else ""
    entry = entry_of(key, keys)
    if entry is None:
        return key
    rest = key.partition("entries/")[2][len(entry):].lstrip("/")
    return f"{entry}/{rest.removeprefix('state/')}{rank}" if rest not in ("", "state") else f"{entry}{rank}"


def summary_lines(a: int, b: int, summary: DiffSummary, rows: list[dict[str, Any]], keys: list[str]) -> list[str]:
    counted = len(summary.equal) + len(summary.changed) + len(summary.added) + len(summary.removed)
    lines = [f"steps {a} -> {b}: {counted} entries: {len(summary.equal)} equal, {len(summary.changed)} changed, "
             f"{len(summary.added)} added, {len(summary.removed)} removed"]
    for word, names in (("added", summary.added), ("removed", summary.removed)):  # the changed: by entry, below
        if names:
            lines.append(f"  {word}: {', '.join(names)}")
    others = sorted({diff_entry(r["key"], keys) for r in rows} & {RNG, META})
    if others:
        lines.append(f"  also changed: {', '.join(others)}")
    if summary.changed:
        lines += ["changes by entry:", *entry_changes(rows, keys, summary.changed)]
    largest = largest_changes(rows, keys)
    if largest:
        lines += ["largest changes (most elements changed):", *largest]
    return lines
