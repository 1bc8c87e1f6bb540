"""The load protocol's first phase: which steps a load tries, newest first, and what "nothing
committed" means (loading.py runs the phases).

    choose    rank 0 lists the durable root's step directories and reads its leases, and
              broadcasts them (the first listing in the exchange that checks the ranks'
              requests: load_request.agree_on_the_request); with a local tier every rank keeps
              the local steps a lease of the durable root wrote, and the ranks agree on those
              every node holds (tiers.py). An unreadable durable root leaves the local steps,
              chosen without their leases (a warning on every rank; the first save checks
              them: leases.py)
    again     after a read that met a candidate committed or removed meanwhile: whether a newer
              step is committed now, or whether no listed step is, settled
    nothing   no candidate committed: a fresh start, unless the leases or the record of an
              earlier commit say the run's checkpoints are gone (then an error on every rank)

Rank 0 reads storage; every rank gets the same answer (coordination through the coordinator).
"""

from __future__ import annotations

import dataclasses
import errno
from typing import Any, Callable

from distckpt.errors import (
    CheckpointFallbackWarning,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    StorageError,
    warn,
)
from distckpt.protocol import fencing, tiers
from distckpt.protocol.commit import is_committed, list_committed, step_candidates
from distckpt.protocol.coord import Coordinator, attempt_on_root, run_on_root
from distckpt.protocol.fencing import Lease
from distckpt.storage import Storage


def committed_since(coord: Coordinator, storage: Storage, listed: list[tuple[int, str]], above: int) -> bool:
    """Rank 0: whether a listed durable step newer than `above` is committed now (its marker: a
    commit adds no directory, and retention removes the marker before the directory). Asked only
    after a read that met an uncommitted or vanished candidate, of the candidates above the one
    found (a step left uncommitted by a killed save costs one more check)."""
    def check() -> dict[str, Any]:
        return {"committed": any(is_committed(storage, s) for s, t in listed if t == tiers.DURABLE and s > above)}

    return bool(run_on_root(coord, "load/recheck", "checking for a newer commit", check)["committed"])


def settled_uncommitted(coord: Coordinator, storage: Storage, listed: list[tuple[int, str]]) -> bool:
    """Rank 0: whether no listed durable step is committed, settled: their markers read oldest
    first, then a listing of the same names. A writer commits a step before it retires the one
    before, and makes a step's directory before either: so a step found retired means a newer
    one was committed, which is found committed when read after it, or retired in turn for a
    newer one still, whose directory the second listing then shows. Read newest first, or against
    the listing the read phase started from, the markers could all have looked uncommitted while
    a step was committed at every instant (a 2-rank reader racing a keep_last=1 writer got None)."""
    def check() -> dict[str, Any]:
        durable = sorted(s for s, t in listed if t == tiers.DURABLE)
        if any(is_committed(storage, s) for s in durable):
            return {"settled": False}
        return {"settled": sorted(durable_candidates(storage, None)) == durable}

    return bool(run_on_root(coord, "load/settle", "checking that no step is committed", check)["settled"])


def check_nothing_was_committed(coord: Coordinator, storage: Storage, leases: list[Lease] | None,
                                 local: Storage | None) -> None:
    """Nothing committed: a fresh start. Unless a lease says an incarnation of this job resumed from a
    committed step: then its history is gone (removed by hand, or a writer killed while it
    replaced a superseded writer's step: fencing.py), and starting over would be a silent wrong
    resume: CorruptCheckpointError, the same on every rank (the leases were broadcast). With a
    local tier, an earlier incarnation that never resumed may have committed steps to its node's
    disk alone (none had reached the URL, every `durable_every`-th save does) that are gone with
    it: nothing says whether it did, so the fresh start goes on, with a warning naming it."""
    if local is not None and leases and not fencing.resumed_leases(leases):
        warn(f"no committed checkpoint at {storage.url} or in {local.url}, though {leases[-1].describe()} began "
             f"saving: any steps it committed to a node's local tier alone (none reach the URL before the "
             f"`durable_every`-th save) are gone with that disk. Starting from scratch", CheckpointFallbackWarning)
    resumed = fencing.resumed_leases(leases or [])
    if resumed:
        raise CorruptCheckpointError(
            f"no committed checkpoint at {storage.url}, but {resumed[-1].describe()} had resumed from a committed "
            f"step (of this URL, or of a node's local tier): the run's checkpoints are gone (removed; lost with a "
            f"node's local disk before any step reached the URL; or with a writer killed while it replaced a "
            f"superseded writer's step). Starting over silently would not resume the run; to start it over on "
            f"purpose, remove {storage.url} (or its {fencing.FENCE_DIR}/ directory) first")
    if local is not None or leases is None:
        return
    # No incarnation resumed, but one may have committed steps that are gone now (a first run
    # whose every step directory was removed afterwards): its record says so (fencing.py)
    record = run_on_root(coord, "load/record", "reading the record of earlier commits",
                         lambda: {"record": fencing.newest_commit_record(storage)})["record"]
    if record is not None:
        step = "" if record.get("step") is None else f" step {record['step']} (the first it committed)"
        raise CorruptCheckpointError(
            f"no committed checkpoint at {storage.url}, but generation {record['generation']} of a job committed"
            f"{step} there: the run's checkpoints are gone (removed by hand, or by a storage lifecycle rule). "
            f"Starting over silently would not resume the run; to start it over on purpose, remove {storage.url} "
            f"(or its {fencing.FENCE_DIR}/ directory) first")


