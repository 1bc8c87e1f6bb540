"""The load of one memory copy: the load protocol's read and apply phases on a node's memory root.

Every rank reads its own node's copy (memory_tier.py's `own` area), with the durable root's
leases: a copy written by another job, or superseded by a newer incarnation, is refused like a
local tier step (fencing.py). A copy that does not verify on some rank is skipped on every rank
with a warning (loading.py's read phase), and nothing is changed.
"""

from __future__ import annotations

from typing import Any

from distckpt.io.copying import Prefault
from distckpt.protocol import tiers
from distckpt.protocol.coord import Coordinator
from distckpt.protocol.fencing import Lease
from distckpt.protocol.load_warnings import MEMORY

# The read and apply phases of the load protocol, shared with it (one rule for every tier).
from distckpt.protocol.loading import Progress, _apply, _read_phase
from distckpt.state.capture import Entry
from distckpt.state.kinds import copy_destinations
from distckpt.state.validation import LoadRules
from distckpt.storage import Storage


def load_memory_copy(coord: Coordinator, durable: Storage, copy: Storage, entries: list[Entry],
                     state: dict[str, Any], step: int, world_size_policy: str, rules: LoadRules,
                     leases: list[Lease]) -> Progress | None:
    """Read, verify and apply committed `step` from every rank's `copy` (collective). None, on
    every rank alike, when some rank's copy does not verify (warned), with `state` unchanged."""
    storages = {tiers.DURABLE: durable, tiers.LOCAL: copy, MEMORY: copy}  # named "memory" in what it warns
    prefault = Prefault(copy_destinations(entries))  # while the files are read and verified
    try:
        read = _read_phase(coord, storages, entries, [(step, MEMORY)], False, world_size_policy, leases, rules)
    finally:
        prefault.stop()
    if read.found is None:
        return None
    return _apply(coord, entries, state, read.found, storages, rules, True)
