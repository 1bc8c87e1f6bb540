"""What a job prunes after each commit (rank 0): retention, leftovers and leases.

retention.py says which steps `keep_last` / `keep_best` keep and how a checkpoint is removed
(marker first); this module applies it for a live job, per tier: `keep_last` and `keep_best` on
the durable root, `keep_local` on the local tier (sparing the step being uploaded from it), and
on the durable root the leases that can no longer matter (fencing.prune). Each root's committed
steps are remembered between saves (commit.CommitIndex), so a save's cost does not grow with
history. A failure here never undoes the commit it follows: it is a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from distckpt.config import ManagerConfig
from distckpt.errors import CheckpointWarning, DistCkptError, warn
from distckpt.io import manifest as mf
from distckpt.protocol import doctor_hooks
from distckpt.protocol.commit import CommitIndex, committed_generations
from distckpt.protocol.fencing import prune as prune_leases
from distckpt.protocol.leases import LeaseKeeper
from distckpt.protocol.retention import (
    Committed,
    Sweeper,
    collect_leftovers,
    kept_references,
    plan_retention,
    read_committed,
    retire,
    superseded_to_retire,
)
from distckpt.storage import Storage

log = logging.getLogger("distckpt")


class Pruner:
    """Rank 0's retention for a manager's tiers (the durable root, and the local tier if any)."""

    def __init__(self, durable: Storage, local: Storage | None, config: ManagerConfig, keep_local: int | None,
                 leases: LeaseKeeper) -> None:
        self.durable, self.local, self.config, self.keep_local, self.leases = durable, local, config, keep_local, leases
        self.sweeper = Sweeper()  # retired steps' files, removed off the save's path
        self._indexes: dict[str, CommitIndex] = {}
        self._newest_committed: dict[str, int] = {}  # per tier: the highest live step committed (branch warning)
        self._warned_below_newest = False

    def index(self, storage: Storage) -> CommitIndex:
        """The memo of a root's committed steps (commit.CommitIndex)."""
        index = self._indexes.get(storage.url)
        if index is None or index.storage is not storage:
            index = self._indexes[storage.url] = CommitIndex(storage)
        return index

    def after_commit(self, storage: Storage, just_committed: int, spared: Collection[int] = ()) -> None:
        """Retention and leftover collection on the root just committed to (never `spared` steps);
        on the durable root also the leases that can no longer matter. Failures are warnings."""
        keep_last, keep_best = (self.keep_local, None) if storage is self.local else \
            (self.config.keep_last, self.config.keep_best)
        if doctor_hooks.keeps_everything():
            keep_last = keep_best = None
        try:
            index = self.index(storage)
            index.scan(expect=just_committed)
            self._warn_if_below_newest(index, just_committed)
            doomed, keep = self._plan(index, keep_last, keep_best, {just_committed, *spared})
            retired = self._retire(storage, index, doomed, keep)
            collect_leftovers(storage, self.config.leftover_grace_s, index=index,
                              skip=frozenset(mf.step_dir(step) for step in retired))
            lease = self.leases.lease
            if lease is not None and storage is self.durable:  # local steps need their leases too
                local = self.local
                prune_leases(storage, lease, lambda: index.generations()
                             + (committed_generations(local) if local is not None else []))
        except (OSError, DistCkptError) as e:
            log.warning("rank 0: retention after step %d failed (the checkpoint is committed): %s",
                        just_committed, e)

    def before_local_write(self, spared: Collection[int] = ()) -> None:
        """Before a local write: the steps keep_local no longer keeps and no upload needs (a step
        spared while it was uploaded, a previous incarnation's) go now, not after this commit. A
        local disk sized for keep_local + 1 checkpoints otherwise stayed full for good after a
        restart that found keep_local + 1 there (ENOSPC at every save)."""
        if self.local is None or self.keep_local is None or doctor_hooks.keeps_everything():
            return
        try:
            index = self.index(self.local)
            index.scan()
            doomed, keep = self._plan(index, self.keep_local, None, set(spared))
            self._retire(self.local, index, doomed, keep)
        except (OSError, DistCkptError) as e:
            log.warning("rank 0: local retention before the save failed (it runs again after the commit): %s", e)

    def close(self) -> None:
        self.sweeper.close()

    def _warn_if_below_newest(self, index: CommitIndex, just_committed: int) -> None:
        """Once per manager: a step saved below the newest committed one (a branch after
        load(state, step=older)) is not what load_latest resumes from, and retention keeps it
        beside the newest keep_last (a step just committed is never removed)."""
        tier = index.storage.url  # each tier's own: an upload finishing after the next local commit is no branch
        newest = self._newest_committed.get(tier)
        if newest is None:  # listed once: a save's cost must not grow with history
            # A superseded writer's steps do not count: load_latest never resumes from them, and
            # this job's retention removes them (a live job replacing a zombie's step 3 below the
            # zombie's step 4 was warned about a branch).
            zombies = index.superseded(self.leases.known(local=index.storage is not self.durable))
            committed = [step for step in index.listing.committed() if step not in zombies]
            newest = committed[0] if committed else just_committed
        self._newest_committed[tier] = max(newest, just_committed)
        if just_committed < newest and not self._warned_below_newest:
            self._warned_below_newest = True
            message = (f"step {just_committed} was committed below the newest committed step {newest} of "
                       f"{index.storage.url}: load_latest resumes from step {newest}, not from this branch, "
                       "and keep_last counts the highest steps (this one is kept as the step just saved). To "
                       f"continue this branch after a restart, number its saves above {newest} or resume it "
                       "with load(state, step=...)")
            warn(message, CheckpointWarning)

    def _retire(self, storage: Storage, index: CommitIndex, doomed: list[int], keep: set[str]) -> list[int]:
        """Retire `doomed` (marker first: no longer committed); their files go on the sweeper's thread."""
        retired: list[int] = []
        try:
            for step in doomed:
                retire(storage, step)
                retired.append(step)
                index.forget(mf.step_dir(step))
                log.info("rank 0: retention removed step %d from %s", step, storage.url)
        finally:
            if retired:
                self.sweeper.submit(storage, retired, keep)
        return retired

    def _plan(self, index: CommitIndex, keep_last: int | None, keep_best: int | None,
              spared: set[int]) -> tuple[list[int], set[str]]:
        """The steps retention deletes and the files it must keep (those a kept incremental
        checkpoint references). Manifests are read only when needed: for the metrics of
        `keep_best`, and for the references when something is deleted; each once per process
        (the index), so a save's cost does not grow with the number of committed steps."""
        if keep_last is None and keep_best is None:
            return [], set()
        # A superseded writer's commit is never loaded: counted, it could push the live job's
        # steps out of keep_last (and a zombie's own retention delete them all); it goes instead.
        zombies = index.superseded(self.leases.known(local=index.storage is not self.durable))
        steps = [step for step in index.listing.committed() if step not in zombies]
        committed = (read_committed(index.storage, steps, index) if keep_best is not None
                     else [Committed(step, None) for step in steps])
        doomed = [step for step in plan_retention(committed, keep_last, keep_best, self.config.best_mode)
                  + superseded_to_retire(zombies, steps) if step not in spared]
        if not doomed:
            return [], set()
        if keep_best is None:
            committed = read_committed(index.storage, steps, index)
        return sorted(doomed), kept_references(committed, doomed)
