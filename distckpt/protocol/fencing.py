"""Fencing: a stale incarnation of a job can never commit, and its late output is never loaded.

A pre-empted job restarted elsewhere can leave the old incarnation running for a while (a VM
that has not noticed, a hung node coming back). Each incarnation that writes takes a lease:

    <root>/fence/gen-000000007.json    {"generation": 7, "floor": 120, "run_id": ..., host, pid, time}

created exclusively (``os.link`` / ``If-None-Match: *``), numbered one above the highest lease
seen, so two incarnations never share a generation. ``floor`` is the step the incarnation
resumed from (-1: it looked and found nothing): every checkpoint at or below it is history it
accepted. A writer that never loaded has no floor (null): it claims no history, so it fences
no one and replaces nothing; same-step collisions with it are settled by the exclusive
creation of manifest.json and COMMITTED (the first wins, the other gets CheckpointExistsError).

* Writers: manifest and marker carry the generation; before writing, before its marker and
  after it, a writer checks that no *resumed* incarnation of a higher generation exists, else
  ``FencedError``.
* Readers: a checkpoint of generation g at step s is zombie output if some resumed lease of a
  higher generation has ``floor < s`` — it was committed after a newer incarnation took over
  from an earlier step. The loader skips it with a warning, ``verify``/``ls`` flag it, and the
  newer incarnation replaces it when it reaches that step.

The lease is taken at an incarnation's first save, not at construction, so a job that only
reads (evaluation, the CLI) never fences the writer.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import Callable

from distckpt.errors import CheckpointExistsError, FencedError, MissingFileError, NotAFileError, StorageError
from distckpt.storage import Storage

log = logging.getLogger("distckpt")

FENCE_DIR = "fence"
_LEASE_RE = re.compile(r"gen-(\d{9,})\.json")
_RECORD_RE = re.compile(r"committed-gen-(\d{9,})\.json")
_ACQUIRE_ATTEMPTS = 20


@dataclass(frozen=True)
class Lease:
    generation: int
    floor: int | None  # the step it resumed from; None: it never loaded (claims no history)
    run_id: str
    host: str = ""
    pid: int = 0
    created_unix: float = 0.0
    damaged: str = ""  # why the lease file could not be read ("": it was); see read_leases

    def describe(self) -> str:
        if self.damaged:
            return f"generation {self.generation} (its lease {lease_path(self.generation)} is unreadable: {self.damaged})"
        return (f"generation {self.generation} (run {self.run_id[:8]} on {self.host or '?'} pid {self.pid}, "
                f"{'resumed from step ' + str(self.floor) if self.floor is not None else 'not resumed'}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.created_unix))} UTC)")


_MAX_LEASE_BYTES = 65536  # a lease is ~200 bytes; a larger file is not one and is not read whole


def lease_path(generation: int) -> str:
    return f"{FENCE_DIR}/gen-{generation:09d}.json"


def lease_generations(storage: Storage) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_LEASE_RE.fullmatch, storage.list_dir(FENCE_DIR)) if m)


def read_leases(storage: Storage, known: dict[int, Lease] | None = None) -> list[Lease]:
    """Every lease, by generation. `known`: leases read before, by generation (a lease is never
    rewritten, so only new ones are read; the new ones are added): one LIST per call once all
    are known.

    A lease is written whole or not at all (exclusive link / conditional PUT), so one that does
    not parse is damage. It still names its generation, and it cannot say from which step that
    incarnation resumed: it counts as resumed from nothing (floor -1, `damaged` set), the
    reading that can never load or commit a superseded writer's output (it fences every older
    writer; their steps are not loaded, and the loader's last resort refuses to guess).
    A lease that could not be read for another reason (the store failing) is not guessed about:
    StorageError. One removed since the listing (pruned: it could fence nothing) is skipped."""
    leases = []
    for gen in lease_generations(storage):
        if known is not None and gen in known:
            leases.append(known[gen])
            continue
        try:
            lease = _parse_lease(gen, storage.read_bytes(lease_path(gen), _MAX_LEASE_BYTES))
        except MissingFileError:
            continue
        except OSError as e:
            # oversized, or not a file (a link, a FIFO ...): damage; anything else the store failing
            if not isinstance(e, NotAFileError) and e.errno != errno.EFBIG:
                raise StorageError(e.errno or errno.EIO, f"reading the write lease {storage.url}/{lease_path(gen)} failed, "
                                   f"so which steps are a superseded writer's output cannot be told: {e}") from e
            lease = _damaged_lease(gen, str(e))
        if lease.damaged:
            log.warning("fence: %s: it counts as an incarnation that resumed from nothing, so every older "
                        "writer is fenced and no older generation's step is loaded", lease.describe())
        elif known is not None:
            known[gen] = lease
        leases.append(lease)
    return leases


# -- the record that the root held a commit ------------------------------------------------------
#
# A lease says an incarnation resumed from a committed step only when one resumed and then saved:
# a first run that committed steps 1-3 (floor -1) and lost every step directory afterwards (removed
# by hand, a bucket's lifecycle rule) left nothing saying so, and the next load started the run
# over without a word. Each incarnation's first commit at the URL leaves a small record beside
# the leases; a load that finds nothing committed but a record refuses to start over silently.


def record_path(generation: int) -> str:
    return f"{FENCE_DIR}/committed-gen-{generation:09d}.json"


def record_commit(storage: Storage, lease: Lease, step: int) -> bool:
    """After the first commit of `lease`'s incarnation at `storage`: the record, then older ones
    removed (one stays however many incarnations came). Best effort: the commit stands anyway;
    False if the record could not be written (the caller tries again at its next commit)."""
    try:
        storage.write_file(record_path(lease.generation), [json.dumps(
            {"generation": lease.generation, "step": step, "run_id": lease.run_id, "host": lease.host,
             "created_unix": time.time()}).encode()])
    except OSError as e:
        log.warning("rank 0: could not record the first commit of generation %d at %s (%s); tried again at the "
                    "next commit (until then, a load that finds every step of this URL removed may take it for a "
                    "fresh start)", lease.generation, storage.url, e)
        return False
    try:
        for gen in commit_record_generations(storage):
            if gen < lease.generation:
                storage.remove_file(record_path(gen))
    except OSError as e:  # the newest record is written: older ones left behind say less, nothing wrong
        log.info("rank 0: could not remove older commit records at %s (%s)", storage.url, e)
    return True


def commit_record_generations(storage: Storage) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_RECORD_RE.fullmatch, storage.list_dir(FENCE_DIR)) if m)


def newest_commit_record(storage: Storage) -> dict[str, object] | None:
    """The newest record of a commit at this root ({"generation", "step", ...}), or None. One that
    cannot be parsed still says that a commit happened (its generation from its name)."""
    generations = commit_record_generations(storage)
    if not generations:
        return None
    gen = generations[-1]
    try:
        d = json.loads(storage.read_bytes(record_path(gen), _MAX_LEASE_BYTES))
        return {"generation": gen, "step": int(d["step"]), "run_id": str(d.get("run_id", ""))}
    except MissingFileError:
        return None  # replaced by a newer record meanwhile
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return {"generation": gen, "step": None, "run_id": ""}


def _parse_lease(gen: int, data: bytes) -> Lease:
    try:
        d = json.loads(data)
        floor = d["floor"]
        return Lease(gen, None if floor is None else int(floor), str(d["run_id"]), str(d.get("host", "")),
                     int(d.get("pid", 0)), float(d.get("created_unix", 0.0)))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        return _damaged_lease(gen, f"{type(e).__name__}: {e}"[:200])


def _damaged_lease(gen: int, why: str) -> Lease:
    return Lease(gen, -1, "", damaged=why)


def acquire(storage: Storage, run_id: str, floor: int | None) -> Lease:
    """Take the next generation: exclusive create of one above the highest seen; retried on a race."""
    for _ in range(_ACQUIRE_ATTEMPTS):
        existing = lease_generations(storage)
        lease = Lease((existing[-1] if existing else 0) + 1, floor, run_id, socket.gethostname(), os.getpid(), time.time())
        try:
            storage.create_exclusive(lease_path(lease.generation), json.dumps(asdict(lease)).encode())
        except CheckpointExistsError:
            continue  # another incarnation took this generation a moment ago
        log.info("rank 0: took the write lease %s", lease.describe())
        return lease
    raise FencedError(f"could not take a write lease under {storage.url}/{FENCE_DIR}: {_ACQUIRE_ATTEMPTS} "
                      "attempts each lost to another writer; is another job writing to this directory?")


def check_current(storage: Storage, lease: Lease) -> None:
    """FencedError if a resumed incarnation of a higher generation exists (one LIST when none)."""
    if not any(g > lease.generation for g in lease_generations(storage)):
        return
    newer = [other for other in read_leases(storage) if other.generation > lease.generation and other.floor is not None]
    if newer:
        raise FencedError(
            f"this job ({lease.describe()}) was superseded at {storage.url}: a newer incarnation holds "
            f"{newer[-1].describe()}; it owns the directory from that step on, so this one may not "
            "commit. Stop this process.")


PRUNE_ABOVE = 8  # leases kept before pruning is considered (it reads every committed marker)


def prune(storage: Storage, lease: Lease, committed_generations: Callable[[], list[int]]) -> list[int]:
    """Remove leases that can no longer matter; returns the generations removed.

    A lease matters for two things: fencing writers older than it, and disqualifying commits of
    older generations. The live, resumed writer's own lease fences every older writer by itself;
    and a lease older than every committed checkpoint's generation disqualifies nothing that
    exists. So once this writer has committed, leases below both are dropped. A writer that never
    loaded fences no one, so it prunes nothing.
    """
    generations = lease_generations(storage)
    if lease.floor is None or len(generations) <= PRUNE_ABOVE:
        return []
    oldest_needed = min([lease.generation, *committed_generations()])
    removed = [g for g in generations if g < oldest_needed]
    for g in removed:
        storage.remove_file(lease_path(g))
    if removed:
        log.info("rank 0: pruned %d lease(s) older than generation %d", len(removed), oldest_needed)
    return removed


def resumed_leases(leases: list[Lease]) -> list[Lease]:
    """The leases of incarnations that resumed from a committed step (floor -1: found nothing)."""
    return [lease for lease in leases if lease.floor is not None and lease.floor >= 0]


def superseded_by(generation: int, step: int, leases: list[Lease]) -> Lease | None:
    """The newer lease that makes (generation, step) zombie output, or None if it is history."""
    for lease in leases:
        if lease.generation > generation and lease.floor is not None and step > lease.floor:
            return lease
    return None
