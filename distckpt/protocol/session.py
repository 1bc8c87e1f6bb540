"""A manager's session: what it holds between calls, and the save and load it runs with it.

CheckpointManager (manager.py) checks each call's arguments and runs one call at a time; the
call itself is a Session method, composed of the protocol's phases:

    save    classify `state` -> count it alike on every rank -> capture and agree (saving.py) ->
            gather, write, commit (here, or on the writer thread with its own process group for
            async saves) -> every rank hears the outcome -> retention (pruning.py) and, with two
            tiers, the upload (uploads.py)
    load    the background save in flight finished -> classify -> the load protocol (loading.py)
            -> what the load tells the next saves: the lease's floor (leases.py), a local resume
            to make durable (uploads.py), the staging buffers to warm

Between calls it holds the background writer and its group, the staging buffers, the save in
flight, the save count every rank keeps alike, and for incremental saves what the last commit
holds. Rank 0's write lease, retention and uploads are objects of their own, shared with it.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any, Callable, NoReturn

from distckpt.config import ManagerConfig
from distckpt.errors import AsyncSaveError, ConfigError, FencedError, IncompatibleCheckpointError, StorageError
from distckpt.io.copying import Prefault
from distckpt.protocol import doctor_hooks, fencing
from distckpt.protocol.async_writer import AsyncWriter, WriterStuckError
from distckpt.protocol.bounded_staging import BoundedStagingPool, payload_trees
from distckpt.protocol.commit import check_step_is_free
from distckpt.protocol.coord import Coordinator, Outcome, agree, make_coordinator
from distckpt.protocol.fencing import Lease
from distckpt.protocol.frameworks import classify_in_world
from distckpt.protocol.incremental import ContentTable
from distckpt.protocol.leases import LeaseKeeper, ResumedBranch
from distckpt.protocol.load_request import refuse_load_request
from distckpt.protocol.loading import Progress, load
from distckpt.protocol.memory_copies import MemoryTier
from distckpt.protocol.memory_flush import flush_to_disk
from distckpt.protocol.memory_load import load_memory_copy
from distckpt.protocol.payload import trees_written_by
from distckpt.protocol.pruning import Pruner
from distckpt.protocol.saving import (
    CapturedSave,
    RankWrite,
    StagedSave,
    capture_save,
    gather_save,
    raise_gathered_failures,
    share_outcome,
    write_and_commit,
)
from distckpt.protocol.snapshot import OverlappedSnapshot
from distckpt.protocol.tiers import TierSettings
from distckpt.protocol.uploads import DurableUploads
from distckpt.protocol.writer_process import staging_for
from distckpt.runtime import faults
from distckpt.runtime.gcpause import collector_paused
from distckpt.runtime.interrupts import sigint_deferred
from distckpt.runtime.versions import VersionsProbe
from distckpt.state import loader_hazards
from distckpt.state.kinds import staged_tensors
from distckpt.state.validation import LoadRules
from distckpt.storage import Storage

log = logging.getLogger("distckpt")


class Session:
    """The state a CheckpointManager keeps between calls and the save/load it runs with it."""

    def __init__(self, coord: Coordinator, run_id: str, config: ManagerConfig, durable: Storage,
                 local: Storage | None, tiers: TierSettings, leases: LeaseKeeper, pruner: Pruner,
                 uploads: DurableUploads, memory: MemoryTier | None = None) -> None:
        self.coord, self.rank, self.world_size, self.run_id = coord, coord.rank, coord.world_size, run_id
        self.config, self.durable, self.local, self.tiers = config, durable, local, tiers
        self.leases, self.pruner, self.uploads = leases, pruner, uploads
        self.memory = memory  # the memory tier (memory_copies.py); None or disabled: off
        self.rules = LoadRules(config.allow_dtype_cast, config.missing_entries)
        self.writer = AsyncWriter()
        self.writer_coord: Coordinator | None = None  # the writer thread's own group (async saves)
        # reused by every async save; free while none is in flight. writer='process': in shared
        # memory, written by the rank's writer process; staging_bytes: bounded (writer_process.py)
        self.staging, self.process_writer = staging_for(config)
        self.warming: Prefault | None = None  # faults in the staging buffers allocated at the load
        self.snapshot = OverlappedSnapshot(self.staging, config.timeout)  # overlap_snapshot
        self.writer.before_exit = self.snapshot.check  # at exit the main thread checks, then waits
        self.pending_step: int | None = None
        self.pending_on_disk = True  # False: the save in flight is committed to memory only (disk_every)
        self.newest_memory_only: int | None = None  # the newest save, if it went to memory only: close() writes it to disk
        self.save_seq = 0  # counts save() calls (the same on every rank): names shard reports
        # rank 0: what the last committed save holds, for incremental saves (incremental.py)
        self.content = ContentTable() if config.incremental else None
        # rank 0 writes the manifests: its git runs from now to the first save
        self.versions_probe: VersionsProbe | None = VersionsProbe() if self.rank == 0 else None

    @property
    def target(self) -> Storage:
        """Where save() commits: the local tier when there is one, else the URL."""
        return self.local if self.local is not None else self.durable

    def refused(self, error: ConfigError) -> ConfigError:
        """A refusal of this rank's arguments or state, kept for the call's first agreement, where
        every rank raises it; a world of one raises it as it is, at once."""
        if self.world_size == 1:
            raise error
        return error

    # -- save -------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], epoch: int | None, metric: float | None,
             refusal: ConfigError | None = None) -> None:
        """The save of `step` (collective), under collector_paused()."""
        self.finish_pending()
        self.uploads.report(block=False)
        self.list_ahead()  # retention's first listing runs while this save writes
        try:
            entries = classify_in_world(state, self.world_size) if refusal is None else []
        except ConfigError as e:  # StateArgumentError: `state` refused before any exchange
            refusal, entries = self.refused(e), []
        if refusal is not None:
            self._refuse_save(step, refusal)
        if self.save_seq < 2:  # a loop's loader left out of `state` (the first two: a step-0 save may come first)
            left_out = loader_hazards.warn_positions_left_out([e.target for e in entries if e.kind_spec.holds_data_position])
            doctor_hooks.note_loaders_left_out(left_out, self.rank)  # for the doctor's likely causes
        # an evaluation loader with persistent workers, outside `state`, that drew its seed at its first pass
        drawn = loader_hazards.warn_first_pass_draws_left_out([e.target for e in entries if e.kind_spec.holds_data_position])
        doctor_hooks.note_first_pass_draws(drawn, self.rank)
        doctor_hooks.rebase_fingerprints(step)
        in_memory, to_disk = self._next_save_tiers()
        durable = self.uploads.next_save_is_durable(entries, metric) if to_disk else False
        memory_only = in_memory and not to_disk
        self.save_seq += 1
        args = (self.coord, self.target, entries, step, epoch, metric, self.run_id,
                self.staging if self.config.async_save else None, self.leases.replace_policy, self.leases.take,
                self.save_seq, bool(self.config.split_writes), self.durable if self.local is not None else None,
                self._before_capture(step),
                self.uploads.hands_over_rank_files and not memory_only,  # a memory save's files go point to point
                memory_only)
        if self.config.async_save:
            self._save_in_background(entries, step, durable, args, in_memory, memory_only)
            return
        captured = capture_save(*args)
        if memory_only:
            self._commit_to_memory_only(self.coord, captured, gather_save(self.coord, captured))
            self.newest_memory_only = step
            doctor_hooks.after_commit(step, self.rank, self.world_size)
            return
        staged, own_write = gather_save(self.coord, captured), captured.own_write
        exc = None
        try:
            self._write(staged, own_write, durable)
        except Exception as e:
            exc = e
        if staged is None:
            faults.point("save/awaiting-commit", step=step, rank=self.rank)
        share_outcome(self.coord, exc, "save/commit", f"save of step {step}", step)
        self.newest_memory_only = None
        if in_memory:
            self._copy_to_memory(self.coord, captured, staged)
        self.uploads.ship(step)
        if durable and self.uploads.preempting:
            self.uploads.report(block=True, final=True)
        doctor_hooks.after_commit(step, self.rank, self.world_size)

    def _refuse_save(self, step: Any, refusal: ConfigError) -> NoReturn:
        """An argument or `state` refused on this rank only (epoch=-1 on rank 1) is the same
        ConfigError on every rank, at once: this rank counts the save as the others do and
        fails their first agreement (the peers raised CoordinationError when this rank went on
        or died, or waited out the timeout when it stayed)."""
        if self._next_save_tiers()[1]:
            self.uploads.next_save_is_durable([])
        self.save_seq += 1
        agree(self.coord, Outcome.failure(self.rank, refusal), "save/capture", f"save of step {step!r}", refusal)
        raise refusal  # not reached: agree raised, the failure being in the outcomes

    def _before_capture(self, step: int) -> Callable[[], None] | None:
        """Rank 0's checks inside the capture (a refusal there is every rank's, before anything is
        written): the local tier's preparation, and with a memory tier the step not saved before
        by this incarnation in memory (a memory-only step has no disk copy to say so)."""
        memory = self.memory.memory if self.memory is not None else None
        if self.local is None and memory is None:
            return None

        def check() -> None:
            if self.local is not None:
                self.leases.prepare_local()
            if memory is not None:
                check_step_is_free(memory.own, step, self.leases.replace_policy)

        return check

    def _next_save_tiers(self) -> tuple[bool, bool]:
        """(to memory, to disk) for the next save, alike on every rank (the pre-emption save, agreed,
        goes to disk: the node's memory goes with the node)."""
        if self.memory is None:
            return False, True
        return self.memory.next_save(must_reach_disk=self.uploads.preempting)

    def _save_in_background(self, entries: list[Any], step: int, durable: bool, args: tuple[Any, ...],
                            in_memory: bool = False, memory_only: bool = False) -> None:
        """The training thread's only exchange: capture and agree. The gather, the write and the
        outcome run on the writer thread, over the writer's own process group."""
        if self.config.overlap_snapshot:
            self.snapshot.prepare(entries)
        self.stop_warming()
        bounded = self.staging if isinstance(self.staging, BoundedStagingPool) else None
        self.staging.before_save()
        try:
            captured = capture_save(*args)
            if bounded is not None:  # the tail of the payload that fits is copied, the rest read in place
                bounded.bound(payload_trees(captured))
            background = self._background_coordinator()
            with sigint_deferred():  # a Ctrl-C between these would leave a job no wait() collects
                self.snapshot.started()  # optimizer steps wait from here until the copy is done
                self.writer.submit(lambda: self._background_save(background, captured, durable, in_memory,
                                                                 memory_only), f"step {step}")
                self.pending_step, self.pending_on_disk = step, not memory_only
        except BaseException:
            if self.pending_step != step:
                self.snapshot.abandon()
                if bounded is not None:
                    bounded.release()
            raise
        finally:
            self.staging.drop_spares()  # those this save did not take: not kept for later ones
        if bounded is not None:  # back-pressure: training resumes once no live tensor is left to read
            stall = bounded.wait_drained()
            (log.info if bounded.last_live_bytes else log.debug)("rank %d: step %d staged %d bytes within staging_bytes=%d, %d read in place; save() "
                      "stalled %.3fs for them", self.rank, step, bounded.last_staged_bytes, bounded.budget,
                      bounded.last_live_bytes, stall)
        if durable and self.uploads.preempting:
            self.finish_pending()  # the VM's disk goes with the VM: this save must reach the URL
            self.uploads.report(block=True, final=True)

    def _write(self, staged: StagedSave | None, own_write: RankWrite | None, durable: bool = False,
               failure: BaseException | None = None) -> None:
        """This rank's part of the write: its own files and their report (`failure` is reported
        instead, then raised); on rank 0 the rest and the commit."""
        target = self.target
        if staged is not None:
            self.pruner.before_local_write(self.uploads.spared)
        self.pruner.sweeper.drain()  # rank 0: the retired steps' files are gone before this save's are written
        try:
            if own_write is not None:
                own_write.run(target, self.coord.reports, failure)
        except StorageError as e:
            self._raise_sized(e)
        if failure is not None:
            raise failure
        if staged is None:
            return
        start = time.perf_counter()
        if self.local is not None:
            self.leases.check_before_local_commit(self.leases.take())
        try:
            write_and_commit(target, staged, self._versions, self.leases.take(), self.coord.reports, self.content)
        except StorageError as e:
            self._raise_sized(e)
        if self.local is not None:
            self.uploads.committed_locally(staged.step, durable)
        else:
            self.leases.record_first_commit(staged.step)
            self.pruner.after_commit(self.durable, staged.step)
        faults.point("save/retained", step=staged.step, rank=0)
        t = staged.timings
        log.info("rank 0: committed step %d at %s in %.3fs (capture %.3fs, gather %.3fs, write %.3fs, "
                 "commit %.3fs), %d payload bytes", staged.step, target.url,
                 time.perf_counter() - start + t["capture_s"] + t["gather_s"], t["capture_s"],
                 t["gather_s"], t["write_s"], t["commit_s"], staged.replicated.payload_bytes)

    def _raise_sized(self, e: StorageError) -> NoReturn:
        """A full disk's error, with how many checkpoints the disk must hold; others unchanged."""
        keep, name = (self.tiers.keep_local, "keep_local") if self.local is not None else \
            (self.config.keep_last, "keep_last")
        if e.errno != errno.ENOSPC or keep is None:
            raise e
        # Two tiers: the step being uploaded to the URL is kept on the local tier besides keep_local.
        extra, why = (2, " + the one being uploaded") if self.local is not None else (1, "")
        raise StorageError(errno.ENOSPC, f"{e.strerror or e}. Retention removes old checkpoints only after a new one "
                           f"commits, so the disk must hold {name}{why} + 1 = {keep + extra} "
                           f"checkpoints; the committed ones are intact. Free space, or lower {name} "
                           "and prune (distckpt prune URL --keep-last N)") from e

    def _versions(self) -> dict[str, Any]:
        """The environment for the manifest (rank 0), read when the first manifest is written: its
        git child was started at construction and has run beside the load, the training and this
        save's payload write (versions.VersionsProbe). Safe on the writer thread: the child writes
        to a file, not a pipe, so a DataLoader worker forked meanwhile cannot hold the read up
        (with a pipe it once did, with no deadline: 1 in 5 two-rank async runs)."""
        if self.versions_probe is None:  # not rank 0: no rank but 0 writes a manifest today
            self.versions_probe = VersionsProbe()
        return self.versions_probe.collect()

    def _background_coordinator(self) -> Coordinator:
        """The writer thread's own process group, made at the first async save (collective: every
        rank is here, having just agreed on the capture)."""
        if self.writer_coord is None:
            self.writer_coord = make_coordinator(self.config.timeout) if self.world_size > 1 else self.coord
        return self.writer_coord

    def _background_save(self, coord: Coordinator, captured: CapturedSave, durable: bool,
                         in_memory: bool = False, memory_only: bool = False) -> None:
        """The writer thread's part of an async save, on every rank: the overlapped snapshot's
        copies and their check, gather (with this rank's failure, if any), write, and rank 0's
        outcome to every rank (raised here, so each rank's wait() sees the same error)."""
        # Not under collector_paused(): the pause is the whole process's, and a background write
        # can outlast many training steps, whose cyclic garbage would wait for it.
        exc = None
        try:
            coord.check_usable()  # after a failed exchange nothing is written: see GlooCoordinator
            faults.point("save/snapshot-copy", step=captured.step, rank=self.rank)
            self.snapshot.copy_and_wait_for_check()
        except Exception as e:
            exc = e
        try:
            staged = gather_save(coord, captured, exc)  # a failure of the collective itself is every rank's
        finally:
            if exc is not None and isinstance(self.staging, BoundedStagingPool):
                self.staging.release()  # nothing of this rank will be written: training may go on
        if memory_only:  # nothing goes to disk: the memory commit shares every rank's outcome itself
            self._commit_to_memory_only(coord, captured, staged, exc)
            return
        try:
            raise_gathered_failures(coord, staged)  # rank 0: another rank failed, write nothing
            with trees_written_by(self.process_writer):  # None: this thread writes them
                self._write(staged, captured.own_write, durable, exc)
        except Exception as e:
            exc = e
        finally:
            if isinstance(self.staging, BoundedStagingPool):
                self.staging.release()
        share_outcome(coord, exc, "save/async-outcome", f"background save of step {captured.step}", captured.step)
        if in_memory:  # on the writer's own group: the training thread does not wait for the copies
            self._copy_to_memory(coord, captured, staged)

    def _copy_to_memory(self, coord: Coordinator, captured: CapturedSave, staged: StagedSave | None) -> None:
        """The committed step to every node's memory and its partner copy (collective, memory_copies.py)."""
        assert self.memory is not None
        self.memory.after_commit(coord, captured.step, captured, staged, self.target, self.leases.lease)

    def _commit_to_memory_only(self, coord: Coordinator, captured: CapturedSave, staged: StagedSave | None,
                               failure: BaseException | None = None) -> None:
        """A save between two disk_every saves: committed to every node's memory and its partner
        copies only (collective, memory_copies.py), under the same lease and fence as a disk commit."""
        assert self.memory is not None
        self.memory.commit_memory_only(coord, captured, staged, self.leases.lease, failure, self._versions,
                                       self._check_fence)

    def flush_memory_only(self) -> None:
        """close() (collective): the newest save, when it went to memory only (disk_every), written
        to the URL from the nodes' memory copies, so a job that ends cleanly keeps it on disk."""
        step = self.newest_memory_only
        if step is None or self.memory is None:
            return
        try:
            flush_to_disk(self.memory, self.coord, step, self.durable, self.leases.lease, self.leases.replace_policy)
        except FencedError as e:  # every rank alike: a superseded writer has nothing more to write
            log.warning("rank %d: step %d stays in memory only: %s", self.rank, step, e)
            return
        finally:
            self.newest_memory_only = None
        if self.rank == 0:
            log.info("rank 0: step %d, saved to memory only, written to %s at close()", step, self.durable.url)
            self.leases.record_first_commit(step)
            if self.local is None:
                self.pruner.after_commit(self.durable, step)

    def _check_fence(self, lease: Lease) -> None:
        """Rank 0, before a memory-only commit: the fence at the URL, as before a disk commit."""
        if self.local is not None:
            self.leases.check_before_local_commit(lease)
        else:
            fencing.check_current(self.durable, lease)

    def finish_pending(self) -> None:
        """Check the overlapped snapshot, join the background save in flight and raise its
        outcome, which every rank's writer received from rank 0 (no exchange here). Interrupted
        (Ctrl-C), the save stays pending: the next call waits for it again."""
        if self.pending_step is None:
            return
        step = self.pending_step
        self.snapshot.check()
        try:
            _, err = self.writer.wait(self._writer_bound_s())
        except WriterStuckError as stuck:
            self._give_up_on_writer(step, stuck)
        self.pending_step = None
        if err is not None:
            raise AsyncSaveError(f"background save of step {step} failed: {type(err).__name__}: {err}") from err
        self.newest_memory_only = None if self.pending_on_disk else step
        if self.pending_on_disk:  # a memory-only save has no local step to ship
            self.uploads.ship(step)
        doctor_hooks.after_commit(step, self.rank, self.world_size)

    def _writer_bound_s(self) -> float | None:
        """How long after submitting a save rank 0 waits for its writer: the other ranks stop
        waiting for its outcome `timeout` after their part (README: timeout must exceed rank 0's
        writes), so a write still running well past that (a storage call hung below Python) can
        only be reported, never shared. None (no bound) in a world of one: nobody else waits."""
        if self.world_size == 1:
            return None
        return self.config.timeout + min(self.config.timeout, 60.0)

    def _give_up_on_writer(self, step: int, stuck: WriterStuckError) -> NoReturn:
        reason = (f"rank 0's background write of step {step} did not finish within {stuck.elapsed_s:.0f}s "
                  f"(the timeout is {self.config.timeout:g}s)")
        for coord in (self.coord, self.writer_coord):
            if coord is not None:
                coord.distrust(reason)
        self.writer.abandon()
        self.writer = AsyncWriter()
        self.writer.before_exit = self.snapshot.check
        self.pending_step = None
        raise AsyncSaveError(
            f"background save of step {step} failed: {reason}; the other ranks have stopped waiting for "
            "its outcome. It is abandoned (a write stuck in storage, or slower than timeout= allows): step "
            f"{step} may or may not be committed later (committed_steps() or a restart's load_latest tell). "
            "This manager's group is not trusted again: restart the job or create a new CheckpointManager")

    # -- load -------------------------------------------------------------------------------

    def load(self, state: dict[str, Any], step: int | None, refusal: ConfigError | None = None) -> Progress | None:
        """The load of `step` (None: the newest that verifies; collective), then what it tells
        the next saves."""
        self.finish_pending()
        with collector_paused():
            try:
                entries = classify_in_world(state, self.world_size) if refusal is None else []
            except ConfigError as e:  # refused on this rank: the same error on every rank, at once
                refusal = self.refused(e)
            if refusal is not None:
                refuse_load_request(self.coord, refusal)
                raise refusal  # not reached: refuse_load_request raised
            progress = self._load_memory(entries, state, step)
            if progress is None:
                try:
                    progress = load(self.coord, self.durable, entries, state, step, self.config.world_size_policy,
                                    self.rules, self.local)
                except IncompatibleCheckpointError as e:
                    self._say_the_memory_tier_lacks_it(e, step)
        if progress is not None:  # a memory step may be on the local tier only: made durable next
            self.uploads.resumed("local" if progress.tier in ("memory", "peer") else progress.tier)
        self.leases.resumed(progress.step if progress is not None else None,
                            None if progress is None or progress.leases_checked or self.local is None else
                            ResumedBranch(progress.step, progress.generation, self.local.url, step is None))
        doctor_hooks.install_fingerprints(entries, progress.step if progress is not None else None, self.rank)
        if self.config.async_save:
            self._warm_staging(entries)
        for entry in entries:
            entry.kind_spec.after_load(entry)  # a DDP model's first step rebuilds its buckets
        if progress is not None:
            for line in progress.config_diff:
                log.warning("rank %d: config differs from the checkpoint's: %s", self.rank, line)
            log.info("rank %d: resumed from %s (step %d, epoch %s%s)", self.rank, progress.url,
                     progress.step, progress.epoch, f", {progress.tier} tier" if self.local is not None else "")
        return progress

    def _say_the_memory_tier_lacks_it(self, error: IncompatibleCheckpointError, step: int | None) -> NoReturn:
        """A named step on no disk tier: with a memory tier, the error says it is not in memory
        either (a memory-only step whose copies are gone), not only which steps the disk holds."""
        if step is None or self.memory is None or not self.memory.enabled or "is not committed at" not in str(error):
            raise error
        raise IncompatibleCheckpointError(f"{error}; nor does the memory tier hold it on every node (own or partner "
                                          "copies): a step saved to memory only is lost with both copies of a node. "
                                          "load_latest(state) resumes the newest step that is") from error

    def _load_memory(self, entries: list[Any], state: dict[str, Any], step: int | None) -> Progress | None:
        """The memory tier's newest step every rank is covered for, or `step` where it is
        (collective; None: load the disk tiers)."""
        if self.memory is None or not self.memory.enabled:
            return None

        def load_from(copy: Storage, step: int, leases: list[Any]) -> Progress | None:
            return load_memory_copy(self.coord, self.durable, copy, entries, state, step,
                                    self.config.world_size_policy, self.rules, leases)

        progress: Progress | None = self.memory.recover(self.coord, self.durable, load_from, self.local, step)
        return progress

    def list_ahead(self) -> None:
        """Rank 0: start the root's full listing that retention after the first save (and every
        64th) needs, on a helper thread (commit.CommitIndex.prefetch); once at most."""
        if self.rank == 0 and self.local is None:
            self.pruner.index(self.durable).prefetch()

    def _warm_staging(self, entries: list[Any]) -> None:
        """Async saves: allocate the staging buffers now, the state's shapes known, and fault
        their pages in on a helper thread while the job trains, so the first save copies into
        ready memory instead of stalling to allocate it (StagingPool.warm)."""
        made = self.staging.warm(staged_tensors(entries))
        if made:
            self.warming = Prefault(made)

    def stop_warming(self) -> None:
        """Before a save stages anything: the helper stops within one 2 MiB step; what it did not
        reach, the copy faults in."""
        warming, self.warming = self.warming, None
        if warming is not None:
            warming.stop()

    def close(self) -> None:
        """Release what the session holds (the manager's own group is the manager's to close)."""
        self.writer.close()
        self.snapshot.close()
        self.stop_warming()
        self.staging.drop_spares()
        if self.process_writer is not None:
            self.process_writer.close()
        if self.versions_probe is not None:
            self.versions_probe.close()
        if self.writer_coord is not None and self.writer_coord is not self.coord:
            self.writer_coord.close()
