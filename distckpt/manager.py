"""CheckpointManager: the public entry point. Its methods delegate to the protocol's phases."""

from __future__ import annotations

import datetime
import errno
import logging
import math
import numbers
import os
import signal
import time
import uuid
from typing import Any

from . import doctor as doctor_hooks
from . import faults
from .async_writer import AsyncWriter
from .capture import classify
from .commit import ReplacePolicy, committed_generations, list_committed
from .config import ManagerConfig
from .coord import make_coordinator
from .ddp import install_bucket_warmup
from .errors import AsyncSaveError, ConfigError, DistCkptError, StorageError
from .fencing import Lease, acquire
from .fencing import prune as prune_leases
from .preemption import PreemptionFlag
from .protocol import Progress, ShardWrite, StagedSave, load, share_outcome, stage_save, write_and_commit
from .retention import collect_leftovers, delete_checkpoint, plan_retention, read_committed
from .serialize import StagingPool
from .storage import open_storage
from .validation import LoadRules
from .versions import collect_versions

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

    def __init__(self, url: str | os.PathLike[str], *, keep_last: int | None = None,
                 keep_best: int | None = None, best_mode: str = "min", async_save: bool = False,
                 storage_options: dict[str, Any] | None = None,
                 timeout: float | datetime.timedelta | None = 600.0,
                 leftover_grace_s: float = 3600.0, world_size_policy: str = "refuse",
                 preemption_signals: Any = (signal.SIGTERM,), split_writes: bool = False,
                 allow_dtype_cast: bool = False, missing_entries: str = "refuse") -> None:
        self.config = ManagerConfig(keep_last, keep_best, best_mode, async_save, timeout,  # type: ignore[arg-type]
                                    leftover_grace_s, world_size_policy, split_writes, allow_dtype_cast,
                                    missing_entries, preemption_signals)
        self.split_writes = split_writes  # replicated tensors written by all ranks in parallel
        # `distckpt doctor` runs the job into roots of its own (DISTCKPT_DOCTOR_ROOT; README)
        self.storage = open_storage(doctor_hooks.root_override(url), storage_options)  # type: ignore[arg-type]
        self.url = os.fspath(url) if isinstance(url, os.PathLike) else url
        self._rules = LoadRules(allow_dtype_cast, missing_entries)
        self._coord = make_coordinator(self.config.timeout)
        self.rank, self.world_size = self._coord.rank, self._coord.world_size
        self.run_id = self._coord.broadcast(uuid.uuid4().hex, "init/run-id")
        self._versions = collect_versions() if self.rank == 0 else {}
        self._writer = AsyncWriter()
        self._staging = StagingPool()  # reused by every async save; free while none is in flight
        self._pending_step: int | None = None
        self._save_seq = 0  # counts save() calls (the same on every rank): names shard reports
        self._floor: int | None = None   # the step this job resumed from (-1: found nothing)
        self._lease: Lease | None = None  # rank 0, taken at the first save (fencing.py)
        self._closed = False
        self._preemption = PreemptionFlag(self.config.preemption_signals)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.storage!r}, rank={self.rank}, world_size={self.world_size})"

    # -- save -----------------------------------------------------------------------------

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
        step, epoch, metric = _check_save_args(step, epoch, metric)
        self._finish_pending()
        entries = classify(state)
        replaceable = ReplacePolicy(self._floor, self._lease.generation if self._lease else None)
        self._save_seq += 1
        staged, shards = stage_save(self._coord, self.storage, entries, step, epoch, metric, self.run_id,
                                    self._staging if self.config.async_save else None, replaceable,
                                    self._take_lease, self._save_seq, self.split_writes)
        if self.config.async_save:
            if staged is not None or shards is not None:
                self._writer.submit(lambda: self._write(staged, shards), f"step {step}")
            self._pending_step = step
            return
        exc = None
        try:
            self._write(staged, shards)
        except Exception as e:
            exc = e
        if staged is None:
            faults.point("save/awaiting-commit", step=step, rank=self.rank)
        share_outcome(self._coord, exc, "save/commit", f"save of step {step}")
        doctor_hooks.after_commit(step, self.rank, self.world_size)

    def _write(self, staged: StagedSave | None, shards: ShardWrite | None) -> None:
        """This rank's part of the write: its shard file (if any); on rank 0 the rest and the commit."""
        if shards is not None:
            shards.run(self.storage, self._coord.reports)
        if staged is None:
            return
        start = time.perf_counter()
        try:
            write_and_commit(self.storage, staged, self._versions, self._take_lease(), self._coord.reports)
        except StorageError as e:
            if e.errno != errno.ENOSPC or self.config.keep_last is None:
                raise
            raise StorageError(errno.ENOSPC, f"{e}. Retention removes old checkpoints only after a new one "
                               f"commits, so the disk must hold keep_last + 1 = {self.config.keep_last + 1} "
                               "checkpoints; the committed ones are intact. Free space, or lower keep_last "
                               "and prune (distckpt prune URL --keep-last N)") from e
        self._retain(staged.step)
        faults.point("save/retained", step=staged.step, rank=0)
        t = staged.timings
        log.info("rank 0: committed step %d at %s in %.3fs (capture %.3fs, gather %.3fs, write %.3fs, "
                 "commit %.3fs), %d payload bytes", staged.step, self.storage.url,
                 time.perf_counter() - start + t["capture_s"] + t["gather_s"], t["capture_s"],
                 t["gather_s"], t["write_s"], t["commit_s"], staged.replicated.payload_bytes)

    def _take_lease(self) -> Lease:
        """Rank 0's write lease, taken once: from here on older incarnations cannot commit."""
        if self._lease is None:
            self._lease = acquire(self.storage, self.run_id, self._floor)
        return self._lease

    def _retain(self, just_committed: int) -> None:
        """Retention and leftover collection; failures here never undo the commit."""
        try:
            no_policy = self.config.keep_last is None and self.config.keep_best is None
            committed = [] if no_policy else read_committed(self.storage, list_committed(self.storage))
            for step in plan_retention(committed, self.config.keep_last, self.config.keep_best,
                                       self.config.best_mode):
                if step != just_committed:
                    delete_checkpoint(self.storage, step)
                    log.info("rank 0: retention removed step %d", step)
            collect_leftovers(self.storage, self.config.leftover_grace_s)
            if self._lease is not None:
                prune_leases(self.storage, self._lease, lambda: committed_generations(self.storage))
        except (OSError, DistCkptError) as e:
            log.warning("rank 0: retention after step %d failed (the checkpoint is committed): %s",
                        just_committed, e)

    def _finish_pending(self) -> None:
        """Share the outcome of the background save in flight with every rank (collective)."""
        if self._pending_step is None:
            return
        step, self._pending_step = self._pending_step, None
        _, err = self._writer.wait()
        exc = None
        if err is not None:
            exc = AsyncSaveError(f"background save of step {step} failed: {type(err).__name__}: {err}")
            exc.__cause__ = err
        share_outcome(self._coord, exc, "save/async-outcome", f"background save of step {step}")
        doctor_hooks.after_commit(step, self.rank, self.world_size)

    # -- load -----------------------------------------------------------------------------

    def load_latest(self, state: dict[str, Any]) -> Progress | None:
        """Restore `state` from the newest committed checkpoint that verifies (collective).

        Returns None on a fresh start (nothing committed), else Progress(step, epoch, ...).
        A damaged newest checkpoint is skipped with a warning; all ranks must agree on
        (step, epoch, manifest digest) or all raise. Nothing is changed unless every rank
        read and checked everything first.
        """
        return self._load(state, None)

    def load(self, state: dict[str, Any], step: int) -> Progress:
        """Restore `state` from committed checkpoint `step` (collective); no fallback."""
        step = _check_step("step", step)
        progress = self._load(state, step)
        assert progress is not None  # load(step=...) raises rather than returning None
        return progress

    def _load(self, state: dict[str, Any], step: int | None) -> Progress | None:
        self._check_open()
        self._finish_pending()
        entries = classify(state)
        progress = load(self._coord, self.storage, entries, state, step, self.config.world_size_policy,
                        self._rules)
        if self._lease is None:
            self._floor = progress.step if progress is not None else -1
        for entry in entries:
            if entry.kind == "module":
                install_bucket_warmup(entry.target)
        if progress is not None:
            for line in progress.config_diff:
                log.warning("rank %d: config differs from the checkpoint's: %s", self.rank, line)
            log.info("rank %d: resumed from %s (step %d, epoch %s)", self.rank, progress.url,
                     progress.step, progress.epoch)
        return progress

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
        flags = self._coord.all_gather(self._preemption.requested, "preemption/agree")
        if any(flags) and self.rank == 0:
            log.warning("rank 0: pre-emption requested by rank(s) %s", [r for r, f in enumerate(flags) if f])
        return any(flags)

    def committed_steps(self) -> list[int]:
        """Committed steps, newest first (reads storage; not collective)."""
        return list_committed(self.storage)

    # -- lifecycle ------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait for the save in flight and raise its failure on every rank (collective)."""
        self._check_open()
        self._finish_pending()

    def close(self) -> None:
        """Wait for the save in flight, then release the manager's process group (collective)."""
        if self._closed:
            return
        try:
            self._finish_pending()
        finally:
            self._closed = True
            self._preemption.uninstall()
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


def _check_step(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(f"{name}={value!r}: must be an int >= 0")
    return int(value)


def _check_save_args(step: Any, epoch: Any, metric: Any) -> tuple[int, int | None, float | None]:
    step = _check_step("step", step)
    if epoch is not None:
        epoch = _check_step("epoch", epoch)
    if metric is not None:
        metric = _check_metric(metric)
    return step, epoch, metric


def _check_metric(metric: Any) -> float:
    """A finite number: int, float, NumPy number or a one-element tensor (a validation loss)."""
    if hasattr(metric, "numel") and callable(metric.numel) and metric.numel() == 1 \
            and not getattr(metric, "is_complex", lambda: False)():
        metric = metric.item()
    if isinstance(metric, bool) or not isinstance(metric, numbers.Real):
        raise ConfigError(f"metric={metric!r}: must be a number (e.g. the validation loss), not "
                          f"{type(metric).__name__}")
    try:
        value = float(metric)
    except OverflowError:
        raise ConfigError(f"metric={metric!r}: too large for a float") from None
    if not math.isfinite(value):
        raise ConfigError(f"metric={metric!r}: must be finite to rank checkpoints by it")
    return value