def choose(coord: Coordinator, storage: Storage, step: int | None, local: Storage | None = None,
           agreed: Callable[[Callable[[], dict[str, Any]] | None], dict[str, Any]] | None = None,
           ) -> tuple[list[tuple[int, str]], list[Lease] | None]:
    """The candidates (step, tier), newest first, and the durable root's leases (None: it could
    not be read, so local steps are loaded without checking who wrote them). With `agreed` (the
    load's first listing: the ranks' requests checked on rank 0, then what it is given run
    there), rank 0 lists in the requests' exchange: one exchange where there were two."""
    if local is not None:
        if agreed is not None:
            agreed(None)  # the local tier's steps are every rank's: the request is agreed first
        return _choose_tiered(coord, storage, step, local)

    def choose() -> dict[str, Any]:
        steps = durable_candidates(storage, step)
        leases = fencing.read_leases(storage) if steps or step is None else []  # None: see check_nothing_was_committed
        return {"candidates": tiers.merge_candidates([], steps, step),
                "leases": [dataclasses.asdict(lease) for lease in leases]}

    chosen = agreed(choose) if agreed is not None else \
        run_on_root(coord, "load/choose", "choosing a checkpoint to load", choose)
    return ([(int(s), str(t)) for s, t in chosen["candidates"]], [Lease(**d) for d in chosen["leases"]])


def durable_candidates(storage: Storage, step: int | None) -> list[int]:
    """Rank 0: the step directories to try, newest first (commit.step_candidates: the read phase
    skips one without a marker); an explicit `step` must be committed."""
    if step is None:
        steps = step_candidates(storage)
        if not steps:
            storage.check_root()  # nothing found: a missing bucket is an error, not a fresh start
        return steps
    if not is_committed(storage, step):
        committed = list_committed(storage)
        raise IncompatibleCheckpointError(f"step {step} is not committed at {storage.url} (committed: {committed[:10]})")
    return [step]


def _choose_tiered(coord: Coordinator, storage: Storage, step: int | None,
                   local: Storage) -> tuple[list[tuple[int, str]], list[Lease] | None]:
    """Two tiers: rank 0 lists the durable root and reads its leases; every rank then keeps the
    local steps a lease of that root wrote (another job's are skipped with a warning) and the
    ranks agree on those every node holds. An unreadable durable root is a warning on every rank
    when local candidates remain, else the error on every rank."""
    def read_durable() -> dict[str, Any]:
        steps = step_candidates(storage) if step is None else [s for s in [step] if is_committed(storage, s)]
        if not steps:
            storage.check_root()
        # a named step that is not there: the error lists what is committed
        listed = list_committed(storage)[:10] if step is not None and not steps else steps[:10]
        return {"steps": steps, "listed": listed, "leases": [dataclasses.asdict(x) for x in fencing.read_leases(storage)]}

    outcome, _ = attempt_on_root(coord, "load/durable", read_durable)
    durable = outcome.info if outcome.ok else {"steps": [], "listed": [], "leases": None}
    leases = None if durable["leases"] is None else [Lease(**d) for d in durable["leases"]]
    local_steps = tiers.common_local_steps(coord, local, leases)
    if not outcome.ok:
        message = (f"rank {coord.rank}: the durable tier {storage.url} cannot be read "
                   f"({outcome.error_type}: {outcome.message})")
        if not local_steps:
            raise StorageError(errno.EIO, f"{message}; and no local tier step is committed on every node")
        message += ("; choosing among the local tier's steps without checking who wrote them (its leases "
                    "live at the durable root)")
        warn(message, CheckpointFallbackWarning)
    steps = list(durable["steps"])
    if step is not None and step not in steps and step not in local_steps:
        raise IncompatibleCheckpointError(
            f"step {step} is not committed at {storage.url} (committed: {durable['listed']}) nor on every node's "
            f"local tier (common: {local_steps[:10]})")
    return tiers.merge_candidates(local_steps, steps, step), leases
