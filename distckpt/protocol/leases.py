"""The write lease as a job holds it: taken at the first save, checked before it extends a branch.

fencing.py says what a lease is and how generations fence each other; this module is the job's
side of it (LeaseKeeper: rank 0's lease and what it knows of the durable root's leases). A job that resumed from its node's local tier while the durable root could not be
read chose that step without the durable root's leases (choosing._choose_tiered). The step may
belong to a branch another incarnation has since superseded (it took over from an earlier step,
or went on past this one), and a new lease with this step as its floor would silently make the
newer incarnation's steps a zombie's. So before such a job's first lease, and before any upload
it makes while the check is due, `check_resumed_branch` reads the durable root's leases and
committed steps and refuses with FencedError what a load that could read them would not have
chosen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from distckpt.errors import (
    CorruptCheckpointError,
    DistCkptError,
    DurableUploadWarning,
    FencedError,
    MissingFileError,
    RunConflictError,
    StorageError,
    warn,
)
from distckpt.protocol import fencing
from distckpt.protocol.commit import ReplacePolicy, list_committed, read_marker
from distckpt.protocol.fencing import Lease, acquire, read_leases, record_commit
from distckpt.protocol.fencing import check_current as check_fence
from distckpt.protocol.tiers import remove_foreign
from distckpt.storage import Storage

log = logging.getLogger("distckpt")


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


class LeaseKeeper:
    """Rank 0's write lease at the durable root, taken at the first save, and what the job knows
    of that root's leases between a manager's calls. The lease lives at the durable root (the one
    that outlives a VM); with two tiers the local tier's files carry its generation too."""

    def __init__(self, durable: Storage, run_id: str, local: Storage | None = None) -> None:
        self.durable, self.run_id, self.local = durable, run_id, local
        self.lease: Lease | None = None
        self.floor: int | None = None  # the step this job resumed from (-1: found nothing)
        self.branch: ResumedBranch | None = None  # a local step loaded unchecked: checked before writing
        self.seen: dict[int, Lease] = {}  # the durable root's leases read so far (fencing.read_leases)
        # the URL's fence could not be read before a local save: not asked again until an upload
        # succeeds, so local saves do not wait for its timeouts at every save
        self.unreachable = False
        self._commit_recorded = False  # this incarnation's first commit at the URL was recorded
        self._local_cleaned = False  # another job's steps removed from the local tier

    def resumed(self, step: int | None, branch: ResumedBranch | None) -> None:
        """After a load: the floor the lease will claim (None: nothing committed, -1), unless the
        lease is already held; and the local step chosen unchecked, if any, to check first."""
        if self.lease is None:
            self.floor = -1 if step is None else step
        self.branch = branch

    @property
    def replace_policy(self) -> ReplacePolicy:
        """Which committed steps this writer may replace (commit.ReplacePolicy)."""
        return ReplacePolicy(self.floor, self.lease.generation if self.lease else None)

    def take(self) -> Lease:
        """The write lease, taken once: from here on older incarnations cannot commit."""
        if self.lease is None:
            try:
                try:
                    self.check_branch()
                    self.lease = acquire(self.durable, self.run_id, self.floor)
                except MissingFileError:
                    self.durable.check_root()  # a missing bucket is said as such ("fence/... does not exist" was all)
                    raise
            except StorageError as e:
                if self.local is None:
                    raise
                # The local tier's files are named with the lease's generation, and a local step
                # loads only under a lease at the URL: without one nothing can be committed anywhere.
                raise StorageError(e.errno, f"{e.strerror or e}. This incarnation's first save takes the write lease at "
                                   f"{self.durable.url} and could not reach it, so nothing was committed, on the "
                                   "local tier either; each save tries again. Once the lease is held, an unreachable "
                                   "URL no longer stops local saves") from e
        return self.lease

    def check_branch(self) -> None:
        """Before the first lease (and before an upload while the check is due): a local step
        loaded while the URL could not be read is checked against the URL's leases and steps;
        FencedError if a newer incarnation superseded it or went on past it."""
        branch = self.branch
        if branch is not None:
            check_resumed_branch(self.durable, branch, self.seen)
            self.branch = None

    def record_first_commit(self, step: int) -> None:
        """After a commit at the URL: the first of this incarnation leaves its record
        (fencing.record_commit), so a load that later finds every step gone does not start over;
        one that could not be written is tried again at the next commit."""
        if self.lease is not None and not self._commit_recorded:
            self._commit_recorded = bool(record_commit(self.durable, self.lease, step))

    def known(self, local: bool = False) -> list[Lease]:
        """The durable root's leases; those read before if it cannot be listed now (the local
        tier's retention goes on while the durable root is unreachable; fewer leases only make
        fewer steps count as a superseded writer's). For the local tier's retention the URL is
        not asked while it is known unreachable (until an upload succeeds): a hung store held
        every local save for its call timeout, twice (the fence, then this listing)."""
        seen = sorted(self.seen.values(), key=lambda lease: lease.generation)
        if local and self.unreachable:
            return seen
        try:
            return read_leases(self.durable, self.seen)
        except (OSError, DistCkptError) as e:
            log.info("rank 0: the leases at %s cannot be listed (%s); retention judges by those seen before",
                     self.durable.url, e)
            if local:
                self.unreachable = True  # the local saves' fence check skips it too
            return seen

    def check_before_local_commit(self, lease: Lease) -> None:
        """Before a local commit: the fence lives at the URL, so it is checked there (a superseded
        writer gets FencedError here, as on one tier). An unreachable URL warns once and is not
        asked again until an upload succeeds (the upload checks the fence itself), so local saves
        go on without waiting for the URL's timeouts at every save."""
        if self.unreachable:
            return
        try:
            check_fence(self.durable, lease)
        except FencedError:
            raise
        except (OSError, DistCkptError) as e:
            self.unreachable = True
            message = (f"rank 0: the fence at {self.durable.url} cannot be checked before the local save ({e}); "
                       "saving locally, and not checking again until an upload to the URL succeeds")
            warn(message, DurableUploadWarning)

    def prepare_local(self) -> None:
        """In the first save's capture: another job's steps leave the local tier (no job of this
        URL can load them; kept, they would collide with this job's steps)."""
        if self._local_cleaned or self.local is None:
            return
        try:
            remove_foreign(self.local, read_leases(self.durable), 0)
            self._local_cleaned = True
        except RunConflictError:
            raise
        except (OSError, DistCkptError) as e:
            log.warning("rank 0: could not check the local tier %s for another job's steps (%s)", self.local.url, e)
