"""The write lease as a job holds it: taken at the first save, checked before it extends a branch.

fencing.py says what a lease is and how generations fence each other; this module is the job's
side of it. A job that resumed from its node's local tier while the durable root could not be
read chose that step without the durable root's leases (loading._choose_tiered). The step may
belong to a branch another incarnation has since superseded (it took over from an earlier step,
or went on past this one), and a new lease with this step as its floor would silently make the
newer incarnation's steps a zombie's. So before such a job's first lease, and before any upload
it makes while the check is due, `check_resumed_branch` reads the durable root's leases and
committed steps and refuses with FencedError what a load that could read them would not have
chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from distckpt.errors import CorruptCheckpointError, FencedError, MissingFileError
from distckpt.protocol import fencing
from distckpt.protocol.commit import list_committed, read_marker
from distckpt.protocol.fencing import Lease
from distckpt.storage import Storage


@dataclass(frozen=True)
class ResumedBranch:
    """A local step a load chose without the durable root's leases (it could not be read)."""

    step: int
    generation: int  # the incarnation that committed it (its marker's)
    local_url: str
    latest: bool  # chosen by load_latest (the newest step), not named by load(state, step=...)


def check_resumed_branch(durable: Storage, branch: ResumedBranch, known: dict[int, Lease] | None = None) -> None:
    """FencedError if the durable root shows `branch` superseded: a newer incarnation took over from
    an earlier step (fencing.superseded_by), or, for load_latest, a step above it is committed there
    by a writer not itself superseded (a later incarnation went on past it). StorageError if the
    durable root cannot be read: nothing may be written until it has been checked."""
    leases = fencing.read_leases(durable, known)
    newer = fencing.superseded_by(branch.generation, branch.step, leases)
    if newer is not None:
        raise FencedError(
            f"{_resumed(durable, branch)}, and that step was superseded: {newer.describe()} took over from step "
            f"{newer.floor}, so its steps after {newer.floor} at {durable.url} are the run's line. {_refused(durable)}")
    if not branch.latest:
        return  # a step named on purpose: a branch from it is the caller's choice (as with a readable URL)
    ahead = _live_steps_above(durable, branch.step, leases)
    if ahead:
        step, generation = ahead[0]
        raise FencedError(
            f"{_resumed(durable, branch)}, and {durable.url} holds newer committed steps {[s for s, _ in ahead[:10]]} "
            f"(step {step} by generation {generation}): the run went on past step {branch.step} elsewhere. "
            f"{_refused(durable)}")


def _live_steps_above(durable: Storage, step: int, leases: list[Lease]) -> list[tuple[int, int]]:
    """(step, generation) of the durable root's committed steps above `step` that no newer lease
    supersedes, newest first: those a load that could read the root would have preferred."""
    live = []
    for above in (s for s in list_committed(durable) if s > step):
        try:
            marker = read_marker(durable, above)
        except (MissingFileError, CorruptCheckpointError):
            continue  # removed meanwhile, or damaged: a load would not take it either
        if fencing.superseded_by(marker.generation, above, leases) is None:
            live.append((above, marker.generation))
    return sorted(live, reverse=True)


def _resumed(durable: Storage, branch: ResumedBranch) -> str:
    return (f"this job resumed from step {branch.step} of the local tier {branch.local_url} (committed by generation "
            f"{branch.generation}) while {durable.url} could not be read")


def _refused(durable: Storage) -> str:
    return (f"Saving would continue a superseded branch and drop that work, so nothing was saved, on either tier. "
            f"Restart the job with {durable.url} reachable: load_latest then reads the durable tier and resumes "
            "from the run's newest step")
