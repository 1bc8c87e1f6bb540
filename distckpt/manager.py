"""CheckpointManager: the public entry point. Its methods delegate to the protocol's phases."""

from __future__ import annotations

import datetime
import errno
import logging
import math
import numbers
import os
import signal
import sys
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, NoReturn

from distckpt import errors
from distckpt.config import DEFAULT_TIMEOUT_S, ManagerConfig, arguments_checked
from distckpt.errors import (
    AsyncSaveError,
    ConfigError,
    CoordinationError,
    DistCkptError,
    StorageError,
    shown,
)
from distckpt.io import manifest as mf
from distckpt.io.copying import Prefault
from distckpt.io.staging import StagingPool
from distckpt.protocol import doctor_hooks
from distckpt.protocol.async_writer import AsyncWriter, WriterStuckError
from distckpt.protocol.commit import list_committed
from distckpt.protocol.coord import Coordinator, Outcome, agree, make_coordinator
from distckpt.protocol.frameworks import classify_in_world, negative_step_refusal
from distckpt.protocol.incremental import ContentTable
from distckpt.protocol.leases import LeaseKeeper, ResumedBranch
from distckpt.protocol.loading import Progress, load, refuse_load_request
from distckpt.protocol.pruning import Pruner
from distckpt.protocol.retention import (
    Committed,
    best_first,
    read_committed,
)
from distckpt.protocol.saving import (
    CapturedSave,
    RankWrite,
    StagedSave,
    capture_save,
    gather_save,
    raise_gathered_failures,
    share_outcome,
    stage_save,
    write_and_commit,
)
from distckpt.protocol.snapshot import OverlappedSnapshot
from distckpt.protocol.tiers import (
    TierSettings,
)
from distckpt.protocol.uploads import DurableUploads
from distckpt.runtime import faults
from distckpt.runtime.gcpause import collector_paused
from distckpt.runtime.interrupts import sigint_deferred
from distckpt.runtime.preemption import PreemptionFlag
from distckpt.runtime.versions import VersionsProbe
from distckpt.state import loader_hazards
from distckpt.state.capture import CheckpointWarning
from distckpt.state.kinds import staged_tensors
from distckpt.state.validation import LoadRules, check_step
from distckpt.storage import open_storage

log = logging.getLogger("distckpt")


