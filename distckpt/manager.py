"""CheckpointManager: the public entry point, a facade over the protocol's rooms.

Each public method checks its arguments, runs one call at a time (the calls are collective) and
delegates to objects of protocol/, built once in the constructor:

    settings.py  the arguments, checked before any exchange and agreed by every rank
    session.py   what the manager holds between calls, and the save and load it runs
    leases.py    rank 0's write lease at the durable root (fencing)
    pruning.py   rank 0's retention after each commit
    uploads.py   with two tiers: which saves are durable, and the uploads in the background
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from distckpt import errors
from distckpt.config import DEFAULT_TIMEOUT_S, ManagerConfig, arguments_checked
from distckpt.errors import ConfigError
from distckpt.protocol.commit import list_committed
from distckpt.protocol.coord import make_coordinator
from distckpt.protocol.leases import LeaseKeeper
from distckpt.protocol.loading import Progress
from distckpt.protocol.memory_copies import MemoryTier
from distckpt.protocol.pruning import Pruner
from distckpt.protocol.retention import Committed, best_first, read_committed
from distckpt.protocol.session import Session
from distckpt.protocol.settings import Settings, agree_on_settings, check_save_args
from distckpt.protocol.uploads import DurableUploads
from distckpt.runtime.gcpause import collector_paused
from distckpt.runtime.iterators import track_iterators
from distckpt.runtime.preemption import PreemptionFlag
from distckpt.state.validation import check_step

log = logging.getLogger("distckpt")


class CheckpointManager:
    """Saves and loads exact-resume checkpoints under one root URL.

    Construction, `save`, `load_latest`, `load`, `preemption_requested`, `wait` and `close` are
    collective: call them on every rank, in the same order (a call on rank 0 only waits for the
    others until `timeout`, then fails). `committed_steps` and `best_step` only read storage and
    are not collective. Without an initialised process group (or with one rank) it works as a
    world of one. Use it as a context manager (``with CheckpointManager(...) as mgr:``) to close
    it on every path.

    Every keyword argument is a setting, checked at construction (a `ConfigError` names the field
    and the reason) and agreed across ranks; the settings page of the reference lists each with
    its default and what it is for: keep_last/keep_best/best_mode (retention), async_save and
    overlap_snapshot, writer and staging_bytes (saves in the background), local_dir/durable_every/keep_local
    (two tiers), incremental, timeout, storage_options, world_size_policy, preemption_signals,
    memory_tier/memory_every/keep_memory/disk_every (a tier in shared memory with a partner copy on another
    node; with disk_every=N only every Nth save is written to disk, the others to memory alone),
    signing_key and verify_key (signed checkpoints: a load with a verify key refuses any step its key did not sign).

    A checkpoint is committed only when its COMMITTED marker is written, after every file is
    durable; a failed or interrupted save never changes an earlier checkpoint.

    ``split_writes=True`` spreads the replicated tensors (a DDP model, its optimizer) across the
    ranks, each writing its share in parallel, under the same one commit. It assumes what DDP
    guarantees: the replicated entries hold the same values on every rank. The default (None) turns
    it on for remote storage (a URL) across several nodes, where it was measured to win, and off on
    local disk or one node (protocol/split_default.py).
    """

    @arguments_checked
    def __init__(self, url: str | os.PathLike[str], *, keep_last: int | None = None,
                 keep_best: int | None = None, best_mode: str = "min", async_save: bool = False,
                 storage_options: dict[str, Any] | None = None,
                 timeout: float | datetime.timedelta | None = 600.0,
                 leftover_grace_s: float = 3600.0, world_size_policy: str = "refuse",
                 preemption_signals: Any = (signal.SIGTERM,), split_writes: bool | None = None,
                 allow_dtype_cast: bool = False, missing_entries: str = "refuse",
                 local_dir: str | os.PathLike[str] | None = None, durable_every: int | None = None,
                 keep_local: int | None = None, incremental: bool = False,
                 overlap_snapshot: bool = False, memory_tier: bool = False, memory_every: int | None = None,
                 keep_memory: int | None = None, disk_every: int | None = None, signing_key: Any = None, verify_key: Any = None,
                 writer: str = "thread", staging_bytes: int | None = None) -> None:
        refusal: Exception | None = None
        settings: Settings | None = None
        try:  # every argument before any exchange (settings.py)
            config = ManagerConfig(keep_last, keep_best, best_mode, async_save,
                                   timeout,  # type: ignore[arg-type]  # a timedelta or None: made seconds there
                                   leftover_grace_s, world_size_policy, split_writes, allow_dtype_cast,
                                   missing_entries, preemption_signals, incremental, overlap_snapshot,
                                   signing_key, verify_key, writer, staging_bytes)
            settings = Settings.check(url, storage_options, local_dir, durable_every, keep_local, config,
                                      (memory_tier, memory_every, keep_memory, disk_every))
        except Exception as e:  # a refused argument, an unreachable store: raised on every rank below
            refusal = e
        track_iterators()  # a loop's loader left out of `state` is told at the first saves (if no earlier call began it)
        self._coord = make_coordinator(settings.config.timeout if settings is not None else DEFAULT_TIMEOUT_S)
        self.rank, self.world_size = self._coord.rank, self._coord.world_size
        if refusal is not None and self.world_size == 1:
            self._coord.close()
            raise refusal
        self.run_id = agree_on_settings(self._coord, settings, refusal)
        assert settings is not None  # a refusal on any rank was raised on every rank just above
        self.config, self.url, self.storage, self.tiers, self.local = \
            settings.config, settings.url, settings.storage, settings.tiers, settings.local
        self.split_writes = bool(self.config.split_writes)  # by all ranks in parallel (decided by now)
        self._leases = LeaseKeeper(self.storage, self.run_id, self.local)  # rank 0's write lease (leases.py)
        self._pruner = Pruner(self.storage, self.local, self.config, self.tiers.keep_local, self._leases)  # rank 0
        self._closed = False
        self._preemption = PreemptionFlag(self.config.preemption_signals)
        self._uploads = DurableUploads(self._coord, self.storage, self.local, self.tiers, self.config,
                                       self.split_writes, self._leases, self._pruner)  # two tiers (uploads.py)
        try:
            self._memory = MemoryTier(self._coord, settings.memory, settings.trust)  # memory_tier=True (memory_copies.py)
        except BaseException:  # a memory root two nodes share: refused on every rank alike
            self._coord.close()
            raise
        # last: rank 0's git (for the manifests) runs from here to the first save
        self._session = Session(self._coord, self.run_id, self.config, self.storage, self.local, self.tiers,
                                self._leases, self._pruner, self._uploads, self._memory)

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
                step, epoch, metric = check_save_args(step, epoch, metric if self.rank == 0 else None)
            except ConfigError as e:
                refusal = self._session.refused(e)
            with collector_paused():
                self._session.save(step, state, epoch, metric, refusal)

    # -- load -----------------------------------------------------------------------------

    @arguments_checked
    def load_latest(self, state: dict[str, Any]) -> Progress | None:
        """Restore `state` from the newest committed checkpoint that verifies (collective).

        Returns None on a fresh start (nothing committed), else Progress(step, epoch, ...).
        A damaged newest checkpoint is skipped with a warning; all ranks must agree on
        (step, epoch, manifest digest) or all raise. Nothing is changed unless every rank
        read and checked everything first. Raises CorruptCheckpointError when checkpoints are
        committed but none verifies, IncompatibleCheckpointError when the one chosen does not fit
        `state` (world size, keys, shapes), RankDisagreementError when the ranks read different
        checkpoints; the same error on every rank, `state` unchanged.
        """
        with self._sole_call("load_latest"):
            self._check_open()
            progress = self._session.load(state, None)
            self._session.list_ahead()  # a job that resumes goes on to save: its first retention's listing runs meanwhile
        if self.rank == 0:  # one line for the person watching the job (errors.notice says where it goes)
            errors.notice(self._resume_line(progress))
        return progress

    def _resume_line(self, progress: Progress | None) -> str:
        if progress is None:
            return f"no committed checkpoint at {self.storage.url}: starting fresh"
        epoch = f" (epoch {progress.epoch})" if progress.epoch is not None else ""
        tier = f" ({progress.tier} tier)" if self.local is not None or self._memory.enabled else ""
        return f"resumed from step {progress.step}{epoch} at {progress.url}{tier}"

    @arguments_checked
    def load(self, state: dict[str, Any], step: int) -> Progress:
        """Restore `state` from committed checkpoint `step` (collective); no fallback to another
        step (with two tiers, only to the other tier's copy of it). Returns its Progress. Raises
        IncompatibleCheckpointError if `step` is not committed (naming the committed steps) or does
        not fit `state`, CorruptCheckpointError if it does not verify; the same error on every
        rank, `state` unchanged."""
        self._check_open()
        refusal = None
        try:
            step = check_step("step", step)
        except ConfigError as e:
            refusal = self._session.refused(e)
        with self._sole_call("load"):
            progress = self._session.load(state, step, refusal)
        assert progress is not None  # load(step=...) raises rather than returning None
        return progress

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
            self._session.finish_pending()
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
                self._session.finish_pending()
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
        self._session.flush_memory_only()  # disk_every: the newest save, if in memory only, to the URL too
        self._shut_down()

    def _shut_down(self) -> None:
        """Release everything: signal handlers, threads, staging buffers, process groups."""
        self._closed = True
        self._preemption.uninstall()
        self._session.close()
        self._uploads.close()
        self._pruner.close()
        self._coord.close()

    def __enter__(self) -> "CheckpointManager":
        """The manager itself; leaving the block calls `close()` (collective)."""
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """close() (collective). Leaving the block by an exception, a failure of close() is logged,
        not raised, so the exception that ended the block is the one that propagates."""
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
        for ident, top in _current_frames().items():
            frame: Any = top
            while frame is not None:
                code = frame.f_code
                if code.co_name in _COLLECTIVE_CALLS and code.co_filename == __file__ \
                        and frame.f_locals.get("self") is self:
                    found.append((code.co_name, ident == me))
                frame = frame.f_back
        return found


def _current_frames() -> dict[int, Any]:
    """sys._current_frames() with the garbage collector held off. CPython 3.11 makes the frame
    objects while holding the interpreter's thread-list lock; an allocation there can start a
    collection, and freeing a threading.local (hypothesis keeps some; so do many libraries) takes
    that same lock: the process hung for ever inside close() (seen in a whole test run; CPython
    gh-106883, fixed in 3.12 the same way)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


# The manager's calls that run one at a time (_sole_call); committed_steps() only reads storage.
_COLLECTIVE_CALLS = frozenset({"save", "load_latest", "load", "preemption_requested", "wait", "close"})
