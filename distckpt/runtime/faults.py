"""Named points in the save and load protocols where a test can inject a fault.

`point(name, **context)` is a no-op unless a hook is registered; a fault-injection harness (a
test, or a training script under test) registers one with `on_point` to raise, stall, or
SIGKILL its own process at exactly that point. Names: see POINTS.
"""

from __future__ import annotations

from typing import Any, Callable

POINTS = (
    "save/captured",        # every rank, after capture, before the agreement collective
    "save/gathered",        # rank 0, before its replicated file (its own rank file may be durable)
    "save/replicated-written",
    "save/rank-files-written",  # every rank, its own rank file durable, not yet reported (rank 0 too
                                # when it writes the files handed over to it)
    "save/shards-written",   # a rank's shard file durable, not yet reported, before rank 0 commits
    "save/manifest-written",  # data and manifest durable, marker not yet written
    "save/committed",        # rank 0, marker written, before retention
    "save/retained",         # rank 0, retention and leftover collection done
    "retention/marker-removed",  # rank 0, a checkpoint retention deletes: its marker gone, files not yet
    "save/awaiting-commit",  # every other rank, waiting for rank 0's outcome (sync saves)
    "save/snapshot-copy",    # writer thread (async), before the overlapped snapshot's copies
    "upload/started",        # rank 0's uploader, a committed local step about to be copied to the URL
    "upload/files-written",  # uploader: every file durable at the URL, no manifest or marker yet
    "upload/committed",      # uploader: the marker at the URL written, before durable retention
    "memory/sending",        # every rank, a memory save's room checked and incoming files made, nothing sent
    "memory/exchanged",      # every rank, a memory save's files exchanged (received into the leaders' incoming
                             # directories), no node's memory copy committed
    "memory/files-writing",  # a node's lowest rank, about to write one memory copy (its own or a partner's)
    "memory/committed",      # a node's lowest rank, one memory copy's marker written
    "memory/repairing",      # a lost node's lowest rank, its partner's copy received and verified, not moved in
    "load/cooperative-part",  # every rank of a cooperative load, its range of the replicated file read
    "load/cooperative-exchange",  # every rank, every range read, before the ranges are exchanged
    "load/read",             # every rank, files read and verified, nothing restored
    "load/applied",          # every rank, state restored, before the final agreement
)

_hooks: list[Callable[[str, dict[str, Any]], None]] = []


def on_point(hook: Callable[[str, dict[str, Any]], None]) -> Callable[[], None]:
    """Register `hook(name, context)`; returns a function that unregisters it."""
    _hooks.append(hook)
    return lambda: _hooks.remove(hook)


def point(name: str, **context: Any) -> None:
    for hook in list(_hooks):
        hook(name, context)
