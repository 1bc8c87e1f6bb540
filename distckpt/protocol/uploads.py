"""Two tiers, the durable side: which saves are made durable, and the uploads in the background.

Every save commits to the local tier; every `durable_every`-th save, the one after a failed
upload, the first after a resume from the local tier and the pre-emption save are also made
durable: rank 0 uploads the committed local step to the durable root on a thread of its own
(tiers.upload_step), one upload in flight. Its outcome reaches every rank at the next save,
wait() or close() (one broadcast): a failure is a DurableUploadWarning and makes the next save
durable; at close() and at the pre-emption save it is AsyncSaveError on every rank. Whatever a
failure leaves on the local tier alone, the next such call uploads again: nothing that fails
flips a state that makes a retry a no-op.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from distckpt.config import ManagerConfig
from distckpt.errors import AsyncSaveError, ConfigError, DurableUploadWarning, warn
from distckpt.protocol.async_writer import AsyncWriter
from distckpt.protocol.coord import Coordinator
from distckpt.protocol.fencing import read_leases
from distckpt.protocol.leases import LeaseKeeper
from distckpt.protocol.pruning import Pruner
from distckpt.protocol.tiers import Nodes, TierSettings, node_name, ship_to_nodes, upload_step
from distckpt.runtime import faults
from distckpt.state.capture import SHARDED
from distckpt.storage import Storage

log = logging.getLogger("distckpt")


class DurableUploads:
    """The durable tier's side of a two-tier manager (every method does nothing with one tier).
    Collective where it says so; the uploads themselves run on rank 0 only."""

    def __init__(self, coord: Coordinator, durable: Storage, local: Storage | None, tiers: TierSettings,
                 config: ManagerConfig, split_writes: bool, leases: LeaseKeeper, pruner: Pruner) -> None:
        names = [node_name()] if local is None or coord.world_size == 1 else coord.all_gather(node_name(), "init/nodes")
        self.nodes = Nodes(tuple(names))
        self.coord, self.rank, self.durable, self.local = coord, coord.rank, durable, local
        self.tiers, self.config, self.split_writes = tiers, config, split_writes
        self.leases, self.pruner = leases, pruner
        self.preempting = False  # agreed by preemption_requested(): the next save is made durable, and waited for
        self.catch_up = False  # an upload failed, or the job resumed from the local tier: next save durable
        self.last_local: int | None = None  # rank 0: the newest step committed on the local tier
        self.last_durable: int | None = None  # rank 0: the newest step uploaded
        self.uploading: int | None = None  # rank 0: the step being uploaded (local retention spares it)
        self._uploader = AsyncWriter()  # rank 0: one upload to the durable tier in flight
        self._failures: list[tuple[int, str]] = []  # rank 0: not yet reported to the ranks
        self._saves = 0  # save() calls: every durable_every-th is durable
        self._failing = False  # rank 0: an upload failed since the last one that worked
        self._deferred = False  # rank 0: a durable save's upload was put off (start)
        self._shipped = False  # whether a step was shipped to the other nodes yet

    @property
    def hands_over_rank_files(self) -> bool:
        """A local tier on several nodes: rank 0 writes the whole step (its ranks' files handed
        over in a gather) and ships it to every node, as no node's disk is another's."""
        return self.local is not None and self.nodes.count > 1

    @property
    def spared(self) -> tuple[int, ...]:
        """The local step local retention must keep: the one being uploaded."""
        return () if self.uploading is None else (self.uploading,)

    def resumed(self, tier: str) -> None:
        """After a load: a resume from the local tier makes the next save durable, else a job
        restarted more often than every durable_every saves never reaches the URL."""
        if tier == "local":
            self.catch_up = True

    def next_save_is_durable(self, entries: list[Any], metric: Any = None) -> bool:
        """Every durable_every-th save, the one after a failed upload, and the pre-emption save
        (decided alike on every rank: the counts and flags are agreed); on rank 0 also one whose
        upload was put off, and with keep_best one given a metric."""
        if self.local is None:
            return False
        if self.nodes.count > 1 and (self.split_writes or any(e.scope == SHARDED for e in entries)):
            raise ConfigError("local_dir= with sharded entries (FSDP2) or split_writes=True across several nodes "
                              "is not supported: each node's local tier would hold only its own ranks' shard "
                              "files; checkpoint such jobs to the URL only (no local_dir)")
        self._saves += 1
        durable = self._saves % self.tiers.durable_every == 0 or self.catch_up or self.preempting
        self.catch_up = False
        # Rank 0's alone (only it uploads; the metric is its own), and every rank agrees wherever
        # durability matters to the others (the pre-emption save, which all make durable).
        # keep_best judges the URL's steps: a save with a metric left on the local tier alone was
        # dropped there by keep_local, and the best checkpoint with it (best_step() went 1 -> None
        # -> 4 -> None).
        if self.rank == 0:
            durable = durable or self._deferred or (bool(self.config.keep_best) and metric is not None)
        return durable

    def committed_locally(self, step: int, durable: bool) -> None:
        """Rank 0, after a local commit: local retention, then the upload if the save is durable."""
        assert self.local is not None
        self.last_local = step
        self.pruner.after_commit(self.local, step, self.spared)
        if durable:
            self.start(step)

    def start(self, step: int) -> None:
        """Rank 0: upload committed local `step` in the background; one upload in flight, so a
        durable save waits here for the previous upload (the documented one-in-flight rule) —
        except while the URL fails: then the upload in flight is a retry that may take the
        store's whole timeout to fail, and waiting for it stalled every save (~5 s each with the
        connections cut); this step's upload is put off to the next save instead. The
        pre-emption save and close() always wait."""
        if (self._failing or self.leases.unreachable) and self._uploader.busy \
                and not self._uploader.finished and not self.preempting:
            self._deferred = True
            log.warning("rank 0: step %d is committed locally; its upload to %s is put off to the next save: the "
                        "upload of step %s is still in flight and the URL failed before", step, self.durable.url,
                        self.uploading)
            return
        self._deferred = False
        self._join()
        self.uploading = step
        self._uploader.submit(lambda: self._upload(step), f"upload of step {step}")

    def _upload(self, step: int) -> None:
        lease = self.leases.lease
        assert self.local is not None and lease is not None  # rank 0 after a local commit
        start = time.perf_counter()
        faults.point("upload/started", step=step, rank=0)
        self.leases.check_branch()  # a load since the lease was taken chose a local step unchecked
        if upload_step(self.local, self.durable, step, lease):
            log.info("rank 0: step %d made durable at %s in %.3fs", step, self.durable.url,
                     time.perf_counter() - start)
        self.leases.record_first_commit(step)
        faults.point("upload/committed", step=step, rank=0)
        self.pruner.after_commit(self.durable, step)

    def _join(self) -> None:
        """Rank 0: collect the upload in flight (if any), recording its failure for the ranks."""
        if not self._uploader.busy:
            return
        step = self.uploading
        _, err = self._uploader.wait()
        self.uploading = None
        if err is not None and step is not None:
            self._failures.append((step, f"{type(err).__name__}: {err}"))
            self._failing = True
        elif step is not None:
            self.last_durable = step
            self.leases.unreachable = False
            self._failing = False

    def report(self, block: bool, final: bool = False) -> None:
        """Tell every rank about failed uploads (collective; two tiers only). `block` waits for
        the upload in flight; `final` raises AsyncSaveError on every rank if one failed."""
        if self.local is None:
            return
        report: Any = None
        if self.rank == 0:
            if block or self._uploader.finished:
                self._join()
            report, self._failures = self._failures, []
        failures = self.coord.broadcast(report, "tiers/upload-status")
        if not failures:
            return
        self.catch_up = True
        steps = [step for step, _ in failures]
        message = (f"rank {self.rank}: making step(s) {steps} durable at {self.durable.url} failed — "
                   + "; ".join(f"step {s}: {m}" for s, m in failures)
                   + f"; they are committed on the local tier {self.local.url} only")
        if final:
            raise AsyncSaveError(message + "; the newest checkpoint is not durable. The manager stays open: "
                                 "close() again uploads it (and raises again while that fails); or copy the local "
                                 "tier (distckpt ls --local-dir) before this node goes away")
        message += "; the next save is made durable"
        log.error(message)  # at ERROR for operators' logs: the steps are at risk until an upload succeeds
        warn(message, DurableUploadWarning)

    def ship(self, step: int) -> None:
        """With several nodes (collective): rank 0's committed local step to every other node's
        local tier (the first time with the URL's leases, so the nodes remove another job's steps too)."""
        if self.local is not None and self.nodes.count > 1:
            durable = self.durable
            ship_to_nodes(self.coord, self.local, self.nodes, step, self.leases.lease,
                          None if self._shipped else (lambda: read_leases(durable)))
            self._shipped = True

    def settle(self) -> None:
        """wait() (collective): the upload in flight joined and reported; after an upload failed,
        the newest local step uploaded again if it is still not durable (a warning if that fails)."""
        retry = self.catch_up  # agreed on every rank: an upload failed before (or a local resume)
        self.report(block=True)
        if retry:
            self.upload_newest(final=False)

    def make_last_save_durable(self) -> None:
        """close() (collective): the newest local step also reaches the URL, and every rank hears
        the outcome (AsyncSaveError if it could not)."""
        if self.local is None:
            return
        self.report(block=True)
        self.upload_newest(final=True)

    def upload_newest(self, final: bool) -> None:
        """Rank 0 uploads the newest local step unless it is durable already, and every rank hears
        the outcome (collective): with `final`, AsyncSaveError on every rank if it failed."""
        step = self.last_local
        if self.rank == 0 and step is not None and step != self.last_durable:
            if self._failing:
                log.warning("rank 0: step %d is committed on the local tier %s only (an upload to %s failed "
                            "before); uploading it again", step, self.local.url if self.local else "", self.durable.url)
            else:
                log.info("rank 0: uploading step %d, committed on the local tier only, to %s", step, self.durable.url)
            try:
                self.start(step)
            except Exception as e:  # reported to every rank like any upload failure
                self._failures.append((step, f"{type(e).__name__}: {e}"))
        self.report(block=True, final=final)

    def close(self) -> None:
        self._uploader.close()