class CheckpointManager:
    """Saves and loads exact-resume checkpoints under one root URL.

    Construction, `save`, `load_latest`, `load`, `wait` and `close` are collective: call them on
    every rank, in the same order. Without an initialised process group (or with one rank) it
    works as a world of one.

    A checkpoint is committed only when its COMMITTED marker is written, after every file is
    durable; a failed or interrupted save never changes an earlier checkpoint.

    ``split_writes=True`` spreads the replicated tensors (a DDP model, its optimizer) across the
    ranks, each writing its share in parallel, under the same one commit. It assumes what DDP
    guarantees: the replicated entries hold the same values on every rank. Off by default.
    """

    @arguments_checked
    def __init__(self, url: str | os.PathLike[str], *, keep_last: int | None = None,
                 keep_best: int | None = None, best_mode: str = "min", async_save: bool = False,
                 storage_options: dict[str, Any] | None = None,
                 timeout: float | datetime.timedelta | None = 600.0,
                 leftover_grace_s: float = 3600.0, world_size_policy: str = "refuse",
                 preemption_signals: Any = (signal.SIGTERM,), split_writes: bool = False,
                 allow_dtype_cast: bool = False, missing_entries: str = "refuse",
                 local_dir: str | os.PathLike[str] | None = None, durable_every: int | None = None,
                 keep_local: int | None = None, incremental: bool = False,
                 overlap_snapshot: bool = False) -> None:
        refusal: Exception | None = None
        try:
            self._check_arguments(url, keep_last, keep_best, best_mode, async_save, storage_options, timeout,
                                  leftover_grace_s, world_size_policy, preemption_signals, split_writes,
                                  allow_dtype_cast, missing_entries, local_dir, durable_every, keep_local,
                                  incremental, overlap_snapshot)
        except Exception as e:  # a refused argument, an unreachable store: raised on every rank below
            refusal = e
        loader_hazards.track_iterators()  # a loop's loader left out of `state` is told at the first saves
        self._coord = make_coordinator(self.config.timeout if refusal is None else DEFAULT_TIMEOUT_S)
        self.rank, self.world_size = self._coord.rank, self._coord.world_size
        if refusal is not None and self.world_size == 1:
            self._coord.close()
            raise refusal
        self.run_id = self._agree_on_settings(refusal)
        self._versions_probe: VersionsProbe | None = None  # rank 0, started last (below)
        self._writer = AsyncWriter()
        self._writer_coord: Coordinator | None = None  # the writer thread's own group (async saves)
        self._staging = StagingPool()  # reused by every async save; free while none is in flight
        self._warming: Prefault | None = None  # faults in the staging buffers allocated at the load
        self._snapshot = OverlappedSnapshot(self._staging, self.config.timeout)  # overlap_snapshot
        self._writer.before_exit = self._snapshot.check  # at exit the main thread checks, then waits
        self._pending_step: int | None = None
        self._save_seq = 0  # counts save() calls (the same on every rank): names shard reports
        self._leases = LeaseKeeper(self.storage, self.run_id, self.local)  # rank 0's write lease (leases.py)
        self._pruner = Pruner(self.storage, self.local, self.config, self.tiers.keep_local, self._leases)  # rank 0
        self._closed = False
        self._preemption = PreemptionFlag(self.config.preemption_signals)
        self._uploads = DurableUploads(self._coord, self.storage, self.local, self.tiers, self.config,
                                       self.split_writes, self._leases, self._pruner)  # two tiers (uploads.py)
        # rank 0: what the last committed save holds, for incremental saves (incremental.py)
        self._content = ContentTable() if incremental else None
        if self.rank == 0:  # it writes the manifests: its git runs from now to the first save
            self._versions_probe = VersionsProbe()

    def _check_arguments(self, url: Any, keep_last: Any, keep_best: Any, best_mode: Any, async_save: Any,
                         storage_options: Any, timeout: Any, leftover_grace_s: Any, world_size_policy: Any,
                         preemption_signals: Any, split_writes: Any, allow_dtype_cast: Any, missing_entries: Any,
                         local_dir: Any, durable_every: Any, keep_local: Any, incremental: Any,
                         overlap_snapshot: Any) -> None:
        """Every argument, before any exchange: a refusal on one rank only (a local_dir that is a
        file on one node) is then raised on every rank alike (_agree_on_settings); raised at once
        it left the other ranks waiting for this one's group for the whole timeout."""
        self.config = ManagerConfig(keep_last, keep_best, best_mode, async_save, timeout,
                                    leftover_grace_s, world_size_policy, split_writes, allow_dtype_cast,
                                    missing_entries, preemption_signals, incremental, overlap_snapshot)
        if self.config.keep_best is not None and self.config.keep_last is None:
            warnings.warn(f"keep_best={self.config.keep_best} without keep_last keeps every step: retention keeps "
                          "the newest keep_last steps and the keep_best best ones, and keep_last=None keeps all; "
                          "set keep_last too (keep_last=1 keeps the newest, to resume from)", CheckpointWarning,
                          stacklevel=3)
        self.split_writes = split_writes  # replicated tensors written by all ranks in parallel
        # `distckpt doctor` runs the job into roots of its own (DISTCKPT_DOCTOR_ROOT; README)
        self.storage = open_storage(doctor_hooks.root_override(url), storage_options)
        mf.refuse_step_directory(self.storage.url)
        self.url = os.fspath(url) if isinstance(url, os.PathLike) else url
        self._rules = LoadRules(allow_dtype_cast, missing_entries)
        self.tiers = TierSettings.check(self.storage.url, doctor_hooks.local_override(local_dir),
                                        durable_every, keep_local)
        if self.tiers.local_dir is not None:
            mf.refuse_step_directory(self.tiers.local_dir, "local_dir")
        self.local = open_storage(self.tiers.local_dir) if self.tiers.local_dir is not None else None
        if incremental and self.tiers.local_dir is not None:
            raise ConfigError("incremental=True with local_dir= is not supported yet: an upload would have to "
                              "carry the files each step references; use one of the two")
        if incremental and split_writes:
            # refused, not accepted: split writes put the replicated tensors in the ranks' shard
            # files, which are written whole, so every save would silently write everything again
            raise ConfigError("incremental=True with split_writes=True is not supported: incremental saves "
                              "leave out the unchanged tensors of rank 0's file, and split writes move them to "
                              "every rank's shard file, written whole at each save; use one of the two")

    def _agree_on_settings(self, refusal: Exception | None) -> str:
        """Rank 0's run id, and the settings every rank must share, compared (one exchange): a
        rank built with other retention, load rules or save modes than the others went unnoticed
        (only async_save was compared, at the first save). A rank whose arguments or storage were
        refused makes every rank raise that error's type (see _refusal_on_every_rank), naming it."""
        mine: dict[str, Any] = {"run_id": uuid.uuid4().hex, "refused": None if refusal is None else str(refusal),
                                "kind": type(refusal).__name__,
                                "settings": None if refusal is not None else self.config.shared_settings()}
        if self.world_size == 1:
            return str(mine["run_id"])
        every = self._coord.all_gather(mine, "init/run-id")
        refused = [(r, view["kind"], view["refused"]) for r, view in enumerate(every) if view["refused"] is not None]
        if refused:
            self._coord.close()
            raise _refusal_on_every_rank(refused) from refusal
        differing = sorted(name for name in every[0]["settings"]
                           if any(view["settings"].get(name) != every[0]["settings"][name] for view in every))
        if differing:
            self._coord.close()
            table = "; ".join(f"{name}: " + ", ".join(f"rank {r}: {view['settings'].get(name)!r}"
                                                     for r, view in enumerate(every)) for name in differing)
            raise ConfigError(f"the ranks built their CheckpointManager with different settings — {table}; build "
                              "every rank's manager with the same arguments")
        return str(every[0]["run_id"])

    def __repr__(self) -> str:
        return f"CheckpointManager({self.storage!r}, rank={self.rank}, world_size={self.world_size})"

    # -- save -----------------------------------------------------------------------------

    @arguments_checked
    def save(self, step: int, state: dict[str, Any], *, epoch: int | None = None,
             metric: float | None = None) -> None:
        """Save `state` as checkpoint `step` (collective).

        Returns once committed, or with ``async_save`` once the state is staged in host memory
        (the write then runs in the background; its failure is raised on every rank by the
        next save/wait/close). Raises UnstorableValueError naming the key path of a value that
        cannot be stored, CheckpointExistsError if `step` is already committed, and the same
        error on every rank when any rank fails.
        """
        self._check_open()
        with self._sole_call("save"):
            refusal = None
            try:
                # the metric is rank 0's: elsewhere it may be anything (README) and is not used
                step, epoch, metric = _check_save_args(step, epoch, metric if self.rank == 0 else None)
            except ConfigError as e:
                refusal = self._refused(e)
            with collector_paused():
                self._save(step, state, epoch, metric, refusal)

    def _refused(self, error: ConfigError) -> ConfigError:
        """A refusal of this rank's arguments or state, kept for the call's first agreement, where
        every rank raises it; a world of one raises it as it is, at once."""
        if self.world_size == 1:
            raise error
        return error

    def _refuse_save(self, step: Any, refusal: ConfigError) -> NoReturn:
        """An argument or `state` refused on this rank only (epoch=-1 on rank 1) is the same
        ConfigError on every rank, at once: this rank counts the save as the others do and
        fails their first agreement (the peers raised CoordinationError when this rank went on
        or died, or waited out the timeout when it stayed)."""
        self._uploads.next_save_is_durable([])
        self._save_seq += 1
        agree(self._coord, Outcome.failure(self.rank, refusal), "save/capture", f"save of step {step!r}", refusal)
        raise refusal  # not reached: agree raised, the failure being in the outcomes

    def _save(self, step: int, state: dict[str, Any], epoch: int | None, metric: float | None,
              refusal: ConfigError | None = None) -> None:
        self._finish_pending()
        self._uploads.report(block=False)
        self._list_ahead()  # retention's first listing runs while this save writes
        try:
            entries = classify_in_world(state, self.world_size) if refusal is None else []
        except ConfigError as e:  # StateArgumentError: `state` refused before any exchange
            refusal, entries = self._refused(e), []
        if refusal is not None:
            self._refuse_save(step, refusal)
        if self._save_seq < 2:  # a loop's loader left out of `state` (the first two: a step-0 save may come first)
            left_out = loader_hazards.warn_positions_left_out([e.target for e in entries if e.kind_spec.holds_data_position])
            doctor_hooks.note_loaders_left_out(left_out, self.rank)  # for the doctor's likely causes
        doctor_hooks.rebase_fingerprints(step)
        durable = self._uploads.next_save_is_durable(entries, metric)
        replaceable = self._leases.replace_policy
        self._save_seq += 1
        args = (self._coord, self._target, entries, step, epoch, metric, self.run_id,
                self._staging if self.config.async_save else None, replaceable, self._leases.take,
                self._save_seq, self.split_writes, self.storage if self.local is not None else None,
                self._leases.prepare_local if self.local is not None else None, self._uploads.hands_over_rank_files)
        if self.config.async_save:
            # The training thread's only exchange: capture and agree. The gather, the write and
            # the outcome run on the writer thread, over the writer's own process group.
            if self.config.overlap_snapshot:
                self._snapshot.prepare(entries)
            self._stop_warming()
            try:
                captured = capture_save(*args)
                background = self._background_coordinator()
                with sigint_deferred():  # a Ctrl-C between these would leave a job no wait() collects
                    self._snapshot.started()  # optimizer steps wait from here until the copy is done
                    self._writer.submit(lambda: self._background_save(background, captured, durable), f"step {step}")
                    self._pending_step = step
            except BaseException:
                if self._pending_step != step:
                    self._snapshot.abandon()
                raise
            finally:
                self._staging.drop_spares()  # those this save did not take: not kept for later ones
            if durable and self._uploads.preempting:
                self._finish_pending()  # the VM's disk goes with the VM: this save must reach the URL
                self._uploads.report(block=True, final=True)
            return
        staged, own_write = stage_save(*args)
        exc = None
        try:
            self._write(staged, own_write, durable)
        except Exception as e:
            exc = e
        if staged is None:
            faults.point("save/awaiting-commit", step=step, rank=self.rank)
        share_outcome(self._coord, exc, "save/commit", f"save of step {step}", step)
        self._uploads.ship(step)
        if durable and self._uploads.preempting:
            self._uploads.report(block=True, final=True)
        doctor_hooks.after_commit(step, self.rank, self.world_size)

    @property
    def _target(self) -> Any:
        """Where save() commits: the local tier when there is one, else the URL."""
        return self.local if self.local is not None else self.storage

    def _write(self, staged: StagedSave | None, own_write: RankWrite | None, durable: bool = False,
               failure: BaseException | None = None) -> None:
        """This rank's part of the write: its own files and their report (`failure` is reported
        instead, then raised); on rank 0 the rest and the commit."""
        target = self._target
        if staged is not None:
            self._pruner.before_local_write(self._uploads.spared)
        self._pruner.sweeper.drain()  # rank 0: the retired steps' files are gone before this save's are written
        try:
            if own_write is not None:
                own_write.run(target, self._coord.reports, failure)
        except StorageError as e:
            sized = self._sized(e)
            if sized is e:
                raise
            raise sized from e
        if failure is not None:
            raise failure
        if staged is None:
            return
        start = time.perf_counter()
        if self.local is not None:
            self._leases.check_before_local_commit(self._leases.take())
        try:
            write_and_commit(target, staged, self._versions, self._leases.take(), self._coord.reports,
                             self._content)
        except StorageError as e:
            sized = self._sized(e)
            if sized is e:
                raise
            raise sized from e
        if self.local is not None:
            self._uploads.committed_locally(staged.step, durable)
        else:
            self._leases.record_first_commit(staged.step)
            self._pruner.after_commit(self.storage, staged.step)
        faults.point("save/retained", step=staged.step, rank=0)
        t = staged.timings
        log.info("rank 0: committed step %d at %s in %.3fs (capture %.3fs, gather %.3fs, write %.3fs, "
                 "commit %.3fs), %d payload bytes", staged.step, target.url,
                 time.perf_counter() - start + t["capture_s"] + t["gather_s"], t["capture_s"],
                 t["gather_s"], t["write_s"], t["commit_s"], staged.replicated.payload_bytes)

    def _sized(self, e: StorageError) -> StorageError:
        """A full disk's error, with how many checkpoints the disk must hold; others unchanged."""
        keep, name = (self.tiers.keep_local, "keep_local") if self.local is not None else \
            (self.config.keep_last, "keep_last")
        if e.errno != errno.ENOSPC or keep is None:
            return e
        # Two tiers: the step being uploaded to the URL is kept on the local tier besides keep_local.
        extra, why = (2, " + the one being uploaded") if self.local is not None else (1, "")
        return StorageError(errno.ENOSPC, f"{e.strerror or e}. Retention removes old checkpoints only after a new one "
                            f"commits, so the disk must hold {name}{why} + 1 = {keep + extra} "
                            f"checkpoints; the committed ones are intact. Free space, or lower {name} "
                            "and prune (distckpt prune URL --keep-last N)")

    def _versions(self) -> dict[str, Any]:
        """The environment for the manifest (rank 0), read when the first manifest is written: its
        git child was started at construction and has run beside the load, the training and this
        save's payload write (versions.VersionsProbe). Safe on the writer thread: the child writes
        to a file, not a pipe, so a DataLoader worker forked meanwhile cannot hold the read up
        (with a pipe it once did, with no deadline: 1 in 5 two-rank async runs)."""
        if self._versions_probe is None:  # not rank 0: no rank but 0 writes a manifest today
            self._versions_probe = VersionsProbe()
        return self._versions_probe.collect()

    # -- the durable tier (two tiers only) -------------------------------------------------

    def _background_coordinator(self) -> Coordinator:
        """The writer thread's own process group, made at the first async save (collective: every
        rank is here, having just agreed on the capture)."""
        if self._writer_coord is None:
            self._writer_coord = make_coordinator(self.config.timeout) if self.world_size > 1 else self._coord
        return self._writer_coord

    def _background_save(self, coord: Coordinator, captured: CapturedSave, durable: bool) -> None:
        """The writer thread's part of an async save, on every rank: the overlapped snapshot's
        copies and their check, gather (with this rank's failure, if any), write, and rank 0's
        outcome to every rank (raised here, so each rank's wait() sees the same error)."""
        # Not under collector_paused(): the pause is the whole process's, and a background write
        # can outlast many training steps, whose cyclic garbage would wait for it.
        exc = None
        try:
            coord.check_usable()  # after a failed exchange nothing is written: see GlooCoordinator
            faults.point("save/snapshot-copy", step=captured.step, rank=self.rank)
            self._snapshot.copy_and_wait_for_check()
        except Exception as e:
            exc = e
        staged = gather_save(coord, captured, exc)  # a failure of the collective itself is every rank's
        try:
            raise_gathered_failures(coord, staged)  # rank 0: another rank failed, write nothing
            self._write(staged, captured.own_write, durable, exc)
        except Exception as e:
            exc = e
        share_outcome(coord, exc, "save/async-outcome", f"background save of step {captured.step}", captured.step)

    def _finish_pending(self) -> None:
        """Check the overlapped snapshot, join the background save in flight and raise its
        outcome, which every rank's writer received from rank 0 (no exchange here). Interrupted
        (Ctrl-C), the save stays pending: the next call waits for it again."""
        if self._pending_step is None:
            return
        step = self._pending_step
        self._snapshot.check()
        try:
            _, err = self._writer.wait(self._writer_bound_s())
        except WriterStuckError as stuck:
            self._give_up_on_writer(step, stuck)
        self._pending_step = None
        if err is not None:
            raise AsyncSaveError(f"background save of step {step} failed: {type(err).__name__}: {err}") from err
        self._uploads.ship(step)
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
        for coord in (self._coord, self._writer_coord):
            if coord is not None:
                coord.distrust(reason)
        self._writer.abandon()
        self._writer = AsyncWriter()
        self._writer.before_exit = self._snapshot.check
        self._pending_step = None
        raise AsyncSaveError(
            f"background save of step {step} failed: {reason}; the other ranks have stopped waiting for "
            "its outcome. It is abandoned (a write stuck in storage, or slower than timeout= allows): step "
            f"{step} may or may not be committed later (committed_steps() or a restart's load_latest tell). "
            "This manager's group is not trusted again: restart the job or create a new CheckpointManager")

    # -- load -----------------------------------------------------------------------------

    @arguments_checked
    def load_latest(self, state: dict[str, Any]) -> Progress | None:
        """Restore `state` from the newest committed checkpoint that verifies (collective).

        Returns None on a fresh start (nothing committed), else Progress(step, epoch, ...).
        A damaged newest checkpoint is skipped with a warning; all ranks must agree on
        (step, epoch, manifest digest) or all raise. Nothing is changed unless every rank
        read and checked everything first.
        """
        with self._sole_call("load_latest"):
            progress = self._load(state, None)
            self._list_ahead()  # a job that resumes goes on to save: its first retention's listing runs meanwhile
        if self.rank == 0:  # one line for the person watching the job (errors.notice says where it goes)
            errors.notice(self._resume_line(progress))
        return progress

    def _resume_line(self, progress: Progress | None) -> str:
        if progress is None:
            return f"no committed checkpoint at {self.storage.url}: starting fresh"
        epoch = f" (epoch {progress.epoch})" if progress.epoch is not None else ""
        tier = f" ({progress.tier} tier)" if self.local is not None else ""
        return f"resumed from step {progress.step}{epoch} at {progress.url}{tier}"

    def _list_ahead(self) -> None:
        """Rank 0: start the root's full listing that retention after the first save (and every
        64th) needs, on a helper thread (commit.CommitIndex.prefetch); once at most."""
        if self.rank == 0 and self.local is None:
            self._pruner.index(self.storage).prefetch()

    @arguments_checked
    def load(self, state: dict[str, Any], step: int) -> Progress:
        """Restore `state` from committed checkpoint `step` (collective); no fallback."""
        self._check_open()
        refusal = None
        try:
            step = check_step("step", step)
        except ConfigError as e:
            refusal = self._refused(e)
        with self._sole_call("load"):
            progress = self._load(state, step, refusal)
        assert progress is not None  # load(step=...) raises rather than returning None
        return progress

    def _load(self, state: dict[str, Any], step: int | None, refusal: ConfigError | None = None) -> Progress | None:
        self._check_open()
        self._finish_pending()
        with collector_paused():
            try:
                entries = classify_in_world(state, self.world_size) if refusal is None else []
            except ConfigError as e:  # refused on this rank: the same error on every rank, at once
                refusal = self._refused(e)
            if refusal is not None:
                refuse_load_request(self._coord, refusal)
                raise refusal  # not reached: refuse_load_request raised
            progress = load(self._coord, self.storage, entries, state, step, self.config.world_size_policy,
                            self._rules, self.local)
        if progress is not None:
            self._uploads.resumed(progress.tier)
        self._leases.resumed(progress.step if progress is not None else None,
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

    def _warm_staging(self, entries: list[Any]) -> None:
        """Async saves: allocate the staging buffers now, the state's shapes known, and fault
        their pages in on a helper thread while the job trains, so the first save copies into
        ready memory instead of stalling to allocate it (StagingPool.warm)."""
        made = self._staging.warm(staged_tensors(entries))
        if made:
            self._warming = Prefault(made)

    def _stop_warming(self) -> None:
        """Before a save stages anything: the helper stops within one 2 MiB step; what it did not
        reach, the copy faults in."""
        warming, self._warming = self._warming, None
        if warming is not None:
            warming.stop()

    @arguments_checked
    def preemption_requested(self) -> bool:
        """True on every rank if any rank received a pre-emption signal (collective).

        Call it at a step boundary, on every rank; when it returns True, save and exit::

            if mgr.preemption_requested():
                mgr.save(step, state, epoch=epoch)
                mgr.close()
                sys.exit(distckpt.PREEMPTED_EXIT_CODE)

        It costs one small collective: call it every step, or every few steps when a step is
        shorter than the grace period allows for.
        """
        self._check_open()
        self._preemption.armed = True
        with self._sole_call("preemption_requested"):
            flags = self._coord.all_gather(self._preemption.requested, "preemption/agree")
        self._uploads.preempting = self._uploads.preempting or any(flags)
        if any(flags) and self.rank == 0:
            log.warning("rank 0: pre-emption requested by rank(s) %s", [r for r, f in enumerate(flags) if f])
        return any(flags)

    @arguments_checked
    def committed_steps(self) -> list[int]:
        """Committed steps, newest first (reads storage; not collective; also after close()). With
        two tiers: the steps committed on either, as this rank sees them (its node's local tier and
        the URL)."""
        steps = set(list_committed(self.storage))
        if self.local is not None:
            steps |= set(list_committed(self.local))
        return sorted(steps, reverse=True)

    @arguments_checked
    def best_step(self) -> int | None:
        """The committed step with the best metric by `best_mode` (the one `keep_best` keeps
        first; of equal metrics the newest), None when no committed step has one. Reads storage,
        on the rank that calls it (not collective); with two tiers, either tier's steps. Resume
        or evaluate from it with `load(state, step=mgr.best_step())`. Also after close()."""
        by_step: dict[int, Committed] = {}
        for storage in (self.storage, self.local):
            if storage is not None:
                for c in read_committed(storage, list_committed(storage)):
                    if by_step.get(c.step) is None or by_step[c.step].metric is None:
                        by_step[c.step] = c
        best = best_first(list(by_step.values()), self.config.best_mode)
        return best[0] if best else None

    # -- lifecycle ------------------------------------------------------------------------

    @arguments_checked
    def wait(self) -> None:
        """Wait for the save in flight and raise its failure on every rank (collective). With
        two tiers it also waits for the upload in flight; a failed upload is a warning here
        (DurableUploadWarning) and makes the next save durable. A wait() after such a warning
        uploads the newest local step again, if it is still not durable (warning again if that
        fails too), so retrying wait() is never a silent no-op."""
        self._check_open()
        with self._sole_call("wait"):
            self._finish_pending()
            self._uploads.settle()

    @arguments_checked
    def close(self) -> None:
        """Wait for the save in flight, then release the manager's process group (collective).
        With two tiers the newest local step is made durable first; AsyncSaveError on every rank
        if it could not be, and the manager then stays open: close() again uploads it (saying so
        in the log), and raises again while it still fails. A failed background save is raised
        after that upload (the newest step committed before it is made durable all the same)."""
        if self._closed:
            return
        with self._sole_call("close"):
            try:
                self._finish_pending()
            except Exception:
                self._close_durably()  # its own failure is raised instead, chained to this one
                raise
            self._close_durably()
        # Not on Ctrl-C (or SystemExit) while waiting: the save in flight and the upload stay
        # pending, the manager open; close() again, or the exit hook, finishes them. Closing then
        # left the writer running with its groups torn down, and the next close() returned at
        # once: a step lost, or committed after close() returned.

    def _close_durably(self) -> None:
        """Shut down once nothing committed is left on node-local disk alone. Shut down after a
        failed upload, the next close() returned at once and the newest steps stayed on the node
        (a pre-empted node that retried close() as told, then exited, lost them)."""
        self._uploads.make_last_save_durable()
        self._shut_down()

    def _shut_down(self) -> None:
        self._closed = True
        self._preemption.uninstall()
        self._writer.close()
        self._uploads.close()
        self._pruner.close()
        self._snapshot.close()
        self._stop_warming()
        self._staging.drop_spares()
        if self._versions_probe is not None:
            self._versions_probe.close()
        if self._writer_coord is not None and self._writer_coord is not self._coord:
            self._writer_coord.close()
        self._coord.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:  # keep the error that is already propagating
            log.error("rank %d: closing after an error also failed: %s", self.rank, close_error)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointManager is closed; create a new one")

    @contextmanager
    def _sole_call(self, name: str) -> Iterator[None]:
        """One manager call at a time. A save() or close() from inside a save (a state_dict(),
        a hook) committed the inner step, then the outer one below it, or closed the manager
        under the save still running; two threads' calls crossed their collectives and failed
        with messages about storage and fencing. Both are refused here, saying which call runs.
        The running calls are read off the threads' stacks, not kept in a flag: a Ctrl-C landing
        between setting a flag and the `try` that clears it left every later call refused."""
        running = self._calls_running()
        mine = [call for call, here in running if here]
        if len(mine) > 1:  # this call and one below it on this thread's stack
            raise ConfigError(f"{name}() called while this CheckpointManager's {mine[1]}() is running on the "
                              "same thread (from a state_dict(), load_state_dict() or hook it called): manager "
                              f"calls do not nest; call {name}() after {mine[1]}() returns")
        others = [call for call, here in running if not here]
        if others:
            raise ConfigError(f"{name}() called from thread {threading.current_thread().name} while this "
                              f"CheckpointManager's {others[0]}() runs on another thread: a manager's calls are "
                              "collective and run one at a time, in the same order on every rank; make them "
                              "from one thread")
        yield

    def _calls_running(self) -> list[tuple[str, bool]]:
        """This manager's public calls on every thread's stack, innermost first: (name, on this thread)."""
        me = threading.get_ident()
        found = []
        for ident, top in sys._current_frames().items():
            frame: Any = top
            while frame is not None:
                code = frame.f_code
                if code.co_name in _COLLECTIVE_CALLS and code.co_filename == __file__ \
                        and frame.f_locals.get("self") is self:
                    found.append((code.co_name, ident == me))
                frame = frame.f_back
        return found


# The manager's calls that run one at a time (_sole_call); committed_steps() only reads storage.
_COLLECTIVE_CALLS = frozenset({"save", "load_latest", "load", "preemption_requested", "wait", "close"})


def _check_save_args(step: Any, epoch: Any, metric: Any) -> tuple[int, int | None, float | None]:
    if isinstance(step, numbers.Integral) and not isinstance(step, bool) and step < 0:
        raise negative_step_refusal(int(step))  # says where saves belong
    step = check_step("step", step)
    if epoch is not None:
        epoch = check_step("epoch", epoch)
    if metric is not None:
        metric = _check_metric(metric)
    return step, epoch, metric


def _check_metric(metric: Any) -> float:
    """A finite number: int, float, NumPy number or a one-element tensor (a validation loss)."""
    if hasattr(metric, "numel") and callable(metric.numel) and metric.numel() == 1 \
            and not getattr(metric, "is_complex", lambda: False)():
        try:
            metric = metric.item()
        except (RuntimeError, ValueError) as e:  # a meta tensor has no value to read
            raise ConfigError(f"metric: a tensor whose value cannot be read ({e}); pass a number") from None
    if isinstance(metric, bool) or not isinstance(metric, numbers.Real):
        raise ConfigError(f"metric={shown(metric)}: must be a number (e.g. the validation loss), not "
                          f"{type(metric).__name__}")
    try:
        value = float(metric)
    except OverflowError:
        raise ConfigError(f"metric={shown(metric)}: too large for a float") from None
    if not math.isfinite(value):
        raise ConfigError(f"metric={shown(metric)}: must be finite to rank checkpoints by it")
    return value


def _refusal_on_every_rank(refused: list[tuple[int, str, str]]) -> DistCkptError:
    """The one error every rank raises when some ranks' constructors failed: the first failing
    rank's distckpt type (ConfigError, StorageError, ...), or CoordinationError for any other
    exception (the raising rank keeps it as __cause__), its message naming each failing rank."""
    message = "; ".join(f"rank {r}: {kind}: {text}" if not _is_distckpt_error(kind) else f"rank {r}: {text}"
                        for r, kind, text in refused)
    kind = refused[0][1]
    cls = getattr(errors, kind) if _is_distckpt_error(kind) else CoordinationError
    return cls(message)  # type: ignore[no-any-return]


def _is_distckpt_error(kind: str) -> bool:
    cls = getattr(errors, kind, None)
    return isinstance(cls, type) and issubclass(cls, DistCkptError)

