"""Entry kinds: what `state` may hold, one class per kind, one module each (base.py says how to
add one). The save and load phases call the functions of entries.py and destinations.py; the
command line and the doctor ask a saved record's kind (`kind_named`).

This package never touches storage or torch.distributed.
"""

from __future__ import annotations

from distckpt.state.capture import PER_RANK, REPLICATED, SHARDED, Entry
from distckpt.state.kinds.base import Differing, Job, Kind, Trait, World
from distckpt.state.kinds.builtin import BUILTIN
from distckpt.state.kinds.destinations import check_destinations_apart, in_place_copies, live_ties
from distckpt.state.kinds.entries import (
    capture_entry,
    capture_rank_buffers,
    classify,
    copy_destinations,
    is_late,
    loading_entry,
    normalize_imported,
    replaced_under_key,
    resolve_sharded_entry,
    resolves_own_shards,
    restore_entry,
    snapshot,
    staged_tensors,
    validate_entry,
)
from distckpt.state.kinds.module import NO_OPTIMIZER_CAUSE
from distckpt.state.kinds.registry import (
    kind_named,
    matching_kind,
    register_kind,
    registered_kinds,
    unregister_kind,
)

for _kind in BUILTIN:
    register_kind(_kind)

__all__ = [
    "BUILTIN", "NO_OPTIMIZER_CAUSE", "PER_RANK", "REPLICATED", "SHARDED", "Differing", "Entry", "Job", "Kind", "Trait",
    "World", "capture_entry", "capture_rank_buffers", "check_destinations_apart", "classify", "copy_destinations",
    "in_place_copies", "is_late", "kind_named", "live_ties", "loading_entry", "matching_kind", "normalize_imported",
    "register_kind", "registered_kinds", "replaced_under_key", "resolve_sharded_entry", "resolves_own_shards",
    "restore_entry", "snapshot", "staged_tensors", "unregister_kind", "validate_entry",
]
