"""The warnings a load gives: a step read at another world size or imported (what was kept),
damaged committed steps passed over (what is loaded instead), entries kept under
missing_entries='keep'. Kept apart from loading.py, which composes the load's phases."""

from __future__ import annotations

from typing import Any

from distckpt.errors import CheckpointFallbackWarning, CheckpointWarning, ReshardWarning, warn
from distckpt.protocol.coord import Coordinator, Outcome

MEMORY = "memory"  # the memory tier's copies, read by memory_load.py through the same phases


def warn_per_rank_kept(read: Any, coord: Coordinator, kept: list[str], buffered: list[str]) -> None:
    if read.manifest.imported is not None:
        message = (f"rank {coord.rank}: step {read.step} was imported from {read.manifest.imported}, which holds no "
                   f"per-rank state: the RNG streams and the per-rank entries {kept} keep what this process set. "
                   "The run continues from the imported state, not bit for bit.")
        warn(message, ReshardWarning)
        return
    message = (f"rank {coord.rank}: step {read.step} was written by {read.manifest.world_size} ranks and "
               f"is loaded by {coord.world_size} (world_size_policy='reshard'): replicated and sharded state "
               f"restored; kept as this process set them, not restored: the RNG streams (Python, NumPy, "
               f"torch, devices) and the per-rank entries {kept}."
               + (f" The persistent buffers of {buffered} (BatchNorm running statistics and the like, saved by "
                  "each rank) are rank 0's on every rank: a rank's own cannot be mapped to another world size."
                  if buffered else "")
               + " The run continues, not bit for bit.")
    warn(message, ReshardWarning)


def warn_fallbacks(skipped: list[tuple[int, str, list[Outcome]]], loading: tuple[int, str] | None, rank: int,
                    tiered: bool) -> None:
    """One warning per damaged committed step skipped (emptying `skipped`), each naming what is
    loaded instead: `loading`, the next committed step every rank read (None: none verified)."""
    for step, tier, damaged in skipped:
        detail = "; ".join(f"rank {o.rank}: {o.message}" for o in damaged)
        # the tiers are named whenever one is not the URL (a memory copy skipped for the same
        # step on disk read "step 5 ... loading step 5 instead")
        named = tiered or tier != "durable" or (loading is not None and loading[1] != "durable")
        where = f"step {step} on the {tier} tier" if named else f"step {step}"
        if loading is None and tier == MEMORY:
            then = "the disk tiers are read instead"
        elif loading is None:
            then = "no other committed checkpoint verifies"
        elif named:
            then = f"loading step {loading[0]} from the {loading[1]} tier instead"
        else:
            then = f"loading step {loading[0]} instead"
        message = f"rank {rank}: committed {where} cannot be loaded and was skipped — {detail}; {then}"
        warn(message, CheckpointFallbackWarning)
    skipped.clear()


def warn_kept_missing(keys: list[str], step: int, rank: int) -> None:
    message = (f"rank {rank}: step {step} holds no entries {keys}; they keep their live values "
               "(missing_entries='keep')")
    warn(message, CheckpointWarning)
